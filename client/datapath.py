"""The client's data path: picks, per node, the fastest transport that works from here.

Order of preference: shared memory (same host, node started with ``--shm``), RDMA (both sides
have a device; see :mod:`kvstore.rdma`, untested on real hardware and not yet wired into reads
and writes, so it falls back), TCP. What each node offers comes from the master's
``node_transports`` verb, cached here and refreshed at most once a second when an unknown node
shows up. A transport that fails its checks falls back to TCP for that batch, with one log line.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from kvstore import auth, rdma
from kvstore.client.shm import ShmTransport
from kvstore.client.transport import ReadItem, TcpTransport, WriteItem
from kvstore.errors import KVStoreError

#: How often (seconds) an unknown node id may trigger a fresh ``node_transports`` call.
REFRESH_INTERVAL_S = 1.0


class DataPath:
    """Reads and writes object bytes through shm, RDMA or TCP.

    Args:
        timeout: socket timeout for TCP.
        fetch_transports: returns the master's ``node_transports`` map.
        shm: whether to use shared memory where a node offers it.
        token: the cluster token for TCP connections to nodes.
    """

    def __init__(
        self,
        timeout: float,
        fetch_transports: Callable[[], dict[str, Any]],
        shm: bool = True,
        token: auth.Token | None = None,
    ) -> None:
        self.tcp = TcpTransport(timeout, token)
        self.shm = ShmTransport() if shm else None
        self._fetch = fetch_transports
        self._known: set[str] = set()
        self._fetched_at = float("-inf")
        self._lock = threading.Lock()
        self._rdma_local: rdma.RdmaDevice | None | bool = False  # False: not looked yet

    def close(self) -> None:
        self.tcp.close()
        if self.shm is not None:
            self.shm.close()

    # ---------------------------------------------------------------- offers
    def _learn(self, node_ids: set[str]) -> None:
        """Fetch offers when a node is new to us (rate-limited)."""
        if self.shm is None:
            return
        if self.shm.dropped:  # a mapping failed its checks: ask the master again
            self._known -= self.shm.dropped
            self.shm.dropped.clear()
        if node_ids <= self._known:
            return
        now = time.monotonic()
        if now - self._fetched_at < REFRESH_INTERVAL_S:
            return
        self._fetched_at = now
        try:
            offers = self._fetch()
        except KVStoreError:
            return  # TCP still works; try again later
        self._known = set(node_ids) | set(offers)
        for node_id, transports in offers.items():
            if not isinstance(transports, dict):
                continue
            if "shm" in transports:
                self.shm.learn(node_id, transports["shm"])
            if "rdma" in transports:
                if self._rdma_local is False:
                    self._rdma_local = rdma.first_device("client")
                # Not wired into reads/writes yet: choose() logs the fallback once.
                rdma.choose(transports["rdma"], self._rdma_local or None)

    # ---------------------------------------------------------------- bytes
    def read(self, items: Sequence[ReadItem]) -> None:
        """Fill each item's ``dest``; sets ``item.result`` on failure."""
        rest: Sequence[ReadItem] = items
        if self.shm is not None and items:
            with self._lock:
                self._learn({i.location.node_id for i in items})
                rest = self.shm.read(items)
        if rest:
            self.tcp.read(rest)

    def write(self, items: Sequence[WriteItem]) -> None:
        """Write each item's bytes to its location; sets ``item.result`` on failure.

        Writes through shm are committed by the node (``shm_commit``: grant and checksum
        checked there) before this returns, exactly as a TCP write is acknowledged.
        """
        rest: Sequence[WriteItem] = items
        written: list[WriteItem] = []
        if self.shm is not None and items:
            with self._lock:
                self._learn({i.location.node_id for i in items})
                written, rest = self.shm.write(items)
        if written:
            self.tcp.call_per_node(
                "shm_commit", written, lambda i: [i.location.grant.to_wire(), i.checksum]
            )
        if rest:
            self.tcp.write(rest)
