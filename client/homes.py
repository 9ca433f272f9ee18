"""The live nodes as this client knows them, for one-hop reads (see :mod:`kvstore.placement`).

A view is asked of the master (``live_nodes``) at most once per ``REFRESH_S``, lazily: the read
that finds it older starts a thread that asks (only the first view is asked for in the call).
Keys this client removed, or put somewhere other than their home, are *held*: read through the
master for ``hold_s`` (the lease window), since their home node may still serve the old bytes
until its next heartbeat drops them; so a client sees its own removes and overwrites at once. A
home node that fails a read makes the view stale at once, so the next read asks again. A master
that refuses the question (a tenant's connection) turns one-hop reads off for this client: its
reads then all go through the master.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from kvstore.errors import ForbiddenError, KVStoreError
from kvstore.placement import Homes

#: Seconds a view of the live nodes is used before the master is asked again (a node that
#: joined is read from at most this late; one that left costs a miss until then).
REFRESH_S = 1.0
#: Most keys held at once; past it, one-hop reads stop for ``hold_s`` instead (memory bound).
MAX_HELD = 1 << 16

Endpoint = tuple[str, int]


class HomeView:
    """Each key's home node and its data endpoint. Thread-safe (a view is swapped whole).

    Args:
        ask: calls the master's ``live_nodes`` and returns its answer.
        hold_s: how long a key this client removed or put away from home is read the usual way.
        clock: ``time.monotonic`` unless a test steps it.
    """

    def __init__(
        self,
        ask: Callable[[], Any],
        hold_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._ask = ask
        self.hold_s = hold_s
        self._clock = clock
        self._held: dict[bytes, float] = {}  # key -> until when
        self._off_until = float("-inf")
        self._lock = threading.Lock()
        self._homes: Homes | None = None
        self._endpoints: dict[str, Endpoint] = {}
        self._asked_at = float("-inf")
        #: False once the master refused to say (a tenant's connection): no one-hop reads.
        self.enabled = True

    def current(self) -> tuple[Homes, dict[str, Endpoint]] | None:
        """The view to read by (asking the master first when it is due); None: no node known,
        or one-hop reads are off."""
        if not self.enabled:
            return None
        now = self._clock()
        if now < self._off_until:
            return None
        with self._lock:
            due = now - self._asked_at >= REFRESH_S
            if due:
                self._asked_at = now  # (one thread asks; the others read the view they have)
        if due:
            if self._homes is None:
                self._refresh()
            else:
                # In the background: a read never waits for the master it means to skip.
                threading.Thread(target=self._refresh, name="kvstore-homes", daemon=True).start()
        homes = self._homes
        if homes is None or not len(homes):
            return None
        return homes, self._endpoints

    def hold(self, keys: list[bytes]) -> None:
        """Read ``keys`` through the master for ``hold_s`` (this client changed them)."""
        now = self._clock()
        until = now + self.hold_s
        with self._lock:
            held = self._held
            if len(held) + len(keys) > MAX_HELD:
                for k in [k for k, t in held.items() if t <= now]:
                    del held[k]
                if len(held) + len(keys) > MAX_HELD:
                    held.clear()
                    self._off_until = until
                    return
            for k in keys:
                held[k] = until

    def held(self, key: bytes, now: float) -> bool:
        """Whether ``key`` is held at ``now`` (see :meth:`hold`)."""
        until = self._held.get(key)
        return until is not None and now < until

    @property
    def holding(self) -> bool:
        return bool(self._held)

    def stale(self) -> None:
        """A home node failed a read: ask the master again before the next one."""
        with self._lock:
            self._asked_at = float("-inf")

    def _refresh(self) -> None:
        try:
            answer = self._ask()
        except ForbiddenError:
            self.enabled = False
            return
        except (KVStoreError, OSError, ValueError):
            return  # the view it has (or none) until the next try (also: the client closed)
        nodes = answer.get("nodes") if isinstance(answer, dict) else None
        if not isinstance(nodes, list):
            return
        endpoints: dict[str, Endpoint] = {}
        for n in nodes:
            if (
                isinstance(n, list)
                and len(n) == 3
                and isinstance(n[0], str)
                and isinstance(n[1], str)
                and type(n[2]) is int
            ):
                endpoints[n[0]] = (n[1], n[2])
        homes = Homes(list(endpoints))
        with self._lock:
            self._homes, self._endpoints = homes, endpoints
