"""Cache-only replays of a trace: hit rate of one pool, or of one cache per instance.

These ignore time (no queues, no SLOs): each request, in trace order, asks the cache for its
blocks and then stores them, which is what a prefix cache sees when every request is served.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvstore.errors import InvalidRequestError

from .policies import BlockCache, HitStats
from .trace import MOONCAKE_BLOCK_SIZE, TraceRequest

#: How requests are spread over per-instance caches.
ROUTINGS = ("round-robin", "cache-aware")


def replay_pool(
    requests: Sequence[TraceRequest],
    capacity_blocks: int | None,
    policy: str = "lru",
    block_size: int = MOONCAKE_BLOCK_SIZE,
) -> HitStats:
    """Replay ``requests`` through one shared cache.

    Args:
        requests: the trace.
        capacity_blocks: cache size in blocks, ``None`` for unlimited.
        policy: eviction policy name.
        block_size: tokens per block (for the token hit rate).

    Returns:
        Prefix-hit blocks over blocks asked for, and hit tokens over prompt tokens.

    Raises:
        InvalidRequestError: for a bad capacity or policy.
    """
    cache = BlockCache(capacity_blocks, policy)
    num_hit = num_blocks = num_hit_tokens = num_tokens = 0
    for request in requests:
        hit = cache.access(request.hash_ids)
        num_hit += hit
        num_blocks += len(request.hash_ids)
        # hash_ids are validated against input_length, so blocks are full but the last
        num_hit_tokens += min(hit * block_size, request.input_length)
        num_tokens += request.input_length
    return HitStats(num_hit, num_blocks, num_hit_tokens, num_tokens)


def replay_per_instance(
    requests: Sequence[TraceRequest],
    num_instances: int,
    capacity_blocks_each: int | None,
    policy: str = "lru",
    routing: str = "round-robin",
    block_size: int = MOONCAKE_BLOCK_SIZE,
) -> HitStats:
    """Replay ``requests`` over ``num_instances`` private caches (no sharing between them).

    Args:
        requests: the trace.
        num_instances: how many caches (>= 1).
        capacity_blocks_each: size of each cache in blocks, ``None`` for unlimited.
        policy: eviction policy name.
        routing: ``round-robin``, or ``cache-aware`` (the cache with the longest prefix hit;
            ties go to the cache that has served the fewest requests, then the lowest index).
        block_size: tokens per block (for the token hit rate).

    Returns:
        Prefix-hit blocks over blocks asked for, summed over the caches.

    Raises:
        InvalidRequestError: for a bad count, capacity, policy or routing.
    """
    if num_instances < 1:
        raise InvalidRequestError(f"num_instances must be >= 1, got {num_instances}")
    if routing not in ROUTINGS:
        raise InvalidRequestError(f"unknown routing {routing!r}; known: {', '.join(ROUTINGS)}")
    caches = [BlockCache(capacity_blocks_each, policy) for _ in range(num_instances)]
    served = [0] * num_instances
    num_hit = num_blocks = num_hit_tokens = num_tokens = 0
    for index, request in enumerate(requests):
        if routing == "round-robin":
            chosen = index % num_instances
        else:
            chosen = min(
                range(num_instances),
                key=lambda i: (-caches[i].match_prefix(request.hash_ids), served[i], i),
            )
        served[chosen] += 1
        hit = caches[chosen].access(request.hash_ids)
        num_hit += hit
        num_blocks += len(request.hash_ids)
        num_hit_tokens += min(hit * block_size, request.input_length)
        num_tokens += request.input_length
    return HitStats(num_hit, num_blocks, num_hit_tokens, num_tokens)
