"""kv_both engines behind the live router's policies: timings, polls, caches, admission."""

from __future__ import annotations

import math

import numpy as np
import pytest

from kvstore.errors import InvalidRequestError
from kvstore.router import state as router_state
from kvstore.router.config import RouterConfig
from kvstore.router.engines import EngineLoad
from kvstore.router.state import RouterState
from kvstore.routing import policy as routing
from kvstore.routing.cost import CostModel
from kvstore.routing.policy import RequestShape, estimate_ttft, slot_wait_s
from kvstore.routing.slo import SLOClass
from kvstore.sim import kvboth
from kvstore.sim.engine import EngineConfig, StepCost
from kvstore.sim.kvboth import (
    KvBothConfig,
    StepCostTerms,
    engine_names,
    engine_view,
    last_poll_s,
    simulate_kv_both,
)
from kvstore.sim.trace import TraceRequest

COST = StepCost(step_base_s=0.01, decode_s_per_seq=0.002, prefill_s_per_token=0.0001)


def request(
    at_s: float, prompt: int, output: int, keys: tuple[int, ...] = (), request_id: int = 0
) -> TraceRequest:
    """A trace request arriving at ``at_s``."""
    return TraceRequest(
        request_id=request_id,
        timestamp_ms=round(at_s * 1000),
        input_length=prompt,
        output_length=output,
        hash_ids=keys,
    )


def config(**kwargs: object) -> KvBothConfig:
    """One engine with :data:`COST` unless told otherwise."""
    base: dict[str, object] = {"num_engines": 1, "engine": EngineConfig(COST)}
    base.update(kwargs)
    return KvBothConfig(**base)  # type: ignore[arg-type]


def test_one_request() -> None:
    result = simulate_kv_both([request(0.0, 100, 3)], config())
    assert result.ttft_s[0] == pytest.approx(0.02)
    assert result.tbt_s[0] == pytest.approx(0.012)
    assert result.makespan_s == pytest.approx(0.044)


def test_two_overlapping_requests_share_steps() -> None:
    # B arrives during A's prefill, is admitted next step beside A's first decode.
    result = simulate_kv_both([request(0.0, 100, 3), request(0.01, 50, 2, request_id=1)], config())
    assert result.ttft_s.tolist() == pytest.approx([0.02, 0.037 - 0.01])
    assert result.tbt_s.tolist() == pytest.approx([(0.051 - 0.02) / 2, 0.051 - 0.037])


def test_request_overhead_delays_reaching_the_engine() -> None:
    cost = StepCost(0.01, 0.002, 0.0001, request_overhead_s=0.005)
    result = simulate_kv_both([request(0.0, 100, 1)], config(engine=EngineConfig(cost)))
    assert result.ttft_s[0] == pytest.approx(0.025)


def test_a_cached_prefix_is_served_from_the_engine_or_the_pool() -> None:
    cost = StepCost(0.01, 0.002, 0.0001, load_s_per_token=1e-5)
    keys = (1, 2, 3, 4)
    trace = [
        request(0.0, 100, 1, keys),
        request(1.0, 100, 1, keys, 1),
        request(2.0, 100, 1, keys, 2),
    ]
    # Round robin: engine 0, engine 1 (pool), engine 0 (its own cache).
    result = simulate_kv_both(
        trace, config(num_engines=2, engine=EngineConfig(cost), policy="round-robin")
    )
    assert result.prefill_ids.tolist() == [0, 1, 0]
    assert result.ttft_s.tolist() == pytest.approx([0.02, 0.0104 + 96e-5, 0.0104])
    assert result.cached_blocks.tolist() == [0, 3, 3]
    assert result.local_blocks.tolist() == [0, 0, 3]
    no_pool = simulate_kv_both(
        trace,
        config(num_engines=2, engine=EngineConfig(cost), policy="round-robin", shared_pool=False),
    )
    assert no_pool.ttft_s.tolist() == pytest.approx([0.02, 0.02, 0.0104])


def test_cache_aware_sends_a_prompt_where_its_prefix_is() -> None:
    keys = tuple(range(10))
    trace = [request(0.0, 320, 1, keys), request(1.0, 320, 1, keys, 1)]
    no_pool = simulate_kv_both(
        trace, config(num_engines=2, policy="cache-aware", shared_pool=False)
    )
    # Engine 1 is idle and empty; engine 0 holds 9 blocks: the second goes to engine 0.
    assert no_pool.prefill_ids.tolist() == [0, 0]
    assert no_pool.local_blocks.tolist() == [0, 9]


def test_least_loaded_reads_the_load_of_the_last_poll() -> None:
    zero = StepCost(step_base_s=0.01, decode_s_per_seq=0.0, prefill_s_per_token=0.0)
    trace = [
        request(0.5, 10, 70),  # engine 0, runs until 0.5 + 0.01 * 70 = 1.2
        request(0.6, 10, 1, request_id=1),  # engine 1 (fewer of the router's), done at 0.61
        request(1.3, 10, 1, request_id=2),  # both idle now; the poll at 1.0 saw engine 0 busy
        request(1.305, 10, 1, request_id=3),  # while request 2 runs
    ]
    polled = simulate_kv_both(
        trace, config(num_engines=2, engine=EngineConfig(zero), policy="least-loaded")
    )
    assert polled.prefill_ids.tolist() == [0, 1, 1, 1]
    exact = simulate_kv_both(
        trace,
        config(
            num_engines=2,
            engine=EngineConfig(zero),
            policy="least-loaded",
            poll_interval_s=1e-4,
        ),
    )
    assert exact.prefill_ids.tolist() == [0, 1, 0, 1]


def test_least_loaded_does_not_see_the_requests_queued_in_the_router() -> None:
    # One slot per engine: a burst fills both, the rest wait in the router, which the engines'
    # load does not show; ties go to the router's in-flight count, then to engine 0.
    trace = [request(0.1 + 0.001 * i, 10, 20, request_id=i) for i in range(6)]
    result = simulate_kv_both(trace, config(num_engines=2, policy="least-loaded", max_inflight=1))
    assert result.prefill_ids.tolist() == [0, 1, 0, 0, 0, 0]
    rr = simulate_kv_both(trace, config(num_engines=2, policy="round-robin", max_inflight=1))
    assert rr.prefill_ids.tolist() == [0, 1, 0, 1, 0, 1]
    assert np.nanmax(result.ttft_s) > np.nanmax(rr.ttft_s)


def test_admission_rejects_a_request_predicted_past_its_target() -> None:
    trace = [request(0.0, 1000, 1), request(0.0, 1000, 1, request_id=1)]
    # prefill 0.01 + 0.1 = 0.11 s each; the second waits behind the first: 0.22 s predicted.
    result = simulate_kv_both(trace, config(admission_ttft_s=0.15))
    assert result.accepted.tolist() == [True, False]
    assert math.isnan(result.ttft_s[1]) and result.num_rejected == 1


def test_estimate_matches_the_live_router_terms() -> None:
    cost = StepCost(0.01, 0.002, 0.0001, load_s_per_token=1e-5)
    # 32 tokens in the engine's cache, 96 in the pool; polled 2 running, 1 waiting.
    view = engine_view("e", StepCostTerms(cost), (2, 1), 0, 0, 0.5, 32, 4)
    estimate = estimate_ttft(view, RequestShape(100, 96, 1), handoff=False)
    ttft, prefill = estimate.ttft_s, estimate.prefill_s
    assert prefill == pytest.approx(0.01 + 4 * 0.0001)
    # queue 0.5 + 1 waiting x prefill; load of 64 tokens overlaps it; then one decode step of 2.
    assert ttft == pytest.approx(0.5 + prefill + prefill + 0.01 + 0.004)


def test_a_request_waits_for_a_router_slot_when_all_are_taken() -> None:
    assert slot_wait_s(4, 3, 0, 16, 0.1) == 0.0  # one slot free
    assert slot_wait_s(4, 4, 0, 16, 0.1) == pytest.approx(16 * 0.1 / 4)  # the next to finish
    assert slot_wait_s(4, 4, 2, 16, 0.1) == pytest.approx(3 * 16 * 0.1 / 4)  # two queued ahead
    assert slot_wait_s(0, 9, 9, 16, 0.1) == 0.0  # unbounded
    cost = StepCost(0.01, 0.002, 0.0001)
    # All 5 slots held: one answer of 100 tokens in a full batch (0.02 s a step) must finish,
    # a fifth of it: 0.4 s.
    full = engine_view("e", StepCostTerms(cost), (0, 0), 5, 0, 0.0, 0, 5)
    ttft = estimate_ttft(full, RequestShape(100, 0, 100), handoff=False).ttft_s
    assert ttft == pytest.approx(0.4 + 0.01 + 100 * 0.0001)


def test_cache_aware_sends_a_burst_where_slots_are_free() -> None:
    # One long answer holds engine 0's only slot (its first token long out, so no prefill of
    # the router's is pending there) and no poll has seen it yet; a second request arrives: the
    # live router's estimate (and so the simulated cache-aware policy) counts the wait for
    # that slot instead of a tie that the first engine wins.
    trace = [request(0.1, 10, 200), request(0.3, 10, 2, request_id=1)]
    result = simulate_kv_both(trace, config(num_engines=2, policy="cache-aware", max_inflight=1))
    assert result.prefill_ids.tolist() == [0, 1]


def test_the_simulator_and_the_router_run_the_same_policy_objects() -> None:
    assert kvboth.POLICIES is routing.POLICIES is router_state.POLICIES
    assert kvboth.choose is routing.choose is router_state.choose


@pytest.mark.parametrize("name", sorted(routing.POLICIES))
@pytest.mark.parametrize(
    "loads",
    [
        # (running, waiting, router in flight, router prefill s, own cached tokens) per engine
        [(0, 0, 0, 0.0, 0), (0, 0, 0, 0.0, 0), (0, 0, 0, 0.0, 0)],  # a three-way tie
        [(2, 1, 1, 0.3, 0), (0, 0, 2, 0.0, 0), (1, 0, 0, 0.0, 960)],
        [(0, 3, 0, 0.0, 640), (1, 0, 1, 0.1, 0), (1, 0, 0, 0.1, 0)],
    ],
)
def test_the_simulator_chooses_the_engine_the_router_chooses(
    name: str, loads: list[tuple[int, int, int, float, int]]
) -> None:
    cost = CostModel(block_size_tokens=32, transfer_bytes_per_s=1e9)
    names = engine_names(len(loads))
    state = RouterState(
        RouterConfig(engines=tuple(f"http://{n}" for n in names), policy=name, prior=cost)
    )
    sim_policy = routing.POLICIES[name]()
    request = RequestShape(1000, 320, 50)
    slo = SLOClass("loose", ttft_s=100.0, tbt_s=10.0)
    for _ in range(len(loads) + 1):  # round robin moves on at every request
        local, views = {}, []
        for engine, (running, waiting, inflight, prefill_s, own) in zip(
            state.engines, loads, strict=True
        ):
            engine.healthy, engine.inflight, engine.prefill_s = True, inflight, prefill_s
            engine.load = EngineLoad(num_running=running, num_waiting=waiting)
            local[engine.url] = own
            polled = (running, waiting)
            views.append(engine_view(engine.url, cost, polled, inflight, 0, prefill_s, own, 4))
        live = state.choose(request, slo, local)
        simulated = routing.choose(request, slo, views, None, policy=sim_policy)
        assert live.prefill is not None and simulated.prefill is not None
        assert live.prefill.engine == simulated.prefill.engine
        assert live.prefill.ttft_s == simulated.prefill.ttft_s


@pytest.mark.parametrize(
    ("now", "expected"), [(0.0, 0.0), (0.49, 0.0), (0.5, 0.5), (1.26, 1.0), (-0.1, -math.inf)]
)
def test_last_poll(now: float, expected: float) -> None:
    assert last_poll_s(now, 0.5) == pytest.approx(expected)


def test_config_refuses_bad_values() -> None:
    with pytest.raises(InvalidRequestError):
        KvBothConfig(policy="random")
    with pytest.raises(InvalidRequestError):
        KvBothConfig(poll_interval_s=0)
    with pytest.raises(InvalidRequestError):
        simulate_kv_both([])
    with pytest.raises(InvalidRequestError):
        simulate_kv_both([request(1.0, 10, 1), request(0.0, 10, 1)])
