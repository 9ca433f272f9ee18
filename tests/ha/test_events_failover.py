"""KV events across a failover (real etcd): kill -9 the leader; the subscriber is told to resync
with the new leader's epoch, and after the snapshot and the events after it its view equals the
new leader's index. A standby refuses to serve events (NOT_LEADER), on both protocols."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import numpy as np

from kvstore import auth, protocol
from kvstore.client import Client, KVCache, Namespace
from kvstore.client.events import BlockEvent, BlockView, EventStream, ResyncNotice, Snapshot
from kvstore.errors import NotLeaderError
from kvstore.keys import block_keys
from tests.etcd_harness import etcd, ha_factory  # noqa: F401 - fixtures
from tests.support import Daemon, wait_until

FAST = ("--heartbeat-interval", "0.5", "--node-ttl", "4")
BS = 16
NS = Namespace(
    model="tiny", dtype="float16", num_layers=2, num_kv_heads=2, head_dim=8, block_size=BS
)


def prompt(i: int) -> np.ndarray:
    return np.arange(5 * BS, dtype=np.uint32) + 10_000 * (i + 1)


def layers_for(tokens: np.ndarray) -> list[tuple[np.ndarray, np.ndarray]]:
    base = np.random.default_rng(int(tokens[0])).standard_normal((2, 2, len(tokens), 2, 8))
    return [(base[i, 0].astype(np.float16), base[i, 1].astype(np.float16)) for i in range(2)]


def expected_blocks(n: int) -> dict[bytes, frozenset[bytes]]:
    return {NS.digest: frozenset(k for i in range(n) for k in block_keys(NS, prompt(i)))}


def refuses_events(standby: Daemon) -> None:
    host, port = standby.field("control").rsplit(":", 1)
    conn = protocol.FramedSocket.connect(host, int(port), timeout=5)
    try:
        auth.hello(conn, None)
        for verb in ("events", "events_snapshot"):
            try:
                conn.call(verb, {"since_seq": 0})
            except NotLeaderError:
                continue
            raise AssertionError(f"a standby served {verb}")
    finally:
        conn.close()

    async def sse_status() -> list[int]:
        async with aiohttp.ClientSession() as s:
            out = []
            for path in ("/api/v1/events?duration_s=1", "/api/v1/events/snapshot"):
                async with s.get(standby.field("admin") + path) as r:
                    body = await r.json()
                    assert body["error"]["name"] == "NOT_LEADER"
                    out.append(r.status)
            return out

    assert asyncio.run(sse_status()) == [503, 503]


def test_failover_makes_subscribers_resync_to_the_new_leaders_table(ha_factory) -> None:  # noqa: F811
    cluster = ha_factory(num_masters=2, num_nodes=2, master_args=FAST)
    old = cluster.leader()
    refuses_events(next(m for m in cluster.masters if m is not old))
    with Client.connect(cluster.url, timeout=15) as c:
        kv = KVCache(c, NS)
        for i in range(4):
            assert kv.store(prompt(i), layers_for(prompt(i))) == 5 * BS
        stream = EventStream(c, retry_s=60)
        view = BlockView()
        deadline = time.monotonic() + 20
        while view.as_sets() != expected_blocks(4):
            assert time.monotonic() < deadline, "the leader's events never came"
            for item in stream.poll(wait_s=1):
                view.apply(item)
        old_epoch = stream.position[0]
        assert stream.num_resyncs == 0

        old.kill()  # kill -9
        new = cluster.leader(timeout=30)
        assert new is not old

        # The first answer of the new leader is a resync (its epoch), then its snapshot.
        items: list[object] = []
        deadline = time.monotonic() + 30
        while not items:
            assert time.monotonic() < deadline, "no answer from the new leader"
            items = stream.poll(wait_s=1)
        assert [type(i) for i in items[:2]] == [ResyncNotice, Snapshot], items
        notice, snap = items[0], items[1]
        assert notice.reason == "epoch" and notice.epoch != old_epoch  # type: ignore[union-attr]
        assert snap.epoch == notice.epoch  # type: ignore[union-attr]
        leading = [ln for ln in new.lines if ln.startswith("kvstore master leading: epoch=")]
        assert notice.epoch == int(leading[-1].split("=")[1])  # type: ignore[union-attr]
        for item in items:
            view.apply(item)  # type: ignore[arg-type]

        # The new leader rebuilds its index from the nodes (stored events after the snapshot);
        # the view follows it exactly and ends equal to the new leader's own snapshot.
        def settled() -> bool:
            for item in stream.poll(wait_s=0.5):
                assert not isinstance(item, ResyncNotice), "resynced twice"
                assert isinstance(item, BlockEvent) and item.epoch == notice.epoch  # type: ignore[union-attr]
                view.apply(item)
            return view.as_sets() == expected_blocks(4)

        wait_until(settled, timeout=30, interval=0.1, what="the view to match the new table")
        fresh = EventStream(c).snapshot()
        assert fresh.epoch == notice.epoch and stream.position == (fresh.epoch, fresh.seq)  # type: ignore[union-attr]
        assert view.as_sets() == {ns: k for ns, k in fresh.blocks.items() if k}
        # And it follows the new leader from here on.
        assert kv.store(prompt(4), layers_for(prompt(4))) == 5 * BS
        wait_until(settled_with(stream, view, 5), timeout=20, what="the new leader's events")
        kv.close()


def settled_with(stream: EventStream, view: BlockView, n: int):  # noqa: ANN201
    def check() -> bool:
        for item in stream.poll(wait_s=0.5):
            view.apply(item)
        return view.as_sets() == expected_blocks(n)

    return check
