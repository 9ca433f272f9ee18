"""Per-tier read/write throughput (DRAM, NVMe, HBM where a GPU exists) and eviction under pressure.

Run:  .venv/bin/python bench/bench_tiers.py [--quick] [--markdown]

Each tier gets its own small cluster (a master and one storage node, each its own process, TCP
data plane). Objects land in the tier under test as follows:

- DRAM: a DRAM big enough for the working set (puts go to the fastest tier with room).
- NVMe: a 1 MiB DRAM filled with hard-pinned objects, so every put lands in lmdb, and reads are
  served from lmdb (promotion is off).
- HBM: ``--hbm`` on a node that sees a GPU (reads and writes stage through host memory).

Eviction: a node with 64 MiB of DRAM and 128 MiB of NVMe takes 512 MiB of puts; the table shows
put throughput under pressure and how many objects per second the master demoted and deleted.
Every read is checksum-verified by the client. ``--markdown`` also writes the table into
docs/benchmarks.md (see bench/markdown.py).
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

sys.path.append(str(Path(__file__).resolve().parents[1]))  # for bench.markdown

from bench import markdown  # noqa: E402
from kvstore.client import Client  # noqa: E402
from kvstore.processes import parse_ready  # noqa: E402

SIZES = [("64KiB", 64 << 10), ("1MiB", 1 << 20)]
BATCH = 16


class Proc:
    def __init__(self, args: list[str], ready: str) -> None:
        self.p = subprocess.Popen(
            [sys.executable, "-m", "kvstore", "--log-level", "error", *args],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.p.stdout is not None
        deadline = time.monotonic() + 60
        for line in self.p.stdout:
            if ready in line:
                self.line = line
                return
            if time.monotonic() > deadline:
                break
        self.stop()
        raise RuntimeError(f"{args[0]} did not start")

    def field(self, name: str) -> str:
        ready = parse_ready(self.line)
        assert ready is not None and name in ready, self.line
        return str(ready[name])

    def stop(self) -> None:
        if self.p.poll() is None:
            os.kill(self.p.pid, signal.SIGTERM)
            self.p.wait(timeout=30)


def cluster(tmp: Path, name: str, node_args: list[str], master_args: list[str]) -> list[Proc]:
    master = Proc(["master", "--port", "0", "--admin-port", "0", *master_args], "master ready")
    try:
        node = Proc(
            [
                "node",
                "--master",
                master.field("control"),
                "--data-dir",
                str(tmp / name),
                *node_args,
            ],
            "node ready",
        )
    except Exception:
        master.stop()
        raise
    return [node, master]


def row(tier: str, op: str, size: str, nbytes: int, nops: int, seconds: float) -> str:
    return (
        f"| {tier:<6} | {op:<22} | {size:>6} | {nbytes / seconds / 1e9:8.3f} | "
        f"{nops / seconds:10.0f} |"
    )


def rw_rows(c: Client, tier: str, total: int, check_tier: str) -> list[str]:
    rng = np.random.default_rng(0)
    out = []
    for label, size in SIZES:
        n = max(BATCH, total // size // BATCH * BATCH)
        keys = [f"{tier}/{label}/{i}" for i in range(n)]
        vals = [rng.integers(0, 256, size, dtype=np.uint8) for _ in range(BATCH)]
        t0 = time.perf_counter()
        for i in range(0, n, BATCH):
            res = c.batch_put(keys[i : i + BATCH], vals)
            assert res == [None] * BATCH, res
        t_put = time.perf_counter() - t0
        seg = c.locate(keys[0]).locations[0].grant.segment
        assert seg == check_tier, f"objects landed in {seg}, not {check_tier}"
        bufs = [np.empty(size, dtype=np.uint8) for _ in range(BATCH)]
        t0 = time.perf_counter()
        for i in range(0, n, BATCH):
            res = c.batch_get_into(keys[i : i + BATCH], bufs)
            assert res == [size] * BATCH, res
        t_get = time.perf_counter() - t0
        assert all(np.array_equal(a, b) for a, b in zip(bufs, vals, strict=True))
        out.append(row(tier, f"write (batch x{BATCH})", label, n * size, n, t_put))
        out.append(row(tier, f"read (batch x{BATCH})", label, n * size, n, t_get))
        c.batch_remove(keys)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="smaller working sets")
    ap.add_argument("--markdown", action="store_true", help="write into docs/benchmarks.md")
    args = ap.parse_args()
    total = (32 << 20) if args.quick else (128 << 20)
    rows: list[str] = []
    with tempfile.TemporaryDirectory() as tmp_:
        tmp = Path(tmp_)
        procs = cluster(tmp, "dram", ["--dram", f"{4 * total}", "--nvme", "0"], [])
        try:
            with Client.connect(procs[1].field("control")) as c:
                rows += rw_rows(c, "dram", total, "dram")
        finally:
            for p in procs:
                p.stop()

        procs = cluster(
            tmp, "nvme", ["--dram", "1MiB", "--nvme", f"{4 * total}"], ["--promote-after", "0"]
        )
        try:
            with Client.connect(procs[1].field("control")) as c:
                fill = [f"pin/{i}" for i in range(16)]
                c.batch_put(fill, [bytes(64 << 10)] * 16)
                c.batch_pin(fill, ttl=3600, hard=True)
                rows += rw_rows(c, "nvme", total, "nvme")
        finally:
            for p in procs:
                p.stop()

        import torch

        if torch.cuda.is_available():
            procs = cluster(tmp, "hbm", ["--dram", "64MiB", "--hbm", f"{2 * total}"], [])
            try:
                with Client.connect(procs[1].field("control")) as c:
                    rows += rw_rows(c, "hbm", total, "hbm")
            finally:
                for p in procs:
                    p.stop()
        else:
            rows.append("| hbm    | (no GPU here: skipped) |        |          |            |")

        procs = cluster(
            tmp,
            "evict",
            ["--dram", "64MiB", "--nvme", "128MiB"],
            ["--heartbeat-interval", "0.2"],
        )
        try:
            with Client.connect(procs[1].field("control")) as c:
                size, pressure = 1 << 20, (128 << 20) if args.quick else (512 << 20)
                val = np.random.default_rng(1).integers(0, 256, size, dtype=np.uint8)
                n = pressure // size
                t0 = time.perf_counter()
                for i in range(0, n, BATCH):
                    res = c.batch_put([f"p/{j}" for j in range(i, i + BATCH)], [val] * BATCH)
                    assert res == [None] * BATCH, res
                secs = time.perf_counter() - t0
                ev = c.stats()["eviction"]
                rows.append(row("evict", "put under pressure", "1MiB", n * size, n, secs))
                demoted = ev["num_demotions"]
                deleted = ev["num_evictions"] + ev["num_sync_evictions"]
                rows.append(
                    row("evict", "demote DRAM->NVMe", "1MiB", demoted * size, demoted, secs)
                )
                rows.append(
                    row("evict", "delete (last tier)", "1MiB", deleted * size, deleted, secs)
                )
        finally:
            for p in procs:
                p.stop()
    head = [
        "| tier   | operation              | size   |     GB/s |      ops/s |",
        "|--------|------------------------|--------|----------|------------|",
    ]
    print("\n".join(head + rows))
    if args.markdown:
        note = (
            f"A master and one node per tier, each its own process, TCP; {total >> 20} MiB "
            f"written and read per size; eviction: 64 MiB DRAM and 128 MiB NVMe taking "
            f"{(128 if args.quick else 512)} MiB of puts; load average {os.getloadavg()[0]:.1f}."
        )
        markdown.write_table("tiers", "\n".join(head + rows) + "\n\n" + note)


if __name__ == "__main__":
    main()
