"""The master's wall clock, as a node or a client keeps it: what grant expiry is measured on.

Grants and read leases expire at a wall-clock millisecond of the master's (``expires_ms``). A
node that checked them on its own wall clock would, an hour ahead of the master, refuse every
fresh grant; an hour behind (or with the master an hour ahead), accept grants the master counts
as long expired, and return bytes the master may have handed to another writer. So a node and
a client keep the master's clock instead: each reply of the master to a node's registration and
heartbeats, and to a client's ``ping``, carries its ``now_ms``, and :class:`MasterClock` carries
the latest one forward on the local monotonic clock, which no one sets.
"""

from __future__ import annotations

import time
from collections.abc import Callable


def _wall_ms() -> int:
    return int(time.time() * 1000)


class MasterClock:
    """The master's wall-clock milliseconds now, from the latest ``now_ms`` it sent.

    The master read its clock somewhere between the request's send and its reply's receipt, so
    ``now_ms`` plus the time since the *send* is never behind the master's clock: a grant may
    end here up to one round trip early, never late. Before any reply the local wall clock
    stands in (no grant of this master is held yet).

    Args:
        wall_ms: the local wall clock (the stand-in).
        monotonic: the local monotonic clock, seconds.
    """

    def __init__(
        self,
        wall_ms: Callable[[], int] = _wall_ms,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self._wall_ms = wall_ms
        self._monotonic = monotonic
        # (master now_ms, monotonic seconds when the request it answered was sent)
        self._sample: tuple[int, float] | None = None

    def sent(self) -> float:
        """Call just before sending a request whose reply carries ``now_ms``; pass the result
        to :meth:`observe`."""
        return self._monotonic()

    def observe(self, now_ms: object, sent: float) -> None:
        """Take the master's ``now_ms`` from a reply to a request sent at ``sent``; a reply
        without one (an older master) changes nothing."""
        if type(now_ms) is int and now_ms > 0:
            self._sample = (now_ms, sent)  # one tuple: readers on other threads see it whole

    def age_s(self) -> float:
        """Seconds since the request of the latest sample was sent (inf: none yet)."""
        sample = self._sample
        return float("inf") if sample is None else self._monotonic() - sample[1]

    def __call__(self) -> int:
        sample = self._sample
        if sample is None:
            return self._wall_ms()
        now_ms, sent = sample
        return now_ms + int((self._monotonic() - sent) * 1000)
