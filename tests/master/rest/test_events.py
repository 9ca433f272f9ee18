"""The SSE event stream in-process (aiohttp TestServer, no sockets of ours to manage): it ends
with an ``error`` event when its master stops leading, and app shutdown ends open streams."""

from __future__ import annotations

import asyncio
import time

import aiohttp
from aiohttp.test_utils import TestServer

from kvstore.master.admin import init_app
from kvstore.master.events import EVENT_STORED
from kvstore.master.ha import Leadership
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
