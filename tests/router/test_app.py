"""The router daemon in-process (its real application, bound to a real socket) in front of
engines of our own making (:mod:`tests.router.fake_engine`), with a real etcd where engines
register: what one engine's malformed answer, a bad prompt or an oversized one does to it.

Routing to real vLLM servers is tests/router/test_router_engines.py."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from kvstore.etcd import EtcdStore, parse_endpoints
from kvstore.router.config import RouterConfig
from tests.etcd_harness import EtcdProcess, etcd  # noqa: F401 - fixture
from tests.router.fake_engine import FakeEngine, metrics_text, write_model
from tests.router.inproc import SpyTokenizer, health, health_is, post, register, router, until


def _warnings_about(caplog: pytest.LogCaptureFixture, text: str) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.levelno >= logging.WARNING and text in r.getMessage()
    ]


# ---------------------------------------------------------------- one engine's bad answer
@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/metrics", metrics_text(running="NaN")),
        ("/metrics", metrics_text(running="+Inf")),
        ("/metrics", metrics_text(usage="-Inf")),
        ("/v1/models", b'[{"id": "fake-model"}]'),
        ("/v1/models", b'{"data": {"id": "fake-model"}}'),
        ("/v1/models", b"\xff not json"),
    ],
    ids=["running-nan", "running-inf", "usage-minus-inf", "models-list", "data-object", "bytes"],
)
def test_a_malformed_answer_stays_with_its_engine(
    etcd: EtcdProcess,  # noqa: F811
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    path: str,
    body: str | bytes,
) -> None:
    """The poller keeps polling every engine: the good one's changes are seen, a killed one
    goes unhealthy, a newly registered one comes healthy; the bad one is unhealthy, and said
    so once."""
    caplog.set_level(logging.INFO, logger="kvstore.router")

    async def run() -> None:
        root = write_model(tmp_path / "model")
        good, bad, doomed, late = (FakeEngine(root) for _ in range(4))
        for engine in (good, bad, doomed, late):
            await engine.start()
        if path == "/metrics":
            bad.metrics = str(body)
        else:
            bad.models = body if isinstance(body, bytes) else body.encode()
        config = RouterConfig(
            engines=(good.url, bad.url, doomed.url), discover=etcd.url, poll_s=0.05
        )
        store = EtcdStore(parse_endpoints(etcd.endpoint))
        try:
            async with router(config) as (url, state), aiohttp.ClientSession() as http:
                await until(lambda: bad.hits["/metrics"] >= 5, "the bad engine polled again")
                engines = await health(http, url)
                assert engines == {good.url: True, bad.url: False, doomed.url: True}

                good.metrics = metrics_text(running="3")
                await until(
                    lambda: state.by_url[good.url].load.num_running == 3, "the good one's change"
                )
                await doomed.stop()
                await until(
                    lambda: health_is(http, url, doomed.url, False), "the killed one unhealthy"
                )
                await register(store, "late", late.url)
                await until(lambda: health_is(http, url, late.url, True), "the new one healthy")
                assert (await health(http, url))[bad.url] is False
            # Said once, however many polls it answered so.
            assert len(_warnings_about(caplog, bad.url)) == 1
        finally:
            await store.close()
            for engine in (good, bad, doomed, late):
                await engine.stop()

    asyncio.run(run())


# ---------------------------------------------------------------- requests
@pytest.fixture
def model(tmp_path: Path) -> Path:
    return write_model(tmp_path / "model")


def test_a_block_size_of_zero_routes_without_a_pool_lookup(
    model: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """``cache_config_info{block_size="0"}`` must not divide by zero where the prompt's full
    blocks are counted: it reads as unknown, like an engine that exports no block size, and is
    said once."""
    caplog.set_level(logging.INFO, logger="kvstore.router")

    async def run() -> None:
        engine = FakeEngine(model)
        await engine.start()
        engine.metrics = metrics_text(block_size="0")
        # A master is named (nothing answers there): the lookup is what is skipped.
        config = RouterConfig(
            engines=(engine.url,), master="127.0.0.1:9", pool_events=False, poll_s=0.05
        )
        try:
            async with router(config) as (url, _), aiohttp.ClientSession() as http:
                await until(lambda: health_is(http, url, engine.url, True), "the engine healthy")
                for prompt in ([1, 2, 3] * 40, "a few words"):
                    status, answer = await post(
                        http, url + "/v1/completions", {"prompt": prompt, "max_tokens": 4}
                    )
                    assert status == 200, answer
                    assert answer["choices"][0]["text"] == "ok"
                await until(lambda: engine.hits["/metrics"] >= 5, "more polls")
            assert len(_warnings_about(caplog, "block_size='0'")) == 1
        finally:
            await engine.stop()

    asyncio.run(run())


#: A prompt of more than one block (32 tokens): its first block is hashed.
LONG = list(range(1, 41))


@pytest.mark.parametrize(
    "prompt",
    [
        [2**32, *LONG],
        [*LONG[:5], 2**63, *LONG],
        [-1, *LONG],
        [[2**32, *LONG]],
        [LONG, [2**40, *LONG]],
        [LONG, [-5, *LONG]],
        [LONG, []],
        ["some words", [2**32, *LONG]],
    ],
    ids=[
        "2**32",
        "2**63",
        "negative",
        "batch-of-one",
        "second-of-batch",
        "negative-in-batch",
        "empty-in-batch",
        "mixed-batch",
    ],
)
def test_token_ids_out_of_range_are_a_400_openai_error(model: Path, prompt: list[Any]) -> None:
    """A token id the router cannot hash (it packs them as uint32) is the client's error, in
    any prompt of a batch, before any engine: a 400, not a 500 text/plain OverflowError."""

    async def run() -> None:
        engine = FakeEngine(model)
        await engine.start()
        config = RouterConfig(engines=(engine.url,), master="127.0.0.1:9", pool_events=False)
        try:
            async with router(config) as (url, _), aiohttp.ClientSession() as http:
                await until(lambda: health_is(http, url, engine.url, True), "the engine healthy")
                status, answer = await post(
                    http, url + "/v1/completions", {"prompt": prompt, "max_tokens": 4}
                )
                assert status == 400, answer
                error = answer["error"]
                assert error["type"] == "BadRequestError" and error["param"] == "prompt"
                assert error["code"] == 400 and "prompt" in error["message"]
                assert engine.bodies == []  # nothing reached an engine
                # The largest id the router can hash is routed.
                status, answer = await post(
                    http, url + "/v1/completions", {"prompt": [[2**32 - 1, *LONG]], "max_tokens": 4}
                )
                assert status == 200, answer
        finally:
            await engine.stop()

    asyncio.run(run())


@pytest.mark.parametrize(
    ("route", "body"),
    [
        ("/v1/completions", {"prompt": "word " * 2_000_000}),  # 10 MB, as a client sent it
        ("/v1/completions", {"prompt": ["a few words", "word " * 20_000]}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "word " * 20_000}]}),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "w" * 40_000}]}]},
        ),
    ],
    ids=["10MB", "second-of-batch", "chat", "chat-parts"],
)
def test_a_prompt_too_long_for_the_context_is_refused_before_tokenizing(
    model: Path, route: str, body: dict[str, Any]
) -> None:
    """Tokenizing a 10 MB prompt costs the router several times its memory, for a 400 anyway:
    a prompt of more characters than the context holds tokens of (at 16 characters a token at
    most) is refused before the tokenizer is loaded or called."""

    async def run() -> None:
        engine = FakeEngine(model, max_model_len=2048)
        await engine.start()
        spy = SpyTokenizer()
        config = RouterConfig(engines=(engine.url,))
        try:
            async with router(config, spy) as (url, _), aiohttp.ClientSession() as http:
                await until(lambda: health_is(http, url, engine.url, True), "the engine healthy")
                status, answer = await post(http, url + route, {**body, "max_tokens": 4})
                assert status == 400, answer
                error = answer["error"]
                assert error["type"] == "BadRequestError" and error["code"] == 400
                assert "maximum context length is 2048 tokens" in error["message"]
                assert "characters" in error["message"]
                assert spy.loads == [] and spy.calls == 0 and engine.bodies == []
                # Under the cap the tokens decide: tokenized, then refused by their count.
                status, answer = await post(
                    http, url + "/v1/completions", {"prompt": "word " * 4000, "max_tokens": 4}
                )
                assert status == 400 and "maximum context length" in answer["error"]["message"]
                assert spy.calls == 1 and engine.bodies == []
        finally:
            await engine.stop()

    asyncio.run(run())


def test_a_body_over_the_cap_is_a_413_openai_error(model: Path) -> None:
    async def run() -> None:
        engine = FakeEngine(model)
        await engine.start()
        spy = SpyTokenizer()
        config = RouterConfig(engines=(engine.url,), max_body_bytes=64 * 1024)
        try:
            async with router(config, spy) as (url, _), aiohttp.ClientSession() as http:
                await until(lambda: health_is(http, url, engine.url, True), "the engine healthy")
                status, answer = await post(
                    http, url + "/v1/completions", {"prompt": [1] * 40_000, "max_tokens": 4}
                )
                assert status == 413, answer
                assert answer["error"]["code"] == 413
                assert str(64 * 1024) in answer["error"]["message"]
                assert spy.loads == [] and engine.bodies == []
                status, answer = await post(
                    http, url + "/v1/completions", {"prompt": [1] * 1000, "max_tokens": 4}
                )
                assert status == 200, answer
        finally:
            await engine.stop()

    asyncio.run(run())
