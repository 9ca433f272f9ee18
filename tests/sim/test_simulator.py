from __future__ import annotations

import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.errors import InvalidRequestError
from kvstore.routing.cost import CostModel
from kvstore.sim.cluster import ClusterConfig
from kvstore.sim.experiments import BASELINES, best_baseline, run_routers
from kvstore.sim.replay import replay_pool
from kvstore.sim.scheduler import ROUTERS, SchedulerConfig
from kvstore.sim.simulator import SimConfig, simulate
from kvstore.sim.trace import parse_trace_lines

from .factories import synthetic_trace, trace_line

COST = CostModel()
NO_REJECT = SchedulerConfig(early_rejection=False)


def one_decode(**kw) -> ClusterConfig:
    return ClusterConfig(num_prefill=1, num_decode=1, **kw)


def test_single_request_timings_follow_the_cost_model() -> None:
    requests = parse_trace_lines([trace_line(1000, 3000, list(range(6)), output_length=101)])
    result = simulate(requests, SimConfig(cluster=one_decode(), router="round-robin"))
    prefill = COST.prefill_s(3000, 0)
    join = max(prefill, COST.transfer_s(3000))
    step = COST.decode_step_s(1, 3000 + 50)
    assert result.ttft_s[0] == pytest.approx(prefill)
    assert result.tbt_s[0] == pytest.approx((join - prefill + 100 * step) / 100)
    assert result.met_slo[0] and result.num_rejected == 0
    assert result.span_s == 0.0 and result.goodput_rps == 1.0


def test_continuous_batching_against_a_hand_computation() -> None:
    # r0 decodes alone, r1 joins later; both then share steps until r0 ends; r1 ends alone.
    lines = [
        trace_line(0, 512, [0], output_length=201),
        trace_line(1000, 512, [1], output_length=301),
    ]
    requests = parse_trace_lines(lines)
    result = simulate(requests, SimConfig(cluster=one_decode(), router="round-robin"))
    p = COST.prefill_s(512, 0)
    m = 512 + 201 // 2, 512 + 301 // 2
    t0, t1 = p, 1.0 + p  # joins (transfer hides behind prefill)
    alone = COST.decode_step_s(1, m[0])
    done0 = (t1 - t0) / alone
    both = COST.decode_step_s(2, m[0] + m[1])
    finish0 = t1 + (200 - done0) * both
    left1 = 300 - (finish0 - t1) / both
    finish1 = finish0 + left1 * COST.decode_step_s(1, m[1])
    assert result.tbt_s[0] == pytest.approx((finish0 - p) / 200)
    assert result.tbt_s[1] == pytest.approx((finish1 - (1.0 + p)) / 300)


def test_runs_are_deterministic_and_complete() -> None:
    requests = synthetic_trace(11, 300, block_size=512)
    for router in ROUTERS:
        config = SimConfig(
            cluster=ClusterConfig(num_prefill=2, num_decode=2), router=router, scheduler=NO_REJECT
        )
        first, second = simulate(requests, config), simulate(requests, config)
        assert first.accepted.all()
        assert np.isfinite(first.ttft_s).all() and np.isfinite(first.tbt_s).all()
        np.testing.assert_array_equal(first.tbt_s, second.tbt_s)
        np.testing.assert_array_equal(first.prefill_ids, second.prefill_ids)


def test_tight_decode_memory_makes_requests_wait_but_all_finish() -> None:
    requests = synthetic_trace(4, 200, block_size=512, gap_ms=5)
    roomy = simulate(requests, SimConfig(cluster=one_decode(), scheduler=NO_REJECT))
    # one request at a time, and some requests are larger than the whole memory
    tight_cluster = one_decode(decode_kv_capacity_tokens=1_000)
    tight = simulate(requests, SimConfig(cluster=tight_cluster, scheduler=NO_REJECT))
    assert np.isfinite(tight.tbt_s).all()
    assert np.nanmean(tight.tbt_s) > np.nanmean(roomy.tbt_s)


def test_hit_rate_with_an_unlimited_pool_equals_the_cache_replay() -> None:
    requests = synthetic_trace(8, 400, block_size=512)
    config = SimConfig(cluster=ClusterConfig(num_prefill=3, pool_blocks=None), scheduler=NO_REJECT)
    result = simulate(requests, config)
    assert result.cache_hit_rate == pytest.approx(replay_pool(requests, None).hit_rate)


@pytest.mark.parametrize(
    ("call", "fragment"),
    [
        (lambda: simulate([]), "empty trace"),
        (lambda: SimConfig(speedup=0), "speedup must be > 0"),
        (
            lambda: simulate(synthetic_trace(1, 3, 512), SimConfig(router="fastest")),
            "unknown scheduler",
        ),
    ],
)
def test_bad_runs_are_typed_errors(call, fragment: str) -> None:
    with pytest.raises(InvalidRequestError, match=fragment):
        call()


@pytest.mark.parametrize(
    ("num_prefill", "pool_blocks"),
    [
        (4, 23_440),  # a pool of 4 x 3M tokens
        (5, 0),  # a cache per instance, no pool
    ],
)
def test_conductor_beats_the_best_baseline_on_goodput(
    real_trace, num_prefill: int, pool_blocks: int
) -> None:
    requests = real_trace[:3_000]
    cluster = ClusterConfig(num_prefill=num_prefill, num_decode=4, pool_blocks=pool_blocks)
    runs = run_routers(requests, cluster)
    ours = dict(runs)["conductor"]
    label, best = best_baseline(runs)
    assert label in BASELINES
    assert ours.goodput_rps >= 1.2 * best.goodput_rps, (label, best.goodput_rps, ours.goodput_rps)
    assert ours.slo_attainment > 0.9


def test_whole_trace_replays_in_seconds(real_trace) -> None:
    started = time.perf_counter()
    result = simulate(real_trace, SimConfig())
    elapsed = time.perf_counter() - started
    assert result.num_requests == 12_031
    assert elapsed < 15.0, f"12k requests took {elapsed:.1f}s"


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    router=st.sampled_from(sorted(ROUTERS)),
    num_prefill=st.integers(1, 3),
    kv_capacity=st.sampled_from([500, 5_000, 1_500_000]),
)
def test_every_admitted_request_finishes_no_faster_than_the_cost_model(
    seed: int, router: str, num_prefill: int, kv_capacity: int
) -> None:
    requests = synthetic_trace(seed, 80, block_size=512, gap_ms=20)
    cluster = ClusterConfig(
        num_prefill=num_prefill, num_decode=2, decode_kv_capacity_tokens=kv_capacity
    )
    result = simulate(requests, SimConfig(cluster=cluster, router=router, scheduler=NO_REJECT))
    assert result.accepted.all()
    new_tokens = [
        r.input_length - min(c * 512, r.input_length - 1)
        for r, c in zip(requests, result.cached_blocks, strict=True)
    ]
    floor = np.array([COST.prefill_s(n, 0) for n in new_tokens]) - 1e-9
    assert (result.ttft_s >= floor).all()
    multi = np.array([r.output_length > 1 for r in requests])
    assert (result.tbt_s[multi] >= COST.decode_base_s).all()
    assert result.makespan_s >= result.span_s
