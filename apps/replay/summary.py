"""Summaries of a replay: latency percentiles, SLO attainment, goodput, hit rate, load.

Definitions (the simulator's, so that predictions compare):

* TTFT: from sending a request to its first token.
* ITL: every gap between two consecutive tokens of a request (pooled over requests);
  TBT: a request's mean gap after its first token (what its SLO is judged on).
* SLO met: served, TTFT within the class's ``ttft_s`` and TBT within its ``tbt_s``;
  attainment is over all requests (rejected and failed ones miss).
* goodput: requests that met their SLO per second of the run, from the first send to the
  last byte.
* hit rate: prompt tokens served from a cache over prompt tokens, over served requests. It is
  ``router`` or ``engine`` when every served request was told its cached tokens (header or
  usage), else ``ideal``: what the trace's prefix structure allows with one unlimited cache.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvstore.errors import InvalidRequestError
from kvstore.routing.slo import SLOClass

from .loadgen import RequestResult

#: SLO classes for replays scaled to this CPU machine (SmolLM2-135M, ~25 tokens/s a stream):
#: ``critical`` is an interactive chat, ``standard`` a patient one, ``batch`` offline work.
SLO_CLASSES: dict[str, SLOClass] = {
    slo.name: slo
    for slo in (
        SLOClass("critical", ttft_s=1.0, tbt_s=0.1),
        SLOClass("standard", ttft_s=3.0, tbt_s=0.25),
        SLOClass("batch", ttft_s=30.0, tbt_s=1.0),
    )
}

PERCENTILES = (50, 90, 99)


def percentiles(values: Sequence[float], qs: Sequence[float] = PERCENTILES) -> tuple[float, ...]:
    """Percentiles (linear interpolation) of the finite values; NaN for each when none.

    Args:
        values: samples.
        qs: percentiles in [0, 100].

    Returns:
        One value per ``qs``.
    """
    finite = [v for v in values if math.isfinite(v)]
    if not finite:
        return tuple(float("nan") for _ in qs)
    return tuple(float(v) for v in np.percentile(np.asarray(finite, dtype=float), qs))


def met_slo(result: RequestResult, slo: SLOClass) -> bool:
    """Whether a request was served within both targets of ``slo``.

    Args:
        result: the measured request.
        slo: the class.

    Returns:
        True when served and within ``ttft_s`` and ``tbt_s``.
    """
    return result.outcome == "ok" and slo.is_met(result.ttft_s, result.tbt_s)


def goodput_rps(num_met: int, duration_s: float) -> float:
    """Requests that met the SLO per second.

    Args:
        num_met: requests that met it.
        duration_s: length of the run, seconds.

    Returns:
        The rate (0 for a run of no length).

    Raises:
        InvalidRequestError: for a negative count or duration.
    """
    if num_met < 0 or duration_s < 0:
        raise InvalidRequestError("num_met and duration_s must be >= 0")
    return num_met / duration_s if duration_s > 0 else 0.0


@dataclass(frozen=True, slots=True)
class ReplaySummary:
    """One run, summed up.

    Attributes:
        num_requests: requests sent.
        num_ok: served.
        num_rejected: HTTP 429/503.
        num_errors: any other failure.
        ttft_s: TTFT p50/p90/p99 over served requests.
        itl_s: gaps between tokens p50/p90/p99, pooled.
        tbt_s: per-request mean TBT p50/p90/p99.
        mean_ttft_s: mean TTFT over served requests.
        num_met: requests that met the SLO.
        slo_attainment: ``num_met / num_requests``.
        duration_s: first send to last byte.
        goodput_rps: ``num_met / duration_s``.
        throughput_tokens_s: generated tokens per second of the run.
        hit_rate: cached prompt tokens over prompt tokens of served requests.
        hit_rate_source: ``router``, ``engine`` or ``ideal``.
        ideal_hit_rate: the trace structure's hit rate (one unlimited cache).
        engine_load: served requests per engine (empty when engines are unknown).
    """

    num_requests: int
    num_ok: int
    num_rejected: int
    num_errors: int
    ttft_s: tuple[float, ...]
    itl_s: tuple[float, ...]
    tbt_s: tuple[float, ...]
    mean_ttft_s: float
    num_met: int
    slo_attainment: float
    duration_s: float
    goodput_rps: float
    throughput_tokens_s: float
    hit_rate: float
    hit_rate_source: str
    ideal_hit_rate: float
    engine_load: dict[str, int]


def run_duration_s(results: Sequence[RequestResult]) -> float:
    """First send to last byte over all requests.

    Args:
        results: every request's result.

    Returns:
        Seconds (0 when nothing was sent).
    """
    if not results:
        return 0.0
    return max(r.finish_s for r in results) - min(r.sent_s for r in results)


def _hit_rates(ok: Sequence[RequestResult]) -> tuple[float, str, float]:
    """The hit rate of served requests, where it comes from, and the trace's ideal one.

    The told counts are used only when every served request was told them by one source (the
    module's definition), since only then do they cover the whole run; else the ideal stands in.
    """
    prompt = sum(r.prompt_tokens for r in ok)
    ideal = sum(r.ideal_cached_tokens for r in ok)
    sources = {r.cached_source for r in ok}
    if ok and len(sources) == 1 and None not in sources:
        source = sources.pop() or "ideal"
        cached = sum(r.cached_tokens or 0 for r in ok)
    else:
        source, cached = "ideal", ideal
    if not prompt:
        return 0.0, source, 0.0
    return cached / prompt, source, ideal / prompt


def _latencies(
    ok: Sequence[RequestResult],
) -> tuple[tuple[float, ...], tuple[float, ...], tuple[float, ...], float]:
    """TTFT, pooled ITL and per-request TBT percentiles, and the mean TTFT, of served requests
    (a failed request has no latency to count)."""
    ttfts = [r.ttft_s for r in ok]
    return (
        percentiles(ttfts),
        percentiles([gap for r in ok for gap in r.itl_s]),
        percentiles([r.tbt_s for r in ok]),
        float(np.mean(ttfts)) if ttfts else float("nan"),
    )


def summarize(results: Sequence[RequestResult], slo: SLOClass) -> ReplaySummary:
    """Sum up a run.

    Args:
        results: every request's result.
        slo: the class every request is judged by.

    Returns:
        The summary.
    """
    ok = [r for r in results if r.outcome == "ok"]
    num_met = sum(met_slo(r, slo) for r in results)
    duration = run_duration_s(results)
    hit_rate, source, ideal_hit_rate = _hit_rates(ok)
    ttft_s, itl_s, tbt_s, mean_ttft_s = _latencies(ok)
    return ReplaySummary(
        num_requests=len(results),
        num_ok=len(ok),
        num_rejected=sum(r.outcome == "rejected" for r in results),
        num_errors=sum(r.outcome == "error" for r in results),
        ttft_s=ttft_s,
        itl_s=itl_s,
        tbt_s=tbt_s,
        mean_ttft_s=mean_ttft_s,
        num_met=num_met,
        slo_attainment=num_met / len(results) if results else 0.0,
        duration_s=duration,
        goodput_rps=goodput_rps(num_met, duration),
        throughput_tokens_s=sum(r.output_tokens for r in ok) / duration if duration else 0.0,
        hit_rate=hit_rate,
        hit_rate_source=source,
        ideal_hit_rate=ideal_hit_rate,
        engine_load=dict(sorted(Counter(r.engine for r in ok if r.engine).items())),
    )
