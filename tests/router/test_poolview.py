"""The router's view of the pool from the KV events: its counts equal the master's prefix index
(real master and node processes: stores, removes, evictions, a resync after a gap), and its
states with a fake stream (starting, synced, resyncing, down, back)."""

from __future__ import annotations

import time

import numpy as np
import pytest

from kvstore.client import Client, KVCache, Namespace
from kvstore.client.events import BlockEvent, EventStream, ResyncNotice, Snapshot, StreamItem
from kvstore.errors import MasterUnavailableError
from kvstore.keys import block_keys
from kvstore.kvblocks import kv_object_key
from kvstore.router.metrics import RouterMetrics
from kvstore.router.poolview import PoolView
from tests.integration.test_tenants import QUICK, SECRET
from tests.support import create_tenant, wait_until

BS = 16
NS = Namespace(
    model="tiny", dtype="float16", num_layers=2, num_kv_heads=2, head_dim=64, block_size=BS
)
D = NS.digest


def layers_for(tokens: np.ndarray) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(int(tokens[0]) + len(tokens))
    base = rng.standard_normal((2, 2, len(tokens), 2, 64)).astype(np.float16)
    return [(base[layer, 0], base[layer, 1]) for layer in range(2)]


def prompt(i: int, num_blocks: int = 4) -> np.ndarray:
    return np.arange(num_blocks * BS, dtype=np.uint32) + 100_000 * (i + 1)


def probes(num_prompts: int) -> list[np.ndarray]:
    """Prompts to count: each stored prompt, its first blocks plus a partial block, one that
    diverges inside its third block, and one nobody stored."""
    out = []
    for i in range(num_prompts):
        p = prompt(i)
        out.append(p)
        out.append(np.concatenate([p[: 2 * BS], p[2 * BS : 2 * BS + 5]]))
        out.append(np.concatenate([p[: 2 * BS + 3], np.full(BS, 7, np.uint32)]))
    out.append(prompt(10_000))
    return out


def master_seq(client: Client) -> int:
    return EventStream(client).snapshot().seq


def assert_view_equals_index(view: PoolView, kv: KVCache, client: Client, prompts: list) -> None:
    """Once the view has caught up with a quiet master, its leading-block count of every
    prompt equals the index's answer in whole blocks (bounded retries while the tier manager
    is still moving things)."""
    for _ in range(50):
        index = [kv.lookup(p) // BS for p in prompts]  # a lookup may drop a stale entry
        seq = master_seq(client)
        wait_until(lambda s=seq: view.position[1] >= s, timeout=20, what="view catches up")
        counts = [view.count_blocks(D, block_keys(NS, p)) for p in prompts]
        if master_seq(client) == seq and [kv.lookup(p) // BS for p in prompts] == index:
            assert counts == index, (counts, index)
            assert any(index), "something is cached"
            return
    pytest.fail("the pool never settled")


def test_the_event_view_counts_what_the_index_answers_after_stores_removes_evictions(
    cluster_factory,
) -> None:
    cluster = cluster_factory(
        num_nodes=1,
        dram="1MiB",
        master_args=(
            "--heartbeat-interval",
            "0.1",
            "--node-ttl",
            "2",
            "--high-watermark",
            "0.6",
            "--low-watermark",
            "0.4",
        ),
        node_args=("--nvme", "2MiB"),
    )
    metrics = RouterMetrics.create()
    view = PoolView(lambda: EventStream(cluster.address, wait_s=1.0, retry_s=2.0), metrics)
    view.start()
    try:
        with Client.connect(cluster.address) as c:
            kv = KVCache(c, NS)
            wait_until(lambda: view.state == "synced", timeout=20, what="view synced")
            for i in range(4):
                kv.store(prompt(i), layers_for(prompt(i)))
            assert_view_equals_index(view, kv, c, probes(4))
            # Removes: a middle block (takes the blocks after it along), a first block.
            c.remove(kv_object_key(D, block_keys(NS, prompt(1))[2]))
            c.remove(kv_object_key(D, block_keys(NS, prompt(2))[0]))
            assert_view_equals_index(view, kv, c, probes(4))
            # Evictions: 40 more prompts of 4 x 16 KiB blocks, far past DRAM and NVMe.
            for i in range(4, 44):
                kv.store(prompt(i), layers_for(prompt(i)))
            wait_until(
                lambda: metrics.registry.get_sample_value(
                    "kvstore_router_pool_view_events_total", {"kind": "evicted"}
                ),
                timeout=30,
                what="evictions reach the view",
            )
            assert_view_equals_index(view, kv, c, probes(44))
            kv.close()
    finally:
        view.close()
    assert metrics.registry.get_sample_value(
        "kvstore_router_pool_view_events_total", {"kind": "stored"}
    )


def test_a_routers_view_with_a_tenants_token_counts_that_tenants_prompts_only(
    cluster_factory, tmp_path
) -> None:
    """A router run with a tenant's token (one router per tenant) follows that tenant's prompts
    under the namespace's own digest, as its engines' connector looks them up, and never counts
    another tenant's."""
    token_file = tmp_path / "token"
    token_file.write_text(SECRET)
    flags = ("--token-file", str(token_file))
    cluster = cluster_factory(
        num_nodes=2, dram="64MiB", master_args=(*flags, *QUICK), node_args=flags
    )
    acme = create_tenant(cluster.admin, SECRET, "acme")
    bolt = create_tenant(cluster.admin, SECRET, "bolt")
    view = PoolView(
        lambda: EventStream(cluster.address, token=acme, wait_s=1.0, retry_s=2.0),
        RouterMetrics.create(),
    )
    view.start()
    try:
        with (
            Client.connect(cluster.address, token=acme) as a,
            Client.connect(cluster.address, token=bolt) as b,
        ):
            kv_a, kv_b = KVCache(a, NS), KVCache(b, NS)
            wait_until(lambda: view.state == "synced", timeout=20, what="view synced")
            kv_a.store(prompt(0), layers_for(prompt(0)))
            kv_b.store(prompt(1), layers_for(prompt(1)))
            kv_b.store(prompt(0), layers_for(prompt(0)))  # the same prompt: B's own blocks
            assert_view_equals_index(view, kv_a, a, [prompt(0), prompt(1)])
            assert view.count_blocks(D, block_keys(NS, prompt(0))) == 4
            assert view.count_blocks(D, block_keys(NS, prompt(1))) == 0
            kv_a.close()
            kv_b.close()
    finally:
        view.close()


def test_a_view_too_far_behind_resyncs_from_the_snapshot_and_counts_right(cluster_factory) -> None:
    cluster = cluster_factory(num_nodes=1, dram="64MiB", master_args=("--event-ring", "4"))
    metrics = RouterMetrics.create()
    with Client.connect(cluster.address) as c:
        kv = KVCache(c, NS)
        kv.store(prompt(0), layers_for(prompt(0)))
        stream = EventStream(c, wait_s=0.5)
        view = PoolView(lambda: stream, metrics)  # stepped here, not in a thread
        assert view.state == "starting" and view.count_blocks(D, []) is None
        assert view.step() and view.state == "synced"
        assert view.count_blocks(D, block_keys(NS, prompt(0))) == 4
        for i in range(1, 10):  # the ring of 4 drops what the view has not read
            kv.store(prompt(i), layers_for(prompt(i)))
        c.remove(kv_object_key(D, block_keys(NS, prompt(3))[1]))
        assert view.step() and view.state == "synced"
        assert metrics.registry.get_sample_value(
            "kvstore_router_pool_view_resyncs_total", {"reason": "gap"}
        )
        counts = [view.count_blocks(D, block_keys(NS, p)) for p in probes(10)]
        assert counts == [kv.lookup(p) // BS for p in probes(10)]
        assert counts[9] == 1  # prompt 3 lost its blocks after the first
        kv.close()


class FakeStream:
    """Hands out scripted poll answers; an exception in the script is raised."""

    def __init__(self, script: list[list[StreamItem] | Exception]) -> None:
        self.script = script
        self.pos: tuple[int | None, int] = (None, 0)
        self.closed = False

    def poll(self, wait_s: float | None = None) -> list[StreamItem]:
        if not self.script:
            time.sleep(0.01)  # stands for a long poll with nothing new
            return []
        step = self.script.pop(0)
        if isinstance(step, Exception):
            raise step
        for item in step:
            if isinstance(item, BlockEvent | Snapshot):
                self.pos = (item.epoch, item.seq)
        return step

    def close(self) -> None:
        self.closed = True

    @property
    def position(self) -> tuple[int | None, int]:
        return self.pos


K = [bytes([i]) * 16 for i in range(6)]
DOWN = MasterUnavailableError("master away")


def stored(epoch: int, seq: int, *keys: bytes) -> BlockEvent:
    return BlockEvent(epoch, seq, "stored", D, keys)


def gauge(metrics: RouterMetrics) -> dict[str, float | None]:
    return {
        s: metrics.registry.get_sample_value("kvstore_router_pool_view_state", {"state": s})
        for s in ("starting", "synced", "resyncing", "down")
    }


def test_states_resync_on_a_new_epoch_and_fallback_while_down() -> None:
    metrics = RouterMetrics.create()
    stream = FakeStream(
        [
            DOWN,  # the master is not there yet: still starting
            [stored(1, 1, *K[:3])],
            [BlockEvent(1, 2, "removed", D, (K[1], K[2]))],
            DOWN,  # stayed away past the retry budget
            # a new leader (epoch 2): resync, its snapshot holds other blocks
            [ResyncNotice("epoch", "another term", 2), Snapshot(2, 7, {D: frozenset(K[:5])})],
            [stored(2, 8, K[5])],
        ]
    )
    opened: list[FakeStream] = []

    def open_stream() -> FakeStream:
        opened.append(stream)
        return stream

    view = PoolView(open_stream, metrics)
    assert not view.step()
    assert view.state == "starting" and view.count_blocks(D, K) is None
    assert gauge(metrics)["starting"] == 1
    assert view.step() and view.count_blocks(D, K) == 3
    assert view.step() and view.count_blocks(D, K) == 1 and view.position == (1, 2)
    assert not view.step()
    assert view.state == "down" and view.count_blocks(D, K) is None
    assert gauge(metrics) == {"starting": 0, "synced": 0, "resyncing": 0, "down": 1}
    assert view.step() and view.state == "synced" and view.position == (2, 7)
    assert view.count_blocks(D, K) == 5 and view.count_blocks(b"x" * 16, K) == 0
    assert view.step() and view.count_blocks(D, K) == 6 and view.num_blocks() == 6
    assert len(opened) == 1, "the stream is kept: it resumes from its position"
    sample = metrics.registry.get_sample_value
    assert sample("kvstore_router_pool_view_resyncs_total", {"reason": "epoch"}) == 1
    assert sample("kvstore_router_pool_view_events_total", {"kind": "stored"}) == 2
    assert sample("kvstore_router_pool_view_events_total", {"kind": "removed"}) == 1
    assert sample("kvstore_router_pool_view_blocks") == 6


def test_the_thread_follows_and_stops() -> None:
    stream = FakeStream([DOWN, [stored(1, 1, *K[:2])]])
    view = PoolView(lambda: stream)
    view.start()
    wait_until(lambda: view.count_blocks(D, K) == 2, timeout=10, what="thread applied")
    view.close()
    assert stream.closed and view.state == "down"
