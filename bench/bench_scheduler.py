"""Replay the whole conversation trace: hit rates, pool vs private caches, goodput under SLO.

Usage::

    .venv/bin/python bench/bench_scheduler.py [TRACE] [--out bench/out]

Prints Markdown tables (copied into docs/scheduler.md) and writes PNG plots to ``bench/out/``
(gitignored). Deterministic: no randomness anywhere, so two runs print the same numbers.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from kvstore.errors import KVStoreError
from kvstore.sim import report
from kvstore.sim.cluster import ClusterConfig
from kvstore.sim.experiments import (
    BASELINES,
    CAPACITIES,
    MOONCAKE_NODE_BLOCKS,
    OURS,
    POOL_VS_LOCAL_HEADERS,
    best_baseline,
    hit_rate_grid,
    pool_vs_local_rows,
    run_routers,
)
from kvstore.sim.policies import POLICIES
from kvstore.sim.scheduler import SchedulerConfig
from kvstore.sim.trace import load_trace

REPO = Path(__file__).resolve().parents[1]
DEFAULT_TRACE = REPO / ".." / "shared" / "data" / "traces" / "conversation_trace.jsonl"

#: (label, cluster, speedup): the scenarios of the goodput table.
SCENARIOS = (
    ("4P/4D, pool 12M tok, 1x", ClusterConfig(num_prefill=4, num_decode=4), 1.0),
    ("4P/4D, no pool, 1x", ClusterConfig(num_prefill=4, num_decode=4, pool_blocks=0), 1.0),
    ("5P/4D, no pool, 1x", ClusterConfig(num_prefill=5, num_decode=4, pool_blocks=0), 1.0),
    (
        "6P/4D, pool 18M tok, 1x",
        ClusterConfig(num_prefill=6, num_decode=4, pool_blocks=6 * MOONCAKE_NODE_BLOCKS),
        1.0,
    ),
    (
        "8P/8D, pool 24M tok, 2x",
        ClusterConfig(num_prefill=8, num_decode=8, pool_blocks=8 * MOONCAKE_NODE_BLOCKS),
        2.0,
    ),
    (  # decode-bound: one decode instance takes twice the trace's rate
        "8P/1D, pool 24M tok, 2x",
        ClusterConfig(num_prefill=8, num_decode=1, pool_blocks=8 * MOONCAKE_NODE_BLOCKS),
        2.0,
    ),
)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trace", nargs="?", type=Path, default=DEFAULT_TRACE)
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "out")
    args = parser.parse_args()
    started = time.perf_counter()
    try:
        requests = load_trace(args.trace)
    except (KVStoreError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    policies = tuple(POLICIES)
    span_s = (requests[-1].timestamp_ms - requests[0].timestamp_ms) / 1000
    print(f"## Trace: {args.trace.name}\n")
    print(
        report.format_table(
            ["requests", "span s", "req/s", "mean input tok", "mean output tok", "distinct blocks"],
            [
                [
                    len(requests),
                    round(span_s),
                    len(requests) / span_s,
                    round(sum(r.input_length for r in requests) / len(requests)),
                    round(sum(r.output_length for r in requests) / len(requests)),
                    len({b for r in requests for b in r.hash_ids}),
                ]
            ],
        )
    )

    t = time.perf_counter()
    grid = hit_rate_grid(requests, policies, CAPACITIES)
    print(
        f"\n## Block hit rate of one shared cache, policies x capacity ({time.perf_counter() - t:.1f}s)\n"
    )
    print(report.hit_rate_table(grid, policies, CAPACITIES))
    unlimited = grid[("lru", None)].hit_rate
    print(
        f"\ncache ratio (unlimited cache): {unlimited:.3f} of blocks, "
        f"{grid[('lru', None)].token_hit_rate:.3f} of prompt tokens"
    )
    for policy in policies:
        reach = next(
            (
                c
                for c in CAPACITIES
                if c is not None and grid[(policy, c)].hit_rate >= 0.95 * unlimited
            ),
            None,
        )
        where = "never" if reach is None else f"{reach * 512 / 1e6:.1f}M tokens"
        print(f"\n{policy}: 95% of the unlimited hit rate ({unlimited:.3f}) at {where}", end="")
    print()
    finite = [c for c in CAPACITIES if c is not None]
    report.plot_hit_rates(grid, policies, finite, args.out / "hit_rate_vs_capacity.png")

    t = time.perf_counter()
    rows = pool_vs_local_rows(requests, (4, 8, 16), MOONCAKE_NODE_BLOCKS, "lru")
    print(
        f"\n## Global pool vs a cache per instance, 3M tokens ({MOONCAKE_NODE_BLOCKS} blocks) "
        f"each, LRU ({time.perf_counter() - t:.1f}s)\n"
    )
    print(report.format_table(POOL_VS_LOCAL_HEADERS, rows))

    slo = SchedulerConfig().slo_classes[0]
    print(f"\n## Goodput (req/s meeting TTFT <= {slo.ttft_s:g}s and TBT <= {slo.tbt_s:g}s)\n")
    print(
        "Baselines run as they are (no early rejection); `+reject` gives them the conductor's "
        "early rejection, `-reject` takes it from the conductor.\n"
    )
    labels: list[str] = []
    table: dict[str, list[object]] = {}
    comparisons = []
    scenario_runs = {}
    for name, cluster, speedup in SCENARIOS:
        t = time.perf_counter()
        runs = run_routers(requests, cluster, speedup=speedup, with_ablation=True)
        scenario_runs[name] = runs
        for label, result in runs:
            if label not in table:
                labels.append(label)
                table[label] = []
            table[label].append(result.goodput_rps)
        ours = dict(runs)[OURS]
        best_label, best = best_baseline(runs)
        gain = ours.goodput_rps / best.goodput_rps - 1 if best.goodput_rps else float("inf")
        gain = 0.0 if abs(gain) < 5e-3 else gain  # no "-0%"
        comparisons.append(
            [name, best_label, best.goodput_rps, ours.goodput_rps, f"{100 * gain:+.0f}%"]
        )
        print(f"  ran {name} in {time.perf_counter() - t:.1f}s", file=sys.stderr)
    print(
        report.format_table(
            ["scheduler", *(s[0] for s in SCENARIOS)], [[lbl, *table[lbl]] for lbl in labels]
        )
    )
    print("\n### Conductor vs the best baseline\n")
    print(
        report.format_table(
            ["scenario", "best baseline", "its goodput", "conductor", "gain"], comparisons
        )
    )

    main_name = SCENARIOS[0][0]
    main_runs = [(lbl, r) for lbl, r in scenario_runs[main_name] if lbl in (*BASELINES, OURS)]
    print(f"\n## Latency, SLO attainment and hit rates: {main_name}\n")
    print(report.summary_table(scenario_runs[main_name]))
    conductor = dict(scenario_runs[main_name])[OURS]
    print(
        f"\n## Per-instance load under the conductor: {main_name} ({conductor.num_replicated} prefixes replicated)\n"
    )
    print(report.load_table(conductor))
    for other in (SCENARIOS[2][0], SCENARIOS[-1][0]):
        print(f"\n## Latency, SLO attainment and hit rates: {other}\n")
        print(report.summary_table(scenario_runs[other]))

    report.plot_ttft_cdf(main_runs, slo, args.out / "ttft_cdf.png")
    report.plot_goodput(labels, table_column(table, labels, 0), args.out / "goodput.png")
    report.plot_instance_load(main_runs, args.out / "prefill_load.png")
    print(f"\nPNGs in {args.out}; total {time.perf_counter() - started:.1f}s")
    return 0


def table_column(table: dict[str, list[object]], labels: list[str], index: int) -> list[float]:
    return [float(table[label][index]) for label in labels]  # type: ignore[arg-type]


if __name__ == "__main__":
    sys.exit(main())
