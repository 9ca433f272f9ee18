"""Block caches with a pluggable eviction policy, and the policies by name.

Mechanism vs policy: :class:`BlockCache` owns which blocks are present, prefix matching and
the capacity; an :class:`EvictionPolicy` only ranks the present blocks and names the next
victim. Policies are looked up by name in :data:`POLICIES`.

Prefix rules (the prefix index's): block keys are chained, so a request can reuse blocks
``0..k-1`` only if every one of them is present; the hit of a request is the longest such
prefix. An access touches every block of the request from the last to the first, so the head
of a chain is the most recently used and, under LRU, the deeper blocks of a chain go first
(the leaves of the radix tree). Blocks are evicted once the whole request is in, down to the
capacity (for LRU this equals evicting one block per insert).
"""

from __future__ import annotations

import abc
import heapq
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Protocol

from kvstore.errors import InvalidRequestError

BlockKey = Hashable


class EvictionPolicy(Protocol):
    """Ranks the blocks of one cache. The cache tells it about every touch and removal."""

    def touch(self, key: BlockKey, depth: int) -> None:
        """Record an insert or a use of ``key``, the ``depth``-th block (0-based) of its chain."""

    def remove(self, key: BlockKey) -> None:
        """Forget ``key`` (it was evicted)."""

    def victim(self) -> BlockKey:
        """The block to evict next. Only called while at least one block is present."""


class LRUPolicy:
    """Least recently used first.

    NOTE: an ``OrderedDict`` is a hash map threaded on a doubly linked list, so touch, remove
    and victim are all O(1); a heap would make touch O(log n) and leave stale entries.
    """

    def __init__(self) -> None:
        self._order: OrderedDict[BlockKey, None] = OrderedDict()

    def touch(self, key: BlockKey, depth: int) -> None:
        order = self._order
        if key in order:
            order.move_to_end(key)
        else:
            order[key] = None

    def remove(self, key: BlockKey) -> None:
        del self._order[key]

    def victim(self) -> BlockKey:
        return next(iter(self._order))


class _HeapPolicy(abc.ABC):
    """A min-heap of (priority, tick, key) with lazy deletion.

    NOTE: a touch pushes a new entry and leaves the old one in the heap; ``_current[key]`` holds
    the live entry, and ``victim`` pops entries that are no longer live. The heap is rebuilt
    when stale entries outnumber live ones 3 to 1, so memory stays O(live blocks) and every
    operation is O(log n) amortised. The unique tick breaks ties, so keys are never compared.
    """

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, BlockKey]] = []
        self._current: dict[BlockKey, tuple[float, int]] = {}
        self._tick = 0

    @abc.abstractmethod
    def _priority(self, key: BlockKey, depth: int, tick: int) -> float:
        """Rank of ``key`` after this touch; the smallest is evicted first."""

    def touch(self, key: BlockKey, depth: int) -> None:
        self._tick += 1
        priority = self._priority(key, depth, self._tick)
        self._current[key] = (priority, self._tick)
        heapq.heappush(self._heap, (priority, self._tick, key))
        if len(self._heap) > 4 * len(self._current) + 1024:
            self._heap = [(p, t, k) for k, (p, t) in self._current.items()]
            heapq.heapify(self._heap)

    def remove(self, key: BlockKey) -> None:
        del self._current[key]

    def victim(self) -> BlockKey:
        heap = self._heap
        while heap:
            priority, tick, key = heap[0]
            if self._current.get(key) == (priority, tick):
                return key
            heapq.heappop(heap)
        raise AssertionError("victim() called on an empty cache")


class LFUPolicy(_HeapPolicy):
    """Least frequently used first; ties go to the least recently used.

    A block's count starts at 1 when it enters and is forgotten when it is evicted.
    """

    def __init__(self) -> None:
        super().__init__()
        self._counts: dict[BlockKey, int] = {}

    def _priority(self, key: BlockKey, depth: int, tick: int) -> float:
        count = self._counts.get(key, 0) + 1
        self._counts[key] = count
        return float(count)

    def remove(self, key: BlockKey) -> None:
        super().remove(key)
        del self._counts[key]


class LengthAwarePolicy(_HeapPolicy):
    """LRU in which deeper blocks age faster: priority = last touch - ``ticks_per_depth`` x depth.

    The head of a prompt is what later requests share (system prompts, earlier turns of a
    conversation); the tail of a long prompt is usually its own. So a block ``depth`` blocks
    into its chain is ranked as if it had been used ``ticks_per_depth * depth`` block touches
    earlier, and long prompts give up their tails before short prompts lose anything.

    Args:
        ticks_per_depth: how much older one block of depth makes a block look (>= 0; 0 is LRU).
    """

    def __init__(self, ticks_per_depth: float = 16.0) -> None:
        if ticks_per_depth < 0:
            raise InvalidRequestError(f"ticks_per_depth must be >= 0, got {ticks_per_depth}")
        super().__init__()
        self._ticks_per_depth = ticks_per_depth

    def _priority(self, key: BlockKey, depth: int, tick: int) -> float:
        return tick - self._ticks_per_depth * depth


#: Eviction policies by name.
POLICIES: dict[str, Callable[[], EvictionPolicy]] = {
    "lru": LRUPolicy,
    "lfu": LFUPolicy,
    "length-aware": LengthAwarePolicy,
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
        self._present: set[BlockKey] = set()
        self.num_evictions = 0

    def __len__(self) -> int:
        return len(self._present)

    def __contains__(self, key: object) -> bool:
        return key in self._present

    def match_prefix(self, keys: Sequence[BlockKey]) -> int:
        """Length of the longest prefix of ``keys`` held here. Changes nothing.

        Args:
            keys: the chained block keys of a request.

        Returns:
            How many leading blocks are present (0..len(keys)).
        """
        present = self._present
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
        present = self._present
        touch = self._policy.touch
        for depth in range(len(keys) - 1, -1, -1):
            key = keys[depth]
            present.add(key)
            touch(key, depth)
        capacity = self.capacity_blocks
        if capacity is not None:
            while len(present) > capacity:
                victim = self._policy.victim()
                self._policy.remove(victim)
                present.remove(victim)
                self.num_evictions += 1
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
