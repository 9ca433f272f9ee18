"""Read leases, pins, and space whose release waits for a lease to end.

- A **lease** is what ``get_locations`` grants a reader: until it ends, the object is not chosen
  for eviction, and space it occupied (after a remove, an overwrite or a move) is not reused.
  The node checks the read grant's expiry, which equals the lease's, so a read after the lease
  fails cleanly instead of seeing reused space. ``exists`` takes no lease (a probe that renewed
  leases could stall eviction forever). The master holds freed space ``grace`` seconds past the
  lease to cover clock skew between it and the nodes.
- A lease is **counted per reader** (``ObjectMeta.readers``) and named by a token
  (:class:`ReadLeases`). A reader gives it back when its read is done (``release_leases``, or
  piggybacked on its next request); once no lease of an object is outstanding, the object may
  be evicted and space freed under it is freed at once. A lease never given back (a crashed
  client) still ends at ``lease_s``. Releasing a token twice, late (after its lease ended) or
  one this master never issued changes nothing, and one reader's release never ends another
  reader's lease of the same object: every lease has its own token and is released once.
- A lease batch has an **owner**: the tenant whose keys it leased (None: the operator's, or a
  batch of no tenant's keys, :func:`lease_owner`). A tenant's connection gives back only its
  own tenant's tokens (tokens run in sequence within a term, so another's are guessable); any
  other token of its release changes nothing, as an unknown one. The operator's connection
  (and the master itself) may give back any token.
- A **pin** keeps an object from eviction: a soft pin until its TTL ends (evicted last, and only
  under pressure), a hard pin until unpinned or its TTL ends. Every pin has a TTL, so a pin its
  owner forgot expires; nothing leaks.
"""

from __future__ import annotations

import collections
import heapq
import random
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from kvstore.errors import InvalidRequestError
from kvstore.tenants import MARK, owner_of, prefix_of

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
    lease_of: Any = field(compare=False, default=None)  # the ObjectMeta whose leases cover it
    done: bool = field(compare=False, default=False)  # freed early: its readers gave leases back


class DeferredFrees:
    """Space to free once the leases that cover it have ended. A heap ordered by release time.

    An entry also ends early, when the last reader of the object it belongs to gives its lease
    back (:meth:`release_for`): it is marked done in place and skipped when the heap reaches it
    (lazy deletion: no O(n) removal from the middle of a heap).
    """

    def __init__(self) -> None:
        self._heap: list[_Held] = []
        self._seq = 0
        self._num_live = 0
        # id(ObjectMeta) -> its live entries; only objects with held space appear here. (The
        # entries reference the ObjectMeta, so its id cannot be reused while it is a key.)
        self._by_obj: dict[int, list[_Held]] = {}

    def hold(self, release_at: float, owner: Any, replica: Any, lease_of: Any = None) -> None:
        """Hold ``replica`` (on node record ``owner``) until ``release_at``, or until every
        lease of ``lease_of`` has been given back, whichever comes first."""
        self._seq += 1
        held = _Held(release_at, self._seq, owner, replica, lease_of)
        heapq.heappush(self._heap, held)
        self._num_live += 1
        if lease_of is not None:
            self._by_obj.setdefault(id(lease_of), []).append(held)

    def _end(self, held: _Held) -> None:
        held.done = True
        self._num_live -= 1
        if held.lease_of is not None:
            mine = self._by_obj.get(id(held.lease_of))
            if mine is not None:
                mine.remove(held)
                if not mine:
                    del self._by_obj[id(held.lease_of)]

    def due(self, now: float) -> list[tuple[Any, Any]]:
        """Pop and return ``(owner, replica)`` of everything whose time has come."""
        out: list[tuple[Any, Any]] = []
        while self._heap and self._heap[0].release_at <= now:
            h = heapq.heappop(self._heap)
            if not h.done:
                self._end(h)
                out.append((h.owner, h.replica))
        return out

    def release_for(self, lease_of: Any, release_at: float) -> list[tuple[Any, Any]]:
        """The last lease of ``lease_of`` was given back: its held space may go at
        ``release_at`` (now, or a little later where an unreleased lease ended too recently
        for the nodes' clocks). Returns ``(owner, replica)`` of what may be freed now."""
        mine = self._by_obj.get(id(lease_of))
        if not mine:
            return []
        out: list[tuple[Any, Any]] = []
        for h in list(mine):
            if h.release_at <= release_at:
                continue  # due by then anyway
            self._end(h)
            if release_at > 0:
                self.hold(release_at, h.owner, h.replica)
            else:
                out.append((h.owner, h.replica))
        return out

    def held_for(self, owner: Any) -> list[Any]:
        """The replicas held for ``owner`` (freed, waiting for their leases to end)."""
        return [h.replica for h in self._heap if h.owner is owner and not h.done]

    def held_until(self, owner: Any) -> list[tuple[float, Any]]:
        """``(release_at, replica)`` of what is held for ``owner``."""
        return [(h.release_at, h.replica) for h in self._heap if h.owner is owner and not h.done]

    def held_bytes(self) -> int:
        return sum(h.replica.size for h in self._heap if not h.done)

    def __len__(self) -> int:
        return self._num_live


#: Tokens per ``get_locations`` batch: the token of the batch's i-th key is ``batch id * span
#: + i`` (one table entry per batch, not per key). A batch never holds more keys than this.
LEASE_BATCH_SPAN = 1 << 24
MAX_LEASE_TOKEN = (1 << 64) - 1


def check_lease_tokens(tokens: object, max_items: int) -> list[int]:
    """The tokens of a ``release`` list, checked.

    Raises:
        InvalidRequestError: not a list of at most ``max_items`` unsigned 64-bit integers.
    """
    if not isinstance(tokens, list) or len(tokens) > max_items:
        raise InvalidRequestError(f"release must be a list of at most {max_items} lease tokens")
    for t in tokens:
        if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t <= MAX_LEASE_TOKEN:
            raise InvalidRequestError(f"a lease token is an unsigned 64-bit integer, got {t!r}")
    return tokens


def lease_owner(keys: Iterable[bytes]) -> str | None:
    """The tenant a batch of stored keys is read for: the one tenant whose keys it names, or
    None (the operator's) when it names no tenant's key or several tenants' keys.

    NOTE: a tenant's batch of shared-namespace keys only (stored as named) is None's: only the
    operator gives it back, and its leases end at ``lease_s`` (never another tenant's release).
    """
    owner: str | None = None
    prefix = b""  # the owner's (a slice test per key, not a parse)
    for key in keys:
        if key[:1] == MARK and not (prefix and key.startswith(prefix)):
            if prefix:
                return None  # a second tenant's key
            owner = owner_of(key)
            if owner is None:
                return None
            prefix = prefix_of(owner)
    return owner


@dataclass(slots=True)
class _LeaseBatch:
    until: float  # monotonic end of every lease of the batch
    objs: list[Any]  # per key its ObjectMeta; None: no lease there (a miss) or given back
    num_live: int
    owner: str | None = None  # the tenant that may give it back besides the operator


class ReadLeases:
    """The read leases outstanding: one entry per ``get_locations`` batch, a counter per object.

    Each lease adds one to its object's ``readers`` and names itself by a token; a release or
    the lease's end takes the one back, exactly once (the token's slot is cleared). So an
    object is leased while ``readers > 0`` and its ``lease_until`` has not passed; the service
    acts when the count drops to zero (:meth:`release`, :meth:`expire` return those objects).

    Why a batch table and a counter, not a set of readers per object: the master holds millions
    of objects and few outstanding reads; an object costs one int slot, a batch one dict entry.
    Batches end in the order they were issued (every lease lasts ``lease_s``), so expiry pops a
    FIFO queue: O(1) per lease.

    Token numbering starts at a random batch id per master term, so a token of an earlier term
    (a client that followed a failover) almost surely names nothing here (and changes nothing).
    """

    def __init__(self, first_batch: int | None = None) -> None:
        self._batches: dict[int, _LeaseBatch] = {}
        self._order: collections.deque[int] = collections.deque()
        self._next = first_batch if first_batch is not None else random.randrange(1, 1 << 32)
        self.num_outstanding = 0
        self.num_granted = 0
        self.num_released = 0
        self.num_expired = 0
        #: The latest end of a lease that expired without being given back: a reader may still
        #: be reading with its grant (nodes' clocks may lag), so space it covered waits for it.
        self.last_unreleased_end = 0.0

    def grant(self, objs: list[Any], until: float, owner: str | None = None) -> int:
        """Lease each object of ``objs`` (None: none) until ``until``, for ``owner`` (a
        tenant; None: the operator).

        Returns:
            The token of ``objs[0]`` (that of ``objs[i]`` is it plus ``i``); 0 when nothing
            was leased.
        """
        assert len(objs) < LEASE_BATCH_SPAN, "a lease batch larger than its token span"
        num_live = 0
        for obj in objs:
            if obj is not None:
                obj.readers += 1
                num_live += 1
        if not num_live:
            return 0
        batch_id = self._next
        self._next += 1
        self._batches[batch_id] = _LeaseBatch(until, objs, num_live, owner)
        self._order.append(batch_id)
        self.num_outstanding += num_live
        self.num_granted += num_live
        return batch_id * LEASE_BATCH_SPAN

    def release(
        self, tokens: Iterable[int], tenant: str | None = None
    ) -> tuple[list[bool], list[Any]]:
        """Give leases back, for ``tenant`` (None: the operator, who may give back any).

        Returns:
            Per token whether it ended a lease (False: unknown, ended, released already, or
            not ``tenant``'s); and the objects whose last outstanding lease that was.
        """
        ended: list[bool] = []
        emptied: list[Any] = []
        for token in tokens:
            batch_id, i = divmod(token, LEASE_BATCH_SPAN)
            batch = self._batches.get(batch_id)
            obj = batch.objs[i] if batch is not None and i < len(batch.objs) else None
            if obj is None or (tenant is not None and batch.owner != tenant):  # type: ignore[union-attr]
                ended.append(False)
                continue
            batch.objs[i] = None
            batch.num_live -= 1
            if not batch.num_live:
                del self._batches[batch_id]
                while self._order and self._order[0] not in self._batches:
                    self._order.popleft()  # (ids given back out of order wait for expire)
            self.num_outstanding -= 1
            self.num_released += 1
            obj.readers -= 1
            if not obj.readers:
                emptied.append(obj)
            ended.append(True)
        return ended, emptied

    def expire(self, now: float) -> list[Any]:
        """End every lease whose time has come. Returns the objects left with no lease."""
        emptied: list[Any] = []
        while self._order:
            batch_id = self._order[0]
            batch = self._batches.get(batch_id)
            if batch is not None and batch.until > now:
                break
            self._order.popleft()
            if batch is None:
                continue  # given back whole already
            del self._batches[batch_id]
            self.last_unreleased_end = max(self.last_unreleased_end, batch.until)
            for obj in batch.objs:
                if obj is None:
                    continue
                self.num_outstanding -= 1
                self.num_expired += 1
                obj.readers -= 1
                if not obj.readers:
                    emptied.append(obj)
        return emptied

    def stats(self) -> dict[str, int]:
        return {
            "num_outstanding": self.num_outstanding,
            "num_granted": self.num_granted,
            "num_released": self.num_released,
            "num_expired": self.num_expired,
        }
