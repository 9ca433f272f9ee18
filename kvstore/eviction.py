"""Eviction policies: one vocabulary for everything that evicts (the master's tiers, the simulator).

A policy only ranks; the cache that uses it chooses the candidates, keeps what it knows of them
and does the freeing (mechanism vs policy, as SGLang's ``evict_policy.py`` and LMCache's
``base_policy.py``). What a policy may look at is a :class:`Candidate`: when an entry was last
used, how often, how big. From that it gives a sort key, and the smallest key goes first.

Two users ask for ranks the way that suits them, through the same policies:

* the master's tier manager (:mod:`kvstore.master.tiering`) ranks a batch,
  :meth:`EvictionPolicy.rank` over the evictable objects of a segment (unleased, unpinned,
  not moving), and deletes or demotes the first few;
* the simulator's block caches (:mod:`kvstore.sim.policies`) keep a heap of their blocks keyed
  by :meth:`EvictionPolicy.key`, pushed on every touch, and pop the victim.

So "lru" means one thing wherever it is named. Policies are looked up by name in
:data:`EVICTION_POLICIES`; add one by adding an entry. A cache that records more than a
:class:`Candidate` holds may add policies that read it, in a dict of its own that extends this
one (the simulator's ``length-aware`` reads a block's depth in its prompt).

Why in the core: the master and the simulator both rank, and neither may import the other (the
master is below the top layer; the simulator stands beside the router, not on the master).
"""

from __future__ import annotations

import abc
import heapq
from collections.abc import Callable, Iterable
from typing import ClassVar, Protocol, TypeVar

from kvstore.errors import InvalidRequestError


class Candidate(Protocol):
    """What a policy may look at (the master's ``ObjectMeta`` and the simulator's block records)."""

    last_access: float
    hits: int
    size: int


C = TypeVar("C", bound=Candidate)


class EvictionPolicy(abc.ABC):
    """Ranks candidates by :meth:`key`: the smallest key is evicted first.

    Keys are tuples so that a policy can name its tie-breaks; candidates whose keys tie are
    ranked in no promised order (callers that need one add their own tie-break after the key).
    """

    #: The name the policy is looked up by (a key of :data:`EVICTION_POLICIES`).
    name: ClassVar[str]

    @abc.abstractmethod
    def key(self, candidate: Candidate) -> tuple[float, ...]:
        """The sort key of ``candidate``; smaller is evicted sooner."""

    def rank(self, candidates: Iterable[C], limit: int) -> list[C]:
        """Up to ``limit`` candidates, the first to evict first."""
        return heapq.nsmallest(limit, candidates, key=self.key)


class LruPolicy(EvictionPolicy):
    """Least recently used first (ties: larger entries first, they free more)."""

    name = "lru"

    def key(self, candidate: Candidate) -> tuple[float, ...]:
        return (candidate.last_access, -candidate.size)


class LfuPolicy(EvictionPolicy):
    """Least frequently used first; among equals, least recently used."""

    name = "lfu"

    def key(self, candidate: Candidate) -> tuple[float, ...]:
        return (candidate.hits, candidate.last_access)


#: Eviction policies by name: each entry makes a fresh policy.
EVICTION_POLICIES: dict[str, Callable[[], EvictionPolicy]] = {
    LruPolicy.name: LruPolicy,
    LfuPolicy.name: LfuPolicy,
}


def make_policy(name: str) -> EvictionPolicy:
    """The policy called ``name``.

    Raises:
        InvalidRequestError: for a name not in :data:`EVICTION_POLICIES`.
    """
    factory = EVICTION_POLICIES.get(name)
    if factory is None:
        raise InvalidRequestError(
            f"unknown eviction policy {name!r}; known: {', '.join(sorted(EVICTION_POLICIES))}"
        )
    return factory()
