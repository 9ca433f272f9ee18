"""CPU time per operation of the client, the master and the node (``/proc``), small requests.

Run:  .venv/bin/python bench/cpu_per_op.py [--n 3000] [--markdown]

On a machine with fewer cores than processes, latency tracks the *sum* of the three processes'
CPU per request, so this is the number the small-request optimisations are judged by.
``--markdown`` also writes the table into docs/benchmarks.md (see bench/markdown.py).
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from kvstore.client import Client

sys.path.insert(0, os.path.dirname(__file__))
sys.path.append(str(Path(__file__).resolve().parents[1]))  # for bench.markdown
from bench_store import start_cluster  # noqa: E402

from bench import markdown  # noqa: E402

TICK = os.sysconf("SC_CLK_TCK")


def cpu_s(pid: int) -> tuple[float, float]:
    """(user, system) CPU seconds of ``pid`` so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) / TICK, int(fields[12]) / TICK


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=3000)
    ap.add_argument("--markdown", action="store_true", help="write into docs/benchmarks.md")
    args = ap.parse_args()
    lines: list[str] = []
    with tempfile.TemporaryDirectory() as tmp:
        proc, address = start_cluster(tmp, "256MiB")
        try:
            kids = subprocess.run(
                ["pgrep", "-P", str(proc.pid)], capture_output=True, text=True, check=False
            ).stdout.split()
            pids = {"client": os.getpid(), "master": proc.pid, "node": int(kids[0])}
            with Client.connect(address) as c:
                v = np.ones(4 << 10, np.uint8)
                b = np.empty_like(v)
                keys = [f"k{i}" for i in range(16)]
                bufs = [np.empty_like(v) for _ in keys]
                c.put("k", v)
                c.batch_put(keys, [v] * 16)
                work = {
                    "get_into 4KiB": (lambda: c.get_into("k", b), args.n),
                    "get 4KiB": (lambda: c.get("k"), args.n),
                    "batch_get_into x16 4KiB": (lambda: c.batch_get_into(keys, bufs), args.n // 4),
                }
                lines += [
                    "| workload | wall µs/op | client usr+sys | master usr+sys | node usr+sys |",
                    "|---|---|---|---|---|",
                ]
                print("\n".join(lines))
                for name, (fn, n) in work.items():
                    for _ in range(n // 10):
                        fn()
                    before = {k: cpu_s(p) for k, p in pids.items()}
                    t0 = time.perf_counter()
                    for _ in range(n):
                        fn()
                    wall = (time.perf_counter() - t0) / n * 1e6
                    cells = []
                    for k, p in pids.items():
                        (u0, s0), (u1, s1) = before[k], cpu_s(p)
                        cells.append(f"{(u1 - u0) / n * 1e6:.0f}+{(s1 - s0) / n * 1e6:.0f}")
                    lines.append(f"| {name} | {wall:.0f} | " + " | ".join(cells) + " |")
                    print(lines[-1])
        finally:
            os.kill(proc.pid, signal.SIGTERM)
            proc.wait(timeout=30)
    if args.markdown:
        note = (
            "CPU µs per operation (user+system, from /proc, tick resolution) in each process; "
            f"TCP, `kvstore up`, {args.n} operations ({args.n // 4} batches); "
            f"load average {os.getloadavg()[0]:.1f}."
        )
        markdown.write_table("cpu-per-op", "\n".join(lines) + "\n\n" + note)


if __name__ == "__main__":
    main()
