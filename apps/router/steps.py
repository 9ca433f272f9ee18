"""The steps of one request on the engines: the prefill step (P/D: the prefill engine computes the
prompt and its connector saves the KV), the answer step (the first engine of an order that
answers; a stream under way cannot move), and the bookkeeping each holds on the engines while
it runs (:class:`Ticket`, :class:`Slot`).
"""

from __future__ import annotations

import contextlib
import json
import logging
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import web

from kvstore.demo.vllm_proxy import forward_headers, prefill_request
from kvstore.routing.policy import RequestShape, estimate_ttft

from .engines import Engine
from .requests import RequestError
from .state import STATE, RouterState

log = logging.getLogger("kvstore.router")

#: Set on a request whose stream broke after it started (its outcome in the metrics).
STREAM_BROKEN = web.RequestKey("stream_broken", bool)
#: Set on a request whose client hung up while its answer was being sent.
CLIENT_GONE = web.RequestKey("client_gone", bool)
_SKIP_HEADERS = {"content-length", "transfer-encoding", "connection", "content-encoding", "host"}


def _engine_failed(state: RouterState, engine: Engine, step: str, why: str) -> None:
    log.warning("router: %s step on %s failed (%s); falling back", step, engine.url, why)
    engine.healthy = False  # until its next poll answers
    state.metrics.fallbacks.labels(step, engine.url).inc()


@dataclass(slots=True)
class Ticket:
    """A request's bookkeeping on the engines; :meth:`first_token` and :meth:`done` undo it
    (each once, whatever path the request takes)."""

    prefill: Engine
    prefill_s: float
    reserved: list[tuple[Engine, int]]
    prefilled: bool = False

    @staticmethod
    def take(prefill: Engine, prefill_s: float, reserved: list[tuple[Engine, int]]) -> Ticket:
        prefill.prefill_s += prefill_s
        for engine, tokens in reserved:
            engine.reserved_tokens += tokens
        return Ticket(prefill, prefill_s, reserved)

    def first_token(self) -> None:
        if not self.prefilled:
            self.prefilled = True
            self.prefill.prefill_s = max(0.0, self.prefill.prefill_s - self.prefill_s)

    def done(self) -> None:
        self.first_token()
        for engine, tokens in self.reserved:
            engine.reserved_tokens -= tokens
        self.reserved = []


class Slot:
    """An engine slot held for one step (``async with``): the admission queue and the
    engine's in-flight count, released together."""

    def __init__(self, engine: Engine, priority: int, budget_s: float) -> None:
        self.engine, self.priority, self.budget_s = engine, priority, budget_s

    async def __aenter__(self) -> Engine:
        await self.engine.slots.acquire(self.priority, self.budget_s)
        self.engine.inflight += 1
        return self.engine

    async def __aexit__(self, *exc: object) -> None:
        self.engine.inflight -= 1
        self.engine.slots.release()


async def prefill_step(
    request: web.Request,
    engine: Engine,
    body: dict[str, Any],
    priority: int,
    budget_s: float,
    sample_tokens: int | None,
) -> web.Response | dict[str, Any] | None:
    """Run the prefill half on ``engine``.

    Returns:
        The kv_transfer_params dict (possibly empty) on success; a response to return as it is
        when the engine refused the request itself (4xx); None when the engine failed.
    """
    state = request.app[STATE]
    assert state.session is not None
    async with Slot(engine, priority, budget_s):
        start = state.clock()
        try:
            async with state.session.post(
                engine.url + request.path,
                json=prefill_request(body),
                headers=forward_headers(request),
            ) as resp:
                answer = await resp.read()
                status, content_type = resp.status, resp.content_type
        except (aiohttp.ClientError, TimeoutError) as err:
            _engine_failed(state, engine, "prefill", repr(err))
            return None
        elapsed = state.clock() - start
    if status >= 500 or status == 429:
        _engine_failed(state, engine, "prefill", f"HTTP {status}")
        return None
    if status != 200:
        return web.Response(body=answer, status=status, content_type=content_type)
    state.metrics.chosen.labels("prefill", engine.url).inc()
    state.metrics.prefill_measured.labels(engine.url).observe(elapsed)
    if sample_tokens is not None:
        engine.fit.prefill.add(sample_tokens, elapsed)
    try:
        params = json.loads(answer).get("kv_transfer_params")
    except (ValueError, AttributeError):
        params = None
    return {"kv_transfer_params": params} if params is not None else {}


def _sse_error(message: str) -> bytes:
    body = {"error": {"message": message, "type": "ServiceUnavailableError", "code": 503}}
    return f"data: {json.dumps(body)}\n\ndata: [DONE]\n\n".encode()


class _ClientGone(Exception):
    """The client hung up while its answer was being sent: the engine did nothing wrong."""


async def _to_client(out: web.StreamResponse, request: web.Request, data: bytes | None) -> None:
    """Prepare ``out`` (first call) and send ``data`` to the client (the end, when None).

    Raises:
        _ClientGone: the client's connection is closed (aiohttp's ClientConnectionResetError is
            a ConnectionResetError too, and a ClientError: it must not read as the engine's).
    """
    try:
        if not out.prepared:
            await out.prepare(request)
        if data is None:
            await out.write_eof()
        else:
            await out.write(data)
    except ConnectionResetError as err:
        raise _ClientGone(str(err)) from err


async def answer_step(
    request: web.Request,
    order: list[Engine],
    body: dict[str, Any],
    headers: dict[str, str],
    priority: int,
    budget_s: float,
    ticket: Ticket,
    started_s: float,
    ttft_sample: tuple[Engine, int] | None,
) -> web.StreamResponse:
    """Send the whole request to the first engine of ``order`` that answers; stream or return
    its answer.

    Raises:
        RequestError: 503 when every engine failed.
    """
    state = request.app[STATE]
    assert state.session is not None
    stream = bool(body.get("stream"))
    failures = []
    for engine in order:
        out: web.StreamResponse | None = None
        async with Slot(engine, priority, budget_s):
            try:
                async with state.session.post(
                    engine.url + request.path, json=body, headers=forward_headers(request)
                ) as resp:
                    if resp.status >= 500 or resp.status == 429:
                        failures.append(f"{engine.url}: HTTP {resp.status}")
                        _engine_failed(state, engine, "answer", f"HTTP {resp.status}")
                        continue
                    tagged = {**headers, "x-kvstore-engine": engine.url}
                    if not stream or resp.status != 200:
                        answer = await resp.read()
                        ticket.first_token()
                        state.metrics.chosen.labels("answer", engine.url).inc()
                        return web.Response(
                            body=answer,
                            status=resp.status,
                            content_type=resp.content_type,
                            headers=tagged,
                        )
                    async for chunk in resp.content.iter_any():
                        if out is None:
                            ttft = state.clock() - started_s
                            ticket.first_token()
                            state.metrics.ttft_measured.labels(engine.url).observe(ttft)
                            if ttft_sample is not None and ttft_sample[0] is engine:
                                engine.fit.prefill.add(ttft_sample[1], ttft)
                            out = web.StreamResponse(
                                status=200,
                                headers={
                                    **{
                                        k: v
                                        for k, v in resp.headers.items()
                                        if k.lower() not in _SKIP_HEADERS
                                    },
                                    **tagged,
                                },
                            )
                        await _to_client(out, request, chunk)
                    if out is None:
                        raise aiohttp.ClientPayloadError("the engine sent an empty stream")
                    state.metrics.chosen.labels("answer", engine.url).inc()
                    await _to_client(out, request, None)
                    return out
            except _ClientGone as gone:
                # Leaving the engine's response closes that connection: vLLM aborts the request.
                log.info("client left while %s answered: %s", engine.url, gone)
                request[CLIENT_GONE] = True
                assert out is not None
                return out
            except (aiohttp.ClientError, TimeoutError) as err:
                _engine_failed(state, engine, "answer", repr(err))
                if out is not None:  # mid-stream: the status is sent; end with an error event
                    request[STREAM_BROKEN] = True
                    with contextlib.suppress(_ClientGone):
                        message = _sse_error(f"engine {engine.url} failed mid-answer: {err!r}")
                        await _to_client(out, request, message)
                        await _to_client(out, request, None)
                    return out
                failures.append(f"{engine.url}: {err!r}")
    raise RequestError(
        503, "every engine failed: " + "; ".join(failures), "ServiceUnavailableError"
    )


def fallback_order(
    state: RouterState, first: Engine, shape: RequestShape, local: dict[str, int]
) -> list[Engine]:
    """``first``, then the other engines: healthy ones by predicted TTFT, then the rest."""
    others = [e for e in state.engines if e is not first]
    healthy = sorted(
        (e for e in others if e.healthy),
        key=lambda e: estimate_ttft(e.view(local.get(e.url, 0)), shape, False).ttft_s,
    )
    return [first, *healthy, *(e for e in others if not e.healthy)]
