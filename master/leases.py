"""Read leases, pins, and space whose release waits for a lease to end.

- A **lease** is what ``get_locations`` grants a reader: until it ends, the object is not chosen
  for eviction, and space it occupied (after a remove, an overwrite or a move) is not reused.
  The node checks the read grant's expiry, which equals the lease's, so a read after the lease
  fails cleanly instead of seeing reused space. ``exists`` takes no lease (a probe that renewed
  leases could stall eviction forever). The master holds freed space ``grace`` seconds past the
  lease to cover clock skew between it and the nodes.
- A **pin** keeps an object from eviction: a soft pin until its TTL ends (evicted last, and only
  under pressure), a hard pin until unpinned or its TTL ends. Every pin has a TTL, so a pin its
  owner forgot expires; nothing leaks.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Any

from kvstore.errors import InvalidRequestError

PIN_NONE = 0
PIN_SOFT = 1
PIN_HARD = 2


def check_pin_ttl(ttl_s: object, max_ttl_s: float) -> float:
    """Raises InvalidRequestError unless ``0 < ttl_s <= max_ttl_s``."""
    if not isinstance(ttl_s, int | float) or isinstance(ttl_s, bool) or not 0 < ttl_s <= max_ttl_s:
        raise InvalidRequestError(f"pin ttl must be in (0, {max_ttl_s:g}] seconds, got {ttl_s!r}")
    return float(ttl_s)


@dataclass(order=True, slots=True)
class _Held:
    release_at: float
    seq: int
    owner: Any = field(compare=False)  # the Node record: a re-registered node is another one
    replica: Any = field(compare=False)


class DeferredFrees:
    """Space to free once the leases that cover it have ended. A heap ordered by release time."""

    def __init__(self) -> None:
        self._heap: list[_Held] = []
        self._seq = 0

    def hold(self, release_at: float, owner: Any, replica: Any) -> None:
        self._seq += 1
        heapq.heappush(self._heap, _Held(release_at, self._seq, owner, replica))

    def due(self, now: float) -> list[tuple[Any, Any]]:
        """Pop and return ``(owner, replica)`` of everything whose time has come."""
        out: list[tuple[Any, Any]] = []
        while self._heap and self._heap[0].release_at <= now:
            h = heapq.heappop(self._heap)
            out.append((h.owner, h.replica))
        return out

    def held_for(self, owner: Any) -> list[Any]:
        """The replicas held for ``owner`` (freed, waiting for their leases to end)."""
        return [h.replica for h in self._heap if h.owner is owner]

    def held_bytes(self) -> int:
        return sum(h.replica.size for h in self._heap)

    def __len__(self) -> int:
        return len(self._heap)
