"""The space under the table on its own: attaching replicas, freeing them now or after the
read leases that cover them, deleting replicas, and where freed bytes are reported."""

from __future__ import annotations

import pytest

from kvstore.master.config import MasterConfig
from kvstore.master.event_ring import EVENT_EVICTED, EventLog
from kvstore.master.membership import Membership, Node
from kvstore.master.prefix import PrefixIndex
from kvstore.master.space import Space
from kvstore.master.table import ObjectMeta, ObjectTable, Replica
from kvstore.types import SegmentSpec
from tests.master.fakes import FakeClock

GRACE_S = 0.25


class Rig:
    def __init__(self) -> None:
        self.clock = FakeClock()
        self.config = MasterConfig(put_timeout_s=10, node_ttl_s=3, heartbeat_interval_s=1)
        self.members = Membership(self.config, self.clock)
        segments = [SegmentSpec("dram", "dram", 4096), SegmentSpec("nvme", "nvme", 4096)]
        self.members.add(self.members.admit("n1", "127.0.0.1", 9001, b"s" * 32, segments))
        self.objects = ObjectTable()
        self.events = EventLog()
        self.space = Space(
            self.config,
            self.members,
            self.objects,
            PrefixIndex(self.events),
            self.clock,
            self.clock.wall_ms,
            GRACE_S,
        )

    @property
    def node(self) -> Node:
        return self.members.nodes["n1"]

    def store(self, key: bytes, segment: str = "dram", copies: int = 1) -> ObjectMeta:
        """Commit ``key`` with ``copies`` replicas in ``segment`` (as put_end would)."""
        alloc = self.node.segments[segment].allocator
        replicas = []
        for _ in range(copies):
            offset = alloc.allocate(100)
            assert offset is not None
            replicas.append(Replica("n1", segment, offset, 100, stamp=5, tier=segment))
        self.objects[key] = ObjectMeta(key, 100, 1, replicas, replicas_wanted=copies)
        for r in replicas:
            self.space.attach(key, r)
        return self.objects[key]

    def used(self, segment: str = "dram") -> int:
        return self.node.segments[segment].allocator.used_bytes


@pytest.fixture
def rig() -> Rig:
    return Rig()


def test_a_release_without_a_lease_frees_now_and_is_reported(rig: Rig) -> None:
    obj = rig.store(b"k")
    (r,) = obj.replicas
    assert rig.node.segments["dram"].holding == {r.offset: b"k"}
    del rig.objects[b"k"]
    rig.space.release_object(obj)
    assert rig.used() == 0 and rig.node.segments["dram"].holding == {}
    assert rig.node.forgotten == [("dram", r.offset, 5)]
    assert rig.node.segments["dram"].reuse_floor == 5, "new claims go after the freed one"
    assert rig.node.limbo == [], "an offset allocator reuses freed bytes at once"


def test_bytes_freed_on_nvme_wait_in_limbo_for_the_node(rig: Rig) -> None:
    obj = rig.store(b"k", "nvme")
    del rig.objects[b"k"]
    rig.space.release_object(obj)
    assert rig.node.limbo == [("nvme", 128)] and rig.used("nvme") == 0


def test_space_under_a_lease_is_held_until_the_lease_and_its_grace_end(rig: Rig) -> None:
    obj = rig.store(b"k")
    rig.space.leases.grant([obj], rig.clock.now + 5)
    obj.lease_until = rig.clock.now + 5
    del rig.objects[b"k"]
    rig.space.release_object(obj)
    assert rig.used() == 128 and len(rig.space.deferred) == 1
    assert rig.space.held_by_node(rig.node) == {("dram", obj.replicas[0].offset)}
    rig.clock.now += 5
    rig.space.tick(rig.clock.now)
    assert rig.used() == 128, "the grace past the lease is not over"
    rig.clock.now += GRACE_S
    rig.space.tick(rig.clock.now)
    assert rig.used() == 0 and len(rig.space.deferred) == 0


def test_giving_the_last_lease_back_frees_held_space_at_once(rig: Rig) -> None:
    obj = rig.store(b"k")
    token = rig.space.leases.grant([obj], rig.clock.now + 5)
    obj.lease_until = rig.clock.now + 5
    del rig.objects[b"k"]
    rig.space.release_object(obj)
    assert rig.space.release_leases([token, token]) == [True, False]
    assert rig.used() == 0 and obj.lease_until == 0.0


def test_held_space_of_a_dropped_node_is_not_freed_into_its_successor(rig: Rig) -> None:
    obj = rig.store(b"k")
    rig.space.leases.grant([obj], rig.clock.now + 5)
    obj.lease_until = rig.clock.now + 5
    rig.space.release_object(obj)
    rig.members.remove("n1", set())
    rig.members.add(
        rig.members.admit("n1", "127.0.0.1", 9001, b"s" * 32, [SegmentSpec("dram", "dram", 4096)])
    )
    rig.clock.now += 10
    rig.space.tick(rig.clock.now)
    assert rig.node.forgotten == [] and rig.used() == 0


def test_deleting_the_last_replica_deletes_the_object(rig: Rig) -> None:
    obj = rig.store(b"k")
    rig.space.delete_replica(obj, obj.replicas[0], kind=EVENT_EVICTED)
    assert b"k" not in rig.objects and rig.used() == 0


def test_deleting_one_of_two_replicas_lowers_what_the_object_wants(rig: Rig) -> None:
    obj = rig.store(b"k", copies=2)
    rig.space.delete_replica(obj, obj.replicas[0])
    assert obj.num_replicas == 1 and obj.replicas_wanted == 1 and b"k" in rig.objects
    assert rig.used() == 128


def test_a_release_on_a_node_that_is_gone_changes_nothing(rig: Rig) -> None:
    rig.space.release(Replica("ghost", "dram", 0, 100))
    rig.space.attach(b"k", Replica("ghost", "dram", 0, 100))


def test_claims_last_a_put_timeout(rig: Rig) -> None:
    assert rig.space.claim_base() == rig.clock.wall_ms() + 10_000
    assert rig.space.hold_until(ObjectMeta(b"k", 1, 1, []), rig.clock.now) == 0.0
