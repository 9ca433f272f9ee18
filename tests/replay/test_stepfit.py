"""The step-model fit: rows from token times, non-negative least squares, and recovery of the
parameters from runs the model itself generated."""

from __future__ import annotations

import random
from collections import defaultdict

import numpy as np
import pytest

from kvstore.errors import InvalidRequestError
from kvstore.replay.loadgen import RequestResult
from kvstore.replay.stepfit import fit_step_model, nonnegative_lstsq, step_rows
from kvstore.sim.engine import EngineConfig, StepCost
from kvstore.sim.kvboth import KvBothConfig, simulate_kv_both
from kvstore.sim.trace import TraceRequest


def synthetic_run(
    cost: StepCost, seed: int, num_requests: int = 60, policy: str = "round-robin"
) -> list[RequestResult]:
    """Requests run through the kv_both simulator, recorded as the load generator would."""
    rng = random.Random(seed)
    trace, now_ms = [], 0
    for i in range(num_requests):
        now_ms += rng.choice([0, 20, 150, 400, 900])
        prompt = rng.randint(40, 900)
        keys = tuple([0] + [rng.randrange(10**9) for _ in range(prompt // 32)])  # shared block 0
        trace.append(TraceRequest(i, now_ms, prompt, rng.randint(1, 16), keys))
    times: dict[int, list[float]] = defaultdict(list)
    config = KvBothConfig(num_engines=2, engine=EngineConfig(cost), policy=policy)
    sim = simulate_kv_both(trace, config, on_token=lambda i, t: times[i].append(t))
    results = []
    for i, request in enumerate(trace):
        sent = request.timestamp_ms / 1000
        results.append(
            RequestResult(
                request_id=i,
                arrival_s=sent,
                sent_s=sent,
                prompt_tokens=request.input_length,
                max_tokens=request.output_length,
                outcome="ok",
                status=200,
                token_times_s=[t - sent for t in times[i]],
                output_tokens=request.output_length,
                cached_tokens=int(sim.cached_blocks[i]) * 32,
                cached_source="router",
                engine=f"e{sim.prefill_ids[i]}",
            )
        )
    return results


@pytest.mark.parametrize(
    "cost",
    [
        StepCost(0.02, 0.004, 0.0003, request_overhead_s=0.015),
        StepCost(0.05, 0.0, 0.001, request_overhead_s=0.0),
        StepCost(0.01, 0.01, 0.0001, request_overhead_s=0.05),
    ],
)
@pytest.mark.parametrize("policy", ["round-robin", "cache-aware"])
def test_fit_recovers_the_parameters_of_a_run_the_model_made(cost: StepCost, policy: str) -> None:
    fit = fit_step_model(synthetic_run(cost, seed=7, policy=policy))
    assert fit.num_gap_rows > 50 and fit.num_ttft_rows >= 3
    assert fit.cost.step_base_s == pytest.approx(cost.step_base_s, rel=1e-6, abs=1e-6)
    assert fit.cost.decode_s_per_seq == pytest.approx(cost.decode_s_per_seq, rel=1e-6, abs=1e-9)
    assert fit.cost.prefill_s_per_token == pytest.approx(cost.prefill_s_per_token, rel=1e-6)
    assert fit.cost.request_overhead_s == pytest.approx(cost.request_overhead_s, abs=1e-6)
    assert fit.rmse < 1e-6


def test_rows_of_two_overlapping_requests() -> None:
    # Hand-made: A alone (TTFT row), then B prefilled in A's second gap.
    a = RequestResult(0, 0.0, 0.0, 100, 3, "ok", 200, token_times_s=[0.02, 0.037, 0.051])
    b = RequestResult(1, 0.01, 0.01, 50, 2, "ok", 200, token_times_s=[0.027, 0.041])
    design, seconds, num_gaps = step_rows([a, b])
    assert num_gaps == 3
    rows = {tuple(r): y for r, y in zip(design.tolist(), seconds.tolist(), strict=True)}
    assert rows[(1.0, 1.0, 50.0, 0.0)] == pytest.approx(0.017)  # A decodes, B prefills
    assert rows[(1.0, 2.0, 0.0, 0.0)] == pytest.approx(0.014)  # both decode
    assert rows[(1.0, 0.0, 100.0, 1.0)] == pytest.approx(0.02)  # A's TTFT on an idle engine


def test_nonnegative_lstsq_clamps_a_negative_coefficient() -> None:
    a = np.array([[1.0, 0.0], [1.0, 1.0], [1.0, 2.0]])
    y = np.array([2.0, 1.0, 0.0])  # the unconstrained slope is -1
    x = nonnegative_lstsq(a, y)
    assert x.tolist() == pytest.approx([1.0, 0.0])


def test_fit_needs_a_served_request() -> None:
    with pytest.raises(InvalidRequestError):
        fit_step_model([RequestResult(0, 0.0, outcome="rejected", status=429)])
