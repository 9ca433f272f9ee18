"""The router daemon: OpenAI-compatible routes in front of vLLM engines.

Per request: check and tokenize it (:mod:`.requests`), count the leading blocks the pool holds
in the namespace the vLLM connector saves in (from the view the KV events keep; the client's
``kv_match`` with ``locate: false`` while that view is not synced) and, for engines that
publish vLLM's KV events, in each engine's own prefix cache (:mod:`.engine_cache`); choose
engines on live load and where the prefix is hottest (:mod:`kvstore.routing.policy`), wait
for a slot (:mod:`.admission`), then run the steps: in P/D mode the prefill engine computes the
prompt (``max_tokens=1``; its connector saves the KV to the pool) and the decode engine answers
(its connector loads the KV); with kv_both engines one engine does both. A failed step falls
back: prefill failed -> the whole request on a decode engine; an engine that refuses or drops
the connection before the answer started -> the next engine. A stream already under way cannot
move: it ends with an OpenAI-style error event.

Response headers say what the router saw: ``x-kvstore-cached-tokens``,
``x-kvstore-loadable-tokens`` (whole blocks an engine loads of them), ``x-kvstore-pool-view``
(where that came from: ``events``, the view the master's KV events keep (:mod:`.poolview`);
``lookup``, one prefix-index call while the view is not synced),
``x-kvstore-local-cached-tokens`` (the chosen engine's own cache hit),
``x-kvstore-prompt-tokens``, ``x-kvstore-slo-class``, ``x-kvstore-predicted-ttft-ms``,
``x-kvstore-prefill-engine``, ``x-kvstore-engine`` (the one that answered) and
``x-kvstore-policy`` (``--policy``).

This module starts the daemon; its parts are apart: :mod:`.config` (what it fronts and how it
decides), :mod:`.state` (engines, polls, models, the choice), :mod:`.poolhits` (what the pool
holds of a prompt), :mod:`.steps` (the prefill and answer steps) and :mod:`.routes` (the HTTP
edge). The choice itself is :mod:`kvstore.routing`, shared with the simulator.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
from aiohttp import web
from transformers import AutoTokenizer

from kvstore.demo.vllm_proxy import serve_until_signal
from kvstore.processes import ready_line

from .config import RouterConfig
from .routes import add_routes, errors
from .state import STATE, RouterState

#: Seconds the ready line waits for the engine registry's first listing (--discover).
DISCOVERY_WAIT_S = 10.0


def init_app(
    config: RouterConfig,
    clock: Callable[[], float] = time.monotonic,
    load_tokenizer: Callable[[str], Any] = AutoTokenizer.from_pretrained,
) -> web.Application:
    """The router's application: its HTTP session and engine poller live in ``cleanup_ctx``.

    Args:
        config: the router's settings.
        clock: monotonic seconds.
        load_tokenizer: loads a model folder's tokenizer.

    Returns:
        The application.
    """
    app = web.Application(client_max_size=config.max_body_bytes, middlewares=[errors])

    async def state_ctx(app: web.Application) -> AsyncIterator[None]:
        state = RouterState(config, clock, load_tokenizer)
        timeout = aiohttp.ClientTimeout(total=config.timeout_s, sock_connect=10)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            state.session = session
            app[STATE] = state
            poller = asyncio.create_task(state.poll_forever())
            if state.pool.view is not None:
                state.pool.view.start()
            for feed in state.engine_events.values():
                feed.start()
            try:
                yield
            finally:
                if state.discovery is not None:
                    await state.discovery.close()
                poller.cancel()
                await asyncio.gather(poller, return_exceptions=True)
                await asyncio.to_thread(state.close)

    app.cleanup_ctx.append(state_ctx)
    add_routes(app)
    return app


async def start_router(
    config: RouterConfig,
    host: str,
    port: int,
    *,
    clock: Callable[[], float] = time.monotonic,
    load_tokenizer: Callable[[str], Any] = AutoTokenizer.from_pretrained,
) -> web.AppRunner:
    """Bind the router and start it (the caller cleans the runner up).

    Args:
        config: the router's settings.
        host: address to bind.
        port: port (0 picks a free one).
        clock: monotonic seconds.
        load_tokenizer: loads a model folder's tokenizer.

    Returns:
        The started runner (``runner.app[STATE]`` is the router's state).
    """
    runner = web.AppRunner(init_app(config, clock, load_tokenizer))
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    await runner.app[STATE].listening(runner.addresses)
    return runner


async def serve_router(config: RouterConfig, host: str, port: int) -> None:
    """Serve until SIGINT or SIGTERM; print a ``ready`` line (after the first poll of the
    engines, bounded) with the bound address first.

    Args:
        config: the router's settings.
        host: address to bind.
        port: port (0 picks a free one).
    """
    runner = await start_router(config, host, port)
    state = runner.app[STATE]
    # Engines slow to answer, etcd slow to list them: serve anyway, /health says so.
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(state.first_poll.wait(), timeout=30 + DISCOVERY_WAIT_S)
    bound = runner.addresses[0]
    healthy = sum(e.healthy for e in state.engines)
    ready = ready_line(
        "router",
        url=f"http://{bound[0]}:{bound[1]}",
        mode="pd" if state.disaggregated else "kv_both",
        engines=len(state.engines),
        healthy=healthy,
        master=config.master,
        discover=config.discover,
    )
    print(ready, flush=True)
    await serve_until_signal(runner, "router")
