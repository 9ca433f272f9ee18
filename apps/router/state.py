"""The router's state: its engines (static and discovered), their polls, the served models and
their tokenizers, the pool's view and the choice on all of it. No routes here (:mod:`.routes`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import Callable, Sequence
from typing import Any

import aiohttp
from aiohttp import web
from transformers import AutoTokenizer

from kvstore.client.engine_registry import RegisteredEngine
from kvstore.etcd import parse_endpoints
from kvstore.routing.policy import POLICIES, Choice, EngineView, RequestShape, choose
from kvstore.routing.slo import SLOClass

from .admission import EngineSlots
from .config import RouterConfig
from .engine_cache import EngineEvents, chain_keys
from .engine_watch import EngineDiscovery
from .engines import ROLES, Engine, EngineAnswerError, EngineLoad, make_engines
from .listen import ROUTER_ID_HEADER, ListenAddresses
from .live_fit import EngineFit
from .metrics import RouterMetrics
from .poolhits import PoolLookup
from .requests import ModelInfo, RequestError

log = logging.getLogger("kvstore.router")

#: The cost-model terms exported per engine (``kvstore_router_cost_term``).
_COST_TERMS = (
    "prefill_base_s",
    "prefill_s_per_token",
    "decode_base_s",
    "decode_s_per_seq",
    "transfer_bytes_per_s",
)
#: ``Retry-After`` of a 503 while no engine is available (one may register or recover soon).
NO_ENGINE_RETRY_S = 1


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
        #: Engines' own prefix caches from vLLM's KV events, by URL; started by the app.
        self.engine_events = {
            url: EngineEvents(url, endpoint, self.metrics) for url, endpoint in config.engine_events
        }
        #: What the pool holds of a prompt (its KV-event view is started by the app).
        self.pool = PoolLookup(
            config.master,
            self.metrics,
            clock,
            dtype=config.dtype,
            salt=config.salt,
            events=config.pool_events,
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
        engine = Engine(url, rec.role, self._new_slots(), self._new_fit(), site=rec.where)
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
            raise no_engine()
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

    def close(self) -> None:
        """Stop following the KV events (the pool's and the engines'); close the pool client."""
        for feed in self.engine_events.values():
            feed.close()
        self.pool.close()

    # ------------------------------------------------------------------ choice
    def local_cached_tokens(
        self, tokens: list[int], cache_salt: str | None = None
    ) -> dict[str, int]:
        """Leading tokens of ``tokens`` in each engine's own prefix cache, for the engines
        whose vLLM KV events the router follows (whole blocks, never the last prompt token:
        vLLM always computes it).

        A request with a ``cache_salt`` counts none: vLLM hashes the salt into its blocks, so
        the unsalted blocks the view matches are no hit for it, and salted ones it never
        matches (:mod:`.engine_cache`).

        Args:
            tokens: the prompt.
            cache_salt: the request body's ``cache_salt`` (None: none).

        Returns:
            Engine URL -> tokens (engines without events are left out).
        """
        out: dict[str, int] = {}
        keys_by_size: dict[int, list[bytes]] = {}
        for url, feed in self.engine_events.items():
            bs = self.by_url[url].load.block_size or feed.cache.block_size
            if cache_salt is not None or not bs or len(tokens) <= bs:
                out[url] = 0
                continue
            if bs not in keys_by_size:
                keys_by_size[bs] = chain_keys(tokens[: (len(tokens) - 1) // bs * bs], bs)
            out[url] = feed.cache.count_keys(keys_by_size[bs], bs) * bs
        return out

    def choose(
        self, shape: RequestShape, slo: SLOClass, local: dict[str, int] | None = None
    ) -> Choice:
        """Choose engines for a request from the engines' live views (see
        :mod:`kvstore.routing.policy`).

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


def no_engine() -> RequestError:
    """503 with ``Retry-After``: no engine is up yet (a registry may add one any moment)."""
    return RequestError(
        503,
        "no engine is available",
        "ServiceUnavailableError",
        headers={"Retry-After": str(NO_ENGINE_RETRY_S)},
    )
