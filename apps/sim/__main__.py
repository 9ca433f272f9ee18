"""Command line: replay a trace through the simulator and print tables.

Usage::

    python -m kvstore.sim TRACE [--limit N] [--prefill 4] [--decode 4]
        [--local-blocks 5860] [--pool-blocks 23440|unlimited|0] [--policy lru]
        [--routers round-robin,least-loaded,cache-only,conductor] [--speedup 1.0]
        [--ttft-slo 30] [--tbt-slo 0.1] [--no-reject] [--ablation] [--hit-rates] [--out DIR]

Exit status 0 on success, 2 for bad arguments or a bad trace (the error names the line).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from kvstore.errors import KVStoreError
from kvstore.routing.slo import SLOClass

from . import report
from .cluster import ClusterConfig
from .default_slo import DEFAULT_SLO
from .experiments import CAPACITIES, hit_rate_grid, run_routers
from .policies import POLICIES
from .scheduler import ROUTERS, SchedulerConfig
from .trace import load_trace


def _blocks(text: str) -> int | None:
    if text.lower() in ("unlimited", "none", "inf"):
        return None
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError("must be >= 0 or 'unlimited'")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The CLI's argument parser."""
    parser = argparse.ArgumentParser(
        prog="python -m kvstore.sim",
        description="Replay a Mooncake-format trace through kvstore's scheduler simulator.",
    )
    parser.add_argument("trace", type=Path, help="JSONL trace (timestamp, lengths, hash_ids)")
    parser.add_argument("--limit", type=int, default=None, help="use the first N requests")
    parser.add_argument("--block-size", type=int, default=512, help="tokens per hash id")
    parser.add_argument("--prefill", type=int, default=4, help="prefill instances")
    parser.add_argument("--decode", type=int, default=4, help="decode instances")
    parser.add_argument("--local-blocks", type=_blocks, default=5_860, help="per-instance cache")
    parser.add_argument(
        "--pool-blocks", type=_blocks, default=23_440, help="global pool; 0 = no pool"
    )
    parser.add_argument("--policy", choices=sorted(POLICIES), default="lru")
    parser.add_argument("--routers", default=",".join(ROUTERS), help="comma-separated")
    parser.add_argument("--speedup", type=float, default=1.0, help="arrival-rate multiplier")
    parser.add_argument("--ttft-slo", type=float, default=DEFAULT_SLO.ttft_s, help="seconds")
    parser.add_argument("--tbt-slo", type=float, default=DEFAULT_SLO.tbt_s, help="seconds")
    parser.add_argument("--no-reject", action="store_true", help="conductor without rejection")
    parser.add_argument("--ablation", action="store_true", help="also flip early rejection")
    parser.add_argument("--hit-rates", action="store_true", help="print the hit-rate table")
    parser.add_argument("--out", type=Path, default=None, help="write PNG plots here")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI.

    Args:
        argv: arguments (default ``sys.argv[1:]``).

    Returns:
        The exit status.
    """
    args = build_parser().parse_args(argv)
    try:
        started = time.perf_counter()
        requests = load_trace(args.trace, block_size=args.block_size, limit=args.limit)
        routers = [name.strip() for name in args.routers.split(",") if name.strip()]
        unknown = [name for name in routers if name not in ROUTERS]
        if unknown:
            print(f"error: unknown router(s) {', '.join(unknown)}", file=sys.stderr)
            return 2
        slo = SLOClass(DEFAULT_SLO.name, args.ttft_slo, args.tbt_slo)
        scheduler = SchedulerConfig((slo,), early_rejection=not args.no_reject)
        cluster = ClusterConfig(
            num_prefill=args.prefill,
            num_decode=args.decode,
            local_cache_blocks=args.local_blocks,
            pool_blocks=args.pool_blocks,
            cache_policy=args.policy,
        )
        runs = run_routers(
            requests, cluster, scheduler, args.speedup, routers, with_ablation=args.ablation
        )
    except (KVStoreError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(
        f"{len(requests)} requests, {args.prefill} prefill / {args.decode} decode, "
        f"SLO TTFT {slo.ttft_s:g}s TBT {slo.tbt_s:g}s, speedup {args.speedup:g}"
    )
    print(report.summary_table(runs))
    for label, result in runs:
        print(f"\nload under {label} ({result.num_replicated} prefixes replicated):")
        print(report.load_table(result))
    grid = None
    if args.hit_rates:
        grid = hit_rate_grid(requests, tuple(POLICIES), CAPACITIES)
        print("\nblock hit rate, one shared cache:")
        print(report.hit_rate_table(grid, tuple(POLICIES), CAPACITIES, args.block_size))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        report.plot_ttft_cdf(runs, slo, args.out / "ttft_cdf.png")
        report.plot_goodput(
            [lbl for lbl, _ in runs], [r.goodput_rps for _, r in runs], args.out / "goodput.png"
        )
        report.plot_instance_load(runs, args.out / "instance_load.png")
        if grid is not None:
            finite = [c for c in CAPACITIES if c is not None]
            report.plot_hit_rates(grid, tuple(POLICIES), finite, args.out / "hit_rate.png")
        print(f"\nplots written to {args.out}")
    print(f"\ndone in {time.perf_counter() - started:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
