"""The router's view of the pool, kept from the master's KV event stream.

A thread follows :class:`~kvstore.client.events.EventStream` (blocking long polls: never on the
aiohttp loop) into a :class:`~kvstore.client.events.BlockView`. Per request the router computes
the prompt's block keys in the engine's namespace and counts the leading ones the view holds
(:meth:`PoolView.count_blocks`): the whole blocks the master's prefix index would answer,
without a master call.

States (the ``kvstore_router_pool_view_state`` gauge):

* ``starting``: no answer from the master yet;
* ``synced``: the view is the index as of the stream's position (it lags by the delivery of
  the events in flight, as any subscriber does);
* ``resyncing``: the master said the position cannot be served (another epoch after a
  failover, a gap in its ring): the snapshot is being read;
* ``down``: the master stayed away longer than the stream's retry budget; the stream keeps
  its position and resumes (or resyncs) when the master answers again.

Outside ``synced`` :meth:`PoolView.count_blocks` answers None and the router asks the prefix
index per request (``kvstore_router_pool_view_fallbacks_total`` counts those).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import Protocol

from kvstore.client.events import BlockEvent, BlockView, ResyncNotice, Snapshot, StreamItem
from kvstore.errors import KVStoreError

from .metrics import RouterMetrics

log = logging.getLogger("kvstore.router")

STATES = ("starting", "synced", "resyncing", "down")
#: Seconds between attempts to reach a master that is away (doubling up to the maximum).
RETRY_MIN_S = 0.2
RETRY_MAX_S = 5.0


class EventSource(Protocol):
    """What the view follows: :class:`~kvstore.client.events.EventStream`, or a fake."""

    def poll(self, wait_s: float | None = None) -> list[StreamItem]:
        """The next items (events, or a resync notice and a snapshot)."""
        ...

    def close(self) -> None:
        """Stop; a poll in progress ends soon after."""
        ...

    @property
    def position(self) -> tuple[int | None, int]:
        """``(epoch, seq)`` of the last item returned."""
        ...


class PoolView:
    """The pool's prefix index as the KV events tell it, followed in a background thread.

    Args:
        open_stream: opens the event stream (called again after it could not be opened).
        metrics: where the state, events, resyncs and fallbacks are counted (None: nowhere).
        wait_s: the long poll of one call.

    NOTE: ``_lock`` guards ``_view`` and ``_state``; it is held for set lookups and for
    applying one event, never across a master call. A snapshot is built outside it and
    swapped in.
    """

    def __init__(
        self,
        open_stream: Callable[[], EventSource],
        metrics: RouterMetrics | None = None,
        wait_s: float = 2.0,
    ) -> None:
        self._open = open_stream
        self._metrics = metrics
        self._wait_s = wait_s
        self._lock = threading.Lock()
        self._view = BlockView()
        self._state = "starting"
        self._position: tuple[int | None, int] = (None, 0)
        self._stream: EventSource | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._set_state("starting")

    # ------------------------------------------------------------------ reading
    @property
    def state(self) -> str:
        """One of :data:`STATES`."""
        return self._state

    @property
    def position(self) -> tuple[int | None, int]:
        """``(epoch, seq)`` the view reflects."""
        return self._position

    def count_blocks(self, namespace: bytes, keys: Sequence[bytes]) -> int | None:
        """Leading ``keys`` the view holds in ``namespace``.

        Args:
            namespace: the namespace digest.
            keys: the prompt's block keys, in order (``kvstore.keys.block_keys``).

        Returns:
            The count, or None while the view is not synced (ask the index instead).
        """
        with self._lock:
            if self._state != "synced":
                return None
            held = self._view.blocks.get(namespace)
            if not held:
                return 0
            n = 0
            for key in keys:
                if key not in held:
                    break
                n += 1
            return n

    def num_blocks(self) -> int:
        """Blocks in the view, all namespaces."""
        with self._lock:
            return sum(len(k) for k in self._view.blocks.values())

    # ------------------------------------------------------------------ following
    def start(self) -> None:
        """Follow the stream in a daemon thread until :meth:`close`."""
        assert self._thread is None, "started twice"
        self._thread = threading.Thread(target=self._run, name="kvstore-pool-view", daemon=True)
        self._thread.start()

    def close(self, timeout: float = 10.0) -> None:
        """Stop following; waits up to ``timeout`` for the thread (a long poll ends within the
        stream's ``wait_s``)."""
        self._stop.set()
        stream = self._stream
        if stream is not None:
            stream.close()
        if self._thread is not None:
            self._thread.join(timeout)

    def step(self) -> bool:
        """One round: open the stream if needed, poll it once, apply what came.

        Returns:
            True when the master answered; False when it could not be reached (state ``down``,
            or still ``starting`` before it ever answered).
        """
        try:
            if self._stream is None:
                self._stream = self._open()
            items = self._stream.poll(self._wait_s)
        except (KVStoreError, OSError) as err:
            if not self._stop.is_set():
                log.warning("router: KV event stream unavailable (%s); asking per request", err)
                if self._state != "starting":
                    self._set_state("down")
            return False
        self.apply(items)
        return True

    def apply(self, items: list[StreamItem]) -> None:
        """Fold one poll's items into the view (a snapshot replaces it whole)."""
        for item in items:
            if isinstance(item, ResyncNotice):
                log.info("router: KV events resync (%s): %s", item.reason, item.message)
                self._count_resync(item.reason)
                self._set_state("resyncing")
            elif isinstance(item, Snapshot):
                fresh = BlockView()
                fresh.apply(item)  # built outside the lock: it may be large
                with self._lock:
                    self._view = fresh
                self._position = (item.epoch, item.seq)
            elif isinstance(item, BlockEvent):
                with self._lock:
                    self._view.apply(item)
                self._position = (item.epoch, item.seq)
                if self._metrics is not None:
                    self._metrics.pool_view_events.labels(item.kind).inc()
        if self._stream is not None:
            self._position = self._stream.position
        self._set_state("synced")
        if self._metrics is not None:
            self._metrics.pool_view_blocks.set(self.num_blocks())
            self._metrics.pool_view_seq.set(self._position[1])

    def _run(self) -> None:
        backoff = RETRY_MIN_S
        while not self._stop.is_set():
            if self.step():
                backoff = RETRY_MIN_S
                continue
            self._stop.wait(backoff)  # a retry period, not a synchronisation
            backoff = min(backoff * 2, RETRY_MAX_S)
        with self._lock:
            self._state = "down"

    def _set_state(self, state: str) -> None:
        assert state in STATES, state
        with self._lock:
            self._state = state
        if self._metrics is not None:
            for s in STATES:
                self._metrics.pool_view_state.labels(s).set(1 if s == state else 0)

    def _count_resync(self, reason: str) -> None:
        if self._metrics is not None:
            self._metrics.pool_view_resyncs.labels(reason or "unknown").inc()
