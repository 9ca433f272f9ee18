"""The router's queue in front of each engine: bounded concurrency, priority by SLO class, and
promotion of a request that has waited through most of its TTFT budget.

:class:`WaitQueue` is the pure part (a clock is passed in); :class:`EngineSlots` grants an
engine's slots to waiters through futures.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

#: The priority a promoted request gets: ahead of every class.
PROMOTED = -1


@dataclass(slots=True)
class Waiter:
    """A request waiting for a slot.

    Attributes:
        priority: its class's priority (0 is highest).
        enqueued_s: when it started waiting (the router's clock).
        ttft_budget_s: its class's TTFT target.
        seq: arrival order (ties).
        granted: resolved when the slot is its own.
    """

    priority: int
    enqueued_s: float
    ttft_budget_s: float
    seq: int = 0
    granted: asyncio.Future[None] | None = field(default=None, compare=False)


class WaitQueue:
    """Waiters in order of (effective priority, arrival).

    NOTE: a list scanned on each pop, not a heap: a waiter's effective priority changes with
    time (promotion), which a heap's fixed keys cannot follow, and the queue in front of one
    engine holds tens of requests, not thousands.

    Args:
        promote_fraction: a waiter that has waited this fraction of its TTFT budget is
            promoted ahead of every class.
    """

    def __init__(self, promote_fraction: float) -> None:
        self.promote_fraction = promote_fraction
        self._waiters: list[Waiter] = []
        self._seq = itertools.count()
        self.num_promoted = 0

    def __len__(self) -> int:
        return len(self._waiters)

    def push(self, waiter: Waiter) -> Waiter:
        """Enqueue ``waiter`` (its ``seq`` is set here).

        Returns:
            The waiter.
        """
        waiter.seq = next(self._seq)
        self._waiters.append(waiter)
        return waiter

    def remove(self, waiter: Waiter) -> None:
        """Drop a waiter that gave up (no-op when it is not queued)."""
        if waiter in self._waiters:
            self._waiters.remove(waiter)

    def effective_priority(self, waiter: Waiter, now_s: float) -> int:
        """:data:`PROMOTED` once ``waiter`` has used ``promote_fraction`` of its budget.

        Args:
            waiter: a queued waiter.
            now_s: the clock.

        Returns:
            The priority it is served by now.
        """
        if now_s - waiter.enqueued_s >= self.promote_fraction * waiter.ttft_budget_s:
            return PROMOTED
        return waiter.priority

    def pop(self, now_s: float) -> Waiter | None:
        """Take the waiter to serve next, or None when empty.

        Args:
            now_s: the clock.

        Returns:
            The waiter (removed from the queue).
        """
        if not self._waiters:
            return None
        best = min(
            self._waiters, key=lambda w: (self.effective_priority(w, now_s), w.enqueued_s, w.seq)
        )
        if self.effective_priority(best, now_s) == PROMOTED and best.priority != PROMOTED:
            self.num_promoted += 1
        self._waiters.remove(best)
        return best

    def predicted_wait_s(self, priority: int, each_s: float) -> float:
        """Seconds a new waiter of ``priority`` waits behind those served before it.

        Args:
            priority: the new waiter's class priority.
            each_s: the predicted service time of one waiter.

        Returns:
            Seconds.
        """
        ahead = sum(1 for w in self._waiters if w.priority <= priority)
        return ahead * each_s


class EngineSlots:
    """At most ``limit`` requests on one engine at once; the rest wait in a :class:`WaitQueue`.

    Args:
        limit: concurrent requests (>= 1).
        promote_fraction: see :class:`WaitQueue`.
        clock: the router's monotonic clock.
    """

    def __init__(self, limit: int, promote_fraction: float, clock: Callable[[], float]) -> None:
        if limit < 1:
            raise ValueError("an engine needs at least one slot")
        self.limit = limit
        self.queue = WaitQueue(promote_fraction)
        self.busy = 0
        self._clock = clock

    async def acquire(self, priority: int, ttft_budget_s: float) -> None:
        """Wait for a slot (at once when one is free and nobody waits).

        Args:
            priority: the request's class priority.
            ttft_budget_s: its TTFT target.
        """
        if self.busy < self.limit and not len(self.queue):
            self.busy += 1
            return
        loop = asyncio.get_running_loop()
        waiter = self.queue.push(Waiter(priority, self._clock(), ttft_budget_s))
        waiter.granted = loop.create_future()
        try:
            await waiter.granted
        except asyncio.CancelledError:
            self.queue.remove(waiter)
            if waiter.granted.done() and not waiter.granted.cancelled():
                self.release()  # granted and cancelled at once: hand the slot on
            raise

    def release(self) -> None:
        """Give a slot back: the next waiter gets it."""
        now = self._clock()
        while True:
            waiter = self.queue.pop(now)
            if waiter is None:
                self.busy -= 1
                return
            assert waiter.granted is not None
            if not waiter.granted.done():
                waiter.granted.set_result(None)  # the slot passes on; busy stays the same
                return
