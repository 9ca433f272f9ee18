"""Rebuilding the object table from node manifests (the failover path), with a fake clock."""

from __future__ import annotations

import itertools

import pytest

from kvstore.errors import NodeUnavailableError
from kvstore.master.service import MasterConfig, MasterService
from kvstore.stored_object import ManifestClaim, claims_from_wire, verify_claims
from kvstore.types import PutTicket, SegmentSpec

SECRET = b"s" * 32


def make_service() -> MasterService:
    ticks = itertools.count(1000)
    return MasterService(MasterConfig(), clock=lambda: 1000.0, wall_ms=lambda: next(ticks))


def register(svc: MasterService, node_id: str, capacity: int = 1 << 20) -> None:
    svc.register(node_id, "127.0.0.1", 9000, SECRET, [SegmentSpec("dram", "dram", capacity)])


def claim(
    key: bytes, offset: int, size: int = 100, checksum: int = 7, stamp: int = 1
) -> ManifestClaim:
    return ManifestClaim("dram", offset, key, size, checksum, stamp)


def table(svc: MasterService) -> dict[bytes, tuple[int, list[tuple[str, int]]]]:
    return {
        k: (o.checksum, sorted((r.node_id, r.offset) for r in o.replicas))
        for k, o in svc.objects.items()
    }


def test_admits_claims_and_reserves_their_extents() -> None:
    svc = make_service()
    register(svc, "a")
    report = svc.admit_manifest("a", [claim(b"k1", 0), claim(b"k2", 128)])
    assert (report.num_admitted, report.num_rejected) == (2, 0)
    assert table(svc) == {b"k1": (7, [("a", 0)]), b"k2": (7, [("a", 128)])}
    alloc = svc.nodes["a"].segments["dram"].allocator
    assert alloc.is_allocated(0) and alloc.is_allocated(128)
    # New puts never land on admitted extents.
    tickets = svc.put_start([b"new"], [100])
    assert isinstance(tickets[0], PutTicket)
    assert tickets[0].locations[0].grant.offset not in (0, 128)


@pytest.mark.parametrize(
    ("bad", "why"),
    [
        (ManifestClaim("nvme", 0, b"x", 10, 1, 1), "no segment"),
        (claim(b"x", 3), "not free"),  # misaligned
        (claim(b"x", 1 << 20), "not free"),  # past the end
        (claim(b"x", 64, size=100), "not free"),  # overlaps k1 at [0, 128)
    ],
)
def test_rejects_bad_claims_with_a_reason_and_tells_the_node_to_forget(bad, why) -> None:
    svc = make_service()
    register(svc, "a")
    svc.admit_manifest("a", [claim(b"k1", 0, stamp=5)])
    report = svc.admit_manifest("a", [bad])
    assert report.num_rejected == 1 and why in report.reasons[0]
    assert (bad.segment, bad.offset, bad.stamp) in svc.nodes["a"].forgotten
    assert set(svc.objects) == {b"k1"}


def test_unregistered_node_cannot_claim() -> None:
    with pytest.raises(NodeUnavailableError):
        make_service().admit_manifest("ghost", [claim(b"k", 0)])


def test_the_live_table_beats_any_claim() -> None:
    svc = make_service()
    register(svc, "a")
    register(svc, "b")
    (ticket,) = svc.put_start([b"k"], [100])
    assert svc.put_end([ticket.put_id], [42]) == [None]
    report = svc.admit_manifest("b", [claim(b"k", 512, checksum=9, stamp=1 << 60)])
    assert report.num_rejected == 1 and "live table" in report.reasons[0]
    assert svc.objects[b"k"].checksum == 42


def _claims_by_node() -> dict[str, list[ManifestClaim]]:
    return {
        "a": [
            claim(b"same", 0, checksum=1, stamp=5),
            claim(b"newer-on-b", 128, checksum=2, stamp=5),
        ],
        "b": [
            claim(b"same", 0, checksum=1, stamp=6),
            claim(b"newer-on-b", 128, checksum=3, stamp=9),
        ],
        "c": [claim(b"tie", 0, checksum=4, stamp=7), claim(b"same", 128, checksum=1, stamp=1)],
        "d": [claim(b"tie", 0, checksum=5, stamp=7)],
    }


@pytest.mark.parametrize("order", list(itertools.permutations("abcd")))
def test_conflicting_claims_end_in_one_table_whatever_the_order(order) -> None:
    claims = _claims_by_node()
    svc = make_service()
    for n in order:
        register(svc, n)
    for n in order:
        svc.admit_manifest(n, claims[n])
    assert table(svc) == {
        # equal checksums: replicas of one object
        b"same": (1, [("a", 0), ("b", 0), ("c", 128)]),
        # different checksums: the later put (larger stamp) wins
        b"newer-on-b": (3, [("b", 128)]),
        # a tie on the stamp: the lower node id wins
        b"tie": (4, [("c", 0)]),
    }
    # The losers' space is free again on their nodes.
    assert not svc.nodes["d"].segments["dram"].allocator.is_allocated(0)
    assert not svc.nodes["a"].segments["dram"].allocator.is_allocated(128)


def test_a_node_claiming_two_versions_of_a_key_keeps_the_newer() -> None:
    svc = make_service()
    register(svc, "a")
    report = svc.admit_manifest(
        "a", [claim(b"k", 0, checksum=1, stamp=1), claim(b"k", 256, checksum=2, stamp=2)]
    )
    assert table(svc) == {b"k": (2, [("a", 256)])}
    assert report.num_rejected == 1 and ("dram", 0, 1) in svc.nodes["a"].forgotten


def test_reset_forgets_everything() -> None:
    svc = make_service()
    register(svc, "a")
    svc.admit_manifest("a", [claim(b"k", 0)])
    svc = svc.next_term()
    assert not svc.nodes and not svc.objects and not svc.manifest_stamps


def test_claims_from_wire_reports_malformed_items_in_place() -> None:
    good = claim(b"k", 0).to_wire()
    out = claims_from_wire([good, ["dram", -1, b"k", 1, 1, 1], "junk", ["dram", 0, b"", 1, 1]])
    assert out[0] == claim(b"k", 0)
    assert all(isinstance(e, Exception) for e in out[1:])


def test_verify_claims_drops_extents_whose_bytes_changed() -> None:
    import xxhash

    arena = bytearray(1024)
    arena[0:4] = b"abcd"
    ok = ManifestClaim("dram", 0, b"k", 4, xxhash.xxh3_64_intdigest(b"abcd"), 1)
    rewritten = ManifestClaim("dram", 0, b"old", 4, xxhash.xxh3_64_intdigest(b"wxyz"), 1)
    outside = ManifestClaim("dram", 1020, b"o", 8, 0, 1)
    good, bad = verify_claims([ok, rewritten, outside], {"dram": memoryview(arena)})
    assert good == [ok]
    assert [c for c, _ in bad] == [rewritten, outside]


def test_freed_replicas_name_their_version_for_the_node() -> None:
    svc = make_service()
    register(svc, "a")
    (t1,) = svc.put_start([b"k"], [100])
    svc.put_end([t1.put_id], [1])
    (t2,) = svc.put_start([b"k"], [100])
    svc.put_end([t2.put_id], [2])
    g1 = t1.locations[0].grant
    assert svc.heartbeat("a") == [(g1.segment, g1.offset, g1.expires_ms)]


def test_a_restarted_node_never_brings_back_an_uncommitted_or_lease_held_extent() -> None:
    svc = make_service()
    register(svc, "a")
    (pending,) = svc.put_start([b"pending"], [100])  # written on the node, never put_end'ed
    (gone,) = svc.put_start([b"gone"], [100])
    assert svc.put_end([gone.put_id], [7]) == [None]
    svc.objects[b"gone"].lease_until = 1e9  # a reader holds it: the remove waits for the lease
    assert svc.remove([b"gone"]) == [None]
    assert len(svc.deferred) == 1
    register(svc, "a")  # the node restarted (same id) before any of it reached it
    offsets = [t.locations[0].grant.offset for t in (pending, gone)]
    report = svc.admit_manifest(
        "a", [claim(b"pending", offsets[0], stamp=5), claim(b"gone", offsets[1], stamp=5)]
    )
    assert (report.num_admitted, report.num_rejected) == (0, 2)
    assert svc.objects == {}
