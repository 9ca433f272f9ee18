"""Write claims (kvstore.node.claims): a node refuses a write whose grant belongs to an older
allocation of the same bytes, stops an older stream before a newer write, and keeps nothing once
a grant has expired."""

from __future__ import annotations

import gc
import threading
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore import grants
from kvstore.errors import GrantInvalidError, KVTimeoutError
from kvstore.node import claims as claims_module
from kvstore.node.claims import WriteClaims, WriteStream

SECRET = b"s" * 32


class _ClaimsModel:
    """The claim rules of WriteClaims, by brute force over a list: what a claim of ``[start,
    end)`` with ``stamp`` and ``sig`` answers ("ok", "used" or "stale"), leaves claimed and
    fences (the streams of the claims it removed)."""

    def __init__(self) -> None:
        self.claims: list[list[object]] = []  # [start, end, stamp, sig, done, stream]
        self.fenced: list[object] = []

    def claim(self, start: int, end: int, stamp: int, sig: bytes, now: int, stream: object) -> str:
        over = [c for c in self.claims if c[0] < end and start < c[1]]  # type: ignore[operator]
        mine = None
        for c in over:
            if c[2] < now and c[3] != sig:  # type: ignore[operator]
                continue
            if c[3] == sig and (c[0], c[1]) == (start, end):
                if c[4] or c[5] is not None:
                    return "used"
                mine = c
            elif c[2] >= stamp:  # type: ignore[operator]
                return "stale"
        self.fenced += [c[5] for c in over if c is not mine and c[5] is not None]
        self.claims = [c for c in self.claims if c is mine or c not in over]
        if mine is None:
            self.claims.append([start, end, stamp, sig, False, None])
        mine = mine or self.claims[-1]
        # A write left streaming holds its claim; any other completes at once.
        mine[4], mine[5] = stream is None, stream
        return "ok"


def _batch(op: str = grants.OP_READ, expires_ms: int = 1000) -> list[object]:
    items = [[b"k%d" % i, "dram", 64 * i, 10 + i] for i in range(3)]
    return grants.sign_batch(SECRET, op, expires_ms, items)


def _w(offset: int, size: int, expires: int, key: bytes = b"k") -> grants.Grant:
    return grants.sign(SECRET, grants.OP_WRITE, key, "dram", offset, size, expires)


def test_claims_refuse_stale_and_used_grants() -> None:
    now = [100]
    claims = WriteClaims(lambda: now[0])
    old = _w(0, 1000, 5000)
    c = claims.begin(old, None)
    claims.end(c, None, complete=True)
    with pytest.raises(GrantInvalidError, match="already used"):
        claims.begin(old, None)  # a replay of a grant that completed a write
    new = _w(512, 1000, 6000, b"n")  # a newer allocation overlapping the old one's bytes
    claims.end(claims.begin(new, None), None, complete=True)
    with pytest.raises(GrantInvalidError, match="newer allocation"):
        claims.begin(_w(0, 600, 5500, b"x"), None)  # older than `new`, overlapping it
    tie = _w(1400, 10, 6000, b"t")  # same expiry, another grant: order unknown, refused
    with pytest.raises(GrantInvalidError):
        claims.begin(tie, None)
    claims.end(claims.begin(_w(1512, 10, 5500, b"y"), None), None, complete=True)  # no overlap
    now[0] = 7000  # every claim expired: nothing left to fence
    claims.end(claims.begin(_w(0, 2000, 9000, b"z"), None), None, complete=True)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.integers(0, 40),  # start, in units of 8 bytes
            st.integers(1, 6),  # length
            st.integers(0, 5),  # stamp (the grant's expiry)
            st.integers(0, 3),  # which signature
            st.integers(0, 2),  # how far the clock moved before it
            st.booleans(),  # the write is left streaming (not ended)
        ),
        max_size=40,
    )
)
def test_claims_answer_as_the_rules_say_whatever_the_order(
    steps: list[tuple[int, int, int, int, int, bool]],
) -> None:
    # Rising offsets (a fresh arena: a claim past every other), reused ones and overlaps in any
    # order, writes that complete and writes still streaming: each claim is granted or refused
    # as the rules say, what stays claimed is the same however it was found, and exactly the
    # streams of the claims a newer one took over are stopped.
    now = [0]
    claims = WriteClaims(lambda: now[0])
    model = _ClaimsModel()
    streams = []
    for start, length, stamp, sig, tick, streaming in steps:
        now[0] += tick
        a, b = start * 8, (start + length) * 8
        stream = WriteStream() if streaming else None
        if stream is not None:
            stream.stopped.set()  # (its receive loop is gone: a fence need not wait)
            streams.append(stream)
        want = model.claim(a, b, stamp, b"s%d" % sig, now[0], stream)
        try:
            c = claims.claim("dram", a, b, stamp, b"s%d" % sig, stream)
        except GrantInvalidError as err:
            assert want == ("used" if "already used" in err.message else "stale")
        else:
            assert want == "ok"
            if stream is None:
                claims.end(c, None, complete=True)
            else:
                assert claims.writing(c) is stream
        live = sorted((s, r[0], r[1], r[2]) for s, r in claims._claims["dram"].items())
        assert live == sorted((c[0], c[1], c[2], c[3]) for c in model.claims)  # type: ignore[misc]
        assert claims._starts["dram"] == sorted(claims._claims["dram"])
        assert [s for s in streams if s.aborted] == [s for s in streams if s in model.fenced]


def test_claims_past_their_write_leave_the_collectors_work_once_it_has_seen_them() -> None:
    """A node keeps a claim per write until its grant expires (30 s of writes): the collector
    must not walk an object per claim at every full collection."""
    claims = WriteClaims(lambda: 100)
    stream = WriteStream()
    gc.collect()
    before = len(gc.get_objects())
    for b in range(40):
        items = [(_w(64 * (256 * b + i), 64, 5000, b"b%d" % b), False, stream) for i in range(256)]
        out = claims.begin_many(items)
        claims.end_many([(c, True) for c in out], stream)  # type: ignore[misc]
    assert len(claims) == 40 * 256
    del items, out  # (the last request's grants)
    gc.collect()  # the first pass sees each claim once, then stops tracking it
    assert len(gc.get_objects()) - before < 100
    with pytest.raises(GrantInvalidError, match="already used"):
        claims.begin(_w(64 * 5, 64, 5000, b"b0"), None)  # each still a claim, used up


def test_a_newer_write_stops_an_older_stream_first() -> None:
    claims = WriteClaims(lambda: 100)
    stream = WriteStream()
    old = claims.begin(_w(0, 100, 5000), stream)
    stopped_when_new_began: list[bool] = []

    def receiver() -> None:  # the older write's receive loop: it sees the abort and leaves
        while not stream.aborted:
            time.sleep(0.001)
        claims.end(old, stream, complete=False)
        stream.stopped.set()

    t = threading.Thread(target=receiver)
    t.start()
    claims.begin(_w(0, 100, 6000, b"n"), None)
    stopped_when_new_began.append(stream.stopped.is_set())
    t.join(5)
    assert stream.aborted and stopped_when_new_began == [True]


def test_reset_stops_every_stream() -> None:
    claims = WriteClaims(lambda: 100)
    stream = WriteStream()
    claims.begin(_w(0, 100, 5000), stream)
    claims.reset()
    assert stream.aborted and len(claims) == 0


def test_one_stream_for_many_claims_ends_them_together() -> None:
    """A write request's items share one stream: ending them releases the stream from every
    claim, marks only the completed ones used up, and a newer write aborts the shared stream."""
    claims = WriteClaims(lambda: 100)
    stream = WriteStream()
    a, b = _w(0, 100, 5000, b"a"), _w(100, 100, 5000, b"b")
    ca, cb = claims.begin(a, stream), claims.begin(b, stream)
    with pytest.raises(GrantInvalidError, match="in use"):
        claims.begin(a, None)
    claims.end_many([(ca, True), (cb, False)], stream)
    assert claims.writing(ca) is None and claims.writing(cb) is None
    with pytest.raises(GrantInvalidError, match="already used"):
        claims.begin(a, None)  # completed: used up
    claims.end(claims.begin(b, None), None, complete=True)  # not completed: may be retried
    shared = WriteStream()  # one request writing two extents
    claims.begin(_w(300, 100, 5000, b"c"), shared)
    claims.begin(_w(400, 100, 5000, b"d"), shared)
    shared.stopped.set()  # its receive loop already left (so the newer write need not wait)
    claims.begin(_w(350, 100, 6000, b"n"), None)  # newer, overlapping only the first extent
    assert shared.is_aborted()


def test_begin_many_claims_in_one_step_with_errors_in_place() -> None:
    claims = WriteClaims(lambda: 100)
    claims.end(claims.begin(_w(0, 100, 6000, b"new"), None), None, complete=True)
    stream = WriteStream()
    used = _w(1000, 10, 5000, b"used")
    claims.end(claims.begin(used, None), None, complete=True)
    out = claims.begin_many(
        [
            (_w(200, 100, 5000, b"a"), False, stream),
            (_w(50, 100, 5000, b"stale"), False, stream),  # older than "new" on its bytes
            (used, False, stream),  # a replay
            (_w(4096, 0, 5000, b"id"), True, None),  # by id (NVMe): no stream
        ]
    )
    assert isinstance(out[0], tuple) and claims.writing(out[0]) is stream
    assert isinstance(out[1], GrantInvalidError) and "newer allocation" in out[1].message
    assert isinstance(out[2], GrantInvalidError) and "already used" in out[2].message
    assert isinstance(out[3], tuple) and claims.writing(out[3]) is None


def test_begin_many_stops_older_writes_and_never_waits_for_itself(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(claims_module, "FENCE_WAIT_S", 0.05)
    claims = WriteClaims(lambda: 100)
    stalled = WriteStream()  # another request's write that never stops
    claims.begin(_w(0, 100, 5000, b"old"), stalled)
    mine = WriteStream()
    t0 = time.monotonic()
    out = claims.begin_many(
        [
            (_w(500, 100, 5000, b"x"), False, mine),
            (_w(520, 10, 5500, b"y"), False, mine),  # fences the item before it: its own stream
            (_w(0, 100, 6000, b"z"), False, mine),  # fences `stalled`, which does not stop
        ]
    )
    assert stalled.aborted and mine.aborted  # no byte of either may land any more
    assert isinstance(out[1], tuple)  # no wait for its own stream
    assert isinstance(out[2], KVTimeoutError)
    assert time.monotonic() - t0 < 1.0  # one bounded wait, for `stalled` only


def test_claims_tell_apart_the_members_of_one_write_batch() -> None:
    """Members of a batch share its signature: a claim is named by the signature and range."""
    claims = WriteClaims(lambda: 0)
    batch = grants.open_batch_unverified(_batch(grants.OP_WRITE))
    first, second = batch.grant(0, check=False), batch.grant(1, check=False)
    assert first.signature == second.signature
    a = claims.begin(first, None)
    claims.end(a, None, complete=True)
    b = claims.begin(second, None)  # another member: its own range, its own claim
    claims.end(b, None, complete=True)
    for used in (first, second):
        with pytest.raises(GrantInvalidError, match="already used"):
            claims.begin(used, None)
