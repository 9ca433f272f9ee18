"""The one eviction vocabulary: policies rank by key, are found by name, and rank a batch the way
their key orders it."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvstore.errors import InvalidRequestError
from kvstore.eviction import (
    EVICTION_POLICIES,
    EvictionPolicy,
    LfuPolicy,
    LruPolicy,
    make_policy,
)


@dataclass
class Entry:
    last_access: float
    hits: int
    size: int


def test_policies_are_found_by_their_own_name() -> None:
    assert set(EVICTION_POLICIES) == {"lru", "lfu"}
    for name in EVICTION_POLICIES:
        policy = make_policy(name)
        assert isinstance(policy, EvictionPolicy) and policy.name == name
    assert make_policy("lru") is not make_policy("lru")  # a fresh one each time


def test_unknown_policy_is_a_typed_error_naming_the_known_ones() -> None:
    with pytest.raises(
        InvalidRequestError, match=r"unknown eviction policy 'fifo'; known: lfu, lru"
    ):
        make_policy("fifo")


@pytest.mark.parametrize(
    ("policy", "first"),
    [
        (LruPolicy(), "old"),  # least recently used
        (LfuPolicy(), "cold"),  # least often used
    ],
)
def test_each_policy_names_its_victim(policy: EvictionPolicy, first: str) -> None:
    entries = {"old": Entry(1.0, 50, 10), "cold": Entry(5.0, 1, 10), "new": Entry(9.0, 9, 10)}
    ranked = policy.rank(entries.values(), 1)
    assert ranked == [entries[first]]


def test_lru_ties_go_to_the_larger_entry_and_lfu_ties_to_the_older() -> None:
    small, large = Entry(1.0, 1, 10), Entry(1.0, 1, 99)
    assert LruPolicy().rank([small, large], 1) == [large]
    older, newer = Entry(1.0, 3, 10), Entry(2.0, 3, 10)
    assert LfuPolicy().rank([newer, older], 1) == [older]


@given(
    entries=st.lists(
        st.builds(Entry, st.floats(0, 1e6), st.integers(0, 1000), st.integers(1, 1 << 20)),
        max_size=50,
    ),
    limit=st.integers(0, 60),
    name=st.sampled_from(sorted(EVICTION_POLICIES)),
)
def test_rank_is_the_key_order_cut_at_the_limit(
    entries: list[Entry], limit: int, name: str
) -> None:
    policy = make_policy(name)
    ranked = policy.rank(entries, limit)
    assert len(ranked) == min(limit, len(entries))
    keys = [policy.key(e) for e in ranked]
    assert keys == sorted(keys)
    if ranked and len(ranked) < len(entries):
        rest = [policy.key(e) for e in entries]
        assert sorted(rest)[len(ranked) - 1] == keys[-1]
