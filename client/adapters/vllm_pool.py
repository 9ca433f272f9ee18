"""What both sides of the vLLM connector share: the pool behind a breaker, and the metadata
the scheduler hands the workers each step."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import numpy as np
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata
from vllm.logger import init_logger

from kvstore import auth
from kvstore.client.adapters.vllm_config import ConnectorConfig
from kvstore.client.adapters.vllm_stats import Counters
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
logger = init_logger("vllm.kvstore_connector")


# ==================================================================== the pool, with a breaker
UNREACHABLE = (KVStoreError, OSError)


class Pool:
    """The client and KV view, connected lazily; while the pool is unreachable, ``get`` says so
    at once (no call waits on a dead pool) and is retried after ``retry_s``.

    One warning line when the pool goes, one info line when it comes back.
    """

    def __init__(self, cfg: ConnectorConfig, namespace: Namespace, counters: Counters) -> None:
        self.cfg = cfg
        self.namespace = namespace
        self._counters = counters
        self._lock = threading.Lock()
        self._kv: KVCache | None = None
        self._down_until = 0.0
        self._down = False

    def get(self) -> KVCache | None:
        """The KV view, or None while the pool is unreachable (the caller recomputes)."""
        with self._lock:
            if self._kv is not None:
                return self._kv
            if time.monotonic() < self._down_until:
                return None
        try:
            token = auth.load_token(self.cfg.token_file)
            client = Client.connect(self.cfg.master, timeout=self.cfg.timeout_s, token=token)
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

    def close(self) -> None:
        with self._lock:
            kv, self._kv = self._kv, None
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


# ==================================================================== step metadata
@dataclass
class Transfer:
    """Blocks ``first .. first + len(block_ids)`` of a prompt, to load or save.

    ``tokens`` is the prompt up to the end of the last of them (the keys chain over it).
    """

    req_id: str
    tokens: np.ndarray
    first: int
    block_ids: list[int]


@dataclass
class KVStoreConnectorMetadata(KVConnectorMetadata):
    """What the scheduler tells the workers for one step."""

    loads: list[Transfer] = field(default_factory=list)
    saves: list[Transfer] = field(default_factory=list)
