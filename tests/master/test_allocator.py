"""The offset allocator against a naive byte map."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.errors import InvalidRequestError
from kvstore.master.allocator import PAGE_UNITS, OffsetAllocator

CAP = 4096


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 900)), max_size=80))
def test_never_overlaps_and_coalesces(ops: list[tuple[bool, int]]) -> None:
    a = OffsetAllocator(CAP, alignment=64)
    owned = bytearray(CAP)  # naive model: 1 where allocated
    live: dict[int, int] = {}
    for is_alloc, n in ops:
        if is_alloc or not live:
            off = a.allocate(n)
            need = a.reserved_size(n)
            if off is None:
                # Must be a true "no room": no free run of `need` aligned bytes exists.
                runs = bytes(owned).split(b"\x01")
                assert all(len(r) < need for r in runs)
                continue
            assert off % 64 == 0 and off + need <= CAP
            assert not any(owned[off : off + need]), "overlap"
            owned[off : off + need] = b"\x01" * need
            live[off] = need
        else:
            off = sorted(live)[n % len(live)]
            a.free(off)
            size = live.pop(off)
            owned[off : off + size] = bytes(size)
        assert a.used_bytes == sum(live.values())
    for off in list(live):
        a.free(off)
    assert a.free_bytes == CAP and a.num_free_extents == 1 and a.largest_free == CAP


def test_zero_byte_objects_get_a_home_and_best_fit_keeps_big_extents() -> None:
    a = OffsetAllocator(1024, alignment=64)
    z = a.allocate(0)
    assert z is not None and a.used_bytes == 64
    x = a.allocate(64)
    assert x is not None
    a.free(z)  # a 64-byte hole at the start
    assert a.allocate(10) == z, "best fit must reuse the small hole"


def test_allocate_at() -> None:
    a = OffsetAllocator(1024, alignment=64)
    assert a.allocate_at(128, 100)
    assert not a.allocate_at(192, 10)  # overlaps [128, 256)
    assert not a.allocate_at(100, 10)  # unaligned
    assert not a.allocate_at(1024, 1)
    a.free(128)
    assert a.num_free_extents == 1


def test_bad_use() -> None:
    a = OffsetAllocator(1024)
    with pytest.raises(InvalidRequestError):
        a.free(0)
    with pytest.raises(InvalidRequestError):
        a.allocate(-1)
    with pytest.raises(InvalidRequestError):
        OffsetAllocator(1024, alignment=3)
    assert a.allocate(2048) is None


def test_one_unit_allocations_across_pages_are_tracked_and_their_pages_dropped() -> None:
    """One-unit allocations live in bitmap pages (allocator.py): each is known, a bad or second
    free of one fails, and a page goes when its last allocation does."""
    a = OffsetAllocator(3 * PAGE_UNITS * 64, alignment=64)
    offs = [a.allocate(16) for _ in range(2 * PAGE_UNITS + 10)]
    assert offs == [i * 64 for i in range(len(offs))] and all(a.is_allocated(o) for o in offs)
    assert not a.is_allocated(offs[-1] + 64) and not a.is_allocated(32) and not a.is_allocated(-64)
    big = a.allocate(1000)
    assert big is not None and a.is_allocated(big)
    for o in offs[::2]:
        a.free(o)
    for bad in (offs[0], 32, offs[-1] + 64 * 4, -64):
        with pytest.raises(InvalidRequestError):
            a.free(bad)
    for o in offs[1::2]:
        a.free(o)
    a.free(big)
    assert a.used_bytes == 0 and a.largest_free == a.capacity and not a._unit_pages
    assert a.allocate_at(64 * 5, 1) and a.is_allocated(64 * 5) and a.used_bytes == 64


@settings(max_examples=150, deadline=None)
@given(
    st.lists(st.tuples(st.booleans(), st.integers(0, 300)), max_size=40),
    st.integers(0, 300),
    st.integers(0, 80),
)
def test_a_run_allocated_together_gets_what_one_allocation_each_would(
    ops: list[tuple[bool, int]], size: int, count: int
) -> None:
    """``allocate_many`` (a put batch's run of one size) gives the offsets, in order, of
    ``count`` calls of ``allocate`` on the same free extents, fewer only when room runs out;
    each is known as allocated, and freeing them one by one leaves what was there before."""
    together, one_each = OffsetAllocator(CAP, alignment=64), OffsetAllocator(CAP, alignment=64)
    live: list[int] = []
    for is_alloc, n in ops:  # the same fragmented history on both
        if is_alloc or not live:
            off = together.allocate(n)
            assert one_each.allocate(n) == off
            if off is not None:
                live.append(off)
        else:
            off = live.pop(n % len(live))
            together.free(off)
            one_each.free(off)
    before = (together.used_bytes, together.num_free_extents, together.largest_free)
    got = together.allocate_many(size, count)
    expected = [one_each.allocate(size) for _ in range(count)]
    assert got == [o for o in expected if o is not None]
    assert None not in expected[: len(got)], "a run stops only where room runs out"
    assert len(got) >= min(count, before[2] // together.reserved_size(size))
    assert together.used_bytes == one_each.used_bytes
    assert all(together.is_allocated(o) for o in got)
    for off in got:
        together.free(off)
    assert (together.used_bytes, together.num_free_extents, together.largest_free) == before


def test_a_run_of_one_unit_objects_crosses_bitmap_pages() -> None:
    a = OffsetAllocator(3 * PAGE_UNITS * 64, alignment=64)
    first = a.allocate(1000)
    offs = a.allocate_many(16, 2 * PAGE_UNITS + 10)
    assert offs == [1024 + i * 64 for i in range(2 * PAGE_UNITS + 10)]
    assert all(a.is_allocated(o) for o in offs) and not a.is_allocated(offs[-1] + 64)
    assert a.used_bytes == 1024 + 64 * len(offs)
    for o in offs:
        a.free(o)
    assert first == 0 and not a._unit_pages and a.used_bytes == 1024
