"""Tables (plain text, Markdown-compatible) and PNG plots of replays and simulations.

Plots need matplotlib (the ``dev`` extra); it is imported only when a plot is drawn, with the
non-interactive ``Agg`` backend, so nothing opens a window and the tables work without it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from kvstore.routing.slo import SLOClass

from .policies import HitStats
from .simulator import SimResult


def format_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """Render a Markdown table with aligned columns.

    Args:
        headers: column titles.
        rows: cells; floats are shown with 3 decimals, others with ``str``.

    Returns:
        The table, one line per row, no trailing newline.
    """

    def cell(value: object) -> str:
        if isinstance(value, float):
            return "nan" if np.isnan(value) else f"{value:.3f}"
        return str(value)

    text_rows = [[cell(v) for v in row] for row in rows]
    widths = [len(h) for h in headers]
    for row in text_rows:
        for i, value in enumerate(row):
            widths[i] = max(widths[i], len(value))

    def line(values: Sequence[str]) -> str:
        return "| " + " | ".join(v.rjust(w) for v, w in zip(values, widths, strict=True)) + " |"

    out = [line(headers), "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    out.extend(line(row) for row in text_rows)
    return "\n".join(out)


def capacity_label(capacity_blocks: int | None) -> str:
    """``10k`` for 10,000 blocks, ``unlimited`` for None."""
    if capacity_blocks is None:
        return "unlimited"
    if capacity_blocks % 1000 == 0 and capacity_blocks >= 1000:
        return f"{capacity_blocks // 1000}k"
    return str(capacity_blocks)


def hit_rate_table(
    grid: Mapping[tuple[str, int | None], HitStats],
    policies: Sequence[str],
    capacities: Sequence[int | None],
    block_size: int = 512,
) -> str:
    """Policies (columns) x capacities (rows) of block hit rates.

    Args:
        grid: hit stats keyed by (policy, capacity in blocks).
        policies: column order.
        capacities: row order (None = unlimited).
        block_size: tokens per block, for the tokens column.

    Returns:
        The table.
    """
    rows = []
    for capacity in capacities:
        tokens = "-" if capacity is None else f"{capacity * block_size / 1e6:.1f}M"
        rows.append(
            [capacity_label(capacity), tokens] + [grid[(p, capacity)].hit_rate for p in policies]
        )
    return format_table(["capacity (blocks)", "tokens", *policies], rows)


def summary_row(result: SimResult, label: str | None = None) -> list[object]:
    """One row of :data:`SUMMARY_HEADERS` for a run."""
    ttft = result.percentiles("ttft_s")
    tbt = result.percentiles("tbt_s")
    return [
        label or result.router,
        *ttft,
        *(1000 * v for v in tbt),
        result.slo_attainment,
        result.goodput_rps,
        result.num_rejected,
        result.cache_hit_rate,
        result.local_hit_rate,
    ]


SUMMARY_HEADERS = (
    "scheduler",
    "TTFT p50 s",
    "TTFT p90 s",
    "TTFT p99 s",
    "TBT p50 ms",
    "TBT p90 ms",
    "TBT p99 ms",
    "SLO att.",
    "goodput req/s",
    "rejected",
    "hit rate",
    "local hit",
)


def summary_table(results: Sequence[tuple[str, SimResult]]) -> str:
    """TTFT/TBT percentiles, SLO attainment, goodput, rejections and hit rates per run.

    Args:
        results: (label, result) pairs.

    Returns:
        The table.
    """
    return format_table(SUMMARY_HEADERS, [summary_row(r, label) for label, r in results])


def load_table(result: SimResult) -> str:
    """Per-instance load of one run: requests of every instance, and the busy fraction of each
    prefill instance (decode instances batch continuously, so they show ``-``).

    Args:
        result: a run.

    Returns:
        The table (prefill rows, then decode rows).
    """
    rows: list[list[object]] = []
    span = max(result.makespan_s, 1e-9)
    for i, busy in enumerate(result.prefill_busy_s):
        rows.append([f"prefill {i}", int((result.prefill_ids == i).sum()), busy / span])
    for i, served in enumerate(result.decode_served):
        rows.append([f"decode {i}", served, "-"])
    return format_table(["instance", "requests", "busy fraction"], rows)


def pyplot() -> Any:
    """matplotlib.pyplot on the non-interactive Agg backend (imported on first use)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig: Any, path: Path, dpi: int) -> Path:
    """Lay ``fig`` out, write it to ``path`` as a PNG and close it.

    Args:
        fig: a matplotlib figure (from :func:`pyplot`).
        path: PNG to write.
        dpi: its resolution.

    Returns:
        ``path``.
    """
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    pyplot().close(fig)
    return path


def plot_hit_rates(
    grid: Mapping[tuple[str, int | None], HitStats],
    policies: Sequence[str],
    capacities: Sequence[int],
    path: Path,
    block_size: int = 512,
) -> Path:
    """Hit rate against capacity (tokens, log scale), one line per policy.

    Args:
        grid: hit stats keyed by (policy, capacity); a ``None`` capacity is drawn dashed.
        policies: lines to draw.
        capacities: finite capacities in blocks.
        path: PNG to write.
        block_size: tokens per block.

    Returns:
        ``path``.
    """
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    xs = [c * block_size for c in capacities]
    for policy in policies:
        line = ax.plot(xs, [grid[(policy, c)].hit_rate for c in capacities], marker="o")[0]
        if (policy, None) in grid:
            ax.axhline(grid[(policy, None)].hit_rate, ls="--", color=line.get_color(), lw=0.8)
        line.set_label(policy)
    ax.set_xscale("log")
    ax.set_xlabel("cache capacity (tokens)")
    ax.set_ylabel("block hit rate")
    ax.set_title("Prefix hit rate vs capacity (dashed: unlimited)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    return save_figure(fig, path, dpi=120)


def plot_ttft_cdf(results: Sequence[tuple[str, SimResult]], slo: SLOClass, path: Path) -> Path:
    """CDF of TTFT of accepted requests per run, with the SLO target.

    Args:
        results: (label, result) pairs.
        slo: the class whose TTFT target is drawn.
        path: PNG to write.

    Returns:
        ``path``.
    """
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for label, result in results:
        values = np.sort(result.ttft_s[result.accepted])
        if values.size:
            ax.plot(values, np.arange(1, values.size + 1) / result.num_requests, label=label)
    ax.axvline(slo.ttft_s, color="k", ls=":", label=f"SLO {slo.ttft_s:g}s")
    ax.set_xscale("log")
    ax.set_xlabel("TTFT (s)")
    ax.set_ylabel("fraction of all requests")
    ax.set_title("TTFT (rejected requests never reach 1.0)")
    ax.grid(True, alpha=0.3)
    ax.legend()
    return save_figure(fig, path, dpi=120)


def plot_goodput(labels: Sequence[str], goodputs: Sequence[float], path: Path) -> Path:
    """Bar chart of goodput per scheduler.

    Args:
        labels: bar names.
        goodputs: requests per second that met the SLO.
        path: PNG to write.

    Returns:
        ``path``.
    """
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.bar(range(len(labels)), goodputs)
    ax.set_xticks(range(len(labels)), labels, rotation=30, ha="right")
    ax.set_ylabel("goodput (req/s meeting TTFT and TBT SLO)")
    ax.set_title("Goodput under SLO")
    return save_figure(fig, path, dpi=120)


def plot_instance_load(results: Sequence[tuple[str, SimResult]], path: Path) -> Path:
    """Requests per prefill instance, grouped bars per run.

    Args:
        results: (label, result) pairs of runs on the same cluster.
        path: PNG to write.

    Returns:
        ``path``.
    """
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    width = 0.8 / max(len(results), 1)
    for k, (label, result) in enumerate(results):
        counts = [int((result.prefill_ids == i).sum()) for i in range(len(result.prefill_busy_s))]
        ax.bar(np.arange(len(counts)) + k * width, counts, width, label=label)
    ax.set_xlabel("prefill instance")
    ax.set_ylabel("requests")
    ax.set_title("Per-instance prefill load")
    ax.legend()
    return save_figure(fig, path, dpi=120)
