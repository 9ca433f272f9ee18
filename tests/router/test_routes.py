"""The router's routes in-process (its real application on a real socket) in front of engines of
our own making: what ``/health`` and ``/v1/models`` say as engines come and go, the headers of
an answer, an early rejection (429 with ``Retry-After``), and the outcome each request is
counted under."""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp
import pytest

from kvstore.router.config import RouterConfig
from kvstore.router.state import NO_ENGINE_RETRY_S, RouterState
from tests.router.fake_engine import FakeEngine, write_model
from tests.router.inproc import health_is, post, router, until


@pytest.fixture
def model(tmp_path: Path) -> Path:
    return write_model(tmp_path / "model")


def requests_counted(state: RouterState, route: str, outcome: str, slo: str) -> float:
    """``kvstore_router_requests_total`` for one route, outcome and class."""
    registry = state.metrics.registry
    labels = {"route": route, "outcome": outcome, "slo_class": slo}
    return registry.get_sample_value("kvstore_router_requests_total", labels) or 0.0


def test_health_and_models_follow_the_engines(model: Path) -> None:
    async def run() -> None:
        up, doomed = FakeEngine(model), FakeEngine(model)
        await up.start()
        await doomed.start()
        config = RouterConfig(engines=(up.url, doomed.url), poll_s=0.05)
        try:
            async with router(config) as (url, _), aiohttp.ClientSession() as http:
                for engine in (up, doomed):
                    await until(lambda e=engine: health_is(http, url, e.url, True), "healthy")
                async with http.get(url + "/health") as resp:
                    body = await resp.json()
                    assert resp.status == 200 and body["status"] == "ok"
                    assert body["roles"] == {up.url: "both", doomed.url: "both"}
                    assert body["sources"] == {up.url: "static", doomed.url: "static"}
                async with http.get(url + "/v1/models") as resp:
                    assert resp.status == 200
                    assert [m["id"] for m in (await resp.json())["data"]] == ["fake-model"]
                await doomed.stop()
                await until(lambda: health_is(http, url, doomed.url, False), "one unhealthy")
                async with http.get(url + "/health") as resp:
                    assert resp.status == 200 and (await resp.json())["status"] == "degraded"
                await up.stop()
                await until(lambda: health_is(http, url, up.url, False), "none healthy")
                async with http.get(url + "/health") as resp:
                    assert resp.status == 503 and (await resp.json())["status"] == "down"
                    assert resp.headers["Retry-After"] == str(NO_ENGINE_RETRY_S)
                async with http.get(url + "/v1/models") as resp:
                    error = (await resp.json())["error"]
                    assert resp.status == 503 and error["type"] == "ServiceUnavailableError"
                    assert resp.headers["Retry-After"] == str(NO_ENGINE_RETRY_S)
        finally:
            await up.stop()
            await doomed.stop()

    asyncio.run(run())


def test_an_answer_says_what_the_router_saw_and_is_counted(model: Path) -> None:
    async def run() -> None:
        engine = FakeEngine(model)
        await engine.start()
        config = RouterConfig(engines=(engine.url,), policy="least-loaded")
        try:
            async with router(config) as (url, state), aiohttp.ClientSession() as http:
                await until(lambda: health_is(http, url, engine.url, True), "the engine healthy")
                async with http.post(
                    url + "/v1/completions",
                    json={"prompt": "one two three", "max_tokens": 4},
                    headers={"X-SLO-Class": "batch"},
                ) as resp:
                    assert resp.status == 200
                    headers = resp.headers
                assert headers["x-kvstore-engine"] == engine.url
                assert headers["x-kvstore-prefill-engine"] == engine.url
                assert headers["x-kvstore-prompt-tokens"] == "3"  # the spy: a token a word
                assert headers["x-kvstore-cached-tokens"] == "0"
                assert headers["x-kvstore-pool-view"] == "none"  # no master
                assert headers["x-kvstore-slo-class"] == "batch"
                assert headers["x-kvstore-policy"] == "least-loaded"
                assert float(headers["x-kvstore-predicted-ttft-ms"]) > 0
                assert requests_counted(state, "/v1/completions", "ok", "batch") == 1
                # An unknown class is the client's error, counted as such.
                async with http.post(
                    url + "/v1/completions",
                    json={"prompt": "one", "max_tokens": 4},
                    headers={"X-SLO-Class": "platinum"},
                ) as resp:
                    assert resp.status == 400
                    assert "unknown SLO class" in (await resp.json())["error"]["message"]
                assert requests_counted(state, "/v1/completions", "bad_request", "unknown") == 1
        finally:
            await engine.stop()

    asyncio.run(run())


def test_a_request_predicted_past_its_class_target_is_rejected_early(model: Path) -> None:
    """The CPU prior predicts 0.05 s + 1 ms a token of prefill: 400 words are past the
    ``critical`` class's 0.3 s, well within ``standard``'s 10 s."""

    async def run() -> None:
        engine = FakeEngine(model)
        await engine.start()
        config = RouterConfig(engines=(engine.url,))
        body = {"prompt": "word " * 400, "max_tokens": 4}
        try:
            async with router(config) as (url, state), aiohttp.ClientSession() as http:
                await until(lambda: health_is(http, url, engine.url, True), "the engine healthy")
                async with http.post(
                    url + "/v1/completions", json=body, headers={"X-SLO-Class": "critical"}
                ) as resp:
                    error = (await resp.json())["error"]
                    assert resp.status == 429 and error["type"] == "RateLimitError"
                    assert "predicted TTFT" in error["message"]
                    assert int(resp.headers["Retry-After"]) >= 1
                assert engine.bodies == []
                assert requests_counted(state, "/v1/completions", "rejected", "critical") == 1
                status, answer = await post(http, url + "/v1/completions", body)
                assert status == 200, answer
                assert requests_counted(state, "/v1/completions", "ok", "standard") == 1
        finally:
            await engine.stop()

    asyncio.run(run())


def test_a_prompt_over_the_context_is_refused_or_truncated_as_it_asks(model: Path) -> None:
    """Over the context length: a 400 naming the limit, the engine never asked; with vLLM's
    ``truncate_prompt_tokens`` the router looks up and checks the tokens the engine will keep
    (vLLM's rule) and says so in a header; values vLLM refuses are a 400 here too."""
    long_prompt = " ".join(["word"] * 40)  # 40 tokens: a token a word

    async def run() -> None:
        engine = FakeEngine(model, max_model_len=32)
        await engine.start()
        try:
            config = RouterConfig(engines=(engine.url,))
            async with router(config) as (url, _), aiohttp.ClientSession() as http:
                await until(lambda: health_is(http, url, engine.url, True), "healthy")

                async def complete(**extra: object) -> tuple[int, dict, object]:
                    body = {"prompt": long_prompt, "max_tokens": 4, **extra}
                    async with http.post(url + "/v1/completions", json=body) as resp:
                        return resp.status, dict(resp.headers), await resp.json()

                status, _, answer = await complete()
                assert status == 400
                assert "maximum context length is 32 tokens" in answer["error"]["message"]
                assert engine.bodies == []
                status, headers, _ = await complete(truncate_prompt_tokens=-1)
                assert status == 200
                assert headers["x-kvstore-prompt-truncated-from"] == "40"
                assert headers["x-kvstore-prompt-tokens"] == "31"  # one held back
                assert engine.bodies[-1]["truncate_prompt_tokens"] == -1  # as asked
                status, headers, _ = await complete(
                    truncate_prompt_tokens=10, truncation_side="left"
                )
                assert status == 200 and headers["x-kvstore-prompt-tokens"] == "10"
                short = {"prompt": "one two", "max_tokens": 4, "truncate_prompt_tokens": 10}
                async with http.post(url + "/v1/completions", json=short) as resp:
                    assert resp.status == 200
                    assert "x-kvstore-prompt-truncated-from" not in resp.headers
                for bad in (0, -2, 33, "5", True):
                    status, _, answer = await complete(truncate_prompt_tokens=bad)
                    assert status == 400, bad
                    assert answer["error"]["param"] == "truncate_prompt_tokens"
                status, _, _ = await complete(truncate_prompt_tokens=5, truncation_side="up")
                assert status == 400
                assert len(engine.bodies) == 3
        finally:
            await engine.stop()

    asyncio.run(run())


def test_engine_priority_sends_each_request_with_its_class_priority(model: Path) -> None:
    """With ``engine_priority`` the engines (vLLM's priority scheduling) get each request's SLO
    class priority, so they preempt the lowest class first; a request's own stays; off, none."""

    async def run() -> None:
        engine = FakeEngine(model)
        await engine.start()
        try:
            for enabled in (True, False):
                config = RouterConfig(engines=(engine.url,), engine_priority=enabled)
                async with router(config) as (url, _), aiohttp.ClientSession() as http:
                    await until(lambda: health_is(http, url, engine.url, True), "healthy")
                    engine.bodies.clear()
                    for slo, extra in (("critical", {}), ("batch", {}), ("batch", {"priority": 7})):
                        async with http.post(
                            url + "/v1/completions",
                            json={"prompt": "one two", "max_tokens": 2, **extra},
                            headers={"X-SLO-Class": slo},
                        ) as resp:
                            assert resp.status == 200
                    got = [b.get("priority") for b in engine.bodies]
                    assert got == ([0, 2, 7] if enabled else [None, None, 7]), got
        finally:
            await engine.stop()

    asyncio.run(run())
