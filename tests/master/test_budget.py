"""The NVMe tier's space (kvstore.master.budget.ByteBudget): a byte budget with fresh ids, bytes
in limbo until the node confirms it dropped them, and the SpaceAllocator contract it shares with
the offset allocator."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.errors import InvalidRequestError
from kvstore.master.allocator import DEFAULT_ALIGNMENT, OffsetAllocator, SpaceAllocator
from kvstore.master.budget import ByteBudget

A = DEFAULT_ALIGNMENT


@pytest.mark.parametrize(
    ("size", "reserved"),
    [(0, A), (1, A), (A - 1, A), (A, A), (A + 1, 2 * A), (10 * A, 10 * A)],
)
def test_sizes_round_up_to_the_alignment(size: int, reserved: int) -> None:
    assert ByteBudget(1 << 20).reserved_size(size) == reserved


def test_ids_are_fresh_and_never_reused() -> None:
    budget = ByteBudget(4 * A)
    first = budget.allocate(A)
    assert first is not None and budget.is_allocated(first)
    assert budget.free(first) == A
    budget.acknowledge(A)
    second = budget.allocate(A)
    assert second is not None and second != first
    assert not budget.is_allocated(first), "a late forget of the old id touches nothing"


def test_freed_bytes_stay_in_limbo_until_acknowledged() -> None:
    budget = ByteBudget(2 * A)
    ids = [budget.allocate(A), budget.allocate(A)]
    assert budget.allocate(1) is None and budget.largest_free == 0
    for i in ids:
        assert i is not None
        budget.free(i)
    # The node's lmdb may still hold them: room for one capacity beyond them, no more.
    assert budget.free_bytes == 2 * A and budget.limbo_bytes == 2 * A
    assert budget.largest_free == 2 * A
    a, b = budget.allocate(A), budget.allocate(A)
    assert a is not None and b is not None
    budget.free(a)
    assert budget.largest_free == 0, "used + limbo may not pass twice the capacity"
    budget.acknowledge(3 * A)
    assert budget.limbo_bytes == 0 and budget.largest_free == A


def test_acknowledging_more_than_is_in_limbo_stops_at_zero() -> None:
    budget = ByteBudget(A)
    budget.acknowledge(10 * A)
    assert budget.limbo_bytes == 0 and budget.largest_free == A


def test_readmission_keeps_the_id_and_moves_new_ids_past_it() -> None:
    budget = ByteBudget(8 * A)
    assert budget.allocate_at(50, 100)
    assert budget.is_allocated(50) and budget.used_bytes == 2 * A
    assert not budget.allocate_at(50, 1), "an id already taken"
    assert not budget.allocate_at(0, 1) and not budget.allocate_at(-3, 1)
    assert not budget.allocate_at(60, 7 * A), "more than is free"
    fresh = budget.allocate(1)
    assert fresh is not None and fresh > 50


def test_ids_a_node_still_holds_are_never_handed_out() -> None:
    budget = ByteBudget(8 * A)
    budget.reserve_ids_through(1000)
    fresh = budget.allocate(1)
    assert fresh is not None and fresh > 1000
    budget.reserve_ids_through(5)  # never moves back
    again = budget.allocate(1)
    assert again is not None and again > fresh


@pytest.mark.parametrize(
    ("call", "args"),
    [("allocate", (-1,)), ("free", (1,)), ("__init__", (-1,))],
)
def test_misuse_is_refused(call: str, args: tuple[int, ...]) -> None:
    budget = ByteBudget(A)
    with pytest.raises(InvalidRequestError):
        if call == "__init__":
            ByteBudget(*args)
        else:
            getattr(budget, call)(*args)


def test_a_double_free_is_refused_and_changes_nothing() -> None:
    budget = ByteBudget(4 * A)
    i = budget.allocate(A)
    assert i is not None
    budget.free(i)
    with pytest.raises(InvalidRequestError):
        budget.free(i)
    assert (budget.used_bytes, budget.limbo_bytes) == (0, A)


# ---------------------------------------------------------------- properties
OPS = st.lists(
    st.one_of(
        st.tuples(st.just("alloc"), st.integers(0, 5 * A)),
        st.tuples(st.just("free"), st.integers(0, 50)),
        st.tuples(st.just("ack"), st.integers(0, 5 * A)),
    ),
    max_size=80,
)


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 16 * A), OPS)
def test_a_budget_never_hands_out_more_than_it_has(
    capacity: int, ops: list[tuple[str, int]]
) -> None:
    """Whatever the order of allocations, frees and acknowledgements: used bytes stay within
    the capacity and equal what the live ids reserved, used plus limbo within twice it, an
    allocation fails only when it would not fit, ids are never handed out twice, and freeing
    and acknowledging everything gives the whole capacity back."""
    budget = ByteBudget(capacity)
    live: dict[int, int] = {}
    ever: set[int] = set()
    for op, n in ops:
        if op == "alloc":
            room = budget.largest_free
            got = budget.allocate(n)
            if got is None:
                assert budget.reserved_size(n) > room
            else:
                assert got not in ever, "an id handed out twice"
                ever.add(got)
                live[got] = budget.reserved_size(n)
        elif op == "free" and live:
            victim = sorted(live)[n % len(live)]
            assert budget.free(victim) == live.pop(victim)
        elif op == "ack":
            budget.acknowledge(n)
        assert 0 <= budget.used_bytes <= budget.capacity
        assert budget.used_bytes == sum(live.values())
        assert budget.used_bytes + budget.limbo_bytes <= 2 * budget.capacity
        assert 0 <= budget.largest_free <= budget.free_bytes
    for i in list(live):
        budget.free(i)
    budget.acknowledge(budget.limbo_bytes)
    assert budget.free_bytes == budget.largest_free == capacity


# ---------------------------------------------------------------- the shared contract
def _allocators() -> list[SpaceAllocator]:
    return [ByteBudget(8 * A), OffsetAllocator(8 * A)]


@pytest.mark.parametrize("allocator", _allocators(), ids=["budget", "offsets"])
def test_both_allocators_keep_the_space_allocator_contract(allocator: SpaceAllocator) -> None:
    """What placement, eviction and recovery rely on, whichever allocator a segment has."""
    assert allocator.free_bytes == allocator.largest_free == allocator.capacity == 8 * A
    offsets = [allocator.allocate(A) for _ in range(8)]
    assert None not in offsets and len(set(offsets)) == 8
    assert allocator.allocate(0) is None, "full: even an empty object takes a unit"
    assert allocator.free_bytes == 0 and allocator.used_bytes == 8 * A
    first = offsets[0]
    assert first is not None and allocator.is_allocated(first)
    in_limbo = allocator.free(first)
    assert in_limbo in (0, A)
    assert not allocator.is_allocated(first) and allocator.free_bytes == A
    allocator.acknowledge(in_limbo)
    assert allocator.largest_free == A
    assert allocator.allocate(A) is not None
    with pytest.raises(InvalidRequestError):
        allocator.free(first if in_limbo else 10**9)


def test_a_run_of_ids_is_fresh_and_stops_where_the_budget_does() -> None:
    budget = ByteBudget(4 * A)
    first = budget.allocate(1)
    assert budget.allocate_many(1, 10) == [first + 1, first + 2, first + 3]
    assert budget.used_bytes == 4 * A and budget.allocate_many(1, 1) == []
