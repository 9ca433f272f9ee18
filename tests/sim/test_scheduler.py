from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.errors import InvalidRequestError
from kvstore.routing.cost import CostModel
from kvstore.routing.slo import SLOClass
from kvstore.sim.cluster import ClusterConfig, ClusterState
from kvstore.sim.scheduler import (
    ROUTERS,
    Router,
    SchedulerConfig,
    ScheduleRequest,
    make_router,
)

BS = 512
COST = CostModel()


def cluster(
    num_prefill: int = 3, num_decode: int = 2, pool: int | None = None, **kw
) -> ClusterState:
    return ClusterState.build(
        ClusterConfig(num_prefill=num_prefill, num_decode=num_decode, pool_blocks=pool, **kw)
    )


def req(
    keys: tuple, input_length: int | None = None, output_length: int = 100, slo: str = "interactive"
) -> ScheduleRequest:
    return ScheduleRequest(keys, input_length or len(keys) * BS, output_length, slo)


PROMPT = tuple(range(10))  # 10 blocks, 5120 tokens


def test_conductor_prefers_the_instance_that_holds_the_prefix() -> None:
    state = cluster(pool=0)  # no pool: only local hits count
    state.prefill[2].cache.access(PROMPT[:8])
    decision = make_router("conductor").decide(state, req(PROMPT), 0.0)
    assert decision.accepted and decision.prefill is not None
    assert decision.prefill.instance_id == 2
    assert decision.prefill.local_hit_blocks == 8
    assert decision.prefill.transfer_s == 0.0
    assert decision.prefill.ttft_s == pytest.approx(COST.prefill_s(2 * BS, 8 * BS))
    assert not decision.replicated


def test_conductor_replicates_a_hot_prefix_away_from_a_busy_instance() -> None:
    state = cluster()  # with a pool: another instance can fetch the prefix
    state.prefill[0].cache.access(PROMPT)
    state.prefill[0].busy_until_s = 50.0
    decision = make_router("conductor").decide(state, req(PROMPT), 0.0)
    assert decision.accepted and decision.prefill is not None
    assert decision.prefill.instance_id == 1
    assert decision.replicated
    cached = len(PROMPT) * BS - 1  # at least one token is always computed
    expected = COST.transfer_s(cached) + COST.prefill_s(1, cached)
    assert decision.prefill.ttft_s == pytest.approx(expected)
    assert decision.prefill.ttft_s < 50.0


def test_without_a_pool_the_hot_instance_is_only_left_when_recompute_is_faster() -> None:
    state = cluster(pool=0)
    state.prefill[0].cache.access(PROMPT)
    state.prefill[0].busy_until_s = 0.1  # a short queue: waiting beats recomputing 10 blocks
    decision = make_router("conductor").decide(state, req(PROMPT), 0.0)
    assert decision.prefill is not None and decision.prefill.instance_id == 0
    state.prefill[0].busy_until_s = 100.0
    decision = make_router("conductor").decide(state, req(PROMPT), 0.0)
    assert decision.prefill is not None and decision.prefill.instance_id == 1
    assert decision.prefill.cached_blocks == 0


@pytest.mark.parametrize(
    ("setup", "request_", "reason"),
    [
        # every instance is 40 s behind: TTFT cannot be met
        (lambda s: [setattr(p, "busy_until_s", 40.0) for p in s.prefill], req(PROMPT), "TTFT"),
        # 126k new tokens take longer than 30 s on an idle instance
        (lambda s: None, req(tuple(range(1000, 1250))), "TTFT"),
        # decode memory is reserved past the high watermark
        (
            lambda s: [setattr(d, "kv_reserved_tokens", d.kv_capacity_tokens) for d in s.decode],
            req(PROMPT),
            "room for the KV",
        ),
        # decode instances so full that a step takes more than the TBT target
        (
            lambda s: [setattr(d, "kv_mean_tokens", 10_000_000) for d in s.decode],
            req(PROMPT),
            "TBT",
        ),
    ],
)
def test_early_rejection(setup, request_: ScheduleRequest, reason: str) -> None:
    state = cluster()
    setup(state)
    rejecting = make_router("conductor").decide(state, request_, 0.0)
    assert not rejecting.accepted and rejecting.decode_id is None
    assert reason in (rejecting.reject_reason or "")
    admitting = make_router("conductor", SchedulerConfig(early_rejection=False))
    assert admitting.decide(state, request_, 0.0).accepted


def test_decode_choice_is_lowest_tbt_among_instances_with_room() -> None:
    state = cluster(num_decode=3)
    state.decode[0].kv_mean_tokens = 500_000  # slow
    state.decode[1].kv_reserved_tokens = state.decode[1].kv_capacity_tokens  # full
    decision = make_router("conductor").decide(state, req(PROMPT), 0.0)
    assert decision.decode_id == 2


@pytest.mark.parametrize(
    ("router", "expected_prefill_ids"),
    [
        ("round-robin", [0, 1, 2, 0]),
        ("least-loaded", [1, 1, 1, 1]),  # instance 1 has the shortest queue
        ("cache-only", [2, 2, 2, 2]),  # instance 2 holds the prefix, however busy
    ],
)
def test_baselines(router: str, expected_prefill_ids: list[int]) -> None:
    state = cluster(pool=0)
    state.prefill[0].busy_until_s = 5.0
    state.prefill[2].busy_until_s = 9.0
    state.prefill[2].cache.access(PROMPT)
    chooser = make_router(router, SchedulerConfig(early_rejection=False))
    chosen = []
    for _ in expected_prefill_ids:
        decision = chooser.decide(state, req(PROMPT), 0.0)
        assert decision.prefill is not None
        chosen.append(decision.prefill.instance_id)
    assert chosen == expected_prefill_ids


def test_decide_changes_nothing_and_commit_release_balance() -> None:
    state = cluster()
    router = make_router("conductor")
    request = req(PROMPT)
    decision = router.decide(state, request, 0.0)
    assert all(len(p.cache) == 0 for p in state.prefill) and state.pool is not None
    assert len(state.pool) == 0
    end = router.commit(state, request, decision, 0.0)
    assert decision.prefill is not None and decision.decode_id is not None
    assert end == pytest.approx(decision.prefill.ttft_s)
    assert state.prefill[decision.prefill.instance_id].busy_until_s == end
    assert len(state.pool) == len(PROMPT)
    decode = state.decode[decision.decode_id]
    assert decode.num_assigned == 1 and decode.kv_reserved_tokens == request.input_length + 100
    Router.release(state, request, decision.decode_id)
    assert (decode.num_assigned, decode.kv_reserved_tokens, decode.kv_mean_tokens) == (0, 0, 0)


@settings(max_examples=30, deadline=None)
@given(
    lengths=st.lists(
        st.tuples(st.integers(1, 20_000), st.integers(1, 2_000)), min_size=1, max_size=30
    ),
    router=st.sampled_from(sorted(ROUTERS)),
)
def test_reservations_return_to_zero(lengths: list[tuple[int, int]], router: str) -> None:
    state = cluster()
    chooser = make_router(router)
    admitted = []
    for n, (input_length, output_length) in enumerate(lengths):
        keys = tuple(f"r{n}b{i}" for i in range(math.ceil(input_length / BS)))
        request = ScheduleRequest(keys, input_length, output_length)
        decision = chooser.decide(state, request, float(n))
        if decision.accepted:
            chooser.commit(state, request, decision, float(n))
            admitted.append((request, decision.decode_id))
    for request, decode_id in admitted:
        Router.release(state, request, decode_id)
    assert all(
        d.num_assigned == d.kv_reserved_tokens == d.kv_mean_tokens == 0 for d in state.decode
    )


@pytest.mark.parametrize(
    ("call", "fragment"),
    [
        (lambda: make_router("random"), "unknown scheduler 'random'"),
        (
            lambda: make_router("conductor").decide(cluster(), req(PROMPT, slo="batch"), 0.0),
            "unknown SLO class 'batch'",
        ),
        (lambda: SchedulerConfig(slo_classes=()), "at least one SLO class"),
        (lambda: SchedulerConfig(kv_high_watermark=1.5), "kv_high_watermark"),
        (
            lambda: SchedulerConfig(slo_classes=(SLOClass("a", 1, 1), SLOClass("a", 2, 2))),
            "unique",
        ),
        (lambda: SLOClass("x", 0, 1), "ttft_s must be > 0"),
        (lambda: SLOClass("x", 1, float("nan")), "tbt_s must be > 0"),
        (lambda: SLOClass("", 1, 1), "non-empty"),
        (lambda: ClusterConfig(num_prefill=0), "at least one prefill"),
        (lambda: ClusterConfig(pool_blocks=-1), "pool_blocks"),
        (lambda: ClusterConfig(cache_policy="mru"), "unknown cache policy"),
        (lambda: ClusterConfig(decode_max_batch_size=0), "batch size"),
    ],
)
def test_bad_settings_are_typed_errors(call, fragment: str) -> None:
    with pytest.raises(InvalidRequestError, match=fragment):
        call()


def test_slo_classes_by_name() -> None:
    batch = SLOClass("batch", ttft_s=300.0, tbt_s=1.0)
    config = SchedulerConfig(slo_classes=(SLOClass("interactive", 30.0, 0.1), batch))
    state = cluster()
    for p in state.prefill:
        p.busy_until_s = 100.0
    router = make_router("conductor", config)
    assert not router.decide(state, req(PROMPT), 0.0).accepted
    assert router.decide(state, req(PROMPT, slo="batch"), 0.0).accepted
    assert config.slo("batch") is batch
