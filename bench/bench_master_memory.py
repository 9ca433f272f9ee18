"""Master memory per object and the longest stall while the object table grows.

Run:  .venv/bin/python bench/bench_master_memory.py [--objects 1000000] [--batch 1000]
      [--markdown]

Drives an in-process ``MasterService`` (fake clock, two registered nodes whose DRAM segments
hold every object) with ``put_start`` / ``put_end`` batches of 16-byte objects, as a client's
``batch_put`` would, and prints one table: bytes per committed object (``tracemalloc`` and RSS
growth, each divided by the number of objects), the total put time, the worst batch, and how
long one full ``gc.collect()`` over the final table takes, and the collector's own pauses
while the table grew (``gc.callbacks``: their total and the longest; these are CPU-bound and
less disturbed by a busy machine than the batch times). Run it once with the cyclic collector
on (the default) and once with ``--gc-off`` to tell collection pauses apart from the master's
own work. ``--daemon-gc`` applies the master daemon's collector policy before the first put
(``kvstore.gc_policy.tune_collector``: a larger young threshold, start-up frozen).
``--tracemalloc`` traces allocations (slower; RSS is
measured either way). ``--markdown`` also writes the table into docs/benchmarks.md (see
bench/markdown.py).
"""

from __future__ import annotations

import argparse
import gc
import os
import resource
import sys
import time
import tracemalloc
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[1]))  # for bench.markdown

from bench import markdown  # noqa: E402
from kvstore.gc_policy import CollectorPauses, tune_collector  # noqa: E402
from kvstore.master.service import MasterConfig, MasterService  # noqa: E402
from kvstore.types import SegmentSpec  # noqa: E402

SECRET = b"s" * 32
OBJECT_BYTES = 16


def _rss_bytes() -> int:
    """Resident set size now (Linux ``/proc/self/statm``), falling back to the peak."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * resource.getpagesize()
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def run(num_objects: int, batch: int, trace: bool, daemon_gc: bool = False) -> dict[str, float]:
    """Put ``num_objects`` objects in batches of ``batch``; return the figures.

    Args:
        num_objects: objects to commit.
        batch: keys per ``put_start`` / ``put_end`` call.
        trace: measure with ``tracemalloc`` as well as RSS.
        daemon_gc: apply the master daemon's collector policy before the first put.

    Returns:
        The figures of the table this prints.
    """
    now = [0.0]
    svc = MasterService(
        MasterConfig(max_batch=max(batch, 1)), clock=lambda: now[0], wall_ms=lambda: 1_000
    )
    capacity = (num_objects * 64 + (1 << 20)) // 2 * 2
    for i in range(2):
        svc.register(
            f"node{i}",
            "127.0.0.1",
            7000 + i,
            SECRET,
            [SegmentSpec("dram", "dram", capacity)],
        )
    keys = [b"bench/obj/%012d" % i for i in range(num_objects)]
    gc.collect()
    if daemon_gc:
        tune_collector()
    pauses = CollectorPauses()
    gc.callbacks.append(pauses)
    rss0 = _rss_bytes()
    if trace:
        tracemalloc.start()
    traced0 = tracemalloc.get_traced_memory()[0] if trace else 0
    worst = 0.0
    t0 = time.perf_counter()
    for start in range(0, num_objects, batch):
        chunk = keys[start : start + batch]
        b0 = time.perf_counter()
        tickets = svc.put_start(chunk, [OBJECT_BYTES] * len(chunk))
        put_ids = [t.put_id for t in tickets]  # type: ignore[union-attr]
        errors = svc.put_end(put_ids, [0x1234] * len(put_ids))
        worst = max(worst, time.perf_counter() - b0)
        assert not any(errors), errors[:3]
        now[0] += 0.001
    total = time.perf_counter() - t0
    gc.callbacks.remove(pauses)
    traced = (tracemalloc.get_traced_memory()[0] - traced0) if trace else 0
    if trace:
        tracemalloc.stop()
    rss = _rss_bytes() - rss0
    assert len(svc.objects) == num_objects
    g0 = time.perf_counter()
    gc.collect()
    full_gc = time.perf_counter() - g0
    return {
        "objects": num_objects,
        "traced_b": traced / num_objects,
        "rss_b": rss / num_objects,
        "put_s": total,
        "worst_ms": worst * 1000,
        "full_gc_ms": full_gc * 1000,
        "tracked": len(gc.get_objects()),
        "gc_total_s": sum(pauses.seconds),
        "gc_longest_ms": max(pauses.longest_s) * 1000,
        "gc_full": pauses.num_collections[2],
    }


def main() -> None:
    """Parse flags, run, print the table."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--objects", type=int, default=1_000_000, help="objects to commit")
    ap.add_argument("--batch", type=int, default=1000, help="keys per put_start/put_end")
    ap.add_argument("--gc-off", action="store_true", help="disable the cyclic collector")
    ap.add_argument("--tracemalloc", action="store_true", help="also trace allocations")
    ap.add_argument("--daemon-gc", action="store_true", help="the master daemon's collector policy")
    ap.add_argument("--markdown", action="store_true", help="write into docs/benchmarks.md")
    args = ap.parse_args()
    if args.gc_off:
        gc.disable()
    r = run(args.objects, args.batch, args.tracemalloc, args.daemon_gc)
    traced = f"{r['traced_b']:.0f}" if args.tracemalloc else "-"
    print(
        "| objects | gc | bytes/object (tracemalloc) | bytes/object (RSS) | put time s "
        "| worst batch ms | gc pauses s (full ones) | longest gc pause ms "
        "| full gc.collect ms | gc-tracked objects |"
    )
    print("| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    gc_mode = "off" if args.gc_off else "on, daemon policy" if args.daemon_gc else "on"
    print(
        f"| {r['objects']:,} | {gc_mode} | {traced} | {r['rss_b']:.0f} "
        f"| {r['put_s']:.1f} | {r['worst_ms']:.0f} | {r['gc_total_s']:.2f} ({r['gc_full']:.0f}) "
        f"| {r['gc_longest_ms']:.0f} | {r['full_gc_ms']:.0f} | {r['tracked']:,} |"
    )
    if args.markdown:
        head = [
            "objects",
            "gc",
            "bytes/object (tracemalloc)",
            "bytes/object (RSS)",
            "put time s",
            "worst batch ms",
            "gc pauses s (full ones)",
            "longest gc pause ms",
            "full gc.collect ms",
            "gc-tracked objects",
        ]
        row = [
            f"{r['objects']:,}",
            gc_mode,
            traced,
            f"{r['rss_b']:.0f}",
            f"{r['put_s']:.1f}",
            f"{r['worst_ms']:.0f}",
            f"{r['gc_total_s']:.2f} ({r['gc_full']:.0f})",
            f"{r['gc_longest_ms']:.0f}",
            f"{r['full_gc_ms']:.0f}",
            f"{r['tracked']:,}",
        ]
        note = (
            f"An in-process master, `put_start` / `put_end` batches of {args.batch:,} objects of "
            f"{OBJECT_BYTES} B; load average {os.getloadavg()[0]:.1f}."
        )
        markdown.write_table("master-memory", f"{markdown.table(head, [row])}\n\n{note}")


if __name__ == "__main__":
    main()
