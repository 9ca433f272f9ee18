"""The node's garbage collector under a steady write load: many tiny distinct objects.

Run:  .venv/bin/python bench/bench_node_gc.py [--objects 1000000] [--batch 1000] [--markdown]

Starts a real master and one storage node (``kvstore master``, ``kvstore node --dram 2GiB``),
each its own process, then from this process writes ``--objects`` distinct 16 B objects in
``batch_put`` calls of ``--batch`` keys (each checked). Prints keys/s over the whole run, the
slowest ``batch_put``, and the node's collections by generation from its ``kvstore_gc_*``
metrics: count, seconds in all and the longest. What a node keeps per object written (its
manifest record, memoised grants, write claims) is what its full collections walk.
``--markdown`` also writes the table into docs/benchmarks.md (see bench/markdown.py).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_small import field, master_and_node  # noqa: E402

from bench import markdown  # noqa: E402
from kvstore.client import Client  # noqa: E402

GC_FIGURES = (
    ("collections", "kvstore_gc_collections_total", "{:.0f}"),
    ("seconds in all", "kvstore_gc_pause_seconds_total", "{:.3f}"),
    ("longest (ms)", "kvstore_gc_longest_pause_seconds", "{:.1f}"),
)


def node_gc(admin: str) -> dict[str, list[float]]:
    """The node's collector figures per generation (0, 1, 2) from its ``/metrics``."""
    with urllib.request.urlopen(f"{admin}/metrics", timeout=10) as r:
        text = r.read().decode()
    out = {}
    for _, name, _ in GC_FIGURES:
        found = dict(re.findall(name + r'\{generation="(\d)"\} ([0-9.e+-]+)', text))
        out[name] = [float(found.get(str(g), "nan")) for g in range(3)]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--objects", type=int, default=1_000_000)
    ap.add_argument("--batch", type=int, default=1000)
    ap.add_argument("--markdown", action="store_true", help="write into docs/benchmarks.md")
    args = ap.parse_args()
    with master_and_node("2GiB", "bench-node-gc-") as (control, nline):
        value = b"x" * 16
        slowest = 0.0
        with Client.connect(control) as client:
            started = time.perf_counter()
            for r in range(args.objects // args.batch):
                keys = [b"gc/%d/%d" % (r, i) for i in range(args.batch)]
                t0 = time.perf_counter()
                results = client.batch_put(keys, [value] * args.batch)
                slowest = max(slowest, time.perf_counter() - t0)
                failed = [e for e in results if e is not None]
                if failed:
                    raise SystemExit(f"batch_put failed: {failed[0]!r}")
            took = time.perf_counter() - started
        figures = node_gc(field(nline, "admin"))
    n = args.objects // args.batch * args.batch
    lines = [
        f"bench_node_gc: {n:,} objects of 16 B, batch_put of {args.batch}, TCP, 1 node",
        f"{n / took:,.0f} keys/s over the run; slowest batch_put {slowest * 1e3:.1f} ms",
        "| the node's collector | gen 0 | gen 1 | gen 2 |",
        "| --- | ---: | ---: | ---: |",
    ]
    for label, name, fmt in GC_FIGURES:
        scale = 1e3 if "ms" in label else 1.0
        lines.append(
            f"| {label} | " + " | ".join(fmt.format(v * scale) for v in figures[name]) + " |"
        )
    print("\n".join(lines))
    if args.markdown:
        # The two heading lines become one paragraph above the table, with the load average.
        head = f"{lines[0]}; {lines[1]}; load average {os.getloadavg()[0]:.1f}"
        markdown.write_table("node-gc", head + "\n\n" + "\n".join(lines[2:]))


if __name__ == "__main__":
    main()
