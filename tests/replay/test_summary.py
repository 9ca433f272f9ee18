"""Percentiles, SLO attainment, goodput and hit-rate sources of a replay's summary."""

from __future__ import annotations

import math

import pytest

from kvstore.errors import InvalidRequestError
from kvstore.replay.loadgen import RequestResult
from kvstore.replay.summary import goodput_rps, met_slo, percentiles, summarize
from kvstore.sim.default_slo import SLOClass

SLO = SLOClass("t", ttft_s=0.5, tbt_s=0.1)


def result(
    rid: int,
    token_times: list[float],
    *,
    sent: float = 0.0,
    outcome: str = "ok",
    prompt: int = 100,
    cached: int | None = None,
    source: str | None = None,
    ideal: int = 0,
    engine: str | None = None,
) -> RequestResult:
    return RequestResult(
        rid,
        sent,
        sent_s=sent,
        prompt_tokens=prompt,
        max_tokens=len(token_times),
        outcome=outcome,
        status=200 if outcome == "ok" else 429,
        token_times_s=token_times,
        output_tokens=len(token_times),
        cached_tokens=cached,
        cached_source=source,
        ideal_cached_tokens=ideal,
        engine=engine,
        finish_s=sent + (token_times[-1] if token_times else 0.0),
    )


def test_percentiles_interpolate_and_skip_nan() -> None:
    assert percentiles([1.0, 2.0, 3.0, 4.0, float("nan")], (50, 100)) == (2.5, 4.0)
    assert all(math.isnan(v) for v in percentiles([], (50, 90)))


def test_request_timings() -> None:
    r = result(0, [0.2, 0.3, 0.5])
    assert r.ttft_s == 0.2
    assert r.itl_s == pytest.approx([0.1, 0.2])
    assert r.tbt_s == pytest.approx(0.15)
    assert result(1, [0.4]).tbt_s == 0.0
    assert math.isnan(result(2, [], outcome="error").ttft_s)


@pytest.mark.parametrize(
    ("times", "outcome", "met"),
    [
        ([0.2, 0.25, 0.3], "ok", True),
        ([0.6, 0.65], "ok", False),  # TTFT over 0.5 s
        ([0.1, 0.4], "ok", False),  # TBT 0.3 s over 0.1 s
        ([0.1], "ok", True),  # one token: no gaps to judge
        ([], "rejected", False),
    ],
)
def test_slo_is_judged_on_ttft_and_mean_tbt(times: list[float], outcome: str, met: bool) -> None:
    assert met_slo(result(0, times, outcome=outcome), SLO) is met


def test_goodput() -> None:
    assert goodput_rps(6, 3.0) == 2.0
    assert goodput_rps(0, 0.0) == 0.0
    with pytest.raises(InvalidRequestError):
        goodput_rps(-1, 1.0)


def test_summary_counts_rates_and_engine_load() -> None:
    results = [
        result(0, [0.1, 0.15, 0.2], sent=0.0, engine="a", ideal=0),
        result(1, [0.3, 0.35], sent=1.0, engine="b", ideal=50),
        result(2, [0.9, 0.95], sent=2.0, engine="a", ideal=50),  # misses TTFT
        result(3, [], sent=3.0, outcome="rejected"),
        result(4, [], sent=3.5, outcome="error"),
    ]
    s = summarize(results, SLO)
    assert (s.num_requests, s.num_ok, s.num_rejected, s.num_errors) == (5, 3, 1, 1)
    assert s.num_met == 2
    assert s.slo_attainment == pytest.approx(0.4)
    assert s.duration_s == pytest.approx(3.5)  # first send 0.0 to last byte 3.5
    assert s.goodput_rps == pytest.approx(2 / 3.5)
    assert s.ttft_s[0] == pytest.approx(0.3)
    assert s.mean_ttft_s == pytest.approx((0.1 + 0.3 + 0.9) / 3)
    assert s.hit_rate_source == "ideal"
    assert s.hit_rate == pytest.approx(100 / 300)
    assert s.engine_load == {"a": 2, "b": 1}


def test_hit_rate_from_the_router_when_every_answer_told() -> None:
    told = [
        result(0, [0.1], cached=0, source="router", ideal=0),
        result(1, [0.1], cached=64, source="router", ideal=96),
    ]
    s = summarize(told, SLO)
    assert (s.hit_rate_source, s.hit_rate, s.ideal_hit_rate) == ("router", 0.32, 0.48)
    # one answer without the header: the measured rate would be partial, so the ideal is shown
    partial = [*told, result(2, [0.1], ideal=0)]
    assert summarize(partial, SLO).hit_rate_source == "ideal"
