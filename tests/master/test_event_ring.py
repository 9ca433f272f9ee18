"""KV events: the ring (resume, resync, bounds, waiters) and what the service records, driven
by a fake clock (no sockets, no sleeping)."""

from __future__ import annotations

import random

import numpy as np
import pytest

from kvstore import protocol
from kvstore.errors import InvalidRequestError
from kvstore.keys import Namespace, block_keys
from kvstore.kvblocks import kv_object_key
from kvstore.master.event_ring import (
    EVENT_EVICTED,
    EVENT_MOVED,
    EVENT_REMOVED,
    EVENT_STORED,
    MAX_EVENTS_PER_CALL,
    RESYNC_AHEAD,
    RESYNC_EPOCH,
    RESYNC_GAP,
    EventBatch,
    EventLog,
    Resync,
    new_epoch,
)
from kvstore.master.ha import Leadership
from kvstore.master.server import dispatch
from kvstore.master.service import MasterConfig, MasterService, ServiceSlot
from kvstore.master.tiering import TierConfig
from kvstore.types import PutTicket, SegmentSpec
from tests.master.fakes import FakeClock

NS = Namespace(model="m", dtype="float16", num_layers=1, num_kv_heads=1, head_dim=4, block_size=4)
NS2 = Namespace(model="m2", dtype="float16", num_layers=1, num_kv_heads=1, head_dim=4, block_size=4)
D = NS.digest


def batch(got: EventBatch | Resync) -> EventBatch:
    assert isinstance(got, EventBatch), got
    return got


# ---------------------------------------------------------------- the ring
def test_read_returns_exactly_the_events_after_the_position_in_order() -> None:
    log = EventLog(capacity=8, epoch=7)
    for i in range(5):
        log.append(EVENT_STORED, D, [bytes([i]) * 16])
    got = batch(log.read(0, None, 100))
    assert [ev[0] for ev in got.events] == [1, 2, 3, 4, 5] and got.last_seq == 5
    got = batch(log.read(2, 7, 2))
    assert [ev[0] for ev in got.events] == [3, 4] and got.last_seq == 4
    got = batch(log.read(5, 7, 100))
    assert got.events == [] and got.last_seq == 5 and got.epoch == 7


def test_namespace_filter_still_advances_the_position() -> None:
    log = EventLog(epoch=1)
    log.append(EVENT_STORED, D, [b"a" * 16])
    log.append(EVENT_STORED, NS2.digest, [b"b" * 16])
    got = batch(log.read(0, 1, 10, frozenset({NS2.digest})))
    assert [ev[0] for ev in got.events] == [2]
    got = batch(log.read(1, 1, 10, frozenset({D})))
    assert got.events == [] and got.last_seq == 2, "past what the filter left out"
    got = batch(log.read(0, 1, 1, frozenset({D})))
    assert [ev[0] for ev in got.events] == [1] and got.last_seq == 1


@pytest.mark.parametrize(
    ("since", "held"),
    [(0, False), (1, False), (2, True), (5, True), (10, True)],
)
def test_a_subscriber_behind_the_ring_must_resync(since: int, held: bool) -> None:
    log = EventLog(capacity=8, epoch=3)
    for i in range(10):  # events 1..10; the ring holds 3..10
        log.append(EVENT_STORED, D, [bytes([i]) * 16])
    assert log.first_seq == 3
    got = log.read(since, 3, 100)
    if held:
        assert [ev[0] for ev in batch(got).events] == list(range(since + 1, 11))
    else:
        assert isinstance(got, Resync) and got.reason == RESYNC_GAP


@pytest.mark.parametrize(
    ("since", "epoch", "reason"),
    [(0, 99, RESYNC_EPOCH), (3, None, RESYNC_EPOCH), (4, 5, RESYNC_AHEAD), (1, 99, RESYNC_EPOCH)],
)
def test_another_epoch_or_an_unknown_position_must_resync(
    since: int, epoch: int | None, reason: str
) -> None:
    log = EventLog(epoch=5)
    for _ in range(3):
        log.append(EVENT_STORED, D, [b"k" * 16])
    got = log.read(since, epoch, 10)
    assert isinstance(got, Resync) and got.reason == reason and got.message


@pytest.mark.parametrize(("since", "max_events"), [(-1, 10), (0, 0), (0, MAX_EVENTS_PER_CALL + 1)])
def test_bad_reads_raise_and_change_nothing(since: int, max_events: int) -> None:
    log = EventLog(epoch=5)
    log.append(EVENT_STORED, D, [b"k" * 16])
    before = log.stats()
    with pytest.raises(InvalidRequestError):
        log.read(since, 5, max_events)
    assert log.stats() == before


def test_block_budget_drops_the_oldest_events_but_keeps_the_newest() -> None:
    log = EventLog(capacity=100, max_blocks=10, epoch=1)
    log.append(EVENT_STORED, D, [b"a" * 16] * 6)
    log.append(EVENT_STORED, D, [b"b" * 16] * 6)
    assert log.first_seq == 2 and log.num_blocks == 6
    log.append(EVENT_STORED, D, [b"c" * 16] * 50)  # over the budget alone: kept
    assert log.first_seq == 3 and log.num_blocks == 50
    assert isinstance(log.read(1, 1, 10), Resync)


def test_waiters_are_woken_once_by_an_event_or_a_restart() -> None:
    log = EventLog(epoch=1)
    calls: list[str] = []
    log.add_waiter(lambda: calls.append("a"))
    log.append(EVENT_STORED, D, [b"k" * 16])
    log.append(EVENT_STORED, D, [b"k" * 16])
    assert calls == ["a"]

    def waiter() -> None:
        calls.append("b")

    log.add_waiter(waiter)
    log.remove_waiter(waiter)
    log.remove_waiter(waiter)  # twice is fine
    log.add_waiter(lambda: calls.append("c"))
    log.restart(2)
    assert calls == ["a", "c"] and log.epoch == 2 and log.last_seq == 0


def test_epochs_of_plain_masters_differ_and_fit_json_numbers() -> None:
    epochs = {new_epoch() for _ in range(100)}
    assert len(epochs) == 100 and all(0 < e < 1 << 53 for e in epochs)
    with pytest.raises(InvalidRequestError):
        EventLog(capacity=0)
    with pytest.raises(InvalidRequestError):
        MasterConfig(event_ring_events=0)


# ---------------------------------------------------------------- what the service records
def make_service(clock: FakeClock, ring: int = 1024, **tier_kw: object) -> MasterService:
    svc = MasterService(
        MasterConfig(
            put_timeout_s=10, node_ttl_s=3, heartbeat_interval_s=1, event_ring_events=ring
        ),
        clock,
        clock.wall_ms,
        tiers=TierConfig(**{"lease_s": 0.5, **tier_kw}),  # type: ignore[arg-type]
    )
    segs = [SegmentSpec("dram", "dram", 64 << 10), SegmentSpec("nvme", "nvme", 1 << 20)]
    svc.register("n0", "127.0.0.1", 9000, b"A" * 32, segs)
    return svc


def store_prompt(svc: MasterService, ns: Namespace, tokens: np.ndarray, size: int = 1024) -> int:
    """What KVCache.store does: put the missing blocks (kv puts), then kv_commit them."""
    keys = [kv_object_key(ns.digest, k) for k in block_keys(ns, tokens)]
    new = [k for k in keys if k not in svc.objects]
    tickets = svc.put_start(new, [size] * len(new), kv_blocks=True)
    assert all(isinstance(t, PutTicket) for t in tickets), tickets
    ids = [t.put_id for t in tickets]  # type: ignore[union-attr]
    results, num_indexed = svc.kv_commit(ids, [1] * len(ids), ns, tokens)
    assert results == [None] * len(ids)
    return num_indexed


def kinds(svc: MasterService, since: int = 0) -> list[tuple[str, int]]:
    got = batch(svc.events.read(since, svc.events.epoch, MAX_EVENTS_PER_CALL))
    return [(ev[1], len(ev[3])) for ev in got.events]


def view_from(svc: MasterService) -> dict[bytes, frozenset[bytes]]:
    _, _, keys = svc.prefix.snapshot()
    return {d: frozenset(k[i : i + 16] for i in range(0, len(k), 16)) for d, k in keys.items()}


def apply(view: dict[bytes, set[bytes]], ev: tuple) -> None:
    _, kind, digest, keys, _, _ = ev
    blocks = view.setdefault(digest, set())
    if kind == EVENT_STORED:
        blocks.update(keys)
    elif kind != EVENT_MOVED:
        blocks.difference_update(keys)
    if not blocks:
        del view[digest]


def test_store_and_remove_record_the_blocks_indexed_and_dropped() -> None:
    svc = make_service(FakeClock())
    tokens = np.arange(16, dtype=np.uint32)  # 4 blocks
    assert store_prompt(svc, NS, tokens) == 4
    assert store_prompt(svc, NS, np.arange(24, dtype=np.uint32)) == 2  # shares 4, adds 2
    ev = batch(svc.events.read(0, None, 10)).events
    assert [(e[1], e[2]) for e in ev] == [(EVENT_STORED, D), (EVENT_STORED, D)]
    assert list(ev[0][3]) == list(block_keys(NS, tokens)) and len(ev[1][3]) == 2
    # Removing block 2 drops it and every block after it (4 of 6), in one event.
    second = kv_object_key(D, block_keys(NS, tokens)[2])
    assert svc.remove([second]) == [None]
    assert kinds(svc, 2) == [(EVENT_REMOVED, 4)]
    assert store_prompt(svc, NS, tokens[:8]) == 0, "already indexed: no event"
    assert svc.events.last_seq == 3


def test_eviction_demotion_and_node_death_are_recorded_with_their_kind() -> None:
    clock = FakeClock()
    svc = make_service(clock, high_watermark=0.5, low_watermark=0.25)
    for p in range(6):  # 6 prompts x 2 blocks x 4 KiB = 48 KiB of a 64 KiB DRAM tier
        store_prompt(svc, NS, np.arange(8, dtype=np.uint32) + 1000 * p, size=4096)
    clock.now += 5  # leases end
    svc.tick()
    for node_id in list(svc.nodes):  # the node runs its moves and reports them
        tasks = svc.take_tasks(node_id)
        svc.tasks_done(node_id, [[t["id"], 0, None] for t in tasks])
    moved = [e for e in batch(svc.events.read(6, svc.events.epoch, 100)).events]
    assert moved and all(e[1] == EVENT_MOVED and (e[4], e[5]) == ("dram", "nvme") for e in moved)
    # An NVMe-only eviction (no tier below): evicted.
    svc2 = make_service(clock, high_watermark=0.5, low_watermark=0.25)
    svc2.nodes["n0"].segments.pop("dram")
    for p in range(3):
        store_prompt(svc2, NS, np.arange(8, dtype=np.uint32) + 1000 * p, size=300 << 10)
    clock.now += 5
    svc2.tick()
    assert EVENT_EVICTED in {k for k, _ in kinds(svc2)}
    # A dead node takes its blocks: removed.
    before = svc.events.last_seq
    clock.now += 10
    svc.expire_nodes()
    after = batch(svc.events.read(before, svc.events.epoch, 100)).events
    assert after and {e[1] for e in after} == {EVENT_REMOVED}
    assert svc.prefix.radix.num_blocks() == 0


def test_snapshot_then_the_events_after_it_reproduce_the_index() -> None:
    """Random stores and removes; at random moments a subscriber snapshots, then applies only
    events: its view always equals the index (nothing lost, nothing doubled)."""
    rng = random.Random(7)
    svc = make_service(FakeClock(), ring=4096)
    subscribers: list[tuple[int, dict[bytes, set[bytes]]]] = []
    for step in range(200):
        ns = NS if rng.random() < 0.7 else NS2
        if rng.random() < 0.6 or not svc.objects:
            base = rng.randrange(4)
            store_prompt(svc, ns, np.arange(4 * rng.randrange(1, 6), dtype=np.uint32) + base * 100)
        else:
            svc.remove([rng.choice(sorted(svc.objects))])
        if step % 25 == 0:
            epoch, seq, _ = svc.prefix.snapshot()
            subscribers.append((seq, {d: set(k) for d, k in view_from(svc).items()}))
    truth = view_from(svc)
    for seq, view in subscribers:
        for ev in batch(svc.events.read(seq, svc.events.epoch, MAX_EVENTS_PER_CALL)).events:
            apply(view, ev)
        assert {d: frozenset(k) for d, k in view.items()} == truth


def test_a_new_term_is_a_new_epoch_and_old_positions_resync() -> None:
    svc = make_service(FakeClock())
    store_prompt(svc, NS, np.arange(8, dtype=np.uint32))
    old = svc.events.epoch
    woken: list[int] = []
    svc.events.add_waiter(lambda: woken.append(1))
    fence = Leadership(ServiceSlot(svc))
    fence.begin(epoch=42, deadline=1e18, recovery_s=0)
    svc = fence.service
    assert woken == [1], "a waiter on the old log is told"
    assert svc.events.epoch == 42 and svc.events.last_seq == 0
    got = svc.events.read(2, old, 10)
    assert isinstance(got, Resync) and got.reason == RESYNC_EPOCH
    svc = svc.next_term()
    assert svc.events.epoch != 42, "a plain reset draws a fresh epoch"


# ---------------------------------------------------------------- the control verbs
def call(svc: MasterService, verb: str, args: dict) -> protocol.Response:
    frame = dispatch(svc, protocol.Request(1, verb, args))
    return protocol.decode_response(frame[protocol.HEADER_SIZE :])


def test_events_and_snapshot_verbs() -> None:
    svc = make_service(FakeClock())
    store_prompt(svc, NS, np.arange(8, dtype=np.uint32))
    store_prompt(svc, NS2, np.arange(4, dtype=np.uint32))
    r = call(svc, "events", {"since_seq": 0, "max": 10})
    assert r.code == 0 and [e["kind"] for e in r.result["events"]] == [EVENT_STORED] * 2
    assert r.result["resync"] is None and r.result["last_seq"] == 2
    assert r.result["events"][0]["namespace"] == D
    r = call(svc, "events", {"since_seq": 0, "namespaces": [NS2.digest]})
    assert [e["seq"] for e in r.result["events"]] == [2]
    r = call(svc, "events", {"since_seq": 1, "since_epoch": 1})
    assert r.result["resync"]["reason"] == RESYNC_EPOCH and r.result["events"] == []
    snap = call(svc, "events_snapshot", {}).result
    assert snap["seq"] == 2 and snap["epoch"] == svc.events.epoch and snap["num_blocks"] == 3
    assert {d: len(k) // 16 for d, k in snap["namespaces"].items()} == {D: 2, NS2.digest: 1}
    only = call(svc, "events_snapshot", {"namespaces": [NS2.digest]}).result
    assert list(only["namespaces"]) == [NS2.digest]


@pytest.mark.parametrize(
    "args",
    [
        {"since_seq": -1},
        {"since_seq": "1"},
        {"since_seq": True},
        {"since_seq": 0, "since_epoch": "x"},
        {"max": 0},
        {"max": 10**9},
        {"max": 1.5},
        {"wait_s": -1},
        {"wait_s": 1e9},
        {"wait_s": float("nan")},
        {"namespaces": [b"short"]},
        {"namespaces": "x"},
        {"namespaces": [b"0" * 16] * 2000},
    ],
)
def test_bad_events_arguments_are_typed_errors_and_change_nothing(args: dict) -> None:
    svc = make_service(FakeClock())
    store_prompt(svc, NS, np.arange(8, dtype=np.uint32))
    before = svc.events.stats()
    r = call(svc, "events", args)
    assert r.code == InvalidRequestError.code, r
    assert svc.events.stats() == before
    if "namespaces" in args:
        assert call(svc, "events_snapshot", args).code == InvalidRequestError.code
