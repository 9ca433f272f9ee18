"""``kvstore proxy``: the smallest working proxy for disaggregated prefill/decode with vLLM.

A request to ``/v1/completions`` or ``/v1/chat/completions`` goes twice: first to the prefill
server with ``max_tokens=1`` and streaming off (it computes the prompt and its connector saves
the KV into the pool), then, unchanged, to the decode server (its connector loads the prompt's KV
from the pool and generates). The decode server's answer comes back as it is: JSON, or its
server-sent events passed through chunk by chunk. ``/v1/models`` is the decode server's;
``/health`` is ours and says whether both servers answer.

The pool is content-addressed (a prompt's blocks are found by their tokens), so nothing has to
travel from the prefill response to the decode request; a ``kv_transfer_params`` field in the
prefill's answer (connectors that hand off by request id use one) is forwarded all the same.
Errors of our own are OpenAI-shaped JSON bodies (``{"error": {"message", "type", "code"}}``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import sys
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import web

from kvstore.processes import ready_line

log = logging.getLogger("kvstore.proxy")

GENERATE_PATHS = ("/v1/completions", "/v1/chat/completions")
# Hop-by-hop and length headers are the proxy's own business, never forwarded.
_SKIP_HEADERS = {"content-length", "transfer-encoding", "connection", "content-encoding", "host"}


@dataclass(frozen=True, slots=True)
class ProxyConfig:
    """Where the two servers are."""

    prefill: str  # base URL, e.g. http://127.0.0.1:8100
    decode: str
    timeout_s: float = 600.0  # one whole request (a long answer streams for a while)


CONFIG = web.AppKey("config", ProxyConfig)
SESSION = web.AppKey("session", aiohttp.ClientSession)


def _error(status: int, message: str, kind: str) -> web.Response:
    return web.json_response(
        {"error": {"message": message, "type": kind, "code": status}}, status=status
    )


def prefill_request(body: dict[str, Any]) -> dict[str, Any]:
    """The prefill half of a request: one token, no streaming, everything else unchanged (but a
    ``min_tokens`` above one, which vLLM would then refuse).

    Args:
        body: the client's request body.

    Returns:
        A new body (``body`` itself is not changed).
    """
    out = {k: v for k, v in body.items() if k not in ("stream", "stream_options", "min_tokens")}
    out["max_tokens"] = 1
    if "max_completion_tokens" in out:  # chat's newer name for the same limit
        out["max_completion_tokens"] = 1
    out["stream"] = False
    return out


def forward_headers(request: web.Request) -> dict[str, str]:
    """The headers an engine gets: JSON, and the caller's ``Authorization`` (vLLM's
    ``--api-key``) if any."""
    headers = {"Content-Type": "application/json"}
    if "Authorization" in request.headers:  # vLLM's --api-key
        headers["Authorization"] = request.headers["Authorization"]
    return headers


async def _generate(request: web.Request) -> web.StreamResponse:
    config = request.app[CONFIG]
    session = request.app[SESSION]
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        return _error(400, "the request body is not JSON", "BadRequestError")
    if not isinstance(body, dict):
        return _error(400, "the request body must be a JSON object", "BadRequestError")
    headers = forward_headers(request)
    path = request.path
    try:
        async with session.post(
            config.prefill + path, json=prefill_request(body), headers=headers
        ) as resp:
            answer = await resp.read()
            if resp.status != 200:  # the client's request is bad, or the server is: say so
                return web.Response(body=answer, status=resp.status, content_type=resp.content_type)
    except (aiohttp.ClientError, TimeoutError) as err:
        return _error(502, f"prefill server {config.prefill}: {err!r}", "BadGatewayError")
    try:
        with_params = json.loads(answer).get("kv_transfer_params")
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError):
        return _error(502, f"prefill server {config.prefill}: not a JSON answer", "BadGatewayError")
    if with_params is not None:
        body = {**body, "kv_transfer_params": with_params}
    out: web.StreamResponse | None = None
    try:
        async with session.post(config.decode + path, json=body, headers=headers) as resp:
            if not body.get("stream"):
                return web.Response(
                    body=await resp.read(), status=resp.status, content_type=resp.content_type
                )
            out = web.StreamResponse(
                status=resp.status,
                headers={k: v for k, v in resp.headers.items() if k.lower() not in _SKIP_HEADERS},
            )
            await out.prepare(request)
            async for chunk in resp.content.iter_any():
                await out.write(chunk)
            await out.write_eof()
            return out
    except (aiohttp.ClientError, TimeoutError) as err:
        if out is not None:  # mid-stream: the status is sent, all we can do is end it
            raise
        return _error(502, f"decode server {config.decode}: {err!r}", "BadGatewayError")


async def _models(request: web.Request) -> web.Response:
    config = request.app[CONFIG]
    try:
        async with request.app[SESSION].get(
            config.decode + "/v1/models", headers=forward_headers(request)
        ) as resp:
            return web.Response(
                body=await resp.read(), status=resp.status, content_type=resp.content_type
            )
    except (aiohttp.ClientError, TimeoutError) as err:
        return _error(502, f"decode server {config.decode}: {err!r}", "BadGatewayError")


async def _health(request: web.Request) -> web.Response:
    config = request.app[CONFIG]
    state = {}
    for name, url in (("prefill", config.prefill), ("decode", config.decode)):
        try:
            async with request.app[SESSION].get(
                url + "/health", timeout=aiohttp.ClientTimeout(total=5)
            ) as resp:
                state[name] = resp.status == 200
        except (aiohttp.ClientError, TimeoutError):
            state[name] = False
    ok = all(state.values())
    return web.json_response(
        {"status": "ok" if ok else "degraded", **state}, status=200 if ok else 503
    )


def init_app(config: ProxyConfig) -> web.Application:
    """The proxy's application (its HTTP client session lives in ``cleanup_ctx``)."""
    app = web.Application(client_max_size=64 * 1024 * 1024)
    app[CONFIG] = config

    async def session_ctx(app: web.Application):  # type: ignore[no-untyped-def]
        timeout = aiohttp.ClientTimeout(total=config.timeout_s, sock_connect=10)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            app[SESSION] = session
            yield

    app.cleanup_ctx.append(session_ctx)
    for path in GENERATE_PATHS:
        app.router.add_post(path, _generate)
    app.router.add_get("/v1/models", _models)
    app.router.add_get("/health", _health)
    return app


async def serve_proxy(config: ProxyConfig, host: str, port: int) -> None:
    """Serve until SIGINT or SIGTERM; print a ``ready`` line with the bound address first."""
    runner = web.AppRunner(init_app(config))
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    bound = runner.addresses[0]
    url = f"http://{bound[0]}:{bound[1]}"
    print(ready_line("proxy", url=url, prefill=config.prefill, decode=config.decode), flush=True)
    await serve_until_signal(runner, "proxy")


async def serve_until_signal(runner: web.AppRunner, name: str) -> None:
    """Wait for SIGINT or SIGTERM, clean ``runner`` up and print ``kvstore <name>: stopped``.

    Args:
        runner: a started runner.
        name: the daemon's name in the stopped line.
    """
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()
    print(f"kvstore {name}: stopped", file=sys.stderr, flush=True)
