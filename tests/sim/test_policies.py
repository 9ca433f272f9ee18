from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.errors import InvalidRequestError
from kvstore.eviction import EVICTION_POLICIES
from kvstore.sim.policies import (
    POLICIES,
    BlockCache,
    BlockStats,
    LengthAwarePolicy,
    make_policy,
)
from kvstore.sim.replay import replay_per_instance, replay_pool
from kvstore.sim.trace import TraceRequest

from .factories import synthetic_trace


def naive_lru_hit_rate(requests: list[TraceRequest], capacity: int | None) -> float:
    """An independent LRU prefix replay: timestamps in a dict, victims by a full scan.

    Same rules as the spec in ``policies.py``: the hit is the longest present prefix; then
    every block is stamped, last block first, so the first block is the most recent; then the
    oldest stamps are dropped until the cache fits.
    """
    stamp: dict[int, int] = {}
    clock = 0
    hits = total = 0
    for request in requests:
        ids = request.hash_ids
        prefix = 0
        while prefix < len(ids) and ids[prefix] in stamp:
            prefix += 1
        hits += prefix
        total += len(ids)
        for block_id in reversed(ids):
            clock += 1
            stamp[block_id] = clock
        while capacity is not None and len(stamp) > capacity:
            oldest = min(stamp, key=stamp.__getitem__)
            del stamp[oldest]
    return hits / total


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 100_000),
    num=st.integers(1, 120),
    capacity=st.one_of(st.none(), st.integers(0, 40)),
)
def test_exact_lru_agrees_with_naive_replay_on_any_trace(seed: int, num: int, capacity) -> None:
    requests = synthetic_trace(seed, num)
    exact = replay_pool(requests, capacity, "lru").hit_rate
    assert exact == pytest.approx(naive_lru_hit_rate(requests, capacity), abs=0.01)


@pytest.mark.parametrize("capacity", [50, 400, 3_000, None])
def test_exact_lru_agrees_with_naive_replay_on_the_real_trace(real_trace, capacity) -> None:
    requests = real_trace[:1_500]
    exact = replay_pool(requests, capacity, "lru").hit_rate
    assert abs(exact - naive_lru_hit_rate(requests, capacity)) <= 0.01


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 100_000),
    capacity=st.integers(0, 30),
    policy=st.sampled_from(sorted(POLICIES)),
)
def test_every_policy_respects_capacity_and_prefix_rules(
    seed: int, capacity: int, policy: str
) -> None:
    cache = BlockCache(capacity, policy)
    for request in synthetic_trace(seed, 60):
        expected = 0
        while expected < len(request.hash_ids) and request.hash_ids[expected] in cache:
            expected += 1
        assert cache.match_prefix(request.hash_ids) == expected
        assert cache.access(request.hash_ids) == expected
        assert len(cache) <= capacity


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_unlimited_cache_hits_every_seen_prefix(policy: str) -> None:
    requests = synthetic_trace(7, 200)
    seen: set[int] = set()
    expected_hits = 0
    for request in requests:
        prefix = 0
        while prefix < len(request.hash_ids) and request.hash_ids[prefix] in seen:
            prefix += 1
        expected_hits += prefix
        seen.update(request.hash_ids)
    stats = replay_pool(requests, None, policy)
    assert stats.num_hit_blocks == expected_hits


@pytest.mark.parametrize(
    ("policy", "kept", "evicted"),
    [
        # a(0) b(1) first, c d after; a and c are used twice; cache of 3 must drop one block.
        ("lru", {"c", "d", "a"}, {"b"}),
        ("lfu", {"a", "c", "d"}, {"b"}),
    ],
)
def test_policy_victims(policy: str, kept: set[str], evicted: set[str]) -> None:
    cache = BlockCache(3, policy)
    cache.access(("a", "b"))
    cache.access(("a",))
    cache.access(("c", "d"))
    assert set(kept) <= {k for k in "abcd" if k in cache}
    assert not any(k in cache for k in evicted)


def test_length_aware_evicts_deep_blocks_before_fresh_shallow_ones() -> None:
    lru = BlockCache(4, "lru")
    aware = BlockCache(4, "length-aware")
    long_prompt = tuple(f"L{i}" for i in range(4))
    for cache in (lru, aware):
        cache.access(("S0",))
        cache.access(long_prompt)  # 5 blocks > 4: one must go
    assert "S0" not in lru  # plain LRU drops the oldest: the short prompt
    assert "S0" in aware and "L3" not in aware  # length-aware drops the deepest block


@pytest.mark.parametrize(
    ("call", "fragment"),
    [
        (lambda: make_policy("fifo"), "unknown cache policy 'fifo'"),
        (lambda: BlockCache(-1), "capacity_blocks must be >= 0"),
        (lambda: replay_per_instance([], 0, 10), "num_instances must be >= 1"),
        (lambda: replay_per_instance([], 1, 10, routing="random"), "unknown routing"),
    ],
)
def test_bad_arguments_are_typed_errors(call, fragment: str) -> None:
    with pytest.raises(InvalidRequestError, match=fragment):
        call()


def test_one_instance_equals_the_pool_and_the_pool_beats_private_caches() -> None:
    requests = synthetic_trace(3, 400)
    pool = replay_pool(requests, 40, "lru")
    for routing in ("round-robin", "cache-aware"):
        assert replay_per_instance(requests, 1, 40, "lru", routing) == pool
    private = replay_per_instance(requests, 4, 10, "lru", "round-robin")
    assert replay_pool(requests, 40, "lru").hit_rate >= private.hit_rate


def test_cache_aware_routing_keeps_conversations_together() -> None:
    requests = synthetic_trace(5, 400)
    rr = replay_per_instance(requests, 4, None, "lru", "round-robin").hit_rate
    aware = replay_per_instance(requests, 4, None, "lru", "cache-aware").hit_rate
    assert aware > rr


def test_the_simulator_ranks_with_the_stores_policies() -> None:
    """One vocabulary: "lru" and "lfu" are kvstore.eviction's, and every name makes a policy
    that calls itself by it."""
    for name, factory in EVICTION_POLICIES.items():
        assert POLICIES[name] is factory
    for name in POLICIES:
        assert make_policy(name).name == name


def test_block_records_are_candidates_the_store_can_rank() -> None:
    old, new = BlockStats(1, 5, 1, 0), BlockStats(2, 1, 1, 3)
    assert EVICTION_POLICIES["lru"]().rank([new, old], 1) == [old]
    assert EVICTION_POLICIES["lfu"]().rank([old, new], 1) == [new]
    assert LengthAwarePolicy(ticks_per_depth=1.0).rank([old, new], 1) == [new]  # 2 - 3 < 1


def test_negative_depth_weight_is_refused() -> None:
    with pytest.raises(InvalidRequestError, match="ticks_per_depth must be >= 0"):
        LengthAwarePolicy(ticks_per_depth=-1.0)


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_the_victim_heap_stays_bounded(policy: str) -> None:
    """Lazy deletion leaves stale heap entries; the cache rebuilds before they pile up."""
    cache = BlockCache(8, policy)
    for i in range(5_000):
        cache.access((i % 10, 100 + i % 3))
        assert len(cache) <= 8
        assert len(cache._heap) <= 4 * len(cache) + 1024 + 2
