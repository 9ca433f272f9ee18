"""Throughput and latency of the byte-level store: client and node in separate processes, TCP.

Run:  .venv/bin/python bench/bench_store.py [--quick] [--small [--repeat N]] [--markdown]

Starts an embedded cluster (``kvstore up``: master in one process, storage node in another),
then from this process measures put / get / get_into and batches of 16 at 4 KiB, 64 KiB,
1 MiB and 16 MiB, verifying the bytes, and prints one table (GB/s, p50/p99 µs per operation).

``--small`` measures only the per-request overheads the peer comparison cares about (single 4 KiB
get/get_into, a batch of 16 x 4 KiB get_into, 1 MiB get/get_into/put) and prints, per workload,
the best p50 of ``--repeat`` rounds, so before/after numbers of one change are comparable. It
runs two clients side by side: a plain one (every read asks the master) and one with lease reads
(``lease_reads=True``: a key located within the read lease is reread from its node directly).

``--markdown`` also writes the table into docs/benchmarks.md (see bench/markdown.py): the region
``store``, or ``store-small`` with ``--small``.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

sys.path.append(str(Path(__file__).resolve().parents[1]))  # for bench.markdown

from bench import markdown  # noqa: E402
from kvstore.cli.embedded import EmbeddedCluster  # noqa: E402
from kvstore.client import Client  # noqa: E402

SIZES = [("4KiB", 4 << 10), ("64KiB", 64 << 10), ("1MiB", 1 << 20), ("16MiB", 16 << 20)]
BATCH = 16


def start_cluster(data_dir: str, dram: str) -> tuple[subprocess.Popen[str], str]:
    """An embedded cluster (``kvstore up``) in a child process, and its control address."""
    cluster = EmbeddedCluster(data_dir, dram)
    return cluster.proc, cluster.address


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


def small(clients: dict[str, Client], repeat: int) -> list[str]:
    """Best-of-``repeat`` p50 (µs) of the small-request workloads, per client: prints the
    table and returns its lines."""
    c = next(iter(clients.values()))
    rng = np.random.default_rng(0)
    v4 = rng.integers(0, 256, 4 << 10, dtype=np.uint8)
    v1m = rng.integers(0, 256, 1 << 20, dtype=np.uint8)
    b4, b1m = np.empty_like(v4), np.empty_like(v1m)
    keys = [f"small/b/{i}" for i in range(BATCH)]
    vals = [rng.integers(0, 256, 4 << 10, dtype=np.uint8) for _ in range(BATCH)]
    bufs = [np.empty(4 << 10, dtype=np.uint8) for _ in range(BATCH)]
    c.put("small/4k", v4)
    c.put("small/1m", v1m)
    c.batch_put(keys, vals)

    def work(c: Client) -> list[tuple[str, Callable[[], object], int]]:
        return [
            ("get 4KiB", lambda: c.get("small/4k"), 2000),
            ("get_into 4KiB", lambda: c.get_into("small/4k", b4), 2000),
            (f"batch_get_into x{BATCH} 4KiB", lambda: c.batch_get_into(keys, bufs), 500),
            ("get 1MiB", lambda: c.get("small/1m"), 300),
            ("get_into 1MiB", lambda: c.get_into("small/1m", b1m), 300),
            ("put 1MiB", lambda: c.put("small/1m", v1m), 300),
        ]

    best: dict[tuple[str, str], float] = {}
    for _ in range(repeat):
        for label, client in clients.items():
            for name, fn, iters in work(client):
                timed(fn, iters // 10)  # warm
                p50 = float(np.percentile(timed(fn, iters), 50)) * 1e6
                best[label, name] = min(best.get((label, name), p50), p50)
    for client in clients.values():
        assert client.get("small/4k") == v4.tobytes() and client.get("small/1m") == v1m.tobytes()
        client.get_into("small/1m", b1m)
        assert np.array_equal(b1m, v1m) and np.array_equal(b4, v4)
        client.batch_get_into(keys, bufs)
        assert all(np.array_equal(a, b) for a, b in zip(bufs, vals, strict=True))
    lines = [
        f"| workload (best p50 of {repeat}, µs) | " + " | ".join(clients) + " |",
        "|---|" + "---|" * len(clients),
    ]
    for name, _, _ in work(c):
        lines.append(f"| {name} | " + " | ".join(f"{best[k, name]:.1f}" for k in clients) + " |")
    print("\n".join(lines))
    return lines


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="fewer iterations")
    ap.add_argument("--small", action="store_true", help="only the small-request overheads")
    ap.add_argument("--repeat", type=int, default=3, help="rounds for --small (best p50)")
    ap.add_argument("--markdown", action="store_true", help="write into docs/benchmarks.md")
    args = ap.parse_args()
    if args.small:
        with tempfile.TemporaryDirectory() as tmp:
            proc, address = start_cluster(tmp, "256MiB")
            try:
                with (
                    Client.connect(address) as plain,
                    Client.connect(address, lease_reads=True) as leased,
                ):
                    lines = small({"plain": plain, "lease reads": leased}, args.repeat)
            finally:
                os.kill(proc.pid, signal.SIGTERM)
                proc.wait(timeout=30)
        if args.markdown:
            note = (
                "p50 µs per operation, TCP, client and node in separate processes (`kvstore up`); "
                f"plain: every read asks the master; load average {os.getloadavg()[0]:.1f}."
            )
            markdown.write_table("store-small", "\n".join(lines) + "\n\n" + note)
        return
    scale = 0.2 if args.quick else 1.0
    with tempfile.TemporaryDirectory() as tmp:
        proc, address = start_cluster(tmp, "1GiB")
        try:
            c = Client.connect(address)
            rng = np.random.default_rng(0)
            lines: list[str] = []

            def emit(line: str) -> None:
                print(line)
                lines.append(line)

            emit("| workload           | size      |     GB/s |   p50 (µs) |   p99 (µs) |")
            emit("|--------------------|-----------|----------|------------|------------|")
            for label, size in SIZES:
                iters = max(5, int(scale * min(2000, (256 << 20) // size)))
                value = rng.integers(0, 256, size, dtype=np.uint8)
                buf = np.empty(size, dtype=np.uint8)
                keys = [f"bench/{label}/{i}" for i in range(BATCH)]
                vals = [rng.integers(0, 256, size, dtype=np.uint8) for _ in range(BATCH)]
                bufs = [np.empty(size, dtype=np.uint8) for _ in range(BATCH)]

                emit(row("put", label, size, timed(lambda: c.put("k", value), iters)))
                emit(row("get", label, size, timed(lambda: c.get("k"), iters)))
                emit(row("get_into", label, size, timed(lambda: c.get_into("k", buf), iters)))
                assert np.array_equal(buf, value), "bytes differ"
                b_iters = max(3, iters // BATCH)
                emit(
                    row(
                        f"batch_put x{BATCH}",
                        label,
                        size * BATCH,
                        timed(lambda: c.batch_put(keys, vals), b_iters),
                    )
                )
                emit(
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
    if args.markdown:
        note = (
            "GB/s over all calls, p50/p99 µs per call (a batch is one call); TCP, client and node "
            "in separate processes (`kvstore up`), bytes verified; "
            f"load average {os.getloadavg()[0]:.1f}."
        )
        markdown.write_table("store", "\n".join(lines) + "\n\n" + note)


if __name__ == "__main__":
    main()
