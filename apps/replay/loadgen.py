"""The load generator: send scaled requests at their arrival times and time every token.

Each request is one streamed ``/v1/completions`` call (``stream: true``, usage included, greedy,
``ignore_eos`` so that exactly ``max_tokens`` come back). The client notes when it sent the
request, when each chunk with tokens arrived, the HTTP status, and what the answer says about
the cache and the engine:

* ``x-kvstore-cached-tokens`` (the router's count of prompt tokens served from a cache) and
  ``x-kvstore-engine`` (which engine ran it) when the endpoint sends them;
* else ``usage.prompt_tokens_details.cached_tokens`` when the engine reports it.

With more than one target URL the generator spreads requests over them in round robin itself
(a baseline with no router), and the engine of a request is its URL.

HTTP 429 and 503 count as rejections, any other failure as an error; neither stops the replay.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from kvstore.errors import InvalidRequestError

from .workload import ReplayRequest, ScaleConfig, synthesize_prompt

if TYPE_CHECKING:  # imported where a replay runs: ``kvstore replay``'s module is loaded by
    # every ``kvstore`` command (each daemon's start-up), and aiohttp is a third of that.
    import aiohttp

REJECTED_STATUSES = frozenset({429, 503})
CACHED_HEADER = "x-kvstore-cached-tokens"
ENGINE_HEADER = "x-kvstore-engine"


@dataclass(slots=True)
class RequestResult:
    """What one request measured. Times are seconds; ``*_s`` stamps are from replay start.

    Attributes:
        request_id: the trace line's index.
        arrival_s: when it was due.
        sent_s: when it was sent (later than due when ``concurrency`` held it back).
        prompt_tokens: prompt length sent.
        max_tokens: tokens asked for.
        outcome: ``ok``, ``rejected`` (HTTP 429/503) or ``error``.
        status: the HTTP status (0 when none came).
        error: what went wrong (empty when ok).
        token_times_s: arrival of each token after the request was sent (first = TTFT).
        output_tokens: tokens generated (usage, else chunks counted).
        cached_tokens: prompt tokens the endpoint says came from a cache (None: not told).
        cached_source: ``router`` (header), ``engine`` (usage) or None.
        ideal_cached_tokens: what the trace's prefix structure allows (one unlimited cache).
        engine: which engine served it (header, or the URL in client round robin; None: unknown).
        finish_s: when the last byte arrived.
    """

    request_id: int
    arrival_s: float
    sent_s: float = 0.0
    prompt_tokens: int = 0
    max_tokens: int = 0
    outcome: str = "error"
    status: int = 0
    error: str = ""
    token_times_s: list[float] = field(default_factory=list)
    output_tokens: int = 0
    cached_tokens: int | None = None
    cached_source: str | None = None
    ideal_cached_tokens: int = 0
    engine: str | None = None
    finish_s: float = 0.0

    @property
    def ttft_s(self) -> float:
        """Time to first token (NaN when no token came)."""
        return self.token_times_s[0] if self.token_times_s else float("nan")

    @property
    def itl_s(self) -> list[float]:
        """Gaps between consecutive tokens."""
        t = self.token_times_s
        return [b - a for a, b in zip(t, t[1:], strict=False)]

    @property
    def tbt_s(self) -> float:
        """Mean time between tokens after the first (0 for one token, NaN for none)."""
        t = self.token_times_s
        if not t:
            return float("nan")
        return (t[-1] - t[0]) / (len(t) - 1) if len(t) > 1 else 0.0

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict, with the derived timings."""
        out = asdict(self)
        out.update(ttft_s=self.ttft_s, tbt_s=self.tbt_s)
        return out


@dataclass(frozen=True, slots=True)
class LoadConfig:
    """Where and how to send.

    Attributes:
        targets: base URLs; one (a router or an engine) or several (client round robin).
        model: the model name to ask for.
        concurrency: most requests in flight (None: no limit, arrival times alone pace).
        timeout_s: most seconds one request may take.

    Raises:
        InvalidRequestError: on creation, for no target, a URL that is not http(s), or a
            concurrency below 1.
    """

    targets: tuple[str, ...]
    model: str
    concurrency: int | None = None
    timeout_s: float = 600.0

    def __post_init__(self) -> None:
        if not self.targets:
            raise InvalidRequestError("no target URL")
        for url in self.targets:
            if not url.startswith(("http://", "https://")):
                raise InvalidRequestError(f"{url!r} is not an http(s):// URL")
        if self.concurrency is not None and self.concurrency < 1:
            raise InvalidRequestError(f"concurrency must be >= 1, got {self.concurrency}")


def request_body(model: str, prompt: list[int], max_tokens: int) -> dict[str, Any]:
    """The ``/v1/completions`` body of one streamed request.

    Args:
        model: the model name.
        prompt: token ids.
        max_tokens: tokens to generate (exactly: ``ignore_eos``).

    Returns:
        The JSON body.
    """
    return {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


async def discover_model(session: aiohttp.ClientSession, url: str) -> str:
    """The first model ``url``'s ``/v1/models`` lists.

    Args:
        session: the HTTP session.
        url: a base URL.

    Returns:
        The model id.

    Raises:
        InvalidRequestError: when the endpoint does not answer or lists no model.
    """
    import aiohttp

    try:
        async with session.get(f"{url}/v1/models") as resp:
            if resp.status != 200:
                raise InvalidRequestError(f"{url}/v1/models answered HTTP {resp.status}")
            body = await resp.json()
    except (aiohttp.ClientError, TimeoutError, json.JSONDecodeError) as exc:
        raise InvalidRequestError(f"cannot list models at {url}: {exc!r:.200}") from None
    models = body.get("data") if isinstance(body, dict) else None
    if not models:
        raise InvalidRequestError(f"{url}/v1/models lists no model")
    return str(models[0]["id"])


def _int_header(value: str | None) -> int | None:
    if value is None:
        return None
    try:
        return max(int(value.strip()), 0)
    except ValueError:
        return None


async def _send(
    session: aiohttp.ClientSession,
    url: str,
    body: dict[str, Any],
    result: RequestResult,
    started: float,
) -> None:
    import aiohttp

    sent = time.perf_counter()
    result.sent_s = sent - started
    usage: dict[str, Any] | None = None
    num_chunks = 0
    try:
        async with session.post(f"{url}/v1/completions", json=body) as resp:
            result.status = resp.status
            result.engine = resp.headers.get(ENGINE_HEADER, result.engine)
            header_cached = _int_header(resp.headers.get(CACHED_HEADER))
            if header_cached is not None:
                result.cached_tokens, result.cached_source = header_cached, "router"
            if resp.status != 200:
                text = (await resp.text())[:200].replace("\n", " ")
                result.outcome = "rejected" if resp.status in REJECTED_STATUSES else "error"
                result.error = f"HTTP {resp.status}: {text}"
                return
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    result.error = str(chunk["error"])[:200]
                    return
                if chunk.get("choices"):
                    num_chunks += 1
                    result.token_times_s.append(time.perf_counter() - sent)
                if chunk.get("usage"):
                    usage = chunk["usage"]
    except (aiohttp.ClientError, TimeoutError, json.JSONDecodeError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"[:200]
        return
    finally:
        result.finish_s = time.perf_counter() - started
    result.output_tokens = num_chunks
    if usage is not None:
        result.output_tokens = int(usage.get("completion_tokens") or num_chunks)
        details = usage.get("prompt_tokens_details") or {}
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
        if result.cached_source is None and isinstance(cached, int):
            result.cached_tokens, result.cached_source = cached, "engine"
    if result.token_times_s:
        result.outcome = "ok"
    else:
        result.error = "the stream ended without a token"


async def replay_async(
    requests: Sequence[ReplayRequest],
    scale: ScaleConfig,
    load: LoadConfig,
    ideal_cached: Sequence[int] | None = None,
) -> list[RequestResult]:
    """Send every request at its arrival time and collect the results.

    Args:
        requests: the scaled requests, in arrival order.
        scale: the scaling (for the prompt contents).
        load: targets, model, concurrency.
        ideal_cached: per request, tokens the trace structure allows to reuse.

    Returns:
        One result per request, in the same order.
    """
    import aiohttp

    semaphore = asyncio.Semaphore(load.concurrency) if load.concurrency else None
    timeout = aiohttp.ClientTimeout(total=load.timeout_s)
    # No connection limit beyond ours: the default (100) would add a queue we do not measure.
    connector = aiohttp.TCPConnector(limit=0)
    results = [
        RequestResult(
            r.request_id,
            r.arrival_s,
            prompt_tokens=r.prompt_tokens,
            max_tokens=r.max_tokens,
            ideal_cached_tokens=ideal_cached[i] if ideal_cached is not None else 0,
            engine=load.targets[i % len(load.targets)] if len(load.targets) > 1 else None,
        )
        for i, r in enumerate(requests)
    ]
    prompts = [
        synthesize_prompt(r.hash_ids, r.prompt_tokens, scale.block_tokens, scale.seed)
        for r in requests
    ]
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        started = time.perf_counter()

        async def one(index: int) -> None:
            request = requests[index]
            url = load.targets[index % len(load.targets)]
            body = request_body(load.model, prompts[index], request.max_tokens)
            delay = started + request.arrival_s - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)  # pacing to the trace's clock
            if semaphore is None:
                await _send(session, url, body, results[index], started)
                return
            async with semaphore:
                await _send(session, url, body, results[index], started)

        await asyncio.gather(*(one(i) for i in range(len(requests))))
    return results


def run_replay(
    requests: Sequence[ReplayRequest],
    scale: ScaleConfig,
    load: LoadConfig,
    ideal_cached: Sequence[int] | None = None,
) -> list[RequestResult]:
    """:func:`replay_async` on a fresh event loop (same arguments, same results)."""
    return asyncio.run(replay_async(requests, scale, load, ideal_cached))


def resolve_model(url: str, timeout_s: float = 30.0) -> str:
    """The first model ``url`` serves (``/v1/models``), on a fresh event loop.

    Args:
        url: a base URL.
        timeout_s: most seconds to wait for the answer.

    Returns:
        The model id.

    Raises:
        InvalidRequestError: when the endpoint does not answer or lists no model.
    """
    import aiohttp

    async def ask() -> str:
        timeout = aiohttp.ClientTimeout(total=timeout_s)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            return await discover_model(session, url)

    return asyncio.run(ask())
