"""Block caches with a pluggable eviction policy, and the policies by name.

Mechanism vs policy: :class:`BlockCache` owns which blocks are present, prefix matching, the
capacity and what it records of each block (:class:`BlockStats`); a policy only ranks. The
policies are the master's (:mod:`kvstore.eviction`: one vocabulary, so "lru" and "lfu" rank the
same way in the simulator as in the store), plus ``length-aware``, which reads what only a block
cache records: how deep a block sits in its prompt. Policies are looked up by name in
:data:`POLICIES`.

Prefix rules (the prefix index's): block keys are chained, so a request can reuse blocks
``0..k-1`` only if every one of them is present; the hit of a request is the longest such
prefix. An access touches every block of the request from the last to the first, so the head
of a chain is the most recently used and, under LRU, the deeper blocks of a chain go first
(the leaves of the radix tree). Blocks are evicted once the whole request is in, down to the
capacity (for LRU this equals evicting one block per insert).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any

from kvstore.errors import InvalidRequestError
from kvstore.eviction import EVICTION_POLICIES, EvictionPolicy

BlockKey = Hashable


@dataclass(slots=True)
class BlockStats:
    """What a :class:`BlockCache` records of one present block: a :class:`~kvstore.eviction.Candidate`.

    ``last_access`` is the cache's touch counter (unique per touch, so keys never tie on it),
    ``hits`` counts touches since the block entered (1 on entry, forgotten when it is evicted),
    every block has ``size`` 1, and ``depth`` is its 0-based index in the chain that last
    touched it.
    """

    last_access: float
    hits: int
    size: int
    depth: int


class LengthAwarePolicy(EvictionPolicy):
    """LRU in which deeper blocks age faster: key = last touch - ``ticks_per_depth`` x depth.

    The head of a prompt is what later requests share (system prompts, earlier turns of a
    conversation); the tail of a long prompt is usually its own. So a block ``depth`` blocks
    into its chain is ranked as if it had been used ``ticks_per_depth * depth`` block touches
    earlier, and long prompts give up their tails before short prompts lose anything. It ranks
    :class:`BlockStats` only (a master object has no depth), so only the simulator offers it.

    Args:
        ticks_per_depth: how much older one block of depth makes a block look (>= 0; 0 is LRU).
    """

    name = "length-aware"

    def __init__(self, ticks_per_depth: float = 16.0) -> None:
        if ticks_per_depth < 0:
            raise InvalidRequestError(f"ticks_per_depth must be >= 0, got {ticks_per_depth}")
        self._ticks_per_depth = ticks_per_depth

    def key(self, candidate: BlockStats) -> tuple[float, ...]:  # type: ignore[override]
        return (candidate.last_access - self._ticks_per_depth * candidate.depth,)


#: Eviction policies by name: the store's (:data:`kvstore.eviction.EVICTION_POLICIES`) and
#: ``length-aware``.
POLICIES: dict[str, Callable[[], EvictionPolicy]] = {
    **EVICTION_POLICIES,
    LengthAwarePolicy.name: LengthAwarePolicy,
}


def make_policy(name: str) -> EvictionPolicy:
    """Build a policy by name.

    Args:
        name: a key of :data:`POLICIES`.

    Returns:
        A fresh policy.

    Raises:
        InvalidRequestError: for an unknown name.
    """
    try:
        factory = POLICIES[name]
    except KeyError:
        known = ", ".join(sorted(POLICIES))
        raise InvalidRequestError(f"unknown cache policy {name!r}; known: {known}") from None
    return factory()


class BlockCache:
    """A set of blocks with a capacity, prefix matching, and a policy that picks victims.

    NOTE: victims come from a min-heap of ``(*policy key, touch, block)`` (flat: cheaper to compare) with lazy deletion: a
    touch pushes a new entry and leaves the old one; an entry is live while its touch is the
    block's ``last_access``, and eviction pops entries that are not. The heap is rebuilt when
    stale entries outnumber live ones 3 to 1, so memory stays O(present blocks) and every
    operation is O(log n) amortised, whatever the policy. The unique touch breaks ties, so
    block keys are never compared. An unlimited cache never evicts and keeps no heap.

    Args:
        capacity_blocks: most blocks held; ``None`` for unlimited.
        policy: a name from :data:`POLICIES`.

    Raises:
        InvalidRequestError: for a negative capacity or an unknown policy.
    """

    def __init__(self, capacity_blocks: int | None, policy: str = "lru") -> None:
        if capacity_blocks is not None and capacity_blocks < 0:
            raise InvalidRequestError(f"capacity_blocks must be >= 0, got {capacity_blocks}")
        self.capacity_blocks = capacity_blocks
        self.policy_name = policy
        self._policy = make_policy(policy)
        self._stats: dict[BlockKey, BlockStats] = {}
        self._heap: list[tuple[Any, ...]] = []  # (*policy key, touch, block)
        self._tick = 0
        self.num_evictions = 0

    def __len__(self) -> int:
        return len(self._stats)

    def __contains__(self, key: object) -> bool:
        return key in self._stats

    def match_prefix(self, keys: Sequence[BlockKey]) -> int:
        """Length of the longest prefix of ``keys`` held here. Changes nothing.

        Args:
            keys: the chained block keys of a request.

        Returns:
            How many leading blocks are present (0..len(keys)).
        """
        present = self._stats
        for index, key in enumerate(keys):
            if key not in present:
                return index
        return len(keys)

    def access(self, keys: Sequence[BlockKey]) -> int:
        """Match the prefix, then insert or touch every block and evict down to capacity.

        Args:
            keys: the chained block keys of a request.

        Returns:
            The prefix hit before the access (as :meth:`match_prefix`).
        """
        hit = self.match_prefix(keys)
        stats = self._stats
        capacity = self.capacity_blocks
        if capacity is None:  # nothing is ever evicted: only presence matters
            for key in keys:
                if key not in stats:
                    stats[key] = BlockStats(0, 0, 1, 0)
            return hit
        heap = self._heap
        rank = self._policy.key
        tick = self._tick
        for depth in range(len(keys) - 1, -1, -1):
            key = keys[depth]
            tick += 1
            record = stats.get(key)
            if record is None:
                record = stats[key] = BlockStats(tick, 1, 1, depth)
            else:
                record.last_access = tick
                record.hits += 1
                record.depth = depth
            heapq.heappush(heap, (*rank(record), tick, key))
        self._tick = tick
        while len(stats) > capacity:
            *_, touched, victim = heapq.heappop(heap)
            record = stats.get(victim)
            if record is not None and record.last_access == touched:
                del stats[victim]
                self.num_evictions += 1
        if len(heap) > 4 * len(stats) + 1024:
            self._heap = [(*rank(r), int(r.last_access), k) for k, r in stats.items()]
            heapq.heapify(self._heap)
        return hit


@dataclass(frozen=True, slots=True)
class HitStats:
    """Hits of a replay. ``hit_rate`` = hit blocks / blocks asked for; ``token_hit_rate``
    counts tokens instead (a prompt's last block is often partial), when tokens were counted.
    """

    num_hit_blocks: int
    num_blocks: int
    num_hit_tokens: int = 0
    num_tokens: int = 0

    @property
    def hit_rate(self) -> float:
        return self.num_hit_blocks / self.num_blocks if self.num_blocks else 0.0

    @property
    def token_hit_rate(self) -> float:
        return self.num_hit_tokens / self.num_tokens if self.num_tokens else 0.0
