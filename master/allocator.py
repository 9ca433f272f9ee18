"""Space allocators of segments: the interface every tier's allocator implements, and the
offset allocator of the tiers with byte positions (DRAM, HBM).

:class:`SpaceAllocator` is what the rest of the master sees of a segment's space: placement,
eviction, heartbeats and recovery call only its methods, never ask which allocator they hold.
Its two implementations: :class:`OffsetAllocator` (here) and ``budget.ByteBudget`` (NVMe,
where lmdb places values itself and ids stand in for offsets).

Offset allocator: a free list with coalescing and best-fit placement.

Why two sorted lists rather than a heap or a tree: ``bisect`` over Python lists gives O(log n)
search and an O(n) but memmove-fast insert, which beats any pure-Python balanced tree up to the
~10^5 free extents a fragmented segment can reach. ``_starts`` finds a freed extent's neighbours
for coalescing; ``_by_size`` finds the smallest extent that fits (best fit keeps large extents
whole for large objects).

Why one-unit allocations live in a bitmap, not in the ``start -> size`` dict of the others: a
store of tiny objects (metadata, 16-byte values) has millions of them per segment, and a dict
entry costs ~42 bytes an allocation (~70 with its int key) where their size is implied. A bit in
a page of :data:`PAGE_UNITS` units says "a one-unit allocation starts here"; a page is made when
its first bit is set and dropped when its last is cleared, so a segment of large objects keeps
none, and a full page costs an eighth of a byte per allocation.
"""

from __future__ import annotations

import bisect
from typing import Protocol

from kvstore.errors import InvalidRequestError

DEFAULT_ALIGNMENT = 64
#: Alignment units per page of the one-unit bitmap (a page is ``PAGE_UNITS // 8`` bytes).
PAGE_UNITS = 4096
_PAGE_SHIFT = PAGE_UNITS.bit_length() - 1
_EMPTY_PAGE = bytes(PAGE_UNITS // 8)


class SpaceAllocator(Protocol):
    """A segment's space, as the master's placement and bookkeeping use it.

    Offsets are what a replica records: a byte position (``OffsetAllocator``) or an id
    (``ByteBudget``). Freed bytes may stay *in limbo* until the node confirms it dropped them
    (:meth:`acknowledge`): allocators that reuse positions at once have no limbo.
    """

    capacity: int
    used_bytes: int
    #: The unit byte offsets come in (their alignment); 0 where offsets are ids, not positions
    #: (what ``membership.Holding`` pages its index by).
    offset_unit: int

    @property
    def free_bytes(self) -> int: ...

    @property
    def largest_free(self) -> int:
        """The largest object (reserved size) one allocation can take now."""
        ...

    def reserved_size(self, size: int) -> int:
        """Bytes an object of ``size`` occupies."""
        ...

    def is_allocated(self, offset: int) -> bool: ...

    def allocate(self, size: int) -> int | None:
        """Reserve room for ``size`` bytes: the offset, or None when there is no room."""
        ...

    def allocate_many(self, size: int, count: int) -> list[int]:
        """Reserve room for ``count`` objects of ``size`` bytes, as ``count`` calls of
        :meth:`allocate` would (the same offsets): their offsets, fewer when room runs out.
        At least ``largest_free // reserved_size(size)`` of them always fit."""
        ...

    def allocate_at(self, offset: int, size: int) -> bool:
        """Reserve ``size`` bytes exactly at ``offset`` (re-admitting what a node reports)."""
        ...

    def free(self, offset: int) -> int:
        """Free an allocation. Returns the bytes that stay in limbo until acknowledged (0:
        none, the space is reusable now)."""
        ...

    def acknowledge(self, num_bytes: int) -> None:
        """The node dropped ``num_bytes`` of what was freed here (ends their limbo)."""
        ...

    def reserve_ids_through(self, offset: int) -> None:
        """A node still holds something at ``offset``: never hand it out again."""
        ...


class OffsetAllocator:
    """Hands out aligned, non-overlapping ``[offset, offset + size)`` ranges of ``capacity`` bytes.

    Not thread-safe; the master's event loop owns it.
    """

    def __init__(self, capacity: int, alignment: int = DEFAULT_ALIGNMENT) -> None:
        if capacity < 0:
            raise InvalidRequestError(f"capacity must be >= 0, got {capacity}")
        if alignment <= 0 or alignment & (alignment - 1):
            raise InvalidRequestError(f"alignment must be a power of two, got {alignment}")
        self.capacity = capacity - capacity % alignment
        self.alignment = alignment
        self.offset_unit = alignment
        self._starts: list[int] = []  # sorted starts of free extents
        self._size_at: dict[int, int] = {}  # free extent start -> size
        self._by_size: list[tuple[int, int]] = []  # sorted (size, start) of free extents
        self._allocated: dict[int, int] = {}  # start -> reserved size, over one unit
        self._unit_pages: dict[int, bytearray] = {}  # page -> bits of one-unit allocations
        self._unit_shift = alignment.bit_length() - 1
        self.used_bytes = 0
        if self.capacity:
            self._add_free(0, self.capacity)

    # ------------------------------------------------------------------ queries
    @property
    def free_bytes(self) -> int:
        return self.capacity - self.used_bytes

    @property
    def largest_free(self) -> int:
        return self._by_size[-1][0] if self._by_size else 0

    @property
    def num_free_extents(self) -> int:
        return len(self._starts)

    def reserved_size(self, size: int) -> int:
        """Bytes an object of ``size`` occupies (at least one aligned unit, so 0 B has a home)."""
        a = self.alignment
        return max(a, (size + a - 1) // a * a)

    def is_allocated(self, offset: int) -> bool:
        if offset in self._allocated:
            return True
        if offset < 0 or offset & (self.alignment - 1):
            return False
        unit = offset >> self._unit_shift
        page = self._unit_pages.get(unit >> _PAGE_SHIFT)
        return page is not None and bool(page[(unit & (PAGE_UNITS - 1)) >> 3] & 1 << (unit & 7))

    # ------------------------------------------------------------------ mutations
    def allocate(self, size: int) -> int | None:
        """Reserve room for ``size`` bytes.

        Returns:
            The offset, or None when no free extent is large enough.
        """
        if size < 0:
            raise InvalidRequestError(f"size must be >= 0, got {size}")
        need = self.reserved_size(size)
        i = bisect.bisect_left(self._by_size, (need, -1))
        if i == len(self._by_size):
            return None
        start = self._take(i, need)
        self._record(start, need)
        return start

    def allocate_many(self, size: int, count: int) -> list[int]:
        """Reserve room for ``count`` objects of ``size`` bytes at once (a batch of puts of one
        size): the offsets ``count`` calls of :meth:`allocate` would give, fewer when no free
        extent fits the rest.

        Best fit carves one object after another from the smallest extent that fits, and what
        is left of it stays the smallest that fits until it is too small: so each extent gives
        as many objects as it holds in one step, and a run of one-unit objects looks up each
        bitmap page once.
        """
        if size < 0:
            raise InvalidRequestError(f"size must be >= 0, got {size}")
        need = self.reserved_size(size)
        out: list[int] = []
        while len(out) < count:
            i = bisect.bisect_left(self._by_size, (need, -1))
            if i == len(self._by_size):
                break
            k = min(count - len(out), self._by_size[i][0] // need)
            start = self._take(i, k * need)
            offsets = range(start, start + k * need, need)
            self._record_run(offsets, need)
            out += offsets
        return out

    def allocate_at(self, offset: int, size: int) -> bool:
        """Reserve exactly ``[offset, offset + reserved_size(size))`` if it is free.

        Used when a master rebuilds its table from a node's manifest.
        """
        need = self.reserved_size(size)
        if offset < 0 or offset % self.alignment or offset + need > self.capacity:
            return False
        i = bisect.bisect_right(self._starts, offset) - 1
        if i < 0:
            return False
        start = self._starts[i]
        ext_size = self._size_at[start]
        if offset + need > start + ext_size:
            return False
        self._remove_free(start, ext_size)
        if offset > start:
            self._add_free(start, offset - start)
        if start + ext_size > offset + need:
            self._add_free(offset + need, start + ext_size - offset - need)
        self._record(offset, need)
        return True

    def free(self, offset: int) -> int:
        """Return an allocation to the free list, merging it with free neighbours.

        Returns:
            0: the bytes are reusable at once (no limbo).

        Raises:
            InvalidRequestError: ``offset`` is not the start of a live allocation.
        """
        size = self._allocated.pop(offset, None)
        if size is None:
            size = self._unrecord_unit(offset)
        self.used_bytes -= size
        start, end = offset, offset + size
        i = bisect.bisect_left(self._starts, start)
        # Right neighbour starts exactly where we end.
        if i < len(self._starts) and self._starts[i] == end:
            right = self._starts[i]
            end += self._size_at[right]
            self._remove_free(right, self._size_at[right])
        # Left neighbour ends exactly where we start.
        if i > 0:
            left = self._starts[i - 1]
            if left + self._size_at[left] == start:
                start = left
                self._remove_free(left, self._size_at[left])
        self._add_free(start, end - start)
        return 0

    def acknowledge(self, num_bytes: int) -> None:
        """Nothing to do: freed extents are reusable at once."""

    def reserve_ids_through(self, offset: int) -> None:
        """Nothing to do: an extent a node holds is reserved by :meth:`allocate_at`."""

    # ------------------------------------------------------------------ internals
    def _record(self, start: int, need: int) -> None:
        """Remember a new allocation: a bit when it is one unit, a dict entry otherwise."""
        self.used_bytes += need
        if need != self.alignment:
            self._allocated[start] = need
            return
        unit = start >> self._unit_shift
        page = self._unit_pages.get(unit >> _PAGE_SHIFT)
        if page is None:
            page = self._unit_pages[unit >> _PAGE_SHIFT] = bytearray(_EMPTY_PAGE)
        page[(unit & (PAGE_UNITS - 1)) >> 3] |= 1 << (unit & 7)

    def _take(self, i: int, taken: int) -> int:
        """Take the first ``taken`` bytes of the free extent ``_by_size[i]``: its start."""
        ext_size, start = self._by_size[i]
        if ext_size > taken:
            # The extent keeps its place among the starts (nothing free lies inside it): only
            # its start moves, and its size entry (a run of tiny puts splits one extent).
            rest, rest_size = start + taken, ext_size - taken
            self._starts[bisect.bisect_left(self._starts, start)] = rest
            del self._size_at[start]
            self._size_at[rest] = rest_size
            del self._by_size[i]
            bisect.insort(self._by_size, (rest_size, rest))
        else:
            self._remove_free(start, ext_size, by_size_index=i)
        return start

    def _record_run(self, offsets: range, need: int) -> None:
        """:meth:`_record` of each of ``offsets`` (consecutive allocations of ``need`` bytes)."""
        self.used_bytes += len(offsets) * need
        if need != self.alignment:
            self._allocated.update(dict.fromkeys(offsets, need))
            return
        shift, pages = self._unit_shift, self._unit_pages
        page_no, page = -1, bytearray()
        for unit in range(offsets.start >> shift, offsets.stop >> shift):
            if unit >> _PAGE_SHIFT != page_no:
                page_no = unit >> _PAGE_SHIFT
                page = pages.get(page_no)
                if page is None:
                    page = pages[page_no] = bytearray(_EMPTY_PAGE)
            page[(unit & (PAGE_UNITS - 1)) >> 3] |= 1 << (unit & 7)

    def _unrecord_unit(self, offset: int) -> int:
        """Forget the one-unit allocation at ``offset``. Returns its reserved size.

        Raises:
            InvalidRequestError: no allocation starts at ``offset``.
        """
        page = None
        if offset >= 0 and not offset & (self.alignment - 1):
            unit = offset >> self._unit_shift
            page = self._unit_pages.get(unit >> _PAGE_SHIFT)
        if page is None:
            raise InvalidRequestError(f"offset {offset} is not allocated")
        i, bit = (unit & (PAGE_UNITS - 1)) >> 3, 1 << (unit & 7)
        if not page[i] & bit:
            raise InvalidRequestError(f"offset {offset} is not allocated")
        page[i] &= ~bit & 0xFF
        if page == _EMPTY_PAGE:
            del self._unit_pages[unit >> _PAGE_SHIFT]
        return self.alignment

    def _add_free(self, start: int, size: int) -> None:
        bisect.insort(self._starts, start)
        self._size_at[start] = size
        bisect.insort(self._by_size, (size, start))

    def _remove_free(self, start: int, size: int, by_size_index: int | None = None) -> None:
        i = bisect.bisect_left(self._starts, start)
        assert self._starts[i] == start, "free-list index out of step"
        del self._starts[i]
        del self._size_at[start]
        if by_size_index is None:
            by_size_index = bisect.bisect_left(self._by_size, (size, start))
        assert self._by_size[by_size_index] == (size, start), "size index out of step"
        del self._by_size[by_size_index]
