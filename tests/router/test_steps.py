"""The steps of a request on the engines: the bookkeeping each holds (undone once, whatever
path the request takes), the order engines are tried in, and the fallback to the next engine
when the chosen one refuses, in-process in front of engines of our own making."""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from kvstore.router.config import RouterConfig
from kvstore.router.engines import EngineLoad
from kvstore.router.state import RouterState
from kvstore.router.steps import Ticket, fallback_order
from kvstore.routing.policy import RequestShape
from tests.router.fake_engine import FakeEngine, metrics_text, write_model
from tests.router.inproc import health_is, post, router, until


def test_a_ticket_is_undone_once_whatever_path_the_request_takes() -> None:
    state = RouterState(RouterConfig(prefill=("http://p",), decode=("http://d",)))
    prefill, decode = state.by_url["http://p"], state.by_url["http://d"]
    ticket = Ticket.take(prefill, 0.5, [(decode, 1100)])
    assert prefill.prefill_s == 0.5 and decode.reserved_tokens == 1100
    ticket.first_token()
    ticket.first_token()  # a second first token (a fallback's) takes nothing more
    assert prefill.prefill_s == 0.0 and decode.reserved_tokens == 1100
    ticket.done()
    ticket.done()
    assert prefill.prefill_s == 0.0 and decode.reserved_tokens == 0
    # Done before any token (a failed request): both undone at once.
    Ticket.take(prefill, 0.25, [(decode, 10)]).done()
    assert prefill.prefill_s == 0.0 and decode.reserved_tokens == 0


def test_fallbacks_go_to_the_healthy_engines_by_predicted_ttft_then_the_rest() -> None:
    urls = ("http://a", "http://b", "http://c", "http://d")
    state = RouterState(RouterConfig(engines=urls))
    a, b, c, d = (state.by_url[u] for u in urls)
    for engine, waiting in ((a, 0), (b, 5), (c, 1)):
        engine.healthy, engine.load = True, EngineLoad(num_waiting=waiting)
    shape = RequestShape(1000, 0, 16)
    assert fallback_order(state, b, shape, {}) == [b, a, c, d]
    # The engine's own cache makes c the faster fallback.
    assert fallback_order(state, b, shape, {"http://c": 960}) == [b, c, a, d]


class RefusingEngine(FakeEngine):
    """An engine whose generate routes answer 503, as a vLLM server that is overloaded."""

    async def _generate(self, request: web.Request) -> web.Response:
        self.hits[request.path] += 1
        return web.Response(status=503, text="overloaded")


@pytest.fixture
def model(tmp_path: Path) -> Path:
    return write_model(tmp_path / "model")


def test_an_engine_that_refuses_falls_back_to_the_next(model: Path) -> None:
    async def run() -> None:
        refusing, good = RefusingEngine(model), FakeEngine(model)
        await refusing.start()
        await good.start()
        good.metrics = metrics_text(waiting="3")  # the refusing engine is the first choice
        config = RouterConfig(engines=(refusing.url, good.url), poll_s=60)
        try:
            async with router(config) as (url, state), aiohttp.ClientSession() as http:
                for engine in (refusing, good):
                    await until(lambda e=engine: health_is(http, url, e.url, True), "healthy")
                async with http.post(
                    url + "/v1/completions", json={"prompt": "a few words", "max_tokens": 4}
                ) as resp:
                    answer = await resp.json()
                    assert resp.status == 200, answer
                    assert resp.headers["x-kvstore-prefill-engine"] == refusing.url
                    assert resp.headers["x-kvstore-engine"] == good.url
                assert answer["choices"][0]["text"] == "ok"
                assert refusing.hits["/v1/completions"] == 1 and len(good.bodies) == 1
                fallbacks = state.metrics.registry.get_sample_value(
                    "kvstore_router_fallbacks_total", {"step": "answer", "instance": refusing.url}
                )
                assert fallbacks == 1
                # Unhealthy until its next poll (a minute away): the next request skips it.
                assert not state.by_url[refusing.url].healthy
                status, _ = await post(http, url + "/v1/completions", {"prompt": "more words"})
                assert status == 200 and refusing.hits["/v1/completions"] == 1
        finally:
            await refusing.stop()
            await good.stop()

    asyncio.run(run())
