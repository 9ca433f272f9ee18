"""Moves that keep data safe ask a tenant's quota in the tier they go to (quotas.py, Moves):
re-replication after a node loss, a drain and the watermark's demotion go to a tier the quota
takes, the next lower one where it has room; where none has, they still happen and are counted
(no copy is dropped for a quota). In-process, fake clock, tenants' stored keys named directly."""

from __future__ import annotations

import pytest

from kvstore.master.quotas import OVER
from kvstore.master.service import MasterService
from kvstore.types import SegmentSpec
from tests.master.fakes import FakeClock
from tests.master.test_quotas import (
    OBJ,
    check_exact,
    key,
    make,
    put,
    put_batch,
    run_tasks,
    tiers_of,
)

KIB = 1024
MIB = 1 << 20
A = key("acme", "k")


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


def task_tiers(svc: MasterService) -> list[str]:
    """The destination tier of every task in flight."""
    return sorted(t.dst.tier for t in svc.tasks.by_id.values())


def lose_a_replica(clock: FakeClock, quotas: dict[str, int]) -> MasterService:
    """acme's object on two of three nodes (DRAM), then ``quotas`` set and one holder lost."""
    svc = make(clock, nodes=3)
    put_batch(svc, [A], replicas=2)
    assert tiers_of(svc, A) == ["dram", "dram"]
    svc.quotas.set_tenant("acme", quotas)
    svc.drop_node(svc.objects[A].replicas[0].node_id)
    assert tiers_of(svc, A) == ["dram"]
    svc.tick()
    return svc


# ---------------------------------------------------------------- re-replication
def test_re_replication_goes_to_the_next_tier_the_quota_takes(clock: FakeClock) -> None:
    svc = lose_a_replica(clock, {"dram": OBJ})  # at its DRAM quota with the one copy left
    assert task_tiers(svc) == ["nvme"], "DRAM would take acme over its quota: NVMe instead"
    check_exact(svc)  # the copy in flight counts where it goes
    assert run_tasks(svc) == 1
    assert tiers_of(svc, A) == ["dram", "nvme"]
    check_exact(svc)
    assert svc.quotas.charged("acme", "dram") == OBJ


def test_re_replication_over_every_quota_still_happens_and_is_counted(clock: FakeClock) -> None:
    svc = lose_a_replica(clock, {"dram": OBJ, "nvme": 0})
    assert task_tiers(svc) == ["dram"], "no tier takes it: the copy is made all the same"
    assert svc.quotas.charged("acme", "dram") == 2 * OBJ, "counted while in flight"
    check_exact(svc)
    run_tasks(svc)
    assert tiers_of(svc, A) == ["dram", "dram"]
    check_exact(svc)
    assert svc.quotas.standing("dram") == {"acme": OVER}, "first in line for eviction there"


def test_a_failed_copy_gives_its_counted_bytes_back(clock: FakeClock) -> None:
    svc = lose_a_replica(clock, {"dram": OBJ})
    run_tasks(svc, ok=False)
    check_exact(svc)
    assert svc.quotas.charged("acme", "nvme") == 0


# ---------------------------------------------------------------- drain
def drain_one_tier_node(
    clock: FakeClock, quotas: dict[str, int], tier: str = "nvme"
) -> MasterService:
    """acme's object on node n0 with one ``tier``; then n1 (DRAM and NVMe) joins, n0 drains."""
    svc = make(clock, nodes=0)
    svc.register("n0", "127.0.0.1", 9000, b"A" * 32, [SegmentSpec(tier, tier, 4 * MIB)])
    put(svc, A)
    svc.quotas.set_tenant("acme", quotas)
    segs = [SegmentSpec("dram", "dram", MIB), SegmentSpec("nvme", "nvme", 4 * MIB)]
    svc.register("n1", "127.0.0.1", 9001, b"B" * 32, segs)
    svc.drain_node("n0")
    svc.tick()
    return svc


def test_a_drain_goes_to_the_next_tier_the_quota_takes(clock: FakeClock) -> None:
    svc = drain_one_tier_node(clock, {"dram": 0})
    assert task_tiers(svc) == ["nvme"], "n1's DRAM would take acme over its quota"
    check_exact(svc)
    run_tasks(svc)
    assert [(r.node_id, r.tier) for r in svc.objects[A].replicas] == [("n1", "nvme")]
    check_exact(svc)


def test_a_drain_over_every_quota_still_moves_the_last_copy(clock: FakeClock) -> None:
    svc = drain_one_tier_node(clock, {"dram": 0, "nvme": 0}, "hbm")
    assert task_tiers(svc) == ["dram"], "the only copy is never left behind for a quota"
    check_exact(svc)
    run_tasks(svc)
    assert [(r.node_id, r.tier) for r in svc.objects[A].replicas] == [("n1", "dram")]
    check_exact(svc)
    clock.now += 1
    svc.tick()
    assert svc.nodes["n0"].retired


def test_a_drain_within_its_tier_takes_nothing_more_there(clock: FakeClock) -> None:
    svc = make(clock, nodes=2)
    put(svc, A)
    holder = svc.objects[A].replicas[0].node_id
    svc.quotas.set_tenant("acme", {"dram": OBJ})  # at its quota: the copy's source leaves
    svc.drain_node(holder)
    svc.tick()
    assert task_tiers(svc) == ["dram"]
    assert svc.quotas.charged("acme", "dram") == OBJ
    run_tasks(svc)
    assert tiers_of(svc, A) == ["dram"] and svc.quotas.charged("acme", "dram") == OBJ
    check_exact(svc)


# ---------------------------------------------------------------- the watermark's demotion
def three_tiers(clock: FakeClock, quotas: dict[str, int]) -> MasterService:
    """acme's objects fill a node's HBM past its high watermark; then ``quotas`` are set and
    the tick demotes."""
    svc = make(clock, nodes=0)
    segs = [
        SegmentSpec("hbm", "hbm", 4 * OBJ),
        SegmentSpec("dram", "dram", MIB),
        SegmentSpec("nvme", "nvme", 4 * MIB),
    ]
    svc.register("n0", "127.0.0.1", 9000, b"A" * 32, segs)
    for i in range(4):
        clock.now += 1
        put(svc, key("acme", f"h{i}"))
    assert all(tiers_of(svc, key("acme", f"h{i}")) == ["hbm"] for i in range(4))
    svc.quotas.set_tenant("acme", quotas)
    clock.now += 10
    svc.tick()
    return svc


def test_a_demotion_skips_a_tier_whose_quota_is_full(clock: FakeClock) -> None:
    svc = three_tiers(clock, {"dram": 0})
    assert task_tiers(svc) and set(task_tiers(svc)) == {"nvme"}, "DRAM's quota takes nothing"
    check_exact(svc)
    run_tasks(svc)
    check_exact(svc)
    assert svc.quotas.usage("acme")["dram"] == 0


def test_a_demotion_over_every_quota_still_happens_and_is_counted(clock: FakeClock) -> None:
    svc = three_tiers(clock, {"dram": 0, "nvme": 0})
    assert task_tiers(svc) and set(task_tiers(svc)) == {"dram"}, "the next tier down anyway"
    check_exact(svc)
    run_tasks(svc)
    check_exact(svc)
    assert svc.quotas.usage("acme")["dram"] > 0
    assert svc.quotas.standing("dram") == {"acme": OVER}


def test_without_quotas_moves_go_where_they_went(clock: FakeClock) -> None:
    svc = three_tiers(clock, {})
    assert set(task_tiers(svc)) == {"dram"}
    svc = lose_a_replica(FakeClock(), {})
    assert task_tiers(svc) == ["dram"]
