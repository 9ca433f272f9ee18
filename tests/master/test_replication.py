"""Re-replication and drain (kvstore.master.replication.Replicator), driven through the master's
verbs with a fake clock: what a copy task carries, where it goes, one copy per object at a
time, failures and timeouts that free what they allocated, and the bounds on a tick."""

from __future__ import annotations

import pytest

from kvstore import grants
from kvstore.errors import KeyNotFoundError
from kvstore.master import replication
from kvstore.master.service import MasterConfig, MasterService
from kvstore.master.tasks import TASK_GRACE_S
from kvstore.master.tiering import TierConfig
from kvstore.types import PutTicket, SegmentSpec
from tests.master.fakes import FakeClock

KIB = 1024
TASK_TIMEOUT_S = 30.0
SECRETS = {f"n{i}": bytes([65 + i]) * 32 for i in range(8)}


def make(clock: FakeClock, *dram: int) -> MasterService:
    """A master with one node per DRAM size given (``n0``, ``n1``, ...)."""
    svc = MasterService(
        MasterConfig(put_timeout_s=10, node_ttl_s=3, heartbeat_interval_s=1),
        clock,
        clock.wall_ms,
        tiers=TierConfig(task_timeout_s=TASK_TIMEOUT_S),
    )
    for i, size in enumerate(dram):
        node_id = f"n{i}"
        svc.register(
            node_id, "127.0.0.1", 9000 + i, SECRETS[node_id], [SegmentSpec("dram", "dram", size)]
        )
    return svc


def put(svc: MasterService, key: bytes, size: int, replicas: int = 1) -> None:
    (ticket,) = svc.put_start([key], [size], replicas=replicas)
    assert isinstance(ticket, PutTicket), ticket
    assert svc.put_end([ticket.put_id], [len(key)]) == [None]


def holders(svc: MasterService, key: bytes) -> set[str]:
    return {r.node_id for r in svc.objects[key].replicas}


def kill(svc: MasterService, clock: FakeClock, node_id: str) -> None:
    """``node_id`` stops beating; the others keep on until it is declared dead."""
    for _ in range(2):
        clock.now += 2
        for other in svc.nodes:
            if other != node_id:
                svc.heartbeat(other)
    assert svc.expire_nodes() == [node_id]


def used(svc: MasterService, node_id: str) -> int:
    return svc.nodes[node_id].segments["dram"].allocator.used_bytes


def under(svc: MasterService) -> int:
    return svc.stats()["replication"]["num_under_replicated"]  # type: ignore[index]


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


def test_a_copy_task_carries_a_read_grant_for_the_surviving_replica(clock: FakeClock) -> None:
    svc = make(clock, 64 * KIB, 64 * KIB, 64 * KIB)
    put(svc, b"k", 1000, replicas=2)
    lost, kept = sorted(holders(svc, b"k"))
    (target,) = set(svc.nodes) - {lost, kept}
    kill(svc, clock, lost)
    svc.tick()
    (task,) = svc.take_tasks(target)
    obj = svc.objects[b"k"]
    assert task["kind"] == "fetch" and task["key"] == b"k"
    assert (task["size"], task["checksum"]) == (obj.size, obj.checksum)
    node_id, host, port, grant_wire = task["from"]
    assert (node_id, host, port) == (kept, "127.0.0.1", svc.nodes[kept].port)
    grant = grants.Grant.from_wire(grant_wire)
    # Only the source node's secret opens it, for reading exactly the surviving replica.
    grants.verify(SECRETS[kept], grant, grants.OP_READ, clock.wall_ms())
    (src,) = obj.replicas
    assert (grant.segment, grant.offset, grant.size) == (src.segment, src.offset, src.size)
    assert grant.expires_ms == task["deadline_ms"] == clock.wall_ms() + TASK_TIMEOUT_S * 1000
    assert task["dst"][0] == "dram" and svc.nodes[target].segments["dram"].allocator.is_allocated(
        task["dst"][1]
    )
    assert task["stamp"] == src.stamp
    assert isinstance(task["claim_ms"], int) and task["claim_ms"] > clock.wall_ms()


def test_the_copy_goes_to_a_live_node_that_is_not_draining(clock: FakeClock) -> None:
    svc = make(clock, 64 * KIB, 64 * KIB, 64 * KIB, 64 * KIB)
    put(svc, b"k", 1000, replicas=2)
    lost, _ = sorted(holders(svc, b"k"))
    spare = sorted(set(svc.nodes) - holders(svc, b"k"))
    svc.drain_node(spare[0])  # holds nothing: it may drain; it takes no copies either
    kill(svc, clock, lost)
    svc.tick()
    assert svc.take_tasks(spare[0]) == []
    assert len(svc.take_tasks(spare[1])) == 1


def test_the_copy_prefers_the_emptiest_node(clock: FakeClock) -> None:
    svc = make(clock, 64 * KIB, 64 * KIB, 64 * KIB, 64 * KIB)
    put(svc, b"k", 1000, replicas=2)
    lost, _ = sorted(holders(svc, b"k"))
    spare = sorted(set(svc.nodes) - holders(svc, b"k"))
    # Fill one spare a little: the other has more room and gets the copy.
    svc.nodes[spare[0]].segments["dram"].allocator.allocate(8 * KIB)
    kill(svc, clock, lost)
    svc.tick()
    assert [len(svc.take_tasks(n)) for n in spare] == [0, 1]


def test_one_copy_per_object_is_in_flight(clock: FakeClock) -> None:
    svc = make(clock, 64 * KIB, 64 * KIB, 64 * KIB)
    put(svc, b"k", 1000, replicas=2)
    lost = min(holders(svc, b"k"))
    kill(svc, clock, lost)
    svc.tick()
    svc.tick()
    stats = svc.stats()["replication"]
    assert stats["num_copies_in_flight"] == 1  # type: ignore[index]


def test_a_successful_copy_adds_the_replica(clock: FakeClock) -> None:
    svc = make(clock, 64 * KIB, 64 * KIB, 64 * KIB)
    put(svc, b"k", 1000, replicas=2)
    lost = min(holders(svc, b"k"))
    kill(svc, clock, lost)
    assert under(svc) == 1
    svc.tick()
    (target,) = [n for n in svc.nodes if svc.tasks.outbox.get(n)]
    (task,) = svc.take_tasks(target)
    svc.tasks_done(target, [[task["id"], 0, None]])
    assert target in holders(svc, b"k") and len(holders(svc, b"k")) == 2
    assert under(svc) == 0
    stats = svc.stats()["replication"]
    assert stats["num_copies_done"] == 1 and stats["num_copies_in_flight"] == 0  # type: ignore[index]


def test_a_failed_copy_frees_its_destination_and_is_tried_again(clock: FakeClock) -> None:
    svc = make(clock, 64 * KIB, 64 * KIB, 64 * KIB)
    put(svc, b"k", 1000, replicas=2)
    lost = min(holders(svc, b"k"))
    kill(svc, clock, lost)
    (target,) = set(svc.nodes) - holders(svc, b"k")
    before = used(svc, target)
    svc.tick()
    assert used(svc, target) > before, "the destination is allocated when the copy is planned"
    (task,) = svc.take_tasks(target)
    svc.tasks_done(target, [[task["id"], 402, "grant expired"]])
    assert used(svc, target) == before and target not in holders(svc, b"k")
    assert svc.stats()["replication"]["num_copies_failed"] == 1  # type: ignore[index]
    assert under(svc) == 1
    svc.tick()
    assert len(svc.take_tasks(target)) == 1, "planned again"


def test_a_copy_the_node_never_reports_times_out(clock: FakeClock) -> None:
    svc = make(clock, 64 * KIB, 64 * KIB, 64 * KIB)
    put(svc, b"k", 1000, replicas=2)
    lost = min(holders(svc, b"k"))
    kill(svc, clock, lost)
    (target,) = set(svc.nodes) - holders(svc, b"k")
    before = used(svc, target)
    svc.tick()
    svc.take_tasks(target)
    clock.now += TASK_TIMEOUT_S  # not yet: the node may still store it
    svc.tick()
    assert svc.stats()["replication"]["num_copies_in_flight"] == 1  # type: ignore[index]
    clock.now += TASK_GRACE_S + 0.001  # the grace past the node's own deadline is over
    for n in svc.nodes:
        svc.heartbeat(n)
    svc.tick()
    stats = svc.stats()["replication"]
    assert stats["num_copies_failed"] == 1  # type: ignore[index]
    assert target not in holders(svc, b"k")
    # (the same tick planned the copy again, into a fresh allocation)
    assert stats["num_copies_in_flight"] == 1 and used(svc, target) > before  # type: ignore[index]


def test_a_copy_of_an_overwritten_object_is_thrown_away(clock: FakeClock) -> None:
    svc = make(clock, 64 * KIB, 64 * KIB, 64 * KIB)
    put(svc, b"k", 1000, replicas=2)
    lost = min(holders(svc, b"k"))
    kill(svc, clock, lost)
    (target,) = set(svc.nodes) - holders(svc, b"k")
    svc.tick()
    (task,) = svc.take_tasks(target)
    put(svc, b"k", 2000)  # a new version, while the old one is being copied
    new_replicas = list(svc.objects[b"k"].replicas)
    before = used(svc, target)
    svc.tasks_done(target, [[task["id"], 0, None]])
    assert list(svc.objects[b"k"].replicas) == new_replicas, (
        "the old bytes never join the new object"
    )
    assert used(svc, target) == before - 1024, "and their space is freed"


def test_nothing_is_planned_without_room(clock: FakeClock) -> None:
    svc = make(clock, 64 * KIB, 64 * KIB, 512)  # the third node cannot hold the object
    put(svc, b"k", 1000, replicas=2)
    assert holders(svc, b"k") == {"n0", "n1"}
    kill(svc, clock, "n0")
    svc.tick()
    assert svc.take_tasks("n2") == [] and under(svc) == 1


def test_a_tick_plans_a_bounded_number_of_copies(
    clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(replication, "MAX_COPIES_PER_TICK", 3)
    svc = make(clock, 64 * KIB, 64 * KIB, 64 * KIB)
    keys = [b"k%d" % i for i in range(8)]
    for k in keys:
        put(svc, k, 1000, replicas=2)
    kill(svc, clock, "n0")
    lost = [k for k in keys if len(svc.objects[k].replicas) == 1]
    assert len(lost) > 3
    svc.tick()
    assert svc.stats()["replication"]["num_copies_in_flight"] == 3  # type: ignore[index]
    svc.tick()  # still three in flight: no more
    assert svc.stats()["replication"]["num_copies_in_flight"] == 3  # type: ignore[index]


# ---------------------------------------------------------------- drain
def test_drain_drops_a_replica_that_has_copies_elsewhere_when_no_node_has_room(
    clock: FakeClock,
) -> None:
    svc = make(clock, 64 * KIB, 64 * KIB, 512)
    put(svc, b"k", 1000, replicas=2)
    svc.drain_node("n0")
    svc.tick()
    assert holders(svc, b"k") == {"n1"}
    svc.tick()
    assert svc.drain_node("n0")["state"] == "retired"


def test_a_draining_node_retires_only_once_its_puts_are_over_and_moved(clock: FakeClock) -> None:
    svc = make(clock, 64 * KIB, 64 * KIB)
    (ticket,) = svc.put_start([b"late"], [1000])
    assert isinstance(ticket, PutTicket)
    writer = ticket.locations[0].node_id
    (other,) = set(svc.nodes) - {writer}
    status = svc.drain_node(writer)
    assert status["state"] == "draining" and status["num_objects_left"] == 0
    svc.tick()
    assert svc.drain_node(writer)["state"] == "draining", "a put is still writing to it"
    assert svc.put_end([ticket.put_id], [4]) == [None]
    svc.tick()
    (task,) = svc.take_tasks(other)
    assert svc.drain_node(writer)["state"] == "draining", "its object is being copied away"
    svc.tasks_done(other, [[task["id"], 0, None]])
    svc.tick()
    assert holders(svc, b"late") == {other}
    assert svc.drain_node(writer)["state"] == "retired"
    assert svc.stats()["replication"]["num_drained"] == 1  # type: ignore[index]


def test_drain_status_counts_what_is_left(clock: FakeClock) -> None:
    svc = make(clock, 64 * KIB, 64 * KIB)
    for i in range(3):
        put(svc, b"k%d" % i, 1000)
    on_n0 = sum(1 for o in svc.objects.values() if o.replicas[0].node_id == "n0")
    status = svc.drain_node("n0")
    assert status == {
        "node_id": "n0",
        "state": "draining",
        "num_objects_left": on_n0,
        "bytes_left": used(svc, "n0"),
    }
    assert svc.drain_node("n0") == status, "draining again changes nothing"
    with pytest.raises(KeyNotFoundError):
        svc.drain_node("nobody")
