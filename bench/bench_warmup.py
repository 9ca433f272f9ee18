"""The first writes to a fresh node, with and without pre-faulting its arena.

Run:  .venv/bin/python bench/bench_warmup.py [--dram 4GiB] [--markdown]

Starts an embedded cluster (``kvstore up``) twice: once as shipped (the node pre-faults its arena
in the background; this waits until the node reports ``arenas_warm``) and once with the arena
left cold (``KVSTORE_PREFAULT=0``). Each time it puts 40 objects of 16 MiB (fresh arena space),
then 40 more into the space the first ones freed, and prints the p50 per round (TCP).
``--markdown`` also writes the table into docs/benchmarks.md (see bench/markdown.py).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.append(str(Path(__file__).resolve().parents[1]))  # for bench.markdown

from bench import markdown  # noqa: E402
from kvstore.cli.embedded import EmbeddedCluster  # noqa: E402
from kvstore.client import Client  # noqa: E402


def run(dram: str, prefault: bool) -> list[float]:
    env = {"KVSTORE_PREFAULT": "1" if prefault else "0"}
    with tempfile.TemporaryDirectory() as tmp, EmbeddedCluster(tmp, dram, env=env) as cluster:
        cluster.wait_warm()
        c = Client.connect(cluster.address, shm=False)
        value = np.ones(16 << 20, np.uint8)
        p50s = []
        for rnd in range(2):
            keys = [f"r{rnd}/{i}" for i in range(40)]
            times = []
            for k in keys:
                t0 = time.perf_counter()
                c.put(k, value)
                times.append(time.perf_counter() - t0)
            p50s.append(float(np.percentile(times, 50)) * 1e3)
            c.batch_remove(keys)
        c.close()
        return p50s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dram", default="4GiB")
    ap.add_argument("--markdown", action="store_true", help="write into docs/benchmarks.md")
    args = ap.parse_args()
    lines = [
        "| arena | first 40 puts of 16 MiB, p50 ms | next 40 (reused space), p50 ms |",
        "|---|---|---|",
    ]
    print("\n".join(lines))
    for prefault in (False, True):
        first, second = run(args.dram, prefault)
        name = "pre-faulted" if prefault else "cold"
        lines.append(f"| {name} | {first:.2f} | {second:.2f} |")
        print(lines[-1])
    if args.markdown:
        note = (
            f"`kvstore up` with {args.dram} of DRAM, TCP, each run once the node reports "
            "`arenas_warm`; pre-faulted: as shipped; cold: `KVSTORE_PREFAULT=0`; "
            f"load average {os.getloadavg()[0]:.1f}."
        )
        markdown.write_table("warmup", "\n".join(lines) + "\n\n" + note)


if __name__ == "__main__":
    main()
