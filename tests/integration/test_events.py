"""KV events across real processes: a subscriber follows stores, removes, evictions and moves
exactly; resumes after a disconnect; resyncs when too far behind; and the SSE stream on the
admin API does the same for a browser or ``curl -N``."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from typing import Any

import aiohttp
import numpy as np
import pytest

from kvstore import auth, protocol
from kvstore.client import Client, KVCache, Namespace
from kvstore.client.events import BlockEvent, BlockView, EventStream, ResyncNotice, Snapshot
from kvstore.errors import InvalidRequestError
from kvstore.keys import block_keys
from kvstore.kvblocks import kv_object_key
from tests.support import wait_until

BS = 16
NS = Namespace(
    model="tiny", dtype="float16", num_layers=2, num_kv_heads=2, head_dim=8, block_size=BS
)
D = NS.digest
FAST = ("--heartbeat-interval", "0.1", "--node-ttl", "2")


def layers_for(tokens: np.ndarray, head_dim: int = 8) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(int(tokens[0]))
    base = rng.standard_normal((2, 2, len(tokens), 2, head_dim)).astype(np.float16)
    return [(base[layer, 0], base[layer, 1]) for layer in range(2)]


def prompt(i: int, num_blocks: int = 4) -> np.ndarray:
    return np.arange(num_blocks * BS, dtype=np.uint32) + 100_000 * (i + 1)


def keys_of(tokens: np.ndarray) -> list[bytes]:
    return list(block_keys(NS, tokens))


def collect(stream: EventStream, n: int, timeout: float = 20.0) -> list[Any]:
    """At least ``n`` items from the stream (bounded)."""
    items: list[Any] = []
    deadline = time.monotonic() + timeout
    while len(items) < n:
        assert time.monotonic() < deadline, f"only {len(items)} of {n} items: {items}"
        items.extend(stream.poll(wait_s=1.0))
    return items


class StrictView(BlockView):
    """A view that fails on a lost or doubled event: a stored block must be new, a dropped one
    must be there."""

    def apply(self, item: Any) -> None:
        if isinstance(item, BlockEvent):
            have = self.blocks.get(item.namespace, set())
            if item.kind == "stored":
                assert not have & set(item.blocks), f"doubled: {item}"
            else:
                assert set(item.blocks) <= have, f"drops blocks never stored: {item}"
        super().apply(item)


def test_a_subscriber_sees_stores_and_removes_exactly_and_in_order(cluster_factory) -> None:
    cluster = cluster_factory(num_nodes=1, dram="64MiB")
    with Client.connect(cluster.address) as c, EventStream(c, wait_s=2) as stream:
        kv = KVCache(c, NS)
        p1 = prompt(0, 4)
        p2 = np.concatenate([p1, prompt(1, 2)])
        assert kv.store(p1, layers_for(p1)) == 4 * BS
        assert kv.store(p2, layers_for(p2)) == 2 * BS  # shares p1's 4 blocks
        k1, k2 = keys_of(p1), keys_of(p2)
        c.remove(kv_object_key(D, k1[2]))  # drops blocks 2, 3 and p2's 4, 5
        asyncio.run(
            _post(cluster.admin + "/api/v1/evict", {"keys": [kv_object_key(D, k1[0]).decode()]})
        )
        items = collect(stream, 4)
        assert all(isinstance(i, BlockEvent) for i in items)
        assert [(i.kind, i.namespace) for i in items] == [
            ("stored", D),
            ("stored", D),
            ("removed", D),
            ("removed", D),
        ]
        assert list(items[0].blocks) == k1 and list(items[1].blocks) == k2[4:]
        assert set(items[2].blocks) == {k1[2], k1[3], k2[4], k2[5]}
        assert set(items[3].blocks) == {k1[0], k1[1]}
        assert [i.seq for i in items] == [1, 2, 3, 4] and stream.position == (items[0].epoch, 4)
        assert stream.poll(wait_s=0) == [], "nothing more, nothing doubled"
        kv.close()


async def _post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    async with aiohttp.ClientSession() as s, s.post(url, json=body) as r:
        assert r.status == 200, await r.text()
        return await r.json()


def test_resume_after_a_disconnect_loses_and_doubles_nothing(cluster_factory) -> None:
    cluster = cluster_factory(num_nodes=1, dram="64MiB")
    with Client.connect(cluster.address) as c:
        kv = KVCache(c, NS)
        for i in range(3):
            kv.store(prompt(i), layers_for(prompt(i)))
        first = EventStream(cluster.address, max_events=1)
        got = collect(first, 1)
        assert [e.seq for e in got] == [1]
        position = first.position
        first.close()  # gone mid-stream: two events are still unread
        # A long poll cut off by its subscriber does not disturb the master.
        host, port = cluster.address.rsplit(":", 1)
        raw = protocol.FramedSocket.connect(host, int(port), timeout=5)
        auth.hello(raw, None)
        raw.send_request("events", {"since_seq": 3, "since_epoch": position[0], "wait_s": 20})
        raw.close()
        for i in range(3, 5):
            kv.store(prompt(i), layers_for(prompt(i)))
        again = EventStream(cluster.address, since_seq=position[1], since_epoch=position[0])
        got = collect(again, 4)
        assert [e.seq for e in got] == [2, 3, 4, 5] and all(e.kind == "stored" for e in got)
        assert [list(e.blocks) for e in got] == [keys_of(prompt(i)) for i in range(1, 5)]
        assert again.poll(wait_s=0) == [] and again.num_resyncs == 0
        again.close()
        kv.close()


def test_a_subscriber_too_far_behind_resyncs_and_the_snapshot_matches_the_table(
    cluster_factory,
) -> None:
    cluster = cluster_factory(num_nodes=1, dram="64MiB", master_args=("--event-ring", "4"))
    with Client.connect(cluster.address) as c:
        kv = KVCache(c, NS)
        kv.store(prompt(0), layers_for(prompt(0)))
        stream = EventStream(c)
        view = StrictView()
        for item in collect(stream, 1):
            view.apply(item)
        for i in range(1, 10):  # 9 more events: the ring of 4 dropped what it had not read
            kv.store(prompt(i), layers_for(prompt(i)))
        c.remove(kv_object_key(D, keys_of(prompt(3))[1]))
        items = stream.poll(wait_s=0)
        assert [type(i) for i in items] == [ResyncNotice, Snapshot]
        assert items[0].reason == "gap" and stream.num_resyncs == 1
        for item in items:
            view.apply(item)
        expected = {k for i in range(10) for k in keys_of(prompt(i))} - set(keys_of(prompt(3))[1:])
        assert view.as_sets() == {D: frozenset(expected)}
        assert stream.position == (items[1].epoch, 11)
        # The admin API's snapshot says the same.
        snap = asyncio.run(_get_json(cluster.admin + "/api/v1/events/snapshot"))
        assert snap["seq"] == 11 and set(snap["namespaces"][D.hex()]) == {k.hex() for k in expected}
        kv.close()


async def _get_json(url: str) -> dict[str, Any]:
    async with aiohttp.ClientSession() as s, s.get(url) as r:
        assert r.status == 200, await r.text()
        return await r.json()


def test_evictions_and_demotions_reach_the_subscriber_and_its_view_stays_exact(
    cluster_factory,
) -> None:
    cluster = cluster_factory(
        num_nodes=1,
        dram="1MiB",
        master_args=(*FAST, "--high-watermark", "0.6", "--low-watermark", "0.4"),
        node_args=("--nvme", "2MiB"),
    )
    big = Namespace(
        model="tiny", dtype="float16", num_layers=2, num_kv_heads=2, head_dim=64, block_size=BS
    )
    with Client.connect(cluster.address) as c:
        kv = KVCache(c, big)
        stream = EventStream(c, max_events=10_000)
        view = StrictView()
        kinds: set[str] = set()
        for i in range(80):  # 80 x 4 blocks x 16 KiB: far past DRAM and NVMe
            kv.store(prompt(i), layers_for(prompt(i), head_dim=64))
            for item in stream.poll(wait_s=0):
                view.apply(item)
                kinds.add(getattr(item, "kind", ""))

        def seen_all() -> bool:
            for item in stream.poll(wait_s=0.2):
                view.apply(item)
                kinds.add(getattr(item, "kind", ""))
            return {"moved", "evicted"} <= kinds

        wait_until(seen_all, timeout=30, what="demotions and evictions as events")
        # Quiet now (no writes): the view equals a snapshot taken at the same position.
        for _ in range(50):
            snap = EventStream(c).snapshot()
            while stream.position[1] < snap.seq:
                for item in stream.poll(wait_s=0):
                    view.apply(item)
            if stream.position[1] == snap.seq:
                assert view.as_sets() == {ns: k for ns, k in snap.blocks.items() if k}
                break
        else:
            pytest.fail("the pool never settled")
        assert stream.num_resyncs == 0
        kv.close()


def test_a_long_poll_answers_as_soon_as_an_event_comes(cluster_factory) -> None:
    cluster = cluster_factory(num_nodes=1, dram="64MiB")
    with Client.connect(cluster.address) as c:
        kv = KVCache(c, NS)
        stream = EventStream(c, wait_s=10)
        out: list[Any] = []
        poller = threading.Thread(target=lambda: out.extend(stream.poll()))
        started = time.monotonic()
        poller.start()
        wait_until(lambda: c.stats()["events"]["num_waiters"] == 1, what="the long poll")
        kv.store(prompt(0), layers_for(prompt(0)))
        poller.join(timeout=8)
        assert not poller.is_alive() and [e.kind for e in out] == ["stored"]
        assert time.monotonic() - started < 8, "answered at the event, not at wait_s"
        kv.close()


@pytest.mark.parametrize(
    "args",
    [
        {"since_seq": -1},
        {"since_seq": "0"},
        {"since_seq": 0, "since_epoch": 1.5},
        {"max": 10**12},
        {"wait_s": 3600},
        {"namespaces": [b"x"]},
    ],
)
def test_bad_events_calls_are_refused_and_change_nothing(cluster_factory, args) -> None:
    cluster = cluster_factory(num_nodes=1, dram="64MiB")
    with Client.connect(cluster.address) as c:
        kv = KVCache(c, NS)
        kv.store(prompt(0), layers_for(prompt(0)))
        before = c.stats()["events"]
        with pytest.raises(InvalidRequestError):
            c._control.call("events", args)
        assert c.stats()["events"] == before
        with pytest.raises(InvalidRequestError):
            EventStream(c, since_seq=5)  # a position without its epoch
        kv.close()


# ---------------------------------------------------------------- server-sent events
async def read_sse(
    url: str, n: int, headers: dict[str, str] | None = None, timeout: float = 20.0
) -> list[tuple[str, str | None, dict[str, Any]]]:
    """The first ``n`` events of a stream as (event, id, data); then it hangs up."""
    out: list[tuple[str, str | None, dict[str, Any]]] = []
    async with aiohttp.ClientSession() as s, s.get(url, headers=headers or {}) as r:
        assert r.status == 200, await r.text()
        assert r.headers["Content-Type"].startswith("text/event-stream")
        kind, ident, data = "message", None, ""
        async with asyncio.timeout(timeout):
            while len(out) < n:
                line = (await r.content.readline()).decode()
                assert line, "the stream ended early"
                line = line.rstrip("\n")
                if not line:
                    if data:
                        out.append((kind, ident, json.loads(data)))
                    kind, ident, data = "message", None, ""
                elif line.startswith("event: "):
                    kind = line[7:]
                elif line.startswith("id: "):
                    ident = line[4:]
                elif line.startswith("data: "):
                    data += line[6:]
    return out


def test_sse_streams_snapshot_then_events_and_resumes_with_last_event_id(cluster_factory) -> None:
    cluster = cluster_factory(num_nodes=1, dram="64MiB")
    url = cluster.admin + "/api/v1/events?duration_s=30"
    with Client.connect(cluster.address) as c:
        kv = KVCache(c, NS)
        kv.store(prompt(0), layers_for(prompt(0)))
        got = asyncio.run(read_sse(url, 1))
        ((kind, ident, snap),) = got
        epoch = snap["epoch"]
        assert kind == "snapshot" and ident == f"{epoch}.1" and snap["seq"] == 1
        assert snap["namespaces"] == {D.hex(): snap["namespaces"][D.hex()]}
        assert set(snap["namespaces"][D.hex()]) == {k.hex() for k in keys_of(prompt(0))}
        kv.store(prompt(1), layers_for(prompt(1)))
        kv.store(prompt(2), layers_for(prompt(2)))
        # Reconnect as a browser does: Last-Event-ID names the last event seen.
        got = asyncio.run(read_sse(url, 1, {"Last-Event-ID": ident}))
        assert [(k, i, d["seq"]) for k, i, d in got] == [("stored", f"{epoch}.2", 2)]
        assert got[0][2]["blocks"] == [k.hex() for k in keys_of(prompt(1))]
        got = asyncio.run(read_sse(url, 1, {"Last-Event-ID": got[0][1]}))
        assert [(k, i) for k, i, _ in got] == [("stored", f"{epoch}.3")], "exactly the next one"
        # A position of another epoch: resync, then a snapshot, then the stream goes on.
        got = asyncio.run(read_sse(url + "&since=2&epoch=1", 2))
        assert [k for k, _, _ in got] == ["resync", "snapshot"]
        assert got[0][2]["reason"] == "epoch" and got[1][1] == f"{epoch}.3"
        # since/epoch query parameters work like the header.
        got = asyncio.run(read_sse(url + f"&since=1&epoch={epoch}", 2))
        assert [(k, i) for k, i, _ in got] == [("stored", f"{epoch}.2"), ("stored", f"{epoch}.3")]
        kv.close()


@pytest.mark.parametrize(
    ("query", "headers"),
    [
        ("since=-1", {}),
        ("since=abc", {}),
        ("since=1&epoch=x", {}),
        ("namespace=zz", {}),
        ("duration_s=0", {}),
        ("duration_s=nan", {}),
        ("", {"Last-Event-ID": "1.x"}),
        ("", {"Last-Event-ID": "99999999999999999999"}),
    ],
)
def test_sse_bad_input_is_a_400_and_changes_nothing(cluster_factory, query, headers) -> None:
    cluster = cluster_factory(num_nodes=1, dram="64MiB")
    with Client.connect(cluster.address) as c:
        before = c.stats()["events"]

        async def get() -> tuple[int, dict[str, Any]]:
            async with (
                aiohttp.ClientSession() as s,
                s.get(f"{cluster.admin}/api/v1/events?{query}", headers=headers) as r,
            ):
                return r.status, await r.json()

        status, body = asyncio.run(get())
        assert status == 400 and body["error"]["name"] == "INVALID_REQUEST"
        assert c.stats()["events"] == before
