"""The router's state: its policy, what a poll of an engine changes and exports (in-process, in
front of an engine of our own making), and the choice over the engines of each role."""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp
import pytest
from prometheus_client import generate_latest

from kvstore.router.config import RouterConfig
from kvstore.router.engines import EngineLoad
from kvstore.router.state import RouterState
from kvstore.routing.policy import POLICIES, RequestShape
from kvstore.routing.slo import SLOClass
from tests.router.fake_engine import FakeEngine, metrics_text, write_model
from tests.router.inproc import health_is, router, until

LOOSE = SLOClass("loose", ttft_s=100.0, tbt_s=10.0)


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_the_router_exports_its_policy(name: str) -> None:
    state = RouterState(RouterConfig(engines=("http://a", "http://b"), policy=name))
    assert state.policy.name == name
    text = generate_latest(state.metrics.registry).decode()
    assert f'kvstore_router_policy_info{{policy="{name}"}} 1.0' in text


def test_a_poll_takes_the_engines_load_and_exports_it(tmp_path: Path) -> None:
    async def run() -> None:
        engine = FakeEngine(write_model(tmp_path / "model"))
        await engine.start()
        engine.metrics = metrics_text(running="2", waiting="1", usage="0.95")
        config = RouterConfig(engines=(engine.url,), poll_s=0.05)
        try:
            async with router(config) as (url, state), aiohttp.ClientSession() as http:
                await until(lambda: health_is(http, url, engine.url, True), "the engine healthy")
                polled = state.by_url[engine.url]
                assert (polled.load.num_running, polled.load.num_waiting) == (2, 1)
                assert polled.load.block_size == 32 and polled.above_high  # over 0.9
                assert [m["id"] for m in state.served_models()] == ["fake-model"]
                registry = state.metrics.registry
                labels = {"instance": engine.url}
                assert registry.get_sample_value("kvstore_router_engine_running", labels) == 2
                assert registry.get_sample_value("kvstore_router_engine_kv_usage", labels) == 0.95
                # Under the low watermark it takes requests again.
                engine.metrics = metrics_text(usage="0.5")
                await until(lambda: not polled.above_high, "the watermark state cleared")
                await engine.stop()
                await until(lambda: not polled.healthy, "the engine unhealthy")
                assert registry.get_sample_value("kvstore_router_engine_healthy", labels) == 0
                assert state.served_models() == []
        finally:
            await engine.stop()

    asyncio.run(run())


def test_the_choice_is_over_the_healthy_engines_of_each_role() -> None:
    state = RouterState(
        RouterConfig(prefill=("http://p1", "http://p2"), decode=("http://d1", "http://d2"))
    )
    assert state.disaggregated
    for url in ("http://p1", "http://p2", "http://d2"):
        state.by_url[url].healthy = True
    state.by_url["http://p1"].load = EngineLoad(num_waiting=4)
    choice = state.choose(RequestShape(1000, 0, 16), LOOSE)
    assert choice.accepted and choice.prefill is not None
    assert choice.prefill.engine == "http://p2" and choice.decode == "http://d2"
    assert [e.url for e in state.role_engines("decode")] == ["http://d1", "http://d2"]
