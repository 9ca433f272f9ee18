"""The object table: cold objects as untracked tuples, hot ones as ObjectMeta, and back."""

from __future__ import annotations

import gc
import subprocess
import sys

import pytest

from kvstore.master.service import COOL_STEP, MasterService
from kvstore.master.table import ObjectMeta, ObjectTable, Replica
from kvstore.types import ObjectInfo
from tests.master.test_tiering import KIB, MIB, FakeClock, make, put, run_tasks


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


def is_cold(svc: MasterService, key: bytes) -> bool:
    return type(svc.objects._d[key]) is bytes


def test_a_commit_is_stored_cold_and_untracked_by_the_collector(clock: FakeClock) -> None:
    svc = make(clock, nvme=0)
    put(svc, b"a", KIB)
    assert is_cold(svc, b"a") and svc.objects.num_hot == 0
    gc.collect()
    assert not gc.is_tracked(svc.objects._d[b"a"]), "a cold record costs the collector nothing"


def test_reading_an_object_makes_it_hot_and_the_same_object_each_time(clock: FakeClock) -> None:
    svc = make(clock, nvme=0)
    put(svc, b"a", KIB)
    obj = svc.objects[b"a"]
    assert isinstance(obj, ObjectMeta) and svc.objects.get(b"a") is obj
    assert obj.size == KIB and obj.checksum == 1 and obj.replicas_wanted == 1
    (r,) = obj.replicas
    assert isinstance(r, Replica) and r.node_id == "n0" and r.size == KIB
    assert svc.objects.num_hot == 1


def test_membership_length_and_scans_make_no_record(clock: FakeClock) -> None:
    svc = make(clock, nodes=2, nvme=0)
    for i in range(4):
        put(svc, b"k%d" % i, KIB)
    assert b"k0" in svc.objects and b"zz" not in svc.objects and len(svc.objects) == 4
    assert sorted(svc.objects) == [b"k0", b"k1", b"k2", b"k3"]
    on = svc.objects.keys_on("n0") + svc.objects.keys_on("n1")
    assert sorted(on) == sorted(svc.objects)
    assert svc.objects.total_bytes() == 4 * KIB
    peeked = svc.objects.peek(b"k0")
    assert peeked is not None and peeked.size == KIB and svc.objects.peek(b"zz") is None
    assert svc.objects.num_hot == 0, "scans and peeks leave cold objects cold"


def test_cool_turns_back_only_what_nothing_else_refers_to(clock: FakeClock) -> None:
    svc = make(clock, nvme=0)
    put(svc, b"a", KIB)
    put(svc, b"b", KIB)
    held = svc.objects[b"a"]
    svc.objects[b"b"].hits += 5  # a change made through a record the table alone keeps
    assert svc.objects.cool(clock(), 10) == 1
    assert is_cold(svc, b"b") and not is_cold(svc, b"a"), "a referenced record keeps its identity"
    assert svc.objects[b"b"].hits == 5, "cooling keeps every field"
    assert svc.objects[b"a"] is held
    del held
    assert svc.objects.cool(clock(), 10) == 2 and svc.objects.num_hot == 0


@pytest.mark.parametrize("state", ["leased", "pinned", "two replicas"])
def test_cool_leaves_leased_pinned_and_multi_replica_objects_hot(
    clock: FakeClock, state: str
) -> None:
    svc = make(clock, nodes=2, nvme=0)
    put(svc, b"a", KIB, replicas=2 if state == "two replicas" else 1)
    token = 0
    if state == "leased":
        (info,) = svc.get_locations([b"a"])
        assert isinstance(info, ObjectInfo)
        token = info.lease
    elif state == "pinned":
        assert svc.pin([b"a"], 10.0) == [None]
    else:
        svc.objects[b"a"]  # noqa: B018 - made hot
    assert svc.objects.cool(clock(), 10) == 0 and not is_cold(svc, b"a")
    if state == "leased":
        assert svc.release_leases([token]) == [True]
    elif state == "pinned":
        clock.now += 11  # the pin ran out: nothing of it is left to keep
    else:
        return
    assert svc.objects.cool(clock(), 10) == 1 and is_cold(svc, b"a")


def test_tick_cools_read_objects_within_a_bound(clock: FakeClock) -> None:
    svc = make(clock, nvme=0)
    for i in range(8):
        put(svc, b"k%d" % i, KIB)
    infos = svc.get_locations([b"k%d" % i for i in range(8)])
    assert svc.objects.num_hot == 8
    svc.release_leases([i.lease for i in infos if isinstance(i, ObjectInfo)])
    svc.tick()
    assert svc.objects.num_hot == 0
    assert svc.objects[b"k3"].hits == 1, "a read's count survives the round trip"


def test_cooling_a_big_read_batch_is_done_in_bounded_steps(clock: FakeClock) -> None:
    """A step (``tick``'s own, then the daemon's, a turn of its loop each) looks at no more
    than COOL_STEP hot objects, and the steps due cover every hot object once."""
    svc = make(clock, dram=64 * MIB, nvme=0)
    n = 3 * COOL_STEP + 5
    keys = [b"k%d" % i for i in range(n)]
    tickets = svc.put_start(keys, [KIB] * n)
    assert svc.put_end([t.put_id for t in tickets], [1] * n) == [None] * n  # type: ignore[union-attr]
    infos = svc.get_locations(keys)
    svc.release_leases([i.lease for i in infos if isinstance(i, ObjectInfo)])
    del infos
    assert svc.objects.num_hot == n and svc.num_cool_steps_due() == 3
    svc.tick()
    assert svc.objects.num_hot == n - COOL_STEP, "a tick's own step is bounded"
    assert svc.num_cool_steps_due() == 2
    assert svc.cool_step() == COOL_STEP and svc.cool_step() == COOL_STEP
    assert svc.num_cool_steps_due() == 0 and svc.cool_step() == 5 and svc.objects.num_hot == 0


def test_a_move_switches_the_replica_of_a_hot_object(clock: FakeClock) -> None:
    svc = make(clock, dram=4 * KIB, nvme=64 * KIB, high_watermark=0.5, low_watermark=0.25)
    for i in range(4):
        put(svc, b"k%d" % i, KIB)
    svc.tick()  # demotes the least recently used below the watermark
    assert run_tasks(svc) > 0
    svc.tick()
    tiers = sorted(r.tier for k in svc.objects for r in svc.objects[k].replicas)
    assert "nvme" in tiers and svc.stats()["object_bytes"] == 4 * KIB


def test_mapping_verbs() -> None:
    table = ObjectTable()
    rep = Replica("n", "dram", 0, 4)
    table.commit(b"a", 4, 7, [rep], 1, 1.0)
    meta = ObjectMeta(b"b", 4, 8, [rep, rep._replace(node_id="m")], replicas_wanted=2)
    table[b"b"] = meta
    assert table[b"b"] is meta and meta.num_replicas == 2 and meta.held_by("m")
    assert table.pop(b"a").checksum == 7 and b"a" not in table
    assert table.pop(b"a", None) is None
    with pytest.raises(KeyError):
        table.pop(b"a")
    del table[b"b"]
    assert len(table) == 0 and table.num_hot == 0


FREEZE_CHECK = """
import gc, sys, weakref
from kvstore.gc_policy import YOUNG_GC_THRESHOLD, tune_collector

class Cycle:
    pass

dead = Cycle()
dead.me = dead
dead_ref = weakref.ref(dead)
del dead  # garbage before the freeze: collected, not frozen
frozen = tune_collector()
assert gc.get_threshold()[0] == YOUNG_GC_THRESHOLD
assert dead_ref() is None, "garbage alive at start-up was frozen"
assert frozen > 1000, frozen
later = Cycle()
later.me = later
later_ref = weakref.ref(later)
del later  # garbage made after the freeze: the collector still finds it
gc.collect()
assert later_ref() is None, "a cycle made after the freeze was not collected"
assert gc.get_freeze_count() == frozen, "the freeze took in nothing after start-up"
print("ok")
"""


def test_freezing_start_up_objects_leaks_no_garbage() -> None:
    # A process of its own: freezing the test process would keep its garbage forever.
    out = subprocess.run(
        [sys.executable, "-c", FREEZE_CHECK], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
