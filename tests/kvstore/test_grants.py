from __future__ import annotations

import gc
import threading
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore import grants
from kvstore.errors import GrantInvalidError, KVTimeoutError, OutOfRangeError

SECRET = b"s" * 32


def test_valid_grant_verifies() -> None:
    g = grants.sign(SECRET, grants.OP_READ, b"k", "dram", 64, 100, 1000)
    grants.verify(SECRET, grants.Grant.from_wire(g.to_wire()), grants.OP_READ, now_ms=999)
    grants.check_range(g, 0, 100)
    grants.check_range(g, 99, 1)


@pytest.mark.parametrize(
    "field,value",
    [
        ("offset", 0),
        ("size", 1 << 30),
        ("segment", "other"),
        ("key", b"other"),
        ("expires_ms", 10**12),
        ("op", grants.OP_WRITE),
    ],
)
def test_tampered_grants_fail(field: str, value: object) -> None:
    g = grants.sign(SECRET, grants.OP_READ, b"k", "dram", 64, 100, 1000)
    wire = g.to_wire()
    wire[["op", "key", "segment", "offset", "size", "expires_ms"].index(field)] = value
    with pytest.raises(GrantInvalidError):
        grants.verify(SECRET, grants.Grant.from_wire(wire), grants.OP_READ, now_ms=0)


def test_expired_wrong_op_wrong_secret() -> None:
    g = grants.sign(SECRET, grants.OP_READ, b"k", "dram", 0, 10, 1000)
    with pytest.raises(GrantInvalidError):
        grants.verify(SECRET, g, grants.OP_READ, now_ms=1001)
    with pytest.raises(GrantInvalidError):
        grants.verify(SECRET, g, grants.OP_WRITE, now_ms=0)
    with pytest.raises(GrantInvalidError):
        grants.verify(b"x" * 32, g, grants.OP_READ, now_ms=0)


@pytest.mark.parametrize("start,length", [(-1, 1), (0, 11), (10, 1), (5, -1), (True, 1), ("0", 1)])
def test_ranges_outside_fail(start: object, length: object) -> None:
    g = grants.sign(SECRET, grants.OP_READ, b"k", "dram", 0, 10, 1000)
    with pytest.raises(OutOfRangeError):
        grants.check_range(g, start, length)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "wire",
    [
        None,
        [],
        ["r", b"k", "d", 0, 1, 1],
        ["x", b"k", "d", 0, 1, 1, b""],
        ["r", "k", "d", 0, 1, 1, b""],
        ["r", b"k", "d", -1, 1, 1, b""],
    ],
)
def test_malformed_grants(wire: object) -> None:
    with pytest.raises(GrantInvalidError):
        grants.Grant.from_wire(wire)


@pytest.mark.parametrize(
    "field,value",
    [
        ("offset", 0),
        ("size", 1 << 30),
        ("segment", "other"),
        ("key", b"other"),
        ("expires_ms", 10**12),
    ],
)
def test_memo_refuses_a_tampered_copy_of_a_verified_grant(field: str, value: object) -> None:
    memo = grants.VerifiedGrants(SECRET)
    g = grants.sign(SECRET, grants.OP_READ, b"k", "dram", 64, 100, 1000)
    assert memo.check(g.to_wire(), grants.OP_READ, now_ms=0) == g
    assert memo.check(g.to_wire(), grants.OP_READ, now_ms=0) == g  # from the memo
    wire = g.to_wire()  # same signature, one field changed
    wire[["op", "key", "segment", "offset", "size", "expires_ms"].index(field)] = value
    with pytest.raises(GrantInvalidError):
        memo.check(wire, grants.OP_READ, now_ms=0)


def test_memo_still_checks_op_and_expiry_and_forgets_with_its_secret() -> None:
    memo = grants.VerifiedGrants(SECRET)
    g = grants.sign(SECRET, grants.OP_READ, b"k", "dram", 0, 10, 1000)
    memo.check(g.to_wire(), grants.OP_READ, now_ms=0)
    with pytest.raises(GrantInvalidError, match="expired"):
        memo.check(g.to_wire(), grants.OP_READ, now_ms=1001)
    with pytest.raises(GrantInvalidError, match="op"):
        memo.check(g.to_wire(), grants.OP_WRITE, now_ms=0)
    with pytest.raises(GrantInvalidError, match="signature"):
        grants.VerifiedGrants(b"x" * 32).check(g.to_wire(), grants.OP_READ, now_ms=0)
    with pytest.raises(GrantInvalidError):
        memo.check(["r", b"k"], grants.OP_READ, now_ms=0)


def test_memo_is_bounded() -> None:
    memo = grants.VerifiedGrants(SECRET, max_items=8)
    for i in range(50):
        g = grants.sign(SECRET, grants.OP_READ, b"k%d" % i, "dram", 0, 10, 1000)
        memo.check(g.to_wire(), grants.OP_READ, now_ms=0)
        assert len(memo._memo) <= 8


def test_memo_is_bounded_by_items_and_keeps_no_write_grant() -> None:
    memo = grants.VerifiedGrants(SECRET, max_items=1024)
    for b in range(50):
        items = [[b"k%d/%d" % (b, i), "dram", 64 * i, 64] for i in range(256)]
        for op in (grants.OP_READ, grants.OP_WRITE):
            memo.check_batch(grants.sign_batch(SECRET, op, 1000, items), op, now_ms=0)
        held = [e[1] for e in memo._memo.values()]
        assert sum(len(g.items) for g in held) <= 1024  # type: ignore[union-attr]
        assert all(g.op == grants.OP_READ for g in held)  # a write grant is used once


def test_memo_makes_room_by_dropping_expired_grants_first() -> None:
    memo = grants.VerifiedGrants(SECRET, max_items=8)
    keep = grants.sign(SECRET, grants.OP_READ, b"keep", "dram", 0, 10, 10_000)
    memo.check(keep.to_wire(), grants.OP_READ, now_ms=0)
    for i in range(7):
        g = grants.sign(SECRET, grants.OP_READ, b"k%d" % i, "dram", 0, 10, 100)
        memo.check(g.to_wire(), grants.OP_READ, now_ms=0)
    late = grants.sign(SECRET, grants.OP_READ, b"late", "dram", 0, 10, 10_000)
    memo.check(late.to_wire(), grants.OP_READ, now_ms=500)  # the seven short ones expired
    assert set(memo._memo) == {keep.signature, late.signature}


def _w(offset: int, size: int, expires: int, key: bytes = b"k") -> grants.Grant:
    return grants.sign(SECRET, grants.OP_WRITE, key, "dram", offset, size, expires)


def test_claims_refuse_stale_and_used_grants() -> None:
    now = [100]
    claims = grants.WriteClaims(lambda: now[0])
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
    claims = grants.WriteClaims(lambda: now[0])
    model = _ClaimsModel()
    streams = []
    for start, length, stamp, sig, tick, streaming in steps:
        now[0] += tick
        a, b = start * 8, (start + length) * 8
        stream = grants.WriteStream() if streaming else None
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
    claims = grants.WriteClaims(lambda: 100)
    stream = grants.WriteStream()
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
    claims = grants.WriteClaims(lambda: 100)
    stream = grants.WriteStream()
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
    claims = grants.WriteClaims(lambda: 100)
    stream = grants.WriteStream()
    claims.begin(_w(0, 100, 5000), stream)
    claims.reset()
    assert stream.aborted and len(claims) == 0


def test_memo_without_remember_verifies_but_keeps_nothing() -> None:
    memo = grants.VerifiedGrants(SECRET)
    g = grants.sign(SECRET, grants.OP_WRITE, b"k", "dram", 0, 10, 1000)
    assert memo.check(g.to_wire(), grants.OP_WRITE, now_ms=0, remember=False) == g
    assert memo._memo == {}
    forged = g.to_wire()
    forged[4] = 11  # one byte more than granted, same signature
    with pytest.raises(GrantInvalidError, match="signature"):
        memo.check(forged, grants.OP_WRITE, now_ms=0, remember=False)
    with pytest.raises(GrantInvalidError, match="expired"):
        memo.check(g.to_wire(), grants.OP_WRITE, now_ms=1001, remember=False)


def test_one_stream_for_many_claims_ends_them_together() -> None:
    """A write request's items share one stream: ending them releases the stream from every
    claim, marks only the completed ones used up, and a newer write aborts the shared stream."""
    claims = grants.WriteClaims(lambda: 100)
    stream = grants.WriteStream()
    a, b = _w(0, 100, 5000, b"a"), _w(100, 100, 5000, b"b")
    ca, cb = claims.begin(a, stream), claims.begin(b, stream)
    with pytest.raises(GrantInvalidError, match="in use"):
        claims.begin(a, None)
    claims.end_many([(ca, True), (cb, False)], stream)
    assert claims.writing(ca) is None and claims.writing(cb) is None
    with pytest.raises(GrantInvalidError, match="already used"):
        claims.begin(a, None)  # completed: used up
    claims.end(claims.begin(b, None), None, complete=True)  # not completed: may be retried
    shared = grants.WriteStream()  # one request writing two extents
    claims.begin(_w(300, 100, 5000, b"c"), shared)
    claims.begin(_w(400, 100, 5000, b"d"), shared)
    shared.stopped.set()  # its receive loop already left (so the newer write need not wait)
    claims.begin(_w(350, 100, 6000, b"n"), None)  # newer, overlapping only the first extent
    assert shared.is_aborted()


@pytest.mark.parametrize(
    ("args", "signature"),
    [
        (("w", b"key/1", "dram", 4096, 16, 1700000000123), "580d3c5b56a60b68134566dd862c6904"),
        (("r", b"", "nvme", 0, 0, 0), "0edb90fc3b66454cf58fbccd05cdb55a"),
    ],
)
def test_signatures_are_stable_across_versions(args: tuple, signature: str) -> None:
    """A master and a node of different versions must agree on every grant's signature."""
    assert grants.sign(b"s" * 32, *args).signature.hex() == signature


def test_begin_many_claims_in_one_step_with_errors_in_place() -> None:
    claims = grants.WriteClaims(lambda: 100)
    claims.end(claims.begin(_w(0, 100, 6000, b"new"), None), None, complete=True)
    stream = grants.WriteStream()
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
    monkeypatch.setattr(grants, "FENCE_WAIT_S", 0.05)
    claims = grants.WriteClaims(lambda: 100)
    stalled = grants.WriteStream()  # another request's write that never stops
    claims.begin(_w(0, 100, 5000, b"old"), stalled)
    mine = grants.WriteStream()
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


# --------------------------------------------------------------------------- batch grants
def _batch(op: str = grants.OP_READ, expires_ms: int = 1000) -> list[object]:
    items = [[b"k%d" % i, "dram", 64 * i, 10 + i] for i in range(3)]
    return grants.sign_batch(SECRET, op, expires_ms, items)


def test_memoised_batch_grants_leave_the_collectors_work_once_it_has_seen_them() -> None:
    """A node's memo holds thousands of batch grants of up to 256 items: the collector must
    not walk an object per item at every full collection."""
    node = grants.VerifiedGrants(SECRET)
    gc.collect()
    before = len(gc.get_objects())
    for b in range(40):
        items = [[b"k%d/%d" % (b, i), "dram", 64 * i, 64] for i in range(256)]
        batch = node.check_batch(
            grants.sign_batch(SECRET, grants.OP_WRITE, 1000, items), grants.OP_WRITE, now_ms=0
        )
        assert batch.grant(255, check=True).key == b"k%d/255" % b
    gc.collect()  # the first pass sees each item once, then stops tracking it
    assert len(gc.get_objects()) - before < 40 * 16  # (a few per batch, not one per item)


def test_a_batch_grant_grants_each_of_its_items_and_is_verified_once() -> None:
    node = grants.VerifiedGrants(SECRET)
    batch = node.check_batch(_batch(), grants.OP_READ, now_ms=1000)
    g = batch.grant(2, check=False)
    assert (g.op, g.key, g.segment, g.offset, g.size, g.expires_ms) == (
        grants.OP_READ,
        b"k2",
        "dram",
        128,
        12,
        1000,
    )
    grants.check_range(g, 0, 12)
    with pytest.raises(OutOfRangeError):
        grants.check_range(g, 1, 12)
    assert node.check_batch(_batch(), grants.OP_READ, now_ms=0) is batch  # memo: no BLAKE2b
    with pytest.raises(GrantInvalidError, match="no such item"):
        batch.grant(3, check=False)


@pytest.mark.parametrize("field", [0, 1, 2, 3])
def test_a_tampered_batch_grant_fails(field: int) -> None:
    wire = _batch()
    forged = {
        0: grants.OP_WRITE,
        1: 10**12,
        2: wire[2].replace(b"k1", b"k9"),  # type: ignore[attr-defined]
        3: bytes(16),
    }
    wire[field] = forged[field]
    with pytest.raises(GrantInvalidError):
        grants.VerifiedGrants(SECRET).check_batch(wire, wire[0], now_ms=0)  # type: ignore[arg-type]


def test_a_batch_grant_expires_is_for_one_op_and_one_secret() -> None:
    node = grants.VerifiedGrants(SECRET)
    with pytest.raises(GrantInvalidError, match="expired"):
        node.check_batch(_batch(), grants.OP_READ, now_ms=1001)
    with pytest.raises(GrantInvalidError, match="not 'w'"):
        node.check_batch(_batch(), grants.OP_WRITE, now_ms=0)
    with pytest.raises(GrantInvalidError, match="does not verify"):
        grants.VerifiedGrants(b"x" * 32).check_batch(_batch(), grants.OP_READ, now_ms=0)
    for bad in ([], [grants.OP_READ, 1000, "items", b"s"], "batch"):
        with pytest.raises(GrantInvalidError, match="batch grant"):
            node.check_batch(bad, grants.OP_READ, now_ms=0)


def test_references_are_read_in_order_and_a_bad_batch_fails_only_its_own() -> None:
    client = grants.GrantReader(grants.open_batch_unverified, check=True)
    members = [client.resolve([0, 0, _batch()]), client.resolve([0, 1]), client.resolve([0, 2])]
    one_key = grants.sign(SECRET, grants.OP_READ, b"solo", "dram", 0, 4, 1000)
    refs = grants.GrantRefs()
    wires = [refs.wire(g) for g in [members[1], one_key, members[0], members[2]]]  # type: ignore[misc]
    assert [len(w) for w in wires] == [3, 7, 2, 2]  # the batch travels once
    node = grants.VerifiedGrants(SECRET)
    reader = grants.GrantReader(lambda b: node.check_batch(b, grants.OP_READ, 0), check=False)
    got = [reader.resolve(w) or node.check(w, grants.OP_READ, 0) for w in wires]
    assert [g.key for g in got] == [b"k1", b"solo", b"k0", b"k2"]
    # A reference before its batch, to no item, or to a batch that failed: refused, alone.
    fresh = grants.GrantReader(lambda b: node.check_batch(b, grants.OP_READ, 0), check=False)
    with pytest.raises(GrantInvalidError, match="not given before"):
        fresh.resolve([0, 1])
    forged = _batch()
    forged[3] = bytes(16)
    with pytest.raises(GrantInvalidError, match="does not verify"):
        fresh.resolve([0, 0, forged])
    with pytest.raises(GrantInvalidError, match="does not verify"):
        fresh.resolve([0, 1])
    assert fresh.resolve([1, 2, _batch()]).key == b"k2"  # type: ignore[union-attr]
    with pytest.raises(GrantInvalidError, match="no such item"):
        fresh.resolve([1, 3])
    with pytest.raises(GrantInvalidError, match="integer"):
        fresh.resolve([[0], 1])
    assert fresh.resolve(one_key.to_wire()) is None  # a one-key grant: the caller's to read
    # A client refuses a malformed item of an answer it cannot verify.
    bad = grants.sign_batch(SECRET, grants.OP_READ, 1000, [[b"k", "dram", -1, 4]])
    with pytest.raises(GrantInvalidError, match="malformed batch grant item"):
        grants.GrantReader(grants.open_batch_unverified, check=True).resolve([0, 0, bad])
    with pytest.raises(AssertionError):
        members[0].to_wire()  # type: ignore[union-attr]


def test_the_batcher_signs_one_batch_per_node_and_expiry() -> None:
    batcher = grants.GrantBatcher(grants.OP_WRITE)
    other = b"o" * 32
    refs = [
        batcher.ref("n1", SECRET, b"a", "dram", 0, 8, 2000),
        batcher.ref("n2", other, b"b", "dram", 0, 8, 2000),
        batcher.ref("n1", SECRET, b"c", "dram", 64, 8, 3000),  # a later claim stamp
        batcher.ref("n1", SECRET, b"d", "dram", 128, 8, 2000),
    ]
    batcher.sign()
    assert [len(r) for r in refs] == [3, 3, 3, 2]  # three batches, each carried by its first
    assert refs[3][0] == refs[0][0]
    secrets = [SECRET, other, SECRET]
    got = []
    for ref in refs:
        secret = secrets[ref[0]]
        node = grants.VerifiedGrants(secret)
        reader = grants.GrantReader(
            lambda b, node=node: node.check_batch(b, grants.OP_WRITE, 1000), check=False
        )
        wire = ref if len(ref) == 3 else [ref[0], ref[1], refs[ref[0]][2]]
        got.append(reader.resolve(wire))
    assert [(g.key, g.offset, g.expires_ms) for g in got] == [
        (b"a", 0, 2000),
        (b"b", 0, 2000),
        (b"c", 64, 3000),
        (b"d", 128, 2000),
    ]


def test_the_batcher_gives_each_batch_to_its_first_reference_in_the_answer() -> None:
    # A put places its keys size by size: key 2 (4 KiB, node n1) is placed before key 0
    # (64 KiB, n1), so the call order is not the answer's order.
    batcher = grants.GrantBatcher(grants.OP_WRITE)
    answer: list[list[object]] = [[], [], [], []]
    for position, node, key in [(2, "n1", b"c"), (3, "n2", b"d"), (0, "n1", b"a"), (1, "n2", b"b")]:
        batcher.position = position
        answer[position] = batcher.ref(node, SECRET, key, "dram", 64 * position, 8, 2000)
    batcher.sign()
    assert [len(r) for r in answer] == [3, 3, 2, 2]  # the batch rides with its first in the answer
    reader = grants.GrantReader(grants.open_batch_unverified, check=True)
    assert [reader.resolve(r).key for r in answer] == [b"a", b"b", b"c", b"d"]  # type: ignore[union-attr]


def test_claims_tell_apart_the_members_of_one_write_batch() -> None:
    """Members of a batch share its signature: a claim is named by the signature and range."""
    claims = grants.WriteClaims(lambda: 0)
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
