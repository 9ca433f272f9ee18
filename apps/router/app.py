"""The router daemon: OpenAI-compatible routes in front of vLLM engines.

Per request: check and tokenize it (:mod:`.requests`), count the leading blocks the pool holds
in the namespace the vLLM connector saves in (from the view the KV events keep; the client's
``kv_match`` with ``locate: false`` while that view is not synced) and, for engines that
publish vLLM's KV events, in each engine's own prefix cache (:mod:`.engine_cache`); choose
engines on live load and where the prefix is hottest (:mod:`.policy`), wait for a slot
(:mod:`.admission`), then run the steps: in P/D mode the prefill engine computes the prompt
(``max_tokens=1``; its connector saves the KV to the pool) and the decode engine answers (its
connector loads the KV); with kv_both engines one engine does both. A failed step falls
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
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import numpy as np
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from transformers import AutoTokenizer

from kvstore.client import Client
from kvstore.client.engine_registry import (
    DEFAULT_ENGINES_PREFIX,
    RegisteredEngine,
    check_engine_url,
    check_prefix,
)
from kvstore.client.events import EventStream
from kvstore.client.kvcache import KVCache
from kvstore.demo.vllm_proxy import (
    forward_headers,
    prefill_request,
    serve_until_signal,
)
from kvstore.errors import InvalidRequestError, KVStoreError
from kvstore.etcd import parse_endpoints
from kvstore.keys import Namespace, block_keys
from kvstore.processes import ready_line
from kvstore.routing.cost import CostModel
from kvstore.routing.policy import (
    DEFAULT_HIGH_WATERMARK,
    DEFAULT_LOW_WATERMARK,
    DEFAULT_POLICY,
    POLICIES,
    Choice,
    EngineView,
    RequestShape,
    choose,
    estimate_ttft,
)
from kvstore.routing.slo import SLOClass

from .admission import EngineSlots
from .discovery import EngineDiscovery
from .engine_cache import EngineEvents, chain_keys
from .engines import ROLES, Engine, EngineAnswerError, EngineLoad, make_engines
from .fit import EngineFit
from .listen import ROUTER_ID_HEADER, ListenAddresses
from .metrics import RouterMetrics
from .poolview import PoolView
from .requests import (
    DEFAULT_ANSWER_TOKENS,
    DEFAULT_MAX_CHARS_PER_TOKEN,
    ModelInfo,
    RequestError,
    answer_tokens,
    check_prompt_length,
    parse_body,
    prompt_tokens,
)
from .slo import SLOPolicy

log = logging.getLogger("kvstore.router")

GENERATE_PATHS = ("/v1/completions", "/v1/chat/completions")
_SKIP_HEADERS = {"content-length", "transfer-encoding", "connection", "content-encoding", "host"}
#: The cost-model terms exported per engine (``kvstore_router_cost_term``).
_COST_TERMS = (
    "prefill_base_s",
    "prefill_s_per_token",
    "decode_base_s",
    "decode_s_per_seq",
    "transfer_bytes_per_s",
)
#: Seconds between two connection attempts to a master that did not answer.
POOL_RETRY_S = 5.0
#: ``Retry-After`` of a 503 while no engine is available (one may register or recover soon).
NO_ENGINE_RETRY_S = 1
#: Seconds the ready line waits for the engine registry's first listing (--discover).
DISCOVERY_WAIT_S = 10.0
#: Largest request body read: room for a million-token context as JSON token ids (or as
#: ASCII-escaped text), and a bound on what one request makes the router hold.
DEFAULT_MAX_BODY_BYTES = 16 * 1024 * 1024
#: Prior cost model for a small model on a CPU engine: measurements replace its prefill and
#: decode terms (:mod:`.fit`), and its transfer bandwidth once the engine's connector reports
#: loads; ``kv_bytes_per_token`` is SmolLM2-135M's in bf16 (30 layers x 3 KV heads x 64 x 2 x 2).
CPU_PRIOR = CostModel(
    block_size_tokens=32,
    prefill_base_s=0.05,
    prefill_s_per_token=1e-3,
    prefill_s_per_token_pair=0.0,
    decode_base_s=0.04,
    decode_s_per_seq=0.005,
    decode_s_per_kv_token=0.0,
    kv_bytes_per_token=23_040,
    transfer_bytes_per_s=1e9,
    transfer_latency_s=0.002,
)


@dataclass(frozen=True, slots=True)
class PoolHit:
    """What the pool holds of one prompt.

    Attributes:
        cached_tokens: leading prompt tokens held (token-granular from the index; whole
            blocks from the event view).
        loadable_tokens: of them, the whole blocks an engine loads (never the last prompt
            token, as the connector offers them): what the TTFT prediction uses.
        source: ``events`` (the view), ``lookup`` (the prefix index), ``none`` (no master, or
            no full block).
    """

    cached_tokens: int
    loadable_tokens: int
    source: str

    @staticmethod
    def of(cached: int, num_tokens: int, block_size: int, source: str) -> PoolHit:
        """A hit of ``cached`` tokens on a prompt of ``num_tokens``."""
        loadable = min(cached // block_size, (num_tokens - 1) // block_size) * block_size
        return PoolHit(cached, loadable, source)


@dataclass(frozen=True, slots=True)
class RouterConfig:
    """What the router fronts and how it decides.

    Attributes:
        prefill: prefill engine URLs (P/D mode).
        decode: decode engine URLs (P/D mode).
        engines: kv_both engine URLs (no P/D split).
        master: the pool's master (``HOST:PORT`` / ``etcd://``), or None: nothing is cached.
        slo: SLO classes and their mapping.
        prior: the cost model before measurements.
        model_dir: the model folder (tokenizer, config) when the engines' ``root`` is not
            readable here.
        dtype: the engines' ``--dtype`` when it differs from the model config's.
        salt: the connector's namespace salt.
        max_inflight: concurrent requests per engine.
        poll_s: seconds between polls of each engine's ``/metrics``.
        timeout_s: one whole request.
        high_watermark: decode KV use over which an engine takes nothing new.
        low_watermark: KV use under which it takes requests again.
        early_rejection: reject requests whose SLO the prediction says cannot be met.
        pool_events: follow the master's KV events for the pool's view (else: one prefix-index
            lookup per request).
        engine_events: (engine URL, ZMQ endpoint) of engines that publish vLLM's own KV events
            (``--kv-events-config``): the router tracks their local prefix caches.
        discover: etcd endpoints (``etcd://HOST:PORT[,HOST:PORT]``) whose engine registry adds
            and removes engines live (:mod:`.discovery`), or None: the static engines only.
        discover_prefix: the registry's prefix in etcd.
        max_body_bytes: the largest request body read (beyond it: 413, unread).
        max_chars_per_token: a prompt with more characters than the model's context length
            times this is refused (400) before it is tokenized.
    """

    prefill: tuple[str, ...] = ()
    decode: tuple[str, ...] = ()
    engines: tuple[str, ...] = ()
    master: str | None = None
    slo: SLOPolicy = field(default_factory=SLOPolicy)
    prior: CostModel = CPU_PRIOR
    model_dir: str | None = None
    dtype: str | None = None
    salt: str | None = None
    max_inflight: int = 4
    poll_s: float = 0.5
    timeout_s: float = 600.0
    high_watermark: float = DEFAULT_HIGH_WATERMARK
    low_watermark: float = DEFAULT_LOW_WATERMARK
    early_rejection: bool = True
    pool_events: bool = True
    engine_events: tuple[tuple[str, str], ...] = ()
    policy: str = DEFAULT_POLICY
    discover: str | None = None
    discover_prefix: str = DEFAULT_ENGINES_PREFIX
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_chars_per_token: int = DEFAULT_MAX_CHARS_PER_TOKEN

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise InvalidRequestError(
                f"unknown policy {self.policy!r}: one of {', '.join(sorted(POLICIES))}"
            )
        if self.engines and (self.prefill or self.decode):
            raise InvalidRequestError("give --engine, or --prefill and --decode, not both")
        if self.discover is not None:
            parse_endpoints(self.discover)  # raises on a malformed list
            check_prefix(self.discover_prefix)
        elif not self.engines and not (self.prefill and self.decode):
            raise InvalidRequestError(
                "give --engine URL, or --prefill URL and --decode URL, or --discover etcd://..."
            )
        for url in (*self.prefill, *self.decode, *self.engines):
            check_engine_url(url)
        if not 0 < self.low_watermark <= self.high_watermark <= 1:
            raise InvalidRequestError("watermarks must satisfy 0 < low <= high <= 1")
        if self.max_inflight < 1 or self.poll_s <= 0 or self.timeout_s <= 0:
            raise InvalidRequestError("max_inflight, poll_s and timeout_s must be positive")
        if self.max_body_bytes < 1 or self.max_chars_per_token < 1:
            raise InvalidRequestError("max_body_bytes and max_chars_per_token must be positive")
        urls = {*self.prefill, *self.engines}
        seen = set()
        for url, endpoint in self.engine_events:
            if url not in urls:
                raise InvalidRequestError(
                    f"--engine-events {url}: not a --prefill or --engine URL of this router"
                )
            if url in seen:
                raise InvalidRequestError(f"--engine-events {url} given twice")
            seen.add(url)
            if not endpoint.startswith(("tcp://", "ipc://")):
                raise InvalidRequestError(
                    f"--engine-events {url}={endpoint}: the endpoint must be tcp://HOST:PORT"
                )

    @property
    def disaggregated(self) -> bool:
        """P/D mode (two steps) rather than kv_both engines, for the static engines (with
        ``discover`` the engine set decides: :attr:`RouterState.disaggregated`)."""
        return not self.engines


class RouterState:
    """Everything a request handler reads and updates.

    NOTE: all of it is touched only from the event loop's thread (blocking work runs in
    ``asyncio.to_thread`` and hands results back), so no lock guards the engine counters.

    Args:
        config: the router's settings.
        clock: monotonic seconds (injectable for tests).
        load_tokenizer: loads a model folder's tokenizer (injectable for tests).
    """

    def __init__(
        self,
        config: RouterConfig,
        clock: Callable[[], float] = time.monotonic,
        load_tokenizer: Callable[[str], Any] = AutoTokenizer.from_pretrained,
    ) -> None:
        self.config = config
        self.clock = clock
        self.load_tokenizer = load_tokenizer
        fraction = config.slo.promote_fraction
        roles = [("prefill", u) for u in config.prefill] + [("decode", u) for u in config.decode]
        roles += [("both", u) for u in config.engines]
        self._new_fit = lambda: EngineFit(config.prior)
        self._new_slots = lambda: EngineSlots(config.max_inflight, fraction, clock)
        self.engines = make_engines(roles, self._new_fit, self._new_slots)
        self.by_url = {e.url: e for e in self.engines}
        self.metrics = RouterMetrics.create()
        #: Where each engine came from: ``static`` (flags) or ``etcd`` (the registry).
        self.sources = {e.url: "static" for e in self.engines}
        #: Registry keys naming each discovered engine (an engine leaves with its last key).
        self._discovered_keys: dict[str, set[str]] = {}
        for e in self.engines:
            self.metrics.engine_info.labels(e.url, e.role, "static").set(1)
        self.policy = POLICIES[config.policy]()
        self.metrics.policy.info({"policy": config.policy})
        self.session: aiohttp.ClientSession | None = None
        self.first_poll = asyncio.Event()
        self._models: dict[str, ModelInfo] = {}
        self._tokenizers: dict[str, Any] = {}
        self._tokenizer_lock = asyncio.Lock()
        self._pool: Client | None = None
        self._pool_failed_s: float | None = None
        self._pool_lock = asyncio.Lock()
        self._kvcaches: dict[bytes, KVCache] = {}
        self._namespaces: dict[tuple[str, int, str], Namespace] = {}
        #: Engines' own prefix caches from vLLM's KV events, by URL; started by the app.
        self.engine_events = {
            url: EngineEvents(url, endpoint, self.metrics) for url, endpoint in config.engine_events
        }
        #: The pool from the KV events (None: per-request lookups only); started by the app.
        self.pool_view: PoolView | None = None
        if config.master is not None and config.pool_events:
            master = config.master
            self.pool_view = PoolView(
                lambda: EventStream(master, wait_s=2.0, retry_s=5.0), self.metrics
            )
        #: This process's id, in every answer (:data:`.listen.ROUTER_ID_HEADER`).
        self.router_id = secrets.token_hex(8)
        #: Where the router listens; set by :meth:`listening`.
        self.listen: ListenAddresses | None = None
        #: The etcd engine registry (None without --discover); started by :meth:`listening`.
        self.discovery: EngineDiscovery | None = None
        if config.discover is not None:
            self.discovery = EngineDiscovery(
                parse_endpoints(config.discover),
                self.add_discovered,
                self.remove_discovered,
                prefix=config.discover_prefix,
                metrics=self.metrics,
                refuse=self._refuse_registration,
            )

    async def listening(self, bound: Sequence[Any]) -> None:
        """The router is bound: follow the engine registry now, knowing the router's own
        address to refuse it.

        Args:
            bound: aiohttp's ``runner.addresses``.
        """
        self.listen = await asyncio.to_thread(ListenAddresses.of, bound)
        if self.discovery is not None:
            self.discovery.start()

    def _refuse_registration(self, reg: RegisteredEngine) -> str | None:
        if self.listen is not None and self.listen.names_router(reg.record.url):
            return "it is the router's own address (it would send requests to itself)"
        return None

    # ------------------------------------------------------------------ engines
    def role_engines(self, role: str) -> list[Engine]:
        """The engines of one role (``prefill``, ``decode``, ``both``)."""
        return [e for e in self.engines if e.role == role]

    @property
    def disaggregated(self) -> bool:
        """P/D mode (two steps). Static engines: as configured. With ``--discover``: while the
        set holds a prefill or decode engine (kv_both engines then serve either step, since
        their connector both saves and loads); kv_both mode otherwise."""
        if self.config.discover is None:
            return self.config.disaggregated
        if self.config.engines:
            return False
        return any(e.role in ("prefill", "decode") for e in self.engines)

    def add_discovered(self, reg: RegisteredEngine) -> None:
        """An engine registered in etcd: route to it once its first poll answers.

        A URL already given on the command line, or already registered under another key,
        stays one engine (its first role wins; a contradicting role is logged).
        """
        rec = reg.record
        url = rec.url.rstrip("/")
        engine = self.by_url.get(url)
        if engine is not None:
            if engine.role != rec.role:
                log.warning(
                    "router: %s registers %s as %s, but the router has it as %s: kept as %s",
                    reg.key,
                    url,
                    rec.role,
                    engine.role,
                    engine.role,
                )
            if self.sources[url] == "etcd":
                self._discovered_keys[url].add(reg.key)
            return
        assert rec.role in ROLES
        engine = Engine(url, rec.role, self._new_slots(), self._new_fit())
        self.engines.append(engine)
        self.by_url[url] = engine
        self.sources[url] = "etcd"
        self._discovered_keys[url] = {reg.key}
        self.metrics.engine_info.labels(url, rec.role, "etcd").set(1)
        self.metrics.engine_healthy.labels(url).set(0)
        if rec.kv_events is not None and rec.role != "decode" and url not in self.engine_events:
            feed = EngineEvents(url, rec.kv_events, self.metrics)
            self.engine_events[url] = feed
            feed.start()
        log.info("router: engine %s (%s) discovered via %s", url, rec.role, reg.key)

    def remove_discovered(self, reg: RegisteredEngine) -> None:
        """An engine's registration went (lease expired or revoked): route nothing new to it.

        Requests already on it finish, or fail over as on any engine that fails: they hold
        the engine itself, not its place in the set.
        """
        url = reg.record.url.rstrip("/")
        keys = self._discovered_keys.get(url)
        if keys is None:  # a static engine, or one never added: the flags keep it
            return
        keys.discard(reg.key)
        if keys:
            return
        del self._discovered_keys[url]
        engine = self.by_url.pop(url)
        self.engines.remove(engine)
        del self.sources[url]
        feed = self.engine_events.pop(url, None)
        if feed is not None:
            asyncio.get_running_loop().run_in_executor(None, feed.close)
        m = self.metrics
        for gauge in (m.engine_healthy, m.engine_running, m.engine_waiting, m.engine_kv_usage):
            with contextlib.suppress(KeyError):
                gauge.remove(url)
        for term in _COST_TERMS:
            with contextlib.suppress(KeyError):
                m.cost_term.remove(url, term)
        with contextlib.suppress(KeyError):
            m.engine_info.remove(url, engine.role, "etcd")
        log.info("router: engine %s left the registry (%s)", url, reg.key)

    async def _ask(self, engine: Engine) -> tuple[EngineLoad, list[Any]]:
        """Ask an engine for its ``/metrics`` and ``/v1/models``.

        Raises:
            aiohttp.ClientError: it did not answer.
            TimeoutError: not in time.
            EngineAnswerError: it answered something the router cannot use.
        """
        assert self.session is not None
        timeout = aiohttp.ClientTimeout(total=max(2.0, 4 * self.config.poll_s))
        async with self.session.get(engine.url + "/metrics", timeout=timeout) as resp:
            if resp.headers.get(ROUTER_ID_HEADER) == self.router_id:
                raise EngineAnswerError("it is this router itself (it answers with its id)")
            if resp.status != 200:
                raise EngineAnswerError(f"/metrics answered HTTP {resp.status}")
            try:
                load = EngineLoad.from_metrics(await resp.text())
            except UnicodeDecodeError:
                raise EngineAnswerError("/metrics is not text") from None
        async with self.session.get(engine.url + "/v1/models", timeout=timeout) as resp:
            if resp.status != 200:
                raise EngineAnswerError(f"/v1/models answered HTTP {resp.status}")
            try:
                body = await resp.json()
            except ValueError:  # JSONDecodeError and UnicodeDecodeError both are
                raise EngineAnswerError("/v1/models is not JSON") from None
        models = body.get("data") if isinstance(body, dict) else None
        if not isinstance(models, list):
            raise EngineAnswerError("/v1/models is not an object with a data list")
        return load, models

    def _report(
        self, engine: Engine, problems: frozenset[str], unexpected: BaseException | None = None
    ) -> None:
        """Log each of an engine's poll problems once, when it appears (with the traceback of
        an ``unexpected`` exception), and its recovery."""
        for problem in sorted(problems - engine.poll_problems):
            if unexpected is None:
                log.warning("router: engine %s: %s", engine.url, problem)
            else:
                log.error("router: engine %s: %s", engine.url, problem, exc_info=unexpected)
        if engine.poll_problems and not problems:
            log.info("router: engine %s answers its polls well again", engine.url)
        engine.poll_problems = problems

    async def poll(self, engine: Engine) -> None:
        """One poll of an engine's ``/metrics`` and ``/v1/models`` (failure: unhealthy)."""
        try:
            load, models = await self._ask(engine)
        except (aiohttp.ClientError, TimeoutError, EngineAnswerError) as err:
            self._failed(engine, err)
            return
        if self.by_url.get(engine.url) is not engine:
            return  # it left the set while we asked: export nothing more about it
        engine.observe(load, models, self.config.high_watermark, self.config.low_watermark)
        self._report(engine, frozenset(f"{why}: read as unknown" for why in load.ignored))
        self._export(engine)

    def _failed(self, engine: Engine, err: BaseException, unexpected: bool = False) -> None:
        """A poll of ``engine`` failed: it is unhealthy until one answers well."""
        if self.by_url.get(engine.url) is not engine:
            return
        engine.healthy = False
        cause = f"{type(err).__name__}: {err}" if str(err) else type(err).__name__
        problem = f"poll failed ({cause}); unhealthy until it answers"
        self._report(engine, frozenset([problem]), err if unexpected else None)
        self._export(engine)

    def _export(self, engine: Engine) -> None:
        m = self.metrics
        m.engine_healthy.labels(engine.url).set(1 if engine.healthy else 0)
        m.engine_running.labels(engine.url).set(engine.load.num_running)
        m.engine_waiting.labels(engine.url).set(engine.load.num_waiting)
        m.engine_kv_usage.labels(engine.url).set(engine.load.kv_usage)
        cost = engine.fit.cost()
        for term in _COST_TERMS:
            m.cost_term.labels(engine.url, term).set(getattr(cost, term))

    async def poll_forever(self) -> None:
        """Poll every engine every ``poll_s`` seconds until cancelled; whatever one engine's
        poll raises stays with that engine."""
        while True:
            engines = list(self.engines)
            results = await asyncio.gather(*(self.poll(e) for e in engines), return_exceptions=True)
            for engine, result in zip(engines, results, strict=True):
                if isinstance(result, BaseException):
                    self._failed(engine, result, unexpected=True)
            if self.discovery is None or self.discovery.listed.is_set():
                self.first_poll.set()
            await asyncio.sleep(self.config.poll_s)  # the poll period, not a synchronisation

    # ------------------------------------------------------------------ models
    def served_models(self) -> list[dict[str, Any]]:
        """The models the healthy engines serve (first seen wins, by id)."""
        seen: dict[str, dict[str, Any]] = {}
        for engine in self.engines:
            if engine.healthy:
                for entry in engine.models:
                    if isinstance(entry, dict) and "id" in entry:
                        seen.setdefault(str(entry["id"]), entry)
        return list(seen.values())

    async def model(self, name: Any) -> ModelInfo:
        """The served model a request names (the first one when it names none).

        Raises:
            RequestError: 404 for a model no engine serves; 503 when no engine answers.
        """
        models = self.served_models()
        if not models:
            raise _no_engine()
        if name is None:
            entry = models[0]
        else:
            found = [m for m in models if m["id"] == name]
            if not found:
                raise RequestError(
                    404, f"The model `{name}` does not exist.", "NotFoundError", param="model"
                )
            entry = found[0]
        key = str(entry["id"])
        if key not in self._models:
            try:
                self._models[key] = await asyncio.to_thread(
                    ModelInfo.load, entry, self.config.model_dir
                )
            except (OSError, ValueError, KeyError) as err:
                raise RequestError(
                    503,
                    f"model {key}: its folder is not readable here ({err}); give --model-dir",
                    "ServiceUnavailableError",
                ) from None
        return self._models[key]

    async def tokenizer(self, model: ModelInfo) -> Any:
        """The model's tokenizer (loaded once, in a thread).

        Raises:
            RequestError: 503 when the folder holds no tokenizer transformers can load.
        """
        key = str(model.root)
        async with self._tokenizer_lock:
            if key not in self._tokenizers:
                try:
                    self._tokenizers[key] = await asyncio.to_thread(self.load_tokenizer, key)
                except (OSError, ValueError) as err:
                    log.warning("router: no tokenizer in %s (%s)", key, err)
                    raise RequestError(
                        503,
                        f"model {model.model_id}: no tokenizer could be loaded; give --model-dir",
                        "ServiceUnavailableError",
                    ) from None
        return self._tokenizers[key]

    # ------------------------------------------------------------------ the pool
    async def _kvcache(self, ns: Namespace) -> KVCache | None:
        if self.config.master is None:
            return None
        now = self.clock()
        if self._pool is None:
            if self._pool_failed_s is not None and now - self._pool_failed_s < POOL_RETRY_S:
                return None
            try:
                self._pool = await asyncio.to_thread(Client.connect, self.config.master)
            except (KVStoreError, OSError) as err:
                log.warning("router: master %s unavailable (%s)", self.config.master, err)
                self._pool_failed_s = now
                self.metrics.lookup_errors.inc()
                return None
        if ns.digest not in self._kvcaches:
            self._kvcaches[ns.digest] = KVCache(self._pool, ns)
        return self._kvcaches[ns.digest]

    def _namespace(self, model: ModelInfo, load: EngineLoad) -> Namespace | None:
        """The namespace the engines' connector saves ``model`` in (None: block size unknown).

        Raises:
            InvalidRequestError: a config the namespace cannot describe.
        """
        if load.block_size is None:
            return None
        key = (model.model_id, load.block_size, load.cache_dtype or "auto")
        if key not in self._namespaces:
            self._namespaces[key] = model.namespace(
                load.block_size, key[2], dtype=self.config.dtype, salt=self.config.salt
            )
        return self._namespaces[key]

    async def cached_tokens(self, model: ModelInfo, tokens: list[int]) -> PoolHit:
        """Leading tokens of ``tokens`` the pool holds, in the namespace the connector saves in
        (the prompt's full blocks, as the connector looks them up). Any failure is a miss.

        From the KV-event view when it is synced (no master call: whole blocks); else from
        the master's prefix index (one ``kv_match``, no leases; token-granular).

        Args:
            model: the served model.
            tokens: the prompt.

        Returns:
            The hit; nothing cached without a master.
        """
        engines = [e for e in self.engines if e.healthy and e.load.block_size] or self.engines
        if self.config.master is None or not engines:  # the set may empty while we tokenize
            return PoolHit(0, 0, "none")
        load = engines[0].load
        if load.block_size is None:
            return PoolHit(0, 0, "none")
        bs = load.block_size
        assert bs > 0, f"block size {bs}: EngineLoad keeps only positive ones"
        full = np.asarray(tokens[: len(tokens) // bs * bs], dtype=np.uint32)
        if not len(full):
            return PoolHit(0, 0, "none")
        try:
            ns = self._namespace(model, load)
        except InvalidRequestError as err:
            log.warning("router: no pool namespace for %s (%s)", model.model_id, err)
            self.metrics.lookup_errors.inc()
            return PoolHit(0, 0, "none")
        assert ns is not None
        if self.pool_view is not None:
            num_blocks = self.pool_view.count_blocks(ns.digest, block_keys(ns, full))
            if num_blocks is not None:
                self.metrics.pool_answers.labels("events").inc()
                return PoolHit.of(num_blocks * bs, len(tokens), bs, "events")
            self.metrics.pool_view_fallbacks.inc()
        self.metrics.pool_answers.labels("lookup").inc()
        async with self._pool_lock:  # one master call at a time through the one client
            kv = await self._kvcache(ns)
            if kv is None:
                return PoolHit(0, 0, "lookup")
            try:
                hit = int(await asyncio.to_thread(kv.lookup, full))
            except (KVStoreError, OSError) as err:
                log.warning("router: prefix lookup failed (%s); counting a miss", err)
                self.metrics.lookup_errors.inc()
                if not isinstance(err, InvalidRequestError):
                    self._drop_pool()
                return PoolHit(0, 0, "lookup")
        return PoolHit.of(hit, len(tokens), bs, "lookup")

    def _drop_pool(self) -> None:
        if self._pool is not None:
            self._pool.close()
        self._pool, self._kvcaches = None, {}
        self._pool_failed_s = self.clock()

    def close(self) -> None:
        """Stop following the KV events; close the pool client."""
        if self.pool_view is not None:
            self.pool_view.close()
        for feed in self.engine_events.values():
            feed.close()
        if self._pool is not None:
            self._pool.close()
        self._pool = None

    # ------------------------------------------------------------------ choice
    def local_cached_tokens(self, tokens: list[int]) -> dict[str, int]:
        """Leading tokens of ``tokens`` in each engine's own prefix cache, for the engines
        whose vLLM KV events the router follows (whole blocks, never the last prompt token:
        vLLM always computes it).

        Args:
            tokens: the prompt.

        Returns:
            Engine URL -> tokens (engines without events are left out).
        """
        out: dict[str, int] = {}
        keys_by_size: dict[int, list[bytes]] = {}
        for url, feed in self.engine_events.items():
            bs = self.by_url[url].load.block_size or feed.cache.block_size
            if not bs or len(tokens) <= bs:
                out[url] = 0
                continue
            if bs not in keys_by_size:
                keys_by_size[bs] = chain_keys(tokens[: (len(tokens) - 1) // bs * bs], bs)
            out[url] = feed.cache.count_keys(keys_by_size[bs], bs) * bs
        return out

    def choose(
        self, shape: RequestShape, slo: SLOClass, local: dict[str, int] | None = None
    ) -> Choice:
        """Choose engines for a request from the engines' live views (see :mod:`.policy`).

        Args:
            shape: the request.
            slo: its class.
            local: the request's tokens in each engine's own prefix cache (by URL).

        Returns:
            The choice.
        """
        local = local or {}
        decode: list[EngineView] | None = None
        if self.disaggregated:
            both = self.role_engines("both")  # none unless discovered next to P/D engines
            prefill = [e.view(local.get(e.url, 0)) for e in self.role_engines("prefill") + both]
            decode = [e.view() for e in self.role_engines("decode") + both]
        else:
            prefill = [e.view(local.get(e.url, 0)) for e in self.role_engines("both")]
        return choose(
            shape,
            slo,
            prefill,
            decode,
            high=self.config.high_watermark,
            early_rejection=self.config.early_rejection,
            policy=self.policy,
        )


STATE = web.AppKey("state", RouterState)


def _no_engine() -> RequestError:
    """503 with ``Retry-After``: no engine is up yet (a registry may add one any moment)."""
    return RequestError(
        503,
        "no engine is available",
        "ServiceUnavailableError",
        headers={"Retry-After": str(NO_ENGINE_RETRY_S)},
    )


# ====================================================================== steps
def _engine_failed(state: RouterState, engine: Engine, step: str, why: str) -> None:
    log.warning("router: %s step on %s failed (%s); falling back", step, engine.url, why)
    engine.healthy = False  # until its next poll answers
    state.metrics.fallbacks.labels(step, engine.url).inc()


@dataclass(slots=True)
class _Ticket:
    """A request's bookkeeping on the engines; :meth:`first_token` and :meth:`done` undo it
    (each once, whatever path the request takes)."""

    prefill: Engine
    prefill_s: float
    reserved: list[tuple[Engine, int]]
    prefilled: bool = False

    @staticmethod
    def take(prefill: Engine, prefill_s: float, reserved: list[tuple[Engine, int]]) -> _Ticket:
        prefill.prefill_s += prefill_s
        for engine, tokens in reserved:
            engine.reserved_tokens += tokens
        return _Ticket(prefill, prefill_s, reserved)

    def first_token(self) -> None:
        if not self.prefilled:
            self.prefilled = True
            self.prefill.prefill_s = max(0.0, self.prefill.prefill_s - self.prefill_s)

    def done(self) -> None:
        self.first_token()
        for engine, tokens in self.reserved:
            engine.reserved_tokens -= tokens
        self.reserved = []


class _Slot:
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


async def _prefill_step(
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
    async with _Slot(engine, priority, budget_s):
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


async def _answer_step(
    request: web.Request,
    order: list[Engine],
    body: dict[str, Any],
    headers: dict[str, str],
    priority: int,
    budget_s: float,
    ticket: _Ticket,
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
        async with _Slot(engine, priority, budget_s):
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
                request[_CLIENT_GONE] = True
                assert out is not None
                return out
            except (aiohttp.ClientError, TimeoutError) as err:
                _engine_failed(state, engine, "answer", repr(err))
                if out is not None:  # mid-stream: the status is sent; end with an error event
                    request[_STREAM_BROKEN] = True
                    with contextlib.suppress(_ClientGone):
                        message = _sse_error(f"engine {engine.url} failed mid-answer: {err!r}")
                        await _to_client(out, request, message)
                        await _to_client(out, request, None)
                    return out
                failures.append(f"{engine.url}: {err!r}")
    raise RequestError(
        503, "every engine failed: " + "; ".join(failures), "ServiceUnavailableError"
    )


#: Set on a request whose stream broke after it started (its outcome in the metrics).
_STREAM_BROKEN = web.RequestKey("stream_broken", bool)
_CLIENT_GONE = web.RequestKey("client_gone", bool)


def _fallback_order(
    state: RouterState, first: Engine, shape: RequestShape, local: dict[str, int]
) -> list[Engine]:
    """``first``, then the other engines: healthy ones by predicted TTFT, then the rest."""
    others = [e for e in state.engines if e is not first]
    healthy = sorted(
        (e for e in others if e.healthy),
        key=lambda e: estimate_ttft(e.view(local.get(e.url, 0)), shape, False).ttft_s,
    )
    return [first, *healthy, *(e for e in others if not e.healthy)]


async def _generate(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    route = request.path
    slo_name = "unknown"
    outcome = "error"
    started = state.clock()
    try:
        body = parse_body(await request.read())
        try:
            priority, slo = state.config.slo.classify(request.headers)
        except InvalidRequestError as err:
            raise RequestError(400, err.message) from None
        slo_name = slo.name
        model = await state.model(body.get("model"))
        kind = "chat" if route.endswith("/chat/completions") else "completions"
        check_prompt_length(kind, body, model.max_model_len, state.config.max_chars_per_token)
        tokenizer = await state.tokenizer(model)
        tokens = await asyncio.to_thread(prompt_tokens, kind, body, tokenizer)
        limit = answer_tokens(body)
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
        hit = await state.cached_tokens(model, tokens)
        state.metrics.prompt_tokens.inc(len(tokens))
        state.metrics.cached_tokens.inc(hit.cached_tokens)
        shape = RequestShape(len(tokens), hit.loadable_tokens, limit or DEFAULT_ANSWER_TOKENS)
        local = state.local_cached_tokens(tokens)
        choice = state.choose(shape, slo, local)
        if not choice.accepted:
            if choice.prefill is None and choice.reason == "no engine is healthy":
                raise _no_engine()
            state.metrics.rejections.labels(slo.name, (choice.reason or "").split(" ")[0]).inc()
            outcome = "rejected"
            raise RequestError(
                429,
                f"request rejected for SLO class {slo.name}: {choice.reason}",
                "RateLimitError",
                headers={"Retry-After": str(choice.retry_after_s)},
            )
        assert choice.prefill is not None
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
        state.metrics.local_cached_tokens.labels(first.url).inc(choice.prefill.local_tokens)
        idle = first.inflight == 0 and first.load.num_running == 0
        uncached = max(shape.prompt_tokens - choice.prefill.cached_tokens, 1)
        sample = uncached if idle else None
        reserved = [(decode or first, shape.prompt_tokens + shape.max_tokens)]
        ticket = _Ticket.take(first, choice.prefill.prefill_s, reserved)
        try:
            if decode is not None:
                got = await _prefill_step(request, first, body, priority, slo.ttft_s, sample)
                if isinstance(got, web.Response):
                    outcome = "engine_refused"
                    return got
                if got is None:
                    headers["x-kvstore-prefill-engine"] = "none (failed; answered whole)"
                else:
                    body = {**body, **got}
                ticket.first_token()
                order = _fallback_order(state, decode, shape, local)
                ttft_sample = None
            else:
                order = _fallback_order(state, first, shape, local)
                ttft_sample = (first, sample) if sample is not None and body.get("stream") else None
            response = await _answer_step(
                request, order, body, headers, priority, slo.ttft_s, ticket, started, ttft_sample
            )
        finally:
            ticket.done()
        outcome = (
            "client_gone"
            if request.get(_CLIENT_GONE)
            else "stream_error"
            if request.get(_STREAM_BROKEN)
            else "ok"
        )
        return response
    except RequestError as err:
        if outcome == "error":
            outcome = "unavailable" if err.status >= 500 else "bad_request"
        raise
    finally:
        state.metrics.requests.labels(route, outcome, slo_name).inc()
        promoted = sum(e.slots.queue.num_promoted for e in state.engines)
        state.metrics.promoted.set(promoted)


async def _models(request: web.Request) -> web.Response:
    state = request.app[STATE]
    models = state.served_models()
    if not models:
        raise _no_engine()
    return web.json_response({"object": "list", "data": models})


async def _health(request: web.Request) -> web.Response:
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


async def _metrics(request: web.Request) -> web.Response:
    registry = request.app[STATE].metrics.registry
    return web.Response(
        body=generate_latest(registry), headers={"Content-Type": CONTENT_TYPE_LATEST}
    )


async def _tag(request: web.Request, response: web.StreamResponse) -> None:
    """Sign every answer with the router's id: a router that polls itself sees its own."""
    state = request.app.get(STATE)
    if state is not None:
        response.headers[ROUTER_ID_HEADER] = state.router_id


@web.middleware
async def _errors(request: web.Request, handler: Any) -> web.StreamResponse:
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
    app = web.Application(client_max_size=config.max_body_bytes, middlewares=[_errors])

    async def state_ctx(app: web.Application) -> AsyncIterator[None]:
        state = RouterState(config, clock, load_tokenizer)
        timeout = aiohttp.ClientTimeout(total=config.timeout_s, sock_connect=10)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            state.session = session
            app[STATE] = state
            poller = asyncio.create_task(state.poll_forever())
            if state.pool_view is not None:
                state.pool_view.start()
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
    app.on_response_prepare.append(_tag)
    for path in GENERATE_PATHS:
        app.router.add_post(path, _generate)
    app.router.add_get("/v1/models", _models)
    app.router.add_get("/health", _health)
    app.router.add_get("/metrics", _metrics)
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
