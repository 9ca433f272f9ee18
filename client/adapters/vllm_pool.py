"""What both sides of the vLLM connector share: the pool behind a breaker, the counters, and a
transfer (the unit of the scheduler's per-step plan). Imports nothing of vLLM, so the worker side
runs where vLLM is absent (a GPU check)."""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from kvstore import auth
from kvstore.client.adapters.vllm_config import ConnectorConfig, salted_namespace
from kvstore.client.client import Client
from kvstore.client.kvcache import KVCache
from kvstore.errors import (
    KVStoreError,
    KVTimeoutError,
    MasterUnavailableError,
    NodeUnavailableError,
    UnauthenticatedError,
)
from kvstore.keys import Namespace

# Under "vllm." so that vLLM's logging config (level, format, process prefix) applies to our lines.
logger = logging.getLogger("vllm.kvstore_connector")


# ==================================================================== counters
class Counters:
    """Thread-safe counters, taken (and zeroed) by each ``get_kv_connector_stats``."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._data: dict[str, float] = {}
        self.totals: dict[str, float] = {}

    def add(self, **values: float) -> None:
        with self._lock:
            for k, v in values.items():
                self._data[k] = self._data.get(k, 0) + v
                self.totals[k] = self.totals.get(k, 0) + v

    def take(self) -> dict[str, float] | None:
        """The sums since the last call (None when all are zero), and zero them."""
        with self._lock:
            data, self._data = self._data, {}
        return data if any(data.values()) else None


# ==================================================================== the pool, with a breaker
UNREACHABLE = (KVStoreError, OSError)
#: Salted KV views kept per pool connection (the most recently used): salts are per request,
#: so an unbounded map would grow with every tenant ever seen; a view is cheap to rebuild.
MAX_SALTED_VIEWS = 256


class Pool:
    """The client and KV view, connected lazily; while the pool is unreachable, ``get`` says so
    at once (no call waits on a dead pool) and is retried after ``retry_s``.

    One warning line when the pool goes, one info line when it comes back. ``get(cache_salt)``
    gives a request's salted view (:func:`~.vllm_config.salted_namespace`) on the same client.
    """

    def __init__(self, cfg: ConnectorConfig, namespace: Namespace, counters: Counters) -> None:
        self.cfg = cfg
        self.namespace = namespace
        self._counters = counters
        self._lock = threading.Lock()
        self._kv: KVCache | None = None
        self._salted: OrderedDict[str, KVCache] = OrderedDict()
        self._down_until = 0.0
        self._down = False

    def get(self, cache_salt: str | None = None) -> KVCache | None:
        """The KV view of a request's namespace (``cache_salt`` None: the engine's own), or
        None while the pool is unreachable or the salt cannot make a namespace (the caller
        recomputes; a salted request never falls back to the unsalted view)."""
        kv = self._get()
        if kv is None or cache_salt is None:
            return kv
        evicted: KVCache | None = None
        with self._lock:
            view = self._salted.get(cache_salt)
            if view is not None and view.client is kv.client:
                self._salted.move_to_end(cache_salt)
                return view
            try:
                view = KVCache(kv.client, salted_namespace(self.namespace, cache_salt))
            except KVStoreError as exc:
                logger.warning("kvstore: cache_salt %r unusable (%s); not cached", cache_salt, exc)
                return None
            stale = self._salted.pop(cache_salt, None)
            self._salted[cache_salt] = view
            if len(self._salted) > MAX_SALTED_VIEWS:
                evicted = self._salted.popitem(last=False)[1]
        for old in (stale, evicted):
            if old is not None:
                old.close()  # (the client is the engine view's: closed with it)
        return view

    def _get(self) -> KVCache | None:
        with self._lock:
            if self._kv is not None:
                return self._kv
            if time.monotonic() < self._down_until:
                return None
        try:
            token = auth.load_token(self.cfg.token_file)
            cfg = self.cfg
            client = Client.connect(
                cfg.master,
                timeout=cfg.timeout_s,
                token=token,
                host_id=cfg.host_id,
                rack=cfg.rack,
                zone=cfg.zone,
            )
        except UNREACHABLE as exc:
            self.failed(exc)
            return None
        kv = KVCache(client, self.namespace)
        with self._lock:
            if self._kv is None:
                self._kv, kv = kv, None  # type: ignore[assignment]
            was_down, self._down = self._down, False
            current = self._kv
        if kv is not None:  # another thread connected meanwhile
            kv.close()
            kv.client.close()
        if was_down:
            logger.info("kvstore: pool at %s reachable again", self.cfg.master)
        return current

    def failed(self, exc: BaseException) -> None:
        """Record that a pool call failed for want of the pool: serve without it for a while."""
        self._counters.add(pool_unavailable=1)
        with self._lock:
            kv, self._kv = self._kv, None
            self._drop_salted()
            first = not self._down
            self._down = True
            self._down_until = time.monotonic() + self.cfg.retry_s
        if kv is not None:
            kv.close()
            kv.client.close()
        if first:
            logger.warning(
                "kvstore: pool at %s unreachable (%s: %s); vLLM keeps serving by recomputing, "
                "retrying the pool every %.0fs",
                self.cfg.master,
                type(exc).__name__,
                exc,
                self.cfg.retry_s,
            )

    def _drop_salted(self) -> None:
        """Forget the salted views (under the lock); their client goes with the engine view's."""
        for view in self._salted.values():
            view.close()
        self._salted.clear()

    def close(self) -> None:
        with self._lock:
            kv, self._kv = self._kv, None
            self._drop_salted()
        if kv is not None:
            kv.close()
            kv.client.close()


def is_unreachable(err: BaseException) -> bool:
    return isinstance(
        err,
        MasterUnavailableError
        | KVTimeoutError
        | NodeUnavailableError
        | UnauthenticatedError
        | OSError,
    )


# ==================================================================== a transfer
@dataclass
class Transfer:
    """Blocks ``first .. first + len(block_ids)`` of a prompt, to load or save.

    ``tokens`` is the prompt up to the end of the last of them (the keys chain over it);
    ``cache_salt`` the request's vLLM ``cache_salt`` (None: none), which picks its namespace.
    """

    req_id: str
    tokens: np.ndarray
    first: int
    block_ids: list[int]
    cache_salt: str | None = None
