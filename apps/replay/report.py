"""Tables, PNG plots and the raw JSON of a replay.

Plots need matplotlib (the ``dev`` extra); it is imported only when a plot is drawn, with the
``Agg`` backend, so the tables work without it.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from kvstore.routing.slo import SLOClass
from kvstore.sim.report import format_table, pyplot, save_figure

from .fit import CostFit, Prediction, queue_ahead, relative_error
from .loadgen import RequestResult
from .stepfit import StepFit
from .summary import PERCENTILES, ReplaySummary


def _ms(values: Sequence[float]) -> list[float]:
    return [v * 1e3 for v in values]


def summary_table(summary: ReplaySummary, slo: SLOClass) -> str:
    """The run's summary as a two-column table.

    Args:
        summary: the run's summary.
        slo: the class it was judged by.

    Returns:
        The table.
    """
    p = "/".join(f"p{q}" for q in PERCENTILES)
    ms = "/".join("{:.0f}" for _ in PERCENTILES)
    rows: list[list[object]] = [
        [
            "requests (ok / rejected / errors)",
            f"{summary.num_requests} ({summary.num_ok} / {summary.num_rejected} / "
            f"{summary.num_errors})",
        ],
        [f"TTFT {p} ms", ms.format(*_ms(summary.ttft_s))],
        [f"ITL {p} ms", ms.format(*_ms(summary.itl_s))],
        [f"TBT (per request) {p} ms", ms.format(*_ms(summary.tbt_s))],
        [
            f"SLO {slo.name} (TTFT {slo.ttft_s:g}s, TBT {slo.tbt_s:g}s) met",
            f"{summary.num_met} ({summary.slo_attainment:.0%})",
        ],
        ["goodput req/s", f"{summary.goodput_rps:.3f}"],
        ["output tokens/s", f"{summary.throughput_tokens_s:.1f}"],
        ["run s", f"{summary.duration_s:.1f}"],
        [f"hit rate ({summary.hit_rate_source})", f"{summary.hit_rate:.1%}"],
        ["hit rate (ideal, trace structure)", f"{summary.ideal_hit_rate:.1%}"],
    ]
    for engine, count in summary.engine_load.items():
        rows.append([f"served by {engine}", count])
    return format_table(["metric", "value"], rows)


def prediction_table(
    summary: ReplaySummary,
    prediction: Prediction,
    fit: CostFit,
    step_fit: StepFit | None = None,
) -> str:
    """Measured against simulated, with the relative error.

    Args:
        summary: the measured run.
        prediction: the simulator's prediction.
        fit: the fitted cost model.
        step_fit: the fitted step cost when the simulation ran kv_both engines (then the line
            describes it instead of ``fit``).

    Returns:
        The table, then a line with the fitted parameters.
    """
    rows = [
        ["goodput req/s", summary.goodput_rps, prediction.goodput_rps],
        ["mean TTFT s", summary.mean_ttft_s, prediction.mean_ttft_s],
        ["SLO attainment", summary.slo_attainment, prediction.slo_attainment],
        ["run s", summary.duration_s, prediction.makespan_s],
    ]
    table = format_table(
        ["metric", "measured", "simulated", "rel. error"],
        [
            [
                name,
                m,
                s,
                f"{relative_error(s, m):+.0%}" if math.isfinite(relative_error(s, m)) else "n/a",
            ]
            for name, m, s in rows
        ],
    )
    if step_fit is not None:
        step = step_fit.cost
        return (
            f"{table}\nfitted (kv_both engine): step = {step.step_base_s * 1e3:.1f} ms + "
            f"{step.decode_s_per_seq * 1e3:.2f} ms x decoding + "
            f"{step.prefill_s_per_token * 1e3:.3f} ms x prefill tokens, request overhead "
            f"{step.request_overhead_s * 1e3:.0f} ms (rmse {step_fit.rmse * 1e3:.0f} ms, "
            f"{step_fit.num_gap_rows} token gaps, {step_fit.num_ttft_rows} idle TTFTs)"
        )
    cost = fit.cost
    return (
        f"{table}\nfitted: TTFT = {cost.prefill_base_s * 1e3:.1f} ms x prefills + "
        f"{cost.prefill_s_per_token * 1e3:.3f} ms x uncached tokens, waited for (rmse "
        f"{fit.ttft.rmse * 1e3:.0f} ms, n={fit.ttft.num_points}); decode step = "
        f"{cost.decode_base_s * 1e3:.1f} ms + {cost.decode_s_per_seq * 1e3:.2f} ms x batch "
        f"(rmse {fit.tbt.rmse * 1e3:.1f} ms, n={fit.tbt.num_points})"
    )


def write_json(
    path: Path,
    config: Mapping[str, Any],
    summary: ReplaySummary,
    results: Sequence[RequestResult],
    prediction: Prediction | None = None,
    fit: CostFit | None = None,
    step_fit: StepFit | None = None,
) -> Path:
    """Write the run (configuration, summary, every request) as JSON.

    Args:
        path: the file.
        config: how the run was made.
        summary: its summary.
        results: every request.
        prediction: the simulator's, if any.
        fit: the fitted cost model, if any.
        step_fit: the fitted kv_both step cost, if any.

    Returns:
        ``path``.
    """

    def clean(value: Any) -> Any:  # JSON has no NaN
        if isinstance(value, float) and not math.isfinite(value):
            return None
        if isinstance(value, dict):
            return {k: clean(v) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return [clean(v) for v in value]
        return value

    body = {
        "config": dict(config),
        "summary": asdict(summary),
        "prediction": asdict(prediction) if prediction else None,
        "cost_model": asdict(fit.cost) if fit else None,
        "step_model": asdict(step_fit.cost) if step_fit else None,
        "requests": [r.to_json() for r in results],
    }
    path.write_text(json.dumps(clean(body), indent=1))
    return path


def plot_latencies(results: Sequence[RequestResult], slo: SLOClass, path: Path) -> Path:
    """CDFs of TTFT and of inter-token latency, with the SLO targets.

    Args:
        results: every request.
        slo: the class (its targets are drawn).
        path: the PNG.

    Returns:
        ``path``.
    """
    plt = pyplot()
    ok = [r for r in results if r.outcome == "ok"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for ax, values, target, title in (
        (left, [r.ttft_s for r in ok], slo.ttft_s, "TTFT"),
        (right, [g for r in ok for g in r.itl_s], slo.tbt_s, "inter-token latency"),
    ):
        values = sorted(v * 1e3 for v in values)
        if values:
            ax.step(values, [(i + 1) / len(values) for i in range(len(values))], where="post")
        ax.axvline(target * 1e3, color="red", linestyle="--", label=f"SLO {target * 1e3:g} ms")
        ax.set_xlabel(f"{title} (ms)")
        ax.set_ylabel("fraction of requests" if title == "TTFT" else "fraction of gaps")
        ax.set_title(title)
        ax.legend()
    return save_figure(fig, path, dpi=100)


def plot_timeline(results: Sequence[RequestResult], path: Path) -> Path:
    """Each request as a bar from send to last byte, its first token marked.

    Args:
        results: every request.
        path: the PNG.

    Returns:
        ``path``.
    """
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(10, max(3, 0.25 * len(results))))
    for i, r in enumerate(results):
        color = {"ok": "tab:blue", "rejected": "tab:orange"}.get(r.outcome, "tab:red")
        ax.plot([r.sent_s, r.finish_s], [i, i], color=color, linewidth=3)
        if r.token_times_s:
            ax.plot([r.sent_s + r.ttft_s], [i], "k|", markersize=8)
    ax.set_xlabel("seconds since start")
    ax.set_ylabel("request")
    ax.set_title("requests: send to last byte (| first token)")
    return save_figure(fig, path, dpi=100)


def plot_fit(results: Sequence[RequestResult], fit: CostFit, path: Path) -> Path:
    """Measured TTFT against the fitted model's (base per prefill waited for + cost per uncached
    token waited for, see :mod:`.fit`); on the diagonal the fit is exact.

    Args:
        results: every request.
        fit: the fitted cost model.
        path: the PNG.

    Returns:
        ``path``.
    """
    plt = pyplot()
    ok = [r for r in results if r.outcome == "ok"]
    cost = fit.cost
    predicted = [
        (cost.prefill_base_s * prefills + cost.prefill_s_per_token * tokens) * 1e3
        for prefills, tokens in queue_ahead(ok, fit.num_engines)
    ]
    measured = [r.ttft_s * 1e3 for r in ok]
    fig, ax = plt.subplots(figsize=(5, 5))
    ax.scatter(predicted, measured, label="requests")
    top = max([*predicted, *measured, 1.0])
    ax.plot([0, top], [0, top], color="red", label="exact")
    ax.set_xlabel("fitted TTFT (ms)")
    ax.set_ylabel("measured TTFT (ms)")
    ax.legend()
    return save_figure(fig, path, dpi=100)


def plot_engine_load(summary: ReplaySummary, path: Path) -> Path:
    """Served requests per engine.

    Args:
        summary: the run's summary.
        path: the PNG.

    Returns:
        ``path``.
    """
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.5))
    names = list(summary.engine_load) or ["(unknown)"]
    counts = list(summary.engine_load.values()) or [summary.num_ok]
    ax.bar(range(len(names)), counts)
    ax.set_xticks(range(len(names)), names, rotation=15, fontsize=8)
    ax.set_ylabel("requests served")
    return save_figure(fig, path, dpi=100)
