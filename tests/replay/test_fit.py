"""The cost-model fit from a measured run, and the simulation of the same slice."""

from __future__ import annotations

import math

import pytest

from kvstore.errors import InvalidRequestError
from kvstore.replay.fit import (
    SimShape,
    decode_batch_sizes,
    fit_cost_model,
    fit_line,
    fit_queued_prefill,
    queue_ahead,
    relative_error,
    simulate_slice,
)
from kvstore.replay.loadgen import RequestResult
from kvstore.replay.stepfit import fit_step_model
from kvstore.replay.workload import ReplayRequest
from kvstore.sim.default_slo import SLOClass

SLO = SLOClass("t", ttft_s=1.0, tbt_s=0.1)


def test_fit_line_recovers_a_line() -> None:
    xs = [0, 100, 200, 400]
    fit = fit_line(xs, [0.05 + 0.001 * x for x in xs])
    assert fit.intercept == pytest.approx(0.05)
    assert fit.slope == pytest.approx(0.001)
    assert fit.rmse == pytest.approx(0.0, abs=1e-12)
    assert fit.num_points == 4


@pytest.mark.parametrize(
    ("xs", "ys", "intercept", "slope"),
    [
        ([10, 10, 10], [1.0, 2.0, 3.0], 2.0, 0.0),  # one distinct x: the mean
        ([0, 10, 20], [3.0, 2.0, 1.0], 2.0, 0.0),  # falling: no negative slope, the mean
        ([10, 20], [0.5, 1.5], 0.0, 0.07),  # negative intercept: through the origin, 35/500
    ],
)
def test_fit_line_never_goes_negative(
    xs: list[float], ys: list[float], intercept: float, slope: float
) -> None:
    fit = fit_line(xs, ys)
    assert fit.intercept == pytest.approx(intercept)
    assert fit.slope == pytest.approx(slope)


def test_fit_line_refuses_bad_input() -> None:
    with pytest.raises(InvalidRequestError):
        fit_line([], [])
    with pytest.raises(InvalidRequestError):
        fit_line([1.0], [1.0, 2.0])


def _run(num: int) -> tuple[list[ReplayRequest], list[RequestResult]]:
    """Requests one after another; TTFT = 20 ms + 1 ms per uncached token, 50 ms a token."""
    requests, results = [], []
    t = 0.0
    for i in range(num):
        prompt = 32 * (i + 1)
        ideal = 32 if i else 0  # every prompt shares its first block with the first one
        ttft = 0.02 + 0.001 * (prompt - ideal)
        times = [ttft + 0.05 * k for k in range(4)]
        requests.append(ReplayRequest(i, t, (0, *range(100 * i + 1, 100 * i + i + 1)), prompt, 4))
        results.append(
            RequestResult(
                i,
                t,
                sent_s=t,
                prompt_tokens=prompt,
                max_tokens=4,
                outcome="ok",
                status=200,
                token_times_s=times,
                output_tokens=4,
                ideal_cached_tokens=ideal,
                finish_s=t + times[-1],
            )
        )
        t += times[-1] + 0.01
    return requests, results


def test_fit_cost_model_from_sequential_requests() -> None:
    _, results = _run(6)
    fit = fit_cost_model(results, 32)
    assert fit.cost.prefill_base_s == pytest.approx(0.02)
    assert fit.cost.prefill_s_per_token == pytest.approx(0.001)
    assert fit.cost.decode_base_s == pytest.approx(0.05)  # batch is always 1: no slope
    assert fit.cost.decode_s_per_seq == 0.0
    assert fit.cost.block_size_tokens == 32
    assert decode_batch_sizes([r for r in results]) == [1] * 6


def test_the_measured_cached_count_wins_over_the_ideal() -> None:
    _, results = _run(4)
    for r in results:  # the engine says nothing was cached, and its TTFTs agree
        r.cached_tokens, r.cached_source = 0, "engine"
        r.token_times_s = [0.02 + 0.001 * r.prompt_tokens + 0.05 * k for k in range(4)]
    fit = fit_cost_model(results, 32)
    assert fit.cost.prefill_base_s == pytest.approx(0.02)
    assert fit.cost.prefill_s_per_token == pytest.approx(0.001)


def test_fit_needs_a_served_request() -> None:
    _, results = _run(2)
    for r in results:
        r.outcome = "error"
    with pytest.raises(InvalidRequestError):
        fit_cost_model(results, 32)


def test_simulating_the_fitted_run_predicts_it() -> None:
    requests, results = _run(6)
    fit = fit_cost_model(results, 32)
    prediction = simulate_slice(requests, results, fit.cost, SimShape(), SLO)
    mean_ttft = sum(r.ttft_s for r in results) / len(results)
    assert prediction.mean_ttft_s == pytest.approx(mean_ttft, rel=0.05)
    assert prediction.slo_attainment == 1.0
    assert prediction.hit_rate == pytest.approx(5 / sum(len(r.hash_ids) for r in requests))


def test_sim_shape_maps_policies_and_refuses_unknown_ones() -> None:
    assert SimShape(router="cache-aware").sim_router == "conductor"
    assert SimShape(router="least-loaded").sim_router == "least-loaded"
    assert SimShape(router="cache-only").sim_router == "cache-only"
    with pytest.raises(InvalidRequestError):
        SimShape(router="random")
    with pytest.raises(InvalidRequestError):
        SimShape(num_prefill=0)


def test_relative_error() -> None:
    assert relative_error(1.1, 1.0) == pytest.approx(0.1)
    assert math.isnan(relative_error(1.0, 0.0))
    assert math.isnan(relative_error(float("nan"), 1.0))


def test_queued_work_is_in_the_regressors_not_the_costs() -> None:
    """Three prompts sent at once to one engine: each waits for the prefills before it."""
    results = []
    done = 0.0
    for i, prompt in enumerate((100, 200, 300)):
        done += 0.01 + 0.001 * prompt  # the engine computes them one after another
        results.append(
            RequestResult(
                i,
                0.0,
                sent_s=0.0,
                prompt_tokens=prompt,
                max_tokens=1,
                outcome="ok",
                status=200,
                token_times_s=[done],
                output_tokens=1,
                engine="e0",
                finish_s=done,
            )
        )
    assert queue_ahead(results) == [(1, 100), (2, 300), (3, 600)]
    fit = fit_cost_model(results, 32)
    assert fit.cost.prefill_base_s == pytest.approx(0.01)
    assert fit.cost.prefill_s_per_token == pytest.approx(0.001)
    # on another engine, nothing is ahead; with the engine unknown, half of it (two engines)
    results[2].engine = "e1"
    assert queue_ahead(results)[2] == (1, 300)
    for r in results:
        r.engine = None
    assert queue_ahead(results, num_engines=2) == [(1, 100), (1.5, 250), (2, 450)]


def test_queued_prefill_fit_keeps_both_costs_non_negative() -> None:
    # exactly -0.05 s a prefill + 1 ms a token: the base goes to 0, tokens alone explain it
    fit = fit_queued_prefill([(1, 100), (2, 300), (3, 600)], [0.05, 0.2, 0.45])
    assert fit.intercept == 0.0
    assert fit.slope == pytest.approx(335 / 460_000)
    fit = fit_queued_prefill([(1, 100), (2, 100)], [0.1, 0.2])
    assert (fit.intercept, fit.slope) == (pytest.approx(0.1), 0.0)
    with pytest.raises(InvalidRequestError):
        fit_queued_prefill([], [])


def test_kv_both_simulation_of_the_fitted_run_predicts_it() -> None:
    requests, results = _run(6)
    step = fit_step_model(results)
    assert step.num_ttft_rows == 6 and step.rmse < 1e-9
    shape = SimShape(1, 1, "round-robin", shared_pool=True, engine_model="kv_both")
    fit = fit_cost_model(results, 32)
    prediction = simulate_slice(requests, results, fit.cost, shape, SLO, step.cost)
    mean_ttft = sum(r.ttft_s for r in results) / len(results)
    assert prediction.mean_ttft_s == pytest.approx(mean_ttft, rel=1e-6)
    assert prediction.slo_attainment == 1.0
    assert prediction.hit_rate == pytest.approx(5 / sum(len(r.hash_ids) for r in requests))
    with pytest.raises(InvalidRequestError):
        simulate_slice(requests, results, fit.cost, shape, SLO)  # no step cost


def test_sim_shape_kv_both_takes_the_live_policies() -> None:
    for policy in ("cache-aware", "round-robin", "least-loaded"):
        assert SimShape(router=policy, engine_model="kv_both").sim_router == policy
    with pytest.raises(InvalidRequestError):
        SimShape(router="conductor", engine_model="kv_both")
    with pytest.raises(InvalidRequestError):
        SimShape(engine_model="mixed")
