"""Eviction policies: they only rank candidates; the tier manager (``tiering.py``) acts.

A policy sees committed objects that may be evicted (not leased, not hard-pinned, not moving)
and returns them best victim first. Soft-pinned objects are ranked separately and only after
every unpinned one, by the same policy. Policies are looked up by name in
:data:`EVICTION_POLICIES`; add one by adding an entry.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable
from typing import Protocol

from kvstore.errors import InvalidRequestError


class Candidate(Protocol):
    """What a policy may look at (``ObjectMeta`` provides it)."""

    last_access: float
    hits: int
    size: int


class EvictionPolicy(Protocol):
    name: str

    def rank(self, candidates: Iterable[Candidate], limit: int) -> list[Candidate]:
        """Up to ``limit`` candidates, the first to evict first."""
        ...


class LruPolicy:
    """Least recently used first (ties: larger objects first, they free more)."""

    name = "lru"

    def rank(self, candidates: Iterable[Candidate], limit: int) -> list[Candidate]:
        return heapq.nsmallest(limit, candidates, key=lambda c: (c.last_access, -c.size))


class LfuPolicy:
    """Least frequently used first; among equals, least recently used."""

    name = "lfu"

    def rank(self, candidates: Iterable[Candidate], limit: int) -> list[Candidate]:
        return heapq.nsmallest(limit, candidates, key=lambda c: (c.hits, c.last_access))


EVICTION_POLICIES: dict[str, type[LruPolicy] | type[LfuPolicy]] = {
    "lru": LruPolicy,
    "lfu": LfuPolicy,
}


def make_policy(name: str) -> EvictionPolicy:
    """Raises InvalidRequestError for a name not in :data:`EVICTION_POLICIES`."""
    cls = EVICTION_POLICIES.get(name)
    if cls is None:
        raise InvalidRequestError(
            f"unknown eviction policy {name!r}; known: {', '.join(sorted(EVICTION_POLICIES))}"
        )
    return cls()
