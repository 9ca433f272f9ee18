from __future__ import annotations

import gc

import pytest

from kvstore import grants
from kvstore.errors import GrantInvalidError, OutOfRangeError

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


# ---------------------------------------------------------------- blank grants
def _blank(expires_ms: int = 1000) -> grants.Grant:
    return grants.sign(SECRET, grants.OP_WRITE, grants.BLANK_KEY, "dram", 64, 100, expires_ms)


def test_a_blank_grant_writes_its_range_under_the_key_its_writer_names() -> None:
    memo = grants.VerifiedGrants(SECRET)
    for key in (b"a", b"another key"):
        wire = _blank().for_key(key).to_wire()
        assert len(wire) == 8 and wire[1] == key and wire[7] is True
        grant = memo.check(wire, grants.OP_WRITE, 0, remember=False)
        assert (grant.key, grant.offset, grant.size, grant.blank) == (key, 64, 100, True)
        with pytest.raises(OutOfRangeError):
            grants.check_range(grant, 50, 51)
        assert grants.Grant.from_wire(wire) == grant


@pytest.mark.parametrize(
    "wire",
    [
        # a blank grant as the master hands it out: it writes only under a key
        _blank().to_wire(),
        # a grant signed for its key does not verify as a blank
        grants.sign(SECRET, grants.OP_WRITE, b"k", "dram", 64, 100, 1000).to_wire() + [True],
        # the eighth item is True and nothing else; a blank's key is not empty; it writes
        [*_blank().for_key(b"k").to_wire()[:7], 1],
        [*_blank().to_wire(), True],
        [grants.OP_READ, *_blank().for_key(b"k").to_wire()[1:]],
        # tampered: another range, another expiry
        [*_blank().for_key(b"k").to_wire()[:3], 0, *_blank().for_key(b"k").to_wire()[4:]],
        [*_blank().for_key(b"k").to_wire()[:5], 2000, *_blank().for_key(b"k").to_wire()[6:]],
    ],
)
def test_a_blank_grant_verifies_only_as_the_master_signed_it(wire: list[object]) -> None:
    with pytest.raises(GrantInvalidError):
        grants.VerifiedGrants(SECRET).check(wire, grants.OP_WRITE, 0, remember=False)


def test_a_blank_grant_expires_and_is_refused_for_reads() -> None:
    memo = grants.VerifiedGrants(SECRET)
    wire = _blank(expires_ms=1000).for_key(b"k").to_wire()
    with pytest.raises(GrantInvalidError, match="expired"):
        memo.check(wire, grants.OP_WRITE, 1001, remember=False)
    with pytest.raises(GrantInvalidError):
        memo.check(wire, grants.OP_READ, 0)
