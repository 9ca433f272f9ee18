"""Tiers, eviction, leases, pins, replication and drain in the master, with a fake clock."""

from __future__ import annotations

import random
from typing import Any

import pytest

from kvstore.errors import InvalidRequestError, KeyNotFoundError, NoSpaceError
from kvstore.eviction import EVICTION_POLICIES, make_policy
from kvstore.master.service import MasterConfig, MasterService
from kvstore.master.table import ObjectMeta, Replica
from kvstore.master.tiering import TierConfig
from kvstore.node.claims import WriteClaims
from kvstore.stored_object import ManifestClaim
from kvstore.types import ObjectInfo, PutTicket, SegmentSpec
from tests.master.fakes import FakeClock

KIB = 1024
MIB = 1 << 20


def make(
    clock: FakeClock,
    nodes: int = 1,
    dram: int = MIB,
    nvme: int = 4 * MIB,
    **tier_kw: object,
) -> MasterService:
    svc = MasterService(
        MasterConfig(put_timeout_s=10, node_ttl_s=3, heartbeat_interval_s=1),
        clock,
        clock.wall_ms,
        tiers=TierConfig(**{"lease_s": 2.0, "promote_after_hits": 2, **tier_kw}),  # type: ignore[arg-type]
    )
    for i in range(nodes):
        segs = [SegmentSpec("dram", "dram", dram)]
        if nvme:
            segs.append(SegmentSpec("nvme", "nvme", nvme))
        svc.register(f"n{i}", "127.0.0.1", 9000 + i, bytes([65 + i]) * 32, segs)
    return svc


def put(svc: MasterService, key: bytes, size: int, replicas: int = 1) -> PutTicket:
    (ticket,) = svc.put_start([key], [size], replicas=replicas)
    assert isinstance(ticket, PutTicket), ticket
    assert svc.put_end([ticket.put_id], [len(key)]) == [None]
    return ticket


def tiers_of(svc: MasterService, key: bytes) -> list[str]:
    return sorted(r.tier for r in svc.objects[key].replicas)


def run_tasks(svc: MasterService, ok: bool = True) -> int:
    """Every node runs what it was handed and reports it (the heartbeat round trip)."""
    count = 0
    for node_id in list(svc.nodes):
        tasks = svc.take_tasks(node_id)
        svc.tasks_done(node_id, [[t["id"], 0 if ok else 402, None] for t in tasks])
        count += len(tasks)
    return count


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


# ---------------------------------------------------------------- config
@pytest.mark.parametrize(
    "kw",
    [
        {"high_watermark": 0.5, "low_watermark": 0.6},
        {"high_watermark": 1.5},
        {"low_watermark": 0.0},
        {"high_watermark": True},
        {"tier_watermarks": (("tape", 0.9, 0.8),)},
        {"tier_watermarks": (("dram", 0.7, 0.9),)},
        {"eviction_policy": "random"},
        {"lease_s": 0},
        {"promote_after_hits": -1},
    ],
)
def test_bad_tier_config_is_refused(kw: dict[str, object]) -> None:
    with pytest.raises(InvalidRequestError):
        TierConfig(**kw)  # type: ignore[arg-type]


def test_policies_are_a_registry() -> None:
    assert set(EVICTION_POLICIES) >= {"lru", "lfu"}
    assert TierConfig(tier_watermarks=(("nvme", 0.95, 0.5),)).marks("nvme") == (0.95, 0.5)


def test_lru_and_lfu_rank_differently() -> None:
    class C:
        def __init__(self, last: float, hits: int) -> None:
            self.last_access, self.hits, self.size = last, hits, 1

    old_hot, new_cold = C(1.0, 50), C(2.0, 1)
    assert make_policy("lru").rank([old_hot, new_cold], 1) == [old_hot]
    assert make_policy("lfu").rank([old_hot, new_cold], 1) == [new_cold]


def test_unknown_segment_tier_is_refused(clock: FakeClock) -> None:
    svc = make(clock, nodes=0)
    with pytest.raises(InvalidRequestError):
        svc.register("x", "h", 1, b"k" * 32, [SegmentSpec("t", "tape", MIB)])


# ---------------------------------------------------------------- placement and sync eviction
def test_puts_fill_dram_then_nvme(clock: FakeClock) -> None:
    svc = make(clock)
    for i in range(16):
        put(svc, b"d%d" % i, 64 * KIB)
    assert all(tiers_of(svc, b"d%d" % i) == ["dram"] for i in range(16))
    put(svc, b"spill", 64 * KIB)
    assert tiers_of(svc, b"spill") == ["nvme"]


def test_full_cluster_evicts_synchronously_least_recent_first(clock: FakeClock) -> None:
    svc = make(clock, dram=256 * KIB, nvme=512 * KIB)
    for i in range(12):  # 4 in DRAM, 8 in NVMe: both full
        clock.now += 1
        put(svc, b"k%d" % i, 64 * KIB)
    clock.now += 10  # every lease over
    svc.get_locations([b"k4"])  # k4 is the oldest NVMe object, but now recently read
    clock.now += 10
    put(svc, b"new", 64 * KIB)
    assert b"k4" in svc.objects
    assert b"k5" not in svc.objects, "the least recently used NVMe object goes first"
    assert svc.tiering.num_sync_evictions == 1
    assert tiers_of(svc, b"new") == ["nvme"]


def test_no_space_only_when_everything_left_is_leased_or_pinned(clock: FakeClock) -> None:
    svc = make(clock, dram=256 * KIB, nvme=0)
    for i in range(4):
        put(svc, b"k%d" % i, 64 * KIB)
    svc.pin([b"k0", b"k1"], ttl_s=100, hard=True)
    svc.get_locations([b"k2", b"k3"])  # leased
    (err,) = svc.put_start([b"x"], [64 * KIB])
    assert isinstance(err, NoSpaceError)
    assert "leased (2 objects" in err.message and "hard-pinned (2 objects" in err.message
    assert len(svc.objects) == 4, "a failed put changes nothing"
    clock.now += 10  # the leases end: those two may go now
    assert isinstance(svc.put_start([b"x"], [64 * KIB])[0], PutTicket)


def test_bytes_reused_in_the_millisecond_they_were_freed_get_a_later_write_claim(
    clock: FakeClock,
) -> None:
    """A node orders writes to the same bytes by their grants' expiry (WriteClaims) and refuses
    the later comer of a tie. An object committed and evicted within one millisecond must not
    hand its bytes to a put with the same expiry: that put's write would be refused as stale."""
    svc = make(clock, dram=256 * KIB, nvme=0)
    node = WriteClaims(clock.wall_ms)  # what the node remembers of each write
    stamps = []
    for i in range(5):  # one clock reading: all in the same millisecond; the 5th evicts one
        clock.now += 0.0001 if i == 4 else 0.0
        (ticket,) = svc.put_start([b"k%d" % i], [64 * KIB])
        assert isinstance(ticket, PutTicket), ticket
        grant = ticket.locations[0].grant
        node.end(node.begin(grant, None), None, complete=True)  # refused before the fix
        assert svc.put_end([ticket.put_id], [i]) == [None]
        stamps.append(grant.expires_ms)
    assert svc.tiering.num_sync_evictions == 1
    assert stamps[4] > max(stamps[:4]), stamps


def test_a_failed_move_s_bytes_reused_at_once_get_a_later_write_claim(clock: FakeClock) -> None:
    svc = make(clock, dram=256 * KIB)
    node = WriteClaims(clock.wall_ms)
    for i in range(5):  # the fifth lands in NVMe
        put(svc, b"k%d" % i, 64 * KIB)
    svc.remove([b"k0", b"k1"])
    svc.get_locations([b"k4"])
    svc.get_locations([b"k4"])  # the second read promotes it into the room k0 and k1 left
    (task,) = svc.take_tasks("n0")
    segment, offset = task["dst"]
    # The node claims the promotion's DRAM bytes, then the move fails: the bytes are free again.
    claim = node.claim(segment, offset, offset + 64 * KIB, task["claim_ms"], b"task:1")
    node.end(claim, None, complete=True)
    svc.tasks_done("n0", [[task["id"], 402, "failed"]])
    # All in one millisecond: the next puts take those bytes again.
    for i in range(2):
        (ticket,) = svc.put_start([b"new%d" % i], [64 * KIB])
        assert isinstance(ticket, PutTicket), ticket
        grant = ticket.locations[0].grant
        node.end(node.begin(grant, None), None, complete=True)  # refused before the fix
        assert grant.expires_ms > task["claim_ms"]
        assert svc.put_end([ticket.put_id], [i]) == [None]
    assert any(r.offset == offset for i in range(2) for r in svc.objects[b"new%d" % i].replicas)


def test_soft_pins_go_last_and_hard_pins_never(clock: FakeClock) -> None:
    svc = make(clock, dram=256 * KIB, nvme=0)
    for i in range(4):
        clock.now += 1
        put(svc, b"k%d" % i, 64 * KIB)
    svc.pin([b"k0"], ttl_s=1000)  # soft: oldest, but goes after the unpinned ones
    svc.pin([b"k1"], ttl_s=1000, hard=True)
    clock.now += 10
    for i in range(2):
        put(svc, b"new%d" % i, 64 * KIB)
    assert set(svc.objects) == {b"k0", b"k1", b"new0", b"new1"}
    clock.now += 10
    svc.pin([b"new0", b"new1"], ttl_s=1000, hard=True)
    put(svc, b"new2", 64 * KIB)  # only the soft pin is evictable now: under pressure, it goes
    assert b"k0" not in svc.objects and b"k1" in svc.objects


def test_pins_expire_and_unpin_works(clock: FakeClock) -> None:
    svc = make(clock, dram=128 * KIB, nvme=0)
    put(svc, b"a", 64 * KIB)
    put(svc, b"b", 64 * KIB)
    svc.pin([b"a", b"b"], ttl_s=5, hard=True)
    assert isinstance(svc.put_start([b"c"], [64 * KIB])[0], NoSpaceError)
    assert svc.unpin([b"b"]) == [None]
    assert isinstance(svc.put_start([b"c"], [64 * KIB])[0], PutTicket)
    clock.now += 6  # the forgotten pin on "a" expired
    assert svc.stats()["num_pinned"] == 0


def test_pin_bad_input(clock: FakeClock) -> None:
    svc = make(clock)
    put(svc, b"a", 10)
    assert isinstance(svc.pin([b"missing"], ttl_s=5)[0], KeyNotFoundError)
    assert isinstance(svc.unpin([b"missing"])[0], KeyNotFoundError)
    for ttl in (0, -1, 10**9, True, "5"):
        with pytest.raises(InvalidRequestError):
            svc.pin([b"a"], ttl_s=ttl)  # type: ignore[arg-type]


def test_object_larger_than_any_tier_is_refused(clock: FakeClock) -> None:
    svc = make(clock, dram=MIB, nvme=2 * MIB)
    (err,) = svc.put_start([b"big"], [3 * MIB])
    assert isinstance(err, NoSpaceError) and "larger than any tier" in err.message
    assert svc.objects == {} and svc.pending == {}


# ---------------------------------------------------------------- background eviction
def test_watermark_demotes_to_nvme_and_switches_atomically(clock: FakeClock) -> None:
    svc = make(clock)
    for i in range(15):  # 15/16 of DRAM: above the 0.90 high mark
        clock.now += 1
        put(svc, b"k%d" % i, 64 * KIB)
    clock.now += 10
    svc.tick()
    planned = svc.take_tasks("n0")
    assert planned and all(t["kind"] == "move" for t in planned)
    assert all(tiers_of(svc, b"k%d" % i) == ["dram"] for i in range(15)), "nothing moves early"
    moved = {t["key"] for t in planned}
    assert moved == {b"k%d" % i for i in range(len(planned))}, "oldest first"
    svc.get_locations([b"k0"])  # a reader arrives while k0 is moving
    svc.tasks_done("n0", [[t["id"], 0, None] for t in planned])
    assert all(tiers_of(svc, k) == ["nvme"] for k in moved)
    dram = svc.nodes["n0"].segments["dram"].allocator
    held = 64 * KIB  # k0's old DRAM space waits for its reader's lease
    assert dram.used_bytes - held <= 0.80 * dram.capacity
    clock.now += 3
    svc.tick()
    assert dram.used_bytes <= 0.80 * dram.capacity
    assert svc.tiering.num_demotions == len(planned)


def test_last_tier_deletes_in_the_background(clock: FakeClock) -> None:
    svc = make(clock, dram=256 * KIB, nvme=512 * KIB)
    for i in range(12):
        clock.now += 1
        put(svc, b"k%d" % i, 64 * KIB)
    clock.now += 10
    svc.tick()
    run_tasks(svc)
    assert svc.tiering.num_evictions > 0
    nvme = svc.nodes["n0"].segments["nvme"].allocator
    assert nvme.used_bytes <= 0.9 * nvme.capacity


def test_failed_or_late_move_frees_its_destination(clock: FakeClock) -> None:
    svc = make(clock, task_timeout_s=5)
    for i in range(15):
        put(svc, b"k%d" % i, 64 * KIB)
    svc.tick()
    nvme = svc.nodes["n0"].segments["nvme"].allocator
    assert nvme.used_bytes > 0
    run_tasks(svc, ok=False)
    assert nvme.used_bytes == 0 and all(tiers_of(svc, b"k%d" % i) == ["dram"] for i in range(15))
    svc.tick()
    assert svc.take_tasks("n0")
    clock.now += 8  # the node never answers (5 s, and the master's grace past that)
    svc.tick()  # settles the late ones (and plans new moves)
    assert svc.tasks.num_failed >= 2


def test_move_of_an_overwritten_object_never_lands(clock: FakeClock) -> None:
    svc = make(clock)
    for i in range(15):
        put(svc, b"k%d" % i, 64 * KIB)
    svc.tick()
    tasks = svc.take_tasks("n0")
    key = tasks[0]["key"]
    put(svc, key, 100)  # a new version while the old one was moving
    svc.tasks_done("n0", [[t["id"], 0, None] for t in tasks])
    obj = svc.objects[key]
    assert obj.size == 100 and tiers_of(svc, key) == ["dram"]


def test_promotion_after_repeated_hits(clock: FakeClock) -> None:
    svc = make(clock, dram=256 * KIB)
    for i in range(5):  # the fifth lands in NVMe
        put(svc, b"k%d" % i, 64 * KIB)
    svc.remove([b"k0", b"k1"])
    assert tiers_of(svc, b"k4") == ["nvme"]
    svc.get_locations([b"k4"])
    assert not svc.take_tasks("n0")
    svc.get_locations([b"k4"])
    (task,) = svc.take_tasks("n0")
    assert task["src"][0] == "nvme" and task["dst"][0] == "dram"
    svc.tasks_done("n0", [[task["id"], 0, None]])
    assert tiers_of(svc, b"k4") == ["dram"] and svc.tiering.num_promotions == 1


# ---------------------------------------------------------------- leases
def test_lease_blocks_eviction_and_delays_reuse(clock: FakeClock) -> None:
    svc = make(clock, dram=128 * KIB, nvme=0)
    put(svc, b"a", 64 * KIB)
    put(svc, b"b", 64 * KIB)
    info = svc.get_locations([b"a"])[0]
    assert isinstance(info, ObjectInfo)
    assert info.locations[0].grant.expires_ms == clock.wall_ms() + 2000
    assert svc.exists([b"b"]) == [True]  # exists takes no lease: b may go
    put(svc, b"c", 64 * KIB)
    assert b"a" in svc.objects and b"b" not in svc.objects
    svc.remove([b"a"])  # gone for new readers, but its bytes wait for the lease
    svc.get_locations([b"c"])
    assert isinstance(svc.put_start([b"d"], [64 * KIB])[0], NoSpaceError)
    clock.now += 2.5
    svc.tick()
    assert isinstance(svc.put_start([b"d"], [64 * KIB])[0], PutTicket)


# ---------------------------------------------------------------- replication and drain
def test_replicas_land_on_distinct_nodes(clock: FakeClock) -> None:
    svc = make(clock, nodes=2)
    put(svc, b"r", 1000, replicas=2)
    assert {r.node_id for r in svc.objects[b"r"].replicas} == {"n0", "n1"}
    (err,) = svc.put_start([b"r3"], [10], replicas=3)
    assert isinstance(err, NoSpaceError)
    for bad in (0, 17, True):
        with pytest.raises(InvalidRequestError):
            svc.put_start([b"x"], [10], replicas=bad)


def test_dead_node_objects_are_re_replicated(clock: FakeClock) -> None:
    svc = make(clock, nodes=3)
    keys = [b"r%d" % i for i in range(20)]
    for k in keys:
        put(svc, k, 1000, replicas=2)
    clock.now += 2
    svc.heartbeat("n0")
    svc.heartbeat("n2")
    clock.now += 2
    assert svc.expire_nodes() == ["n1"]
    lost = [k for k in keys if len(svc.objects[k].replicas) == 1]
    assert lost and svc.stats()["replication"]["num_under_replicated"] == len(lost)
    svc.tick()
    assert run_tasks(svc) == len(lost)
    assert all(len(svc.objects[k].replicas) == 2 for k in keys)
    for k in keys:
        assert len({r.node_id for r in svc.objects[k].replicas}) == 2
    stats = svc.stats()["replication"]
    assert stats["num_under_replicated"] == 0 and stats["num_copies_done"] == len(lost)


def test_drain_moves_everything_then_retires(clock: FakeClock) -> None:
    svc = make(clock, nodes=2)
    for i in range(10):
        put(svc, b"k%d" % i, 1000)
    on_n0 = [k for k, o in svc.objects.items() if o.replicas[0].node_id == "n0"]
    assert on_n0
    status = svc.drain_node("n0")
    assert status["state"] == "draining" and status["num_objects_left"] == len(on_n0)
    (ticket,) = svc.put_start([b"new"], [10])
    assert ticket.locations[0].node_id == "n1", "a draining node takes no new data"
    svc.tick()
    fetches = svc.take_tasks("n1")
    assert len(fetches) == len(on_n0) and all(t["kind"] == "fetch" for t in fetches)
    svc.tasks_done("n1", [[t["id"], 0, None] for t in fetches])
    svc.tick()
    assert svc.drain_node("n0")["state"] == "retired"
    assert all(o.replicas[0].node_id == "n1" for o in svc.objects.values())
    assert svc.take_retirement("n0") and "n0" not in svc.nodes
    assert svc.drain_node("n0")["state"] == "retired"  # a poll after retirement still answers
    with pytest.raises(KeyNotFoundError):
        svc.drain_node("nope")


def test_drain_of_the_only_node_is_refused(clock: FakeClock) -> None:
    svc = make(clock, nodes=1)
    put(svc, b"k", 10)
    with pytest.raises(InvalidRequestError):
        svc.drain_node("n0")
    assert not svc.nodes["n0"].draining


# ---------------------------------------------------------------- manifests
def test_admit_manifest_readmits_and_drops_the_rest(clock: FakeClock) -> None:
    svc = make(clock, nodes=1)
    put(svc, b"live", 10)
    claims = [
        ManifestClaim("nvme", 7, b"kept", 100, 5, 1),
        ManifestClaim("nvme", 8, b"live", 10, 999, 1),  # other bytes than the live version
        ManifestClaim("nope", 9, b"x", 10, 1, 1),  # no such segment
        ManifestClaim("nvme", 7, b"dup", 10, 1, 1),  # id already taken
        ManifestClaim("nvme", 50, b"live", 10, 999, 1),  # dropped, and its id never reused
    ]
    report = svc.admit_manifest("n0", claims)
    assert (report.num_admitted, report.num_rejected) == (1, 4)
    info = svc.get_locations([b"kept"])[0]
    assert isinstance(info, ObjectInfo) and info.checksum == 5
    assert tiers_of(svc, b"kept") == ["nvme"], "an admitted replica takes its segment's tier"
    assert svc.objects[b"live"].checksum == len(b"live")
    forgot = {(s, o) for s, o, _ in svc.heartbeat("n0")}
    assert forgot == {("nvme", 8), ("nope", 9), ("nvme", 7), ("nvme", 50)}
    (ticket,) = svc.put_start([b"after"], [5 * MIB // 2])  # NVMe ids continue above 50
    assert isinstance(ticket, PutTicket) and ticket.locations[0].grant.offset > 50
    svc.remove([b"kept"])  # admitted objects are in the eviction index too
    assert not svc.nodes["n0"].segments["nvme"].holding.get(7)


def test_nvme_budget_waits_for_the_node_to_forget(clock: FakeClock) -> None:
    """lmdb still holds a freed object until the node applies its forget (next heartbeat): the
    master lets such bytes pile up to one capacity, never more."""
    svc = make(clock, dram=0, nvme=256 * KIB)
    nvme = svc.nodes["n0"].segments["nvme"].allocator
    for round_ in range(2):
        keys = [b"r%d/%d" % (round_, i) for i in range(4)]
        for k in keys:
            put(svc, k, 64 * KIB)
        svc.remove(keys)
    assert nvme.used_bytes == 0 and nvme.limbo_bytes == 512 * KIB
    (err,) = svc.put_start([b"x"], [64 * KIB])
    assert isinstance(err, NoSpaceError)
    svc.heartbeat("n0")  # delivers the forgets
    assert nvme.limbo_bytes == 512 * KIB
    svc.heartbeat("n0")  # the node applied them before this one
    assert nvme.limbo_bytes == 0
    assert isinstance(svc.put_start([b"x"], [64 * KIB])[0], PutTicket)


def test_restart_before_a_forget_arrives_never_resurrects_an_old_version(clock: FakeClock) -> None:
    svc = make(clock, dram=64 * KIB, nvme=MIB)
    put(svc, b"filler", 60 * KIB)
    (old,) = svc.put_start([b"k"], [64 * KIB])  # DRAM is full: lands in NVMe
    assert isinstance(old, PutTicket) and old.locations[0].grant.segment == "nvme"
    svc.put_end([old.put_id], [1])
    svc.remove([b"filler"])
    put(svc, b"k", 100)  # a new version in DRAM; the NVMe one is to be forgotten ...
    # ... but the node restarts before the heartbeat that would tell it, and reports the old one.
    svc.register(
        "n0",
        "127.0.0.1",
        9000,
        b"A" * 32,
        [SegmentSpec("dram", "dram", 64 * KIB), SegmentSpec("nvme", "nvme", MIB)],
    )
    claim = ManifestClaim("nvme", old.locations[0].grant.offset, b"k", 64 * KIB, 1, 1)
    report = svc.admit_manifest("n0", [claim])
    assert (report.num_admitted, report.num_rejected) == (0, 1)
    assert isinstance(svc.get_locations([b"k"])[0], KeyNotFoundError)


def test_tasks_per_heartbeat_are_bounded_by_bytes(clock: FakeClock) -> None:
    svc = make(clock, max_task_bytes_per_heartbeat=100 * KIB)
    for i in range(15):
        put(svc, b"k%d" % i, 64 * KIB)
    svc.tick()
    first = svc.take_tasks("n0")
    second = svc.take_tasks("n0")
    assert len(first) == 1 and second, "at most 100 KiB of moves per reply"
    assert {t["id"] for t in first}.isdisjoint(t["id"] for t in second)


def test_a_pin_holds_across_an_overwrite(clock: FakeClock) -> None:
    svc = make(clock)
    put(svc, b"k", 10)
    svc.pin([b"k"], ttl_s=100, hard=True)
    put(svc, b"k", 20)
    assert svc.objects[b"k"].pin and svc.stats()["num_pinned"] == 1


def test_corrupt_replica_reports_drop_and_re_replicate(clock: FakeClock) -> None:
    svc = make(clock, nodes=3)
    put(svc, b"k", 1000, replicas=2)
    obj = svc.objects[b"k"]
    bad = obj.replicas[0]
    report = [b"k", bad.node_id, bad.segment, bad.offset, obj.checksum]
    # A report naming another version, or a replica the object does not have, changes nothing.
    assert svc.report_corrupt([[b"k", bad.node_id, bad.segment, bad.offset, 999]]) == 0
    assert (
        svc.report_corrupt([[b"k", bad.node_id, bad.segment, bad.offset + 64, obj.checksum]]) == 0
    )
    assert svc.report_corrupt([[b"missing", bad.node_id, bad.segment, 0, 1]]) == 0
    with pytest.raises(InvalidRequestError):
        svc.report_corrupt([[b"k", bad.node_id]])
    assert svc.report_corrupt([report]) == 1
    assert bad not in obj.replicas and len(obj.replicas) == 1 and obj.replicas_wanted == 2
    svc.tick()
    assert run_tasks(svc) == 1
    assert len(obj.replicas) == 2 and svc.stats()["num_corrupt_replicas"] == 1
    # A corrupt last replica takes the object with it: a miss, never bad bytes.
    put(svc, b"one", 100)
    one = svc.objects[b"one"]
    r = one.replicas[0]
    assert svc.report_corrupt([[b"one", r.node_id, r.segment, r.offset, one.checksum]]) == 1
    assert b"one" not in svc.objects


def _nvme_object_being_promoted(
    svc: MasterService, key: bytes, replicas: int
) -> tuple[ObjectMeta, Replica, dict[str, Any]]:
    """``key`` lives on NVMe only and its reads have started a promotion: the object, the
    replica the promotion copies and the task as the node gets it."""
    for i in range(5):  # the fifth lands in NVMe
        put(svc, b"k%d" % i, 64 * KIB, replicas=replicas)
    svc.remove([b"k0", b"k1"])
    put(svc, key, 64 * KIB, replicas=replicas)  # (DRAM has room again: it goes there)
    svc.remove([key])
    put(svc, b"fill", 128 * KIB, replicas=replicas)
    put(svc, key, 64 * KIB, replicas=replicas)
    assert tiers_of(svc, key) == ["nvme"] * replicas
    svc.remove([b"fill"])
    svc.get_locations([key])
    svc.get_locations([key])  # (promote_after_hits=2)
    obj = svc.objects[key]
    assert obj.busy
    (task,) = [t for n in svc.nodes for t in svc.take_tasks(n)]
    src = next(r for r in obj.replicas if [r.segment, r.offset] == task["src"])
    assert task["dst"][0] == "dram" and src.tier == "nvme"
    return obj, src, task


@pytest.mark.parametrize("ending", ["checksum", "ok", "late"])
def test_a_corrupt_nvme_replica_is_dropped_while_its_promotion_is_in_flight(
    clock: FakeClock, ending: str
) -> None:
    svc = make(clock, dram=256 * KIB, task_timeout_s=5)
    obj, src, task = _nvme_object_being_promoted(svc, b"hot", replicas=1)
    nvme = svc.nodes[src.node_id].segments["nvme"].allocator
    dram = svc.nodes[src.node_id].segments["dram"].allocator
    dram_before = dram.used_bytes - 64 * KIB  # (less the promotion's destination)
    nvme_before = nvme.used_bytes
    # A reader finds the NVMe bytes corrupt while the promotion is in flight: a miss from now on.
    assert svc.report_corrupt([[b"hot", src.node_id, src.segment, src.offset, obj.checksum]]) == 1
    assert b"hot" not in svc.objects
    assert isinstance(svc.get_locations([b"hot"])[0], KeyNotFoundError)
    assert nvme.used_bytes == nvme_before  # the node may still be reading it for the move
    # However the move ends, nothing lands: not even bytes the node found intact.
    if ending == "late":
        clock.now += 8
        svc.tick()
    else:
        svc.tasks_done(src.node_id, [[task["id"], 0 if ending == "ok" else 202, "x"]])
    assert b"hot" not in svc.objects and not svc.tasks.by_id
    assert dram.used_bytes == dram_before
    clock.now += 8
    svc.tick()
    assert nvme.used_bytes == nvme_before - 64 * KIB
    assert svc.stats()["num_corrupt_replicas"] == 1


def test_a_corrupt_replica_of_two_is_dropped_mid_promotion_and_copied_back(
    clock: FakeClock,
) -> None:
    svc = make(clock, nodes=2, dram=256 * KIB)
    obj, src, task = _nvme_object_being_promoted(svc, b"hot", replicas=2)
    good = next(r for r in obj.replicas if r != src)
    assert svc.report_corrupt([[b"hot", src.node_id, src.segment, src.offset, obj.checksum]]) == 1
    (info,) = svc.get_locations([b"hot"])
    assert isinstance(info, ObjectInfo)
    assert [(loc.node_id, loc.grant.offset) for loc in info.locations] == [
        (good.node_id, good.offset)
    ]
    # The promotion fails its checksum on the node; then replication copies the good one back.
    svc.tasks_done(src.node_id, [[task["id"], 202, "source bytes fail their checksum"]])
    assert svc.objects[b"hot"].replicas == (good,)
    svc.tick()
    run_tasks(svc)
    assert len(svc.objects[b"hot"].replicas) == 2 and src not in svc.objects[b"hot"].replicas


def test_a_move_whose_source_fails_its_checksum_drops_that_replica(clock: FakeClock) -> None:
    svc = make(clock, dram=256 * KIB)
    obj, src, task = _nvme_object_being_promoted(svc, b"hot", replicas=1)
    # No reader reported it: the node's own check on the move does.
    svc.tasks_done(src.node_id, [[task["id"], 202, "source bytes fail their checksum"]])
    assert b"hot" not in svc.objects
    assert svc.stats()["num_corrupt_replicas"] == 1
    # Any other failure is no evidence of corruption: the replica stays.
    obj, src, task = _nvme_object_being_promoted(svc, b"warm", replicas=1)
    svc.tasks_done(src.node_id, [[task["id"], 301, "NVMe read failed"]])
    assert svc.objects[b"warm"].replicas == (src,)


def test_one_replica_goes_where_the_ranked_choice_of_several_puts_its_first(
    clock: FakeClock,
) -> None:
    """A single replica goes to the best segment with room (fastest tier, then the most free
    bytes, then the first node): the same segment a 2-replica put picks first, whatever the
    nodes' fill."""
    rng = random.Random(7)
    for round_ in range(40):
        svc = make(clock, nodes=3, dram=64 * KIB, nvme=256 * KIB)
        for i in range(rng.randrange(0, 40)):
            put(svc, b"fill%d-%d" % (round_, i), rng.choice([1, 4, 16]) * KIB)
        place = svc.tiering.placer(set())
        size = rng.choice([1, 8, 32]) * KIB
        one, _ = place(size, 1)
        ranked, _ = place(size, 2)
        assert [(s.name, n.node_id) for s, n in one] == [
            (ranked[0][0].name, ranked[0][1].node_id)
        ], round_
