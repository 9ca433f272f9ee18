"""The SSE event stream in-process (aiohttp TestServer, no sockets of ours to manage): it ends
with an ``error`` event when its master stops leading, and app shutdown ends open streams."""

from __future__ import annotations

import asyncio
import json
import os
import time

import aiohttp
from aiohttp.test_utils import TestServer

from kvstore.auth import Token
from kvstore.master.admin import init_app
from kvstore.master.event_ring import EVENT_STORED
from kvstore.master.ha import Leadership
from kvstore.master.rest import event_stream as events_rest
from kvstore.master.rest.state import AdminConfig
from kvstore.master.service import MasterService, ServiceSlot


class Clock:
    now = 100.0

    def __call__(self) -> float:
        return self.now


async def _next_event(content: aiohttp.StreamReader) -> tuple[str, str]:
    """(event, data) of the next event on the stream (comments and retry lines skipped)."""
    kind, data = "", ""
    while True:
        line = (await content.readline()).decode()
        assert line, "the stream ended"
        line = line.rstrip("\n")
        if not line and kind:
            return kind, data
        if line.startswith("event: "):
            kind = line[7:]
        elif line.startswith("data: "):
            data += line[6:]


def test_a_stream_ends_with_an_error_when_its_master_stops_leading() -> None:
    async def run() -> None:
        slot = ServiceSlot(MasterService())
        fence = Leadership(slot, clock=Clock())
        fence.begin(epoch=7, deadline=1e9, recovery_s=0)
        svc = slot.service
        fence.expected_nodes = set()
        server = TestServer(init_app(slot, fence=fence))
        await server.start_server()
        try:
            async with (
                aiohttp.ClientSession() as http,
                http.get(server.make_url("/api/v1/events?duration_s=30")) as r,
            ):
                assert r.status == 200
                assert (await _next_event(r.content))[0] == "snapshot"
                svc.events.append(EVENT_STORED, b"d" * 16, [b"k" * 16])
                kind, data = await asyncio.wait_for(_next_event(r.content), 10)
                assert kind == "stored" and '"seq":1' in data
                fence.step_down("test")
                kind, data = await asyncio.wait_for(_next_event(r.content), 10)
                assert kind == "error" and "NOT_LEADER" in data
                assert await asyncio.wait_for(r.content.read(), 10) == b"", "the stream ended"
        finally:
            await server.close()

    asyncio.run(run())


def test_shutdown_ends_open_streams_at_once() -> None:
    async def run() -> float:
        server = TestServer(init_app(ServiceSlot(MasterService())))
        await server.start_server()
        http = aiohttp.ClientSession()
        try:
            r = await http.get(server.make_url("/api/v1/events"))
            assert (await _next_event(r.content))[0] == "snapshot"
            started = time.monotonic()
            await asyncio.wait_for(server.close(), 20)
            return time.monotonic() - started
        finally:
            await http.close()

    assert asyncio.run(run()) < 5, "shutdown waited for the stream"


def _big_snapshot(svc: MasterService, num_keys: int) -> dict[str, list[str]]:
    """Make the index's snapshot hold ``num_keys`` blocks in two namespaces (what a pool of a
    million blocks answers, without indexing a million prompts here)."""
    raw = {b"a" * 16: os.urandom(16 * (num_keys // 2)), b"b" * 16: os.urandom(16 * (num_keys // 2))}
    svc.prefix.snapshot = lambda: (svc.events.epoch, 0, raw)  # type: ignore[method-assign]
    return {d.hex(): [k[i : i + 16].hex() for i in range(0, len(k), 16)] for d, k in raw.items()}


def test_a_large_snapshot_streams_in_pieces_that_join_into_one_document() -> None:
    async def run() -> None:
        svc = MasterService()
        want = _big_snapshot(svc, 3 * events_rest.SNAPSHOT_PIECE_KEYS)
        server = TestServer(init_app(ServiceSlot(svc)))
        await server.start_server()
        try:
            async with (
                aiohttp.ClientSession() as http,
                http.get(server.make_url("/api/v1/events?duration_s=5")) as r,
            ):
                kind, data = await asyncio.wait_for(_next_event(r.content), 30)
                assert kind == "snapshot"
                snap = json.loads(data)
                assert snap["namespaces"] == want and snap["seq"] == 0
        finally:
            await server.close()

    asyncio.run(run())


def test_event_streams_are_capped_and_a_subscriber_that_reads_nothing_is_dropped(
    monkeypatch,
) -> None:
    monkeypatch.setattr(events_rest, "WRITE_TIMEOUT_S", 0.5)

    async def run() -> None:
        svc = MasterService()
        _big_snapshot(svc, 400_000)  # ~14 MB of JSON: more than the sockets buffer
        app = init_app(ServiceSlot(svc))
        state = app[events_rest.STREAMS_KEY]
        state.max_open = 2
        server = TestServer(app)
        await server.start_server()
        try:
            async with aiohttp.ClientSession() as http:
                silent = [await http.get(server.make_url("/api/v1/events")) for _ in range(2)]
                third = await http.get(server.make_url("/api/v1/events"))
                assert third.status == 503
                assert (await third.json())["error"]["name"] == "OVERLOADED"
                # Neither silent subscriber reads: each is dropped once its buffers stay full.
                for _ in range(600):
                    if state.num_open == 0:
                        break
                    await asyncio.sleep(0.05)
                assert state.num_open == 0, "a subscriber that reads nothing was kept"
                for r in silent:
                    r.close()
        finally:
            await server.close()

    asyncio.run(run())


def test_events_need_the_token_even_where_reads_are_public() -> None:
    async def run() -> None:
        settings = AdminConfig(token=Token("events-secret-0123456789"), public_reads=True)
        server = TestServer(init_app(ServiceSlot(MasterService()), settings=settings))
        await server.start_server()
        try:
            async with aiohttp.ClientSession() as http:
                for path in ("/api/v1/events?duration_s=1", "/api/v1/events/snapshot"):
                    async with http.get(server.make_url(path)) as r:
                        assert r.status == 401, path
                async with http.get(server.make_url("/api/v1/nodes")) as r:
                    assert r.status == 200  # other reads stay public
                auth = {"Authorization": "Bearer events-secret-0123456789"}
                async with http.get(server.make_url("/api/v1/events/snapshot"), headers=auth) as r:
                    assert r.status == 200
        finally:
            await server.close()

    asyncio.run(run())
