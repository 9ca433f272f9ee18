"""Throughput and latency of the byte-level store: client and node in separate processes, TCP.

Run:  .venv/bin/python bench/bench_store.py [--quick]

Starts an embedded cluster (``kvstore up``: master in one process, storage node in another),
then from this process measures put / get / get_into and batches of 16 at 4 KiB, 64 KiB,
1 MiB and 16 MiB, verifying the bytes, and prints one table (GB/s, p50/p99 µs per operation).
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

import numpy as np
from kvstore.client import Client

SIZES = [("4KiB", 4 << 10), ("64KiB", 64 << 10), ("1MiB", 1 << 20), ("16MiB", 16 << 20)]
BATCH = 16


def start_cluster(data_dir: str, dram: str) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvstore",
            "--log-level",
            "warning",
            "up",
            "--port",
            "0",
            "--dram",
            dram,
            "--data-dir",
            data_dir,
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    deadline = time.monotonic() + 60
    for line in proc.stdout:
        m = re.search(r"ready control=(\S+)", line)
        if m:
            return proc, m.group(1)
        if time.monotonic() > deadline:
            break
    proc.kill()
    raise RuntimeError("cluster did not start")


def timed(fn: Callable[[], object], iters: int) -> list[float]:
    out = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def row(name: str, size: int, per_op_bytes: int, samples: list[float]) -> str:
    s = np.array(samples)
    gbps = per_op_bytes * len(s) / s.sum() / 1e9
    return f"| {name:<18} | {size:>9} | {gbps:8.3f} | {np.percentile(s, 50) * 1e6:10.1f} | {np.percentile(s, 99) * 1e6:10.1f} |"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="fewer iterations")
    args = ap.parse_args()
    scale = 0.2 if args.quick else 1.0
    with tempfile.TemporaryDirectory() as tmp:
        proc, address = start_cluster(tmp, "1GiB")
        try:
            c = Client.connect(address)
            rng = np.random.default_rng(0)
            print("| workload           | size      |     GB/s |   p50 (µs) |   p99 (µs) |")
            print("|--------------------|-----------|----------|------------|------------|")
            for label, size in SIZES:
                iters = max(5, int(scale * min(2000, (256 << 20) // size)))
                value = rng.integers(0, 256, size, dtype=np.uint8)
                buf = np.empty(size, dtype=np.uint8)
                keys = [f"bench/{label}/{i}" for i in range(BATCH)]
                vals = [rng.integers(0, 256, size, dtype=np.uint8) for _ in range(BATCH)]
                bufs = [np.empty(size, dtype=np.uint8) for _ in range(BATCH)]

                print(row("put", label, size, timed(lambda: c.put("k", value), iters)))
                print(row("get", label, size, timed(lambda: c.get("k"), iters)))
                print(row("get_into", label, size, timed(lambda: c.get_into("k", buf), iters)))
                assert np.array_equal(buf, value), "bytes differ"
                b_iters = max(3, iters // BATCH)
                print(
                    row(
                        f"batch_put x{BATCH}",
                        label,
                        size * BATCH,
                        timed(lambda: c.batch_put(keys, vals), b_iters),
                    )
                )
                print(
                    row(
                        f"batch_get_into x{BATCH}",
                        label,
                        size * BATCH,
                        timed(lambda: c.batch_get_into(keys, bufs), b_iters),
                    )
                )
                assert all(np.array_equal(a, b) for a, b in zip(bufs, vals, strict=True)), (
                    "batch bytes differ"
                )
                c.batch_remove(keys)
            c.close()
        finally:
            os.kill(proc.pid, signal.SIGTERM)
            proc.wait(timeout=30)


if __name__ == "__main__":
    main()
