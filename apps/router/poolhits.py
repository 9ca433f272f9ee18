"""What the pool holds of a prompt, as the router asks it: from the view the master's KV events
keep (:mod:`.poolview`) while it is synced, else from the master's prefix index (one
``kv_match`` through one client, no leases). Any failure is a miss, never an error.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from kvstore.client import Client
from kvstore.client.adapters.vllm_config import salted_namespace
from kvstore.client.events import EventStream
from kvstore.client.kvcache import KVCache
from kvstore.errors import InvalidRequestError, KVStoreError
from kvstore.keys import Namespace, block_keys

from .engines import Engine, EngineLoad
from .metrics import RouterMetrics
from .poolview import PoolView
from .requests import ModelInfo

log = logging.getLogger("kvstore.router")

#: Seconds between two connection attempts to a master that did not answer.
POOL_RETRY_S = 5.0
#: KV views kept (one per namespace, the oldest dropped first): requests' ``cache_salt`` makes
#: a namespace per salt, so an unbounded map would grow with every tenant ever seen.
MAX_KVCACHES = 256


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


class PoolLookup:
    """The router's questions to the pool, and the client and namespaces they need.

    NOTE: touched only from the event loop's thread; the one master client is used by one
    call at a time (``_pool_lock``).

    Args:
        master: the pool's master (``HOST:PORT`` / ``etcd://``), or None: nothing is cached.
        metrics: the router's metrics.
        clock: monotonic seconds (the retry delay after a failed connection).
        dtype: the engines' ``--dtype`` when it differs from the model config's.
        salt: the connector's namespace salt.
        events: follow the master's KV events (else: one prefix-index lookup per request).
    """

    def __init__(
        self,
        master: str | None,
        metrics: RouterMetrics,
        clock: Callable[[], float],
        *,
        dtype: str | None = None,
        salt: str | None = None,
        events: bool = True,
    ) -> None:
        self.master = master
        self.metrics = metrics
        self.clock = clock
        self.dtype = dtype
        self.salt = salt
        self._pool: Client | None = None
        self._pool_failed_s: float | None = None
        self._pool_lock = asyncio.Lock()
        self._kvcaches: dict[bytes, KVCache] = {}
        self._namespaces: dict[tuple[str, int, str], Namespace] = {}
        #: The pool from the KV events (None: per-request lookups only); started by the app.
        self.view: PoolView | None = None
        if master is not None and events:
            self.view = PoolView(lambda: EventStream(master, wait_s=2.0, retry_s=5.0), metrics)

    async def _kvcache(self, ns: Namespace) -> KVCache | None:
        if self.master is None:
            return None
        now = self.clock()
        if self._pool is None:
            if self._pool_failed_s is not None and now - self._pool_failed_s < POOL_RETRY_S:
                return None
            try:
                self._pool = await asyncio.to_thread(Client.connect, self.master)
            except (KVStoreError, OSError) as err:
                log.warning("router: master %s unavailable (%s)", self.master, err)
                self._pool_failed_s = now
                self.metrics.lookup_errors.inc()
                return None
        kv = self._kvcaches.pop(ns.digest, None)
        if kv is None:
            kv = KVCache(self._pool, ns)
        self._kvcaches[ns.digest] = kv  # (last: the most recently used)
        if len(self._kvcaches) > MAX_KVCACHES:
            self._kvcaches.pop(next(iter(self._kvcaches))).close()
        return kv

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
                load.block_size, key[2], dtype=self.dtype, salt=self.salt
            )
        return self._namespaces[key]

    async def cached_tokens(
        self,
        model: ModelInfo,
        tokens: list[int],
        engines: list[Engine],
        cache_salt: str | None = None,
    ) -> PoolHit:
        """Leading tokens of ``tokens`` the pool holds, in the namespace the connector saves in
        (the prompt's full blocks, as the connector looks them up). Any failure is a miss.

        A request's ``cache_salt`` picks the salted namespace the connector uses for it
        (:func:`~kvstore.client.adapters.vllm_config.salted_namespace`): blocks of other salts,
        or of none, are no hit for it.

        From the KV-event view when it is synced (no master call: whole blocks); else from
        the master's prefix index (one ``kv_match``, no leases; token-granular).

        Args:
            model: the served model.
            tokens: the prompt.
            engines: the router's engines now (the block size and cache dtype are theirs).
            cache_salt: the request body's ``cache_salt`` (None: none).

        Returns:
            The hit; nothing cached without a master.
        """
        engines = [e for e in engines if e.healthy and e.load.block_size] or engines
        if self.master is None or not engines:  # the set may empty while we tokenize
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
            if ns is not None and cache_salt is not None:
                ns = salted_namespace(ns, cache_salt)
        except InvalidRequestError as err:
            log.warning("router: no pool namespace for %s (%s)", model.model_id, err)
            self.metrics.lookup_errors.inc()
            return PoolHit(0, 0, "none")
        assert ns is not None
        if self.view is not None:
            num_blocks = self.view.count_blocks(ns.digest, block_keys(ns, full))
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
        if self.view is not None:
            self.view.close()
        if self._pool is not None:
            self._pool.close()
        self._pool = None
