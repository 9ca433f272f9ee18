"""The router's routes: the OpenAI generate routes (read the request, choose engines, run the
steps of :mod:`.steps`), ``/v1/models``, ``/health``, ``/metrics``, and the middleware that maps
refusals to OpenAI-style JSON error bodies. Each handler reads the state (:mod:`.state`) and
keeps to the HTTP edge.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kvstore.errors import InvalidRequestError
from kvstore.routing.policy import Choice, RequestShape
from kvstore.routing.slo import SLOClass

from .listen import ROUTER_ID_HEADER
from .poolhits import PoolHit
from .requests import (
    DEFAULT_ANSWER_TOKENS,
    ModelInfo,
    RequestError,
    answer_tokens,
    check_prompt_length,
    parse_body,
    prompt_tokens,
    truncation,
)
from .state import NO_ENGINE_RETRY_S, STATE, RouterState, no_engine
from .steps import CLIENT_GONE, STREAM_BROKEN, Ticket, answer_step, fallback_order, prefill_step

GENERATE_PATHS = ("/v1/completions", "/v1/chat/completions")


@dataclass(slots=True)
class _Outcome:
    """How one generate request ended, for ``kvstore_router_requests_total``.

    Attributes:
        slo_name: its class, once known.
        value: ``error`` until something better is known.
    """

    slo_name: str = "unknown"
    value: str = "error"


@dataclass(frozen=True, slots=True)
class _Prompt:
    """A checked, tokenized generate request.

    Attributes:
        body: its JSON body.
        priority: its class's priority (0 is highest).
        slo: its class.
        model: the served model it names.
        tokens: its prompt's tokens.
        limit: the tokens it may generate, when it says.
    """

    body: dict[str, Any]
    priority: int
    slo: SLOClass
    model: ModelInfo
    tokens: list[int]
    limit: int | None
    #: The prompt's tokens before the truncation it asked for (None: not truncated).
    truncated_from: int | None = None


async def _read_prompt(state: RouterState, request: web.Request, outcome: _Outcome) -> _Prompt:
    """Parse, classify and tokenize a generate request.

    Raises:
        RequestError: a body, class, model or prompt the engines would refuse (4xx), or no
            engine (503).
    """
    body = parse_body(await request.read())
    try:
        priority, slo = state.config.slo.classify(request.headers)
    except InvalidRequestError as err:
        raise RequestError(400, err.message) from None
    outcome.slo_name = slo.name
    model = await state.model(body.get("model"))
    kind = "chat" if request.path.endswith("/chat/completions") else "completions"
    check_prompt_length(kind, body, model.max_model_len, state.config.max_chars_per_token)
    tokenizer = await state.tokenizer(model)
    tokens = await asyncio.to_thread(prompt_tokens, kind, body, tokenizer)
    limit = answer_tokens(body)
    cut = truncation(body, model.max_model_len, getattr(tokenizer, "truncation_side", None))
    truncated_from = None
    if cut is not None and len(tokens[cut]) < len(tokens):
        # The engine truncates the same way (vLLM's renderer) and caps the answer to the
        # context left, so the check below is on what it will compute.
        truncated_from, tokens = len(tokens), tokens[cut]
        if limit is not None and model.max_model_len:
            limit = min(limit, model.max_model_len - len(tokens))
    if model.max_model_len and (
        len(tokens) >= model.max_model_len
        or (limit is not None and len(tokens) + limit > model.max_model_len)
    ):
        raise RequestError(
            400,
            f"This model's maximum context length is {model.max_model_len} tokens. However, "
            f"you requested {len(tokens) + (limit or 0)} tokens ({len(tokens)} in the "
            f"messages, {limit or 0} in the completion).",
        )
    return _Prompt(body, priority, slo, model, tokens, limit, truncated_from)


async def _choose(
    state: RouterState, prompt: _Prompt, outcome: _Outcome
) -> tuple[PoolHit, RequestShape, dict[str, int], Choice]:
    """Look the prompt up in the pool and the engines' caches, and choose its engines.

    Returns:
        The pool's hit, the request's shape, its tokens in each engine's own cache, and the
        accepted choice.

    Raises:
        RequestError: 429 when rejected early (with ``Retry-After``), 503 with no engine.
    """
    tokens, slo = prompt.tokens, prompt.slo
    salt = prompt.body.get("cache_salt")  # vLLM keeps a salted request's blocks apart
    hit = await state.pool.cached_tokens(prompt.model, tokens, state.engines, salt)
    state.metrics.prompt_tokens.inc(len(tokens))
    state.metrics.cached_tokens.inc(hit.cached_tokens)
    shape = RequestShape(len(tokens), hit.loadable_tokens, prompt.limit or DEFAULT_ANSWER_TOKENS)
    local = state.local_cached_tokens(tokens, salt)
    choice = state.choose(shape, slo, local)
    if not choice.accepted:
        if choice.prefill is None and choice.reason == "no engine is healthy":
            raise no_engine()
        state.metrics.rejections.labels(slo.name, (choice.reason or "").split(" ")[0]).inc()
        outcome.value = "rejected"
        raise RequestError(
            429,
            f"request rejected for SLO class {slo.name}: {choice.reason}",
            "RateLimitError",
            headers={"Retry-After": str(choice.retry_after_s)},
        )
    return hit, shape, local, choice


async def _run_steps(
    request: web.Request,
    state: RouterState,
    prompt: _Prompt,
    hit: PoolHit,
    shape: RequestShape,
    local: dict[str, int],
    choice: Choice,
    started_s: float,
    outcome: _Outcome,
) -> web.StreamResponse:
    """Run the chosen steps: P/D, the prefill then the answer on the decode engine (the whole
    request there when the prefill failed); kv_both, the answer on the chosen engine. Either
    falls back to the other engines (:func:`.steps.fallback_order`).

    Raises:
        RequestError: 503 when every engine failed.
    """
    assert choice.prefill is not None
    body, slo, tokens = prompt.body, prompt.slo, prompt.tokens
    if state.config.engine_priority and "priority" not in body:
        body = {**body, "priority": prompt.priority}  # vLLM preempts the lowest class first
    first = state.by_url[choice.prefill.engine]
    decode = state.by_url[choice.decode] if choice.decode is not None else None
    state.metrics.ttft_predicted.labels(first.url).observe(choice.prefill.ttft_s)
    headers = {
        "x-kvstore-cached-tokens": str(hit.cached_tokens),
        "x-kvstore-loadable-tokens": str(hit.loadable_tokens),
        "x-kvstore-pool-view": hit.source,
        "x-kvstore-local-cached-tokens": str(choice.prefill.local_tokens),
        "x-kvstore-prompt-tokens": str(len(tokens)),
        "x-kvstore-slo-class": slo.name,
        "x-kvstore-predicted-ttft-ms": f"{choice.prefill.ttft_s * 1000:.1f}",
        "x-kvstore-prefill-engine": first.url,
        "x-kvstore-policy": state.config.policy,
    }
    if prompt.truncated_from is not None:
        headers["x-kvstore-prompt-truncated-from"] = str(prompt.truncated_from)
    state.metrics.local_cached_tokens.labels(first.url).inc(choice.prefill.local_tokens)
    idle = first.inflight == 0 and first.load.num_running == 0
    uncached = max(shape.prompt_tokens - choice.prefill.cached_tokens, 1)
    sample = uncached if idle else None
    reserved = [(decode or first, shape.prompt_tokens + shape.max_tokens)]
    ticket = Ticket.take(first, choice.prefill.prefill_s, reserved)
    try:
        if decode is not None:
            got = await prefill_step(request, first, body, prompt.priority, slo.ttft_s, sample)
            if isinstance(got, web.Response):
                outcome.value = "engine_refused"
                return got
            if got is None:
                headers["x-kvstore-prefill-engine"] = "none (failed; answered whole)"
            else:
                body = {**body, **got}
            ticket.first_token()
            order = fallback_order(state, decode, shape, local)
            ttft_sample = None
        else:
            order = fallback_order(state, first, shape, local)
            ttft_sample = (first, sample) if sample is not None and body.get("stream") else None
        return await answer_step(
            request,
            order,
            body,
            headers,
            prompt.priority,
            slo.ttft_s,
            ticket,
            started_s,
            ttft_sample,
        )
    finally:
        ticket.done()


async def generate(request: web.Request) -> web.StreamResponse:
    """``POST /v1/completions`` and ``/v1/chat/completions``: read, choose, run the steps."""
    state = request.app[STATE]
    outcome = _Outcome()
    started = state.clock()
    try:
        prompt = await _read_prompt(state, request, outcome)
        hit, shape, local, choice = await _choose(state, prompt, outcome)
        response = await _run_steps(
            request, state, prompt, hit, shape, local, choice, started, outcome
        )
        if outcome.value == "error":  # not refused by the engine: how the answer went
            outcome.value = (
                "client_gone"
                if request.get(CLIENT_GONE)
                else "stream_error"
                if request.get(STREAM_BROKEN)
                else "ok"
            )
        return response
    except RequestError as err:
        if outcome.value == "error":
            outcome.value = "unavailable" if err.status >= 500 else "bad_request"
        raise
    finally:
        state.metrics.requests.labels(request.path, outcome.value, outcome.slo_name).inc()
        promoted = sum(e.slots.queue.num_promoted for e in state.engines)
        state.metrics.promoted.set(promoted)


async def models(request: web.Request) -> web.Response:
    """``GET /v1/models``: what the healthy engines serve."""
    state = request.app[STATE]
    models = state.served_models()
    if not models:
        raise no_engine()
    return web.json_response({"object": "list", "data": models})


async def health(request: web.Request) -> web.Response:
    """``GET /health``: each engine's health, role and source (503 while none is healthy)."""
    state = request.app[STATE]
    engines = {e.url: e.healthy for e in state.engines}
    ok = any(engines.values())
    body: dict[str, Any] = {
        "status": "down" if not ok else "ok" if all(engines.values()) else "degraded",
        "engines": engines,
        "roles": {e.url: e.role for e in state.engines},
        "sources": dict(state.sources),
    }
    if state.discovery is not None:
        body["discovery"] = {
            "etcd": state.config.discover,
            "prefix": state.config.discover_prefix,
            "watching": state.discovery.watching,
            "revision": state.discovery.revision,
        }
    headers = {} if ok else {"Retry-After": str(NO_ENGINE_RETRY_S)}
    return web.json_response(body, status=200 if ok else 503, headers=headers)


async def metrics(request: web.Request) -> web.Response:
    """``GET /metrics``: the router's Prometheus metrics."""
    registry = request.app[STATE].metrics.registry
    return web.Response(
        body=generate_latest(registry), headers={"Content-Type": CONTENT_TYPE_LATEST}
    )


async def tag(request: web.Request, response: web.StreamResponse) -> None:
    """Sign every answer with the router's id: a router that polls itself sees its own."""
    state = request.app.get(STATE)
    if state is not None:
        response.headers[ROUTER_ID_HEADER] = state.router_id


@web.middleware
async def errors(request: web.Request, handler: Any) -> web.StreamResponse:
    """Map refusals to OpenAI-style JSON error bodies."""
    try:
        return await handler(request)
    except RequestError as err:
        return web.json_response(err.body(), status=err.status, headers=err.headers)
    except InvalidRequestError as err:
        return web.json_response(RequestError(400, err.message).body(), status=400)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        kind = "NotFoundError" if exc.status == 404 else "BadRequestError"
        # A 413's text says the cap and what was read; other statuses' texts repeat the reason.
        message = exc.text or exc.reason if exc.status == 413 else exc.reason
        return web.json_response(RequestError(exc.status, message, kind).body(), status=exc.status)


def add_routes(app: web.Application) -> None:
    """Add the router's routes, its error middleware and its id on every answer to ``app``.

    Args:
        app: the application (made with ``middlewares=[errors]``).
    """
    app.on_response_prepare.append(tag)
    for path in GENERATE_PATHS:
        app.router.add_post(path, generate)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
