"""The leadership fence on the admin API, over real HTTP: mutations and /ready need a leader."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
from aiohttp.test_utils import TestServer

from kvstore.errors import ErrorCode
from kvstore.master.admin import init_app
from kvstore.master.ha import Leadership
from kvstore.master.rest.fence import is_fenced
from kvstore.master.service import MasterService, ServiceSlot
from kvstore.types import SegmentSpec

FENCED = [
    ("DELETE", "/api/v1/objects/k", None),
    ("POST", "/api/v1/evict", {"keys": ["k"]}),
    ("POST", "/api/v1/evict", {"prefix": "k"}),
    ("POST", "/api/v1/nodes/n1/drain", None),
    ("GET", "/ready", None),
    # The table's reads: a deposed leader must not answer for objects the leader since removed.
    ("GET", "/api/v1/objects", None),
    ("GET", "/api/v1/objects/k", None),
    ("GET", "/api/v1/nodes", None),
    ("GET", "/api/v1/nodes/n1", None),
    ("GET", "/api/v1/cluster", None),
    ("POST", "/api/v1/prefix/match", {"keys": ["k"]}),
]
#: The KV event routes (a leader would stream forever: only the refusal is called here).
FENCED_EVENTS = [
    ("GET", "/api/v1/events", None),
    ("GET", "/api/v1/events/snapshot", None),
]
OPEN = [
    ("GET", "/health", None),
    ("GET", "/api/v1/history", None),
]


class Clock:
    now = 100.0

    def __call__(self) -> float:
        return self.now


def _service() -> MasterService:
    svc = MasterService()
    svc.register("n1", "127.0.0.1", 9, b"x" * 16, [SegmentSpec("dram", "dram", 1 << 20)])
    return svc


async def _calls(
    app: object, calls: list[tuple[str, str, object]]
) -> list[tuple[int, dict[str, object]]]:
    server = TestServer(app)  # type: ignore[arg-type]
    await server.start_server()
    try:
        async with aiohttp.ClientSession() as http:
            out = []
            for method, path, body in calls:
                async with http.request(method, server.make_url(path), json=body) as r:
                    out.append((r.status, await r.json()))
            return out
    finally:
        await server.close()


def _not_leader(reply: tuple[int, dict[str, object]]) -> bool:
    status, body = reply
    error = body.get("error")
    return status == 503 and isinstance(error, dict) and error["error_code"] == ErrorCode.NOT_LEADER


@pytest.mark.parametrize("state", ["standby", "lease unproven", "rebuilding"])
def test_a_master_that_may_not_lead_refuses_every_mutation_and_ready(state: str) -> None:
    async def run() -> None:
        slot = ServiceSlot(_service())
        fence = Leadership(slot, clock=Clock())
        if state != "standby":
            fence.begin(epoch=3, deadline=110.0, recovery_s=5.0 if state == "rebuilding" else 0)
            svc = slot.service
            svc.register("n1", "127.0.0.1", 9, b"x" * 16, [SegmentSpec("dram", "dram", 1 << 20)])
            fence.expected_nodes = {"n1", "n2"} if state == "rebuilding" else {"n1"}
        if state == "lease unproven":
            fence.clock.now = 111.0  # type: ignore[attr-defined]
        app = init_app(slot, fence=fence)
        fenced = FENCED + FENCED_EVENTS
        replies = await _calls(app, fenced + OPEN)
        assert all(_not_leader(r) for r in replies[: len(fenced)]), replies
        assert all(status == 200 for status, _ in replies[len(fenced) :]), replies

    asyncio.run(run())


def test_a_leader_with_a_proven_lease_passes_the_fence() -> None:
    async def run() -> None:
        slot = ServiceSlot(_service())
        fence = Leadership(slot, clock=Clock())
        fence.begin(epoch=3, deadline=110.0, recovery_s=0)
        svc = slot.service
        svc.register("n1", "127.0.0.1", 9, b"x" * 16, [SegmentSpec("dram", "dram", 1 << 20)])
        fence.expected_nodes = {"n1"}
        replies = await _calls(init_app(slot, fence=fence), FENCED)
        # Past the fence, each route answers for itself (no such key, nothing to evict, ...).
        assert not any(_not_leader(r) for r in replies), replies
        assert replies[0][0] == 404 and replies[-1][0] == 200

    asyncio.run(run())


def test_without_ha_there_is_no_fence() -> None:
    replies = asyncio.run(_calls(init_app(ServiceSlot(_service())), [("GET", "/ready", None)]))
    assert replies[0][0] == 200


def test_which_routes_are_fenced() -> None:
    assert is_fenced("DELETE", "/api/v1/objects/x") and is_fenced("GET", "/ready")
    assert is_fenced("POST", "/api/v1/evict") and is_fenced("PUT", "/anything")
    assert is_fenced("POST", "/api/v1/prefix/match") and is_fenced("GET", "/api/v1/objects/a/b")
    assert is_fenced("GET", "/api/v1/objects") and is_fenced("GET", "/api/v1/nodes/n1")
    assert not is_fenced("GET", "/health") and not is_fenced("GET", "/metrics")
    assert not is_fenced("GET", "/api/v1/objectsfoo") and not is_fenced("GET", "/api/v1/history")
    assert is_fenced("GET", "/api/v1/events") and is_fenced("GET", "/api/v1/events/snapshot")
