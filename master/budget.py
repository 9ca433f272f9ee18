"""Space accounting for tiers without byte positions (NVMe/lmdb): a byte budget and unique ids.

lmdb finds room for a value itself, so the master needs no extents for the NVMe tier, only a
budget; an id names each object's lmdb records instead of an offset. Ids are never reused while
the master runs (and restart above everything a node reports), so a late ``forget`` for a freed
id can never delete a newer object. A :class:`~kvstore.master.allocator.SpaceAllocator`, like
:class:`~kvstore.master.allocator.OffsetAllocator`.
"""

from __future__ import annotations

from kvstore.errors import InvalidRequestError
from kvstore.master.allocator import DEFAULT_ALIGNMENT


class ByteBudget:
    """``capacity`` bytes handed out in units of ``alignment``, each allocation a fresh id."""

    def __init__(self, capacity: int, alignment: int = DEFAULT_ALIGNMENT) -> None:
        if capacity < 0:
            raise InvalidRequestError(f"capacity must be >= 0, got {capacity}")
        self.capacity = capacity
        self.alignment = alignment
        self.offset_unit = 0  # offsets are ids
        self.used_bytes = 0
        #: Bytes freed here that the node may not have deleted yet (its forget is in flight).
        #: lmdb still holds them, so ``used + limbo`` may not pass twice the capacity.
        self.limbo_bytes = 0
        self._allocated: dict[int, int] = {}
        self._next_id = 1

    @property
    def free_bytes(self) -> int:
        return self.capacity - self.used_bytes

    @property
    def largest_free(self) -> int:
        return max(0, min(self.free_bytes, 2 * self.capacity - self.used_bytes - self.limbo_bytes))

    def reserved_size(self, size: int) -> int:
        a = self.alignment
        return max(a, (size + a - 1) // a * a)

    def is_allocated(self, offset: int) -> bool:
        return offset in self._allocated

    def allocate(self, size: int) -> int | None:
        """Reserve ``size`` bytes. Returns a fresh id, or None when the budget is spent."""
        if size < 0:
            raise InvalidRequestError(f"size must be >= 0, got {size}")
        need = self.reserved_size(size)
        if need > self.largest_free:
            return None
        offset = self._next_id
        self._next_id += 1
        self._allocated[offset] = need
        self.used_bytes += need
        return offset

    def allocate_many(self, size: int, count: int) -> list[int]:
        """:meth:`allocate` ``count`` times: fresh ids, fewer when the budget runs out."""
        out: list[int] = []
        while len(out) < count:
            offset = self.allocate(size)
            if offset is None:
                break
            out.append(offset)
        return out

    def allocate_at(self, offset: int, size: int) -> bool:
        """Reserve ``size`` bytes under a known id (re-admitting what a node reports)."""
        need = self.reserved_size(size)
        if offset <= 0 or offset in self._allocated or need > self.free_bytes:
            return False
        self._allocated[offset] = need
        self.used_bytes += need
        self._next_id = max(self._next_id, offset + 1)
        return True

    def reserve_ids_through(self, offset: int) -> None:
        """Never hand out ``offset`` or anything below it (a node still holds records there)."""
        self._next_id = max(self._next_id, offset + 1)

    def free(self, offset: int) -> int:
        """Free an id; its bytes stay in limbo until :meth:`ack`. Returns them.

        Raises:
            InvalidRequestError: ``offset`` is not a live allocation.
        """
        need = self._allocated.pop(offset, None)
        if need is None:
            raise InvalidRequestError(f"id {offset} is not allocated")
        self.used_bytes -= need
        self.limbo_bytes += need
        return need

    def acknowledge(self, num_bytes: int) -> None:
        """The node has deleted ``num_bytes`` of freed objects."""
        self.limbo_bytes = max(0, self.limbo_bytes - num_bytes)
