"""The first writes to a fresh node, with and without pre-faulting its arena.

Run:  .venv/bin/python bench/bench_warmup.py [--dram 4GiB]

Starts an embedded cluster (``kvstore up``) twice: once as shipped (the node pre-faults its arena
in the background; this waits until the node reports ``arenas_warm``) and once with the arena
left cold (``KVSTORE_PREFAULT=0``). Each time it puts 40 objects of 16 MiB (fresh arena space),
then 40 more into the space the first ones freed, and prints the p50 per round (TCP).
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

import numpy as np

from kvstore import protocol
from kvstore.client import Client


def _wait_warm(data: str, timeout: float = 120.0) -> None:
    host, port = data.rsplit(":", 1)
    conn = protocol.FramedSocket.connect(host, int(port), timeout=10)
    try:
        deadline = time.monotonic() + timeout
        while not conn.call("stats", {}).get("arenas_warm", True):
            if time.monotonic() > deadline:
                raise RuntimeError("node did not warm up")
            time.sleep(0.05)  # polling a state, bounded by the deadline
    finally:
        conn.close()


def run(dram: str, prefault: bool) -> list[float]:
    env = {**os.environ, "KVSTORE_PREFAULT": "1" if prefault else "0"}
    with tempfile.TemporaryDirectory() as tmp:
        argv = [sys.executable, "-m", "kvstore", "--log-level", "warning", "up", "--port", "0"]
        argv += ["--dram", dram, "--data-dir", f"{tmp}/d"]
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, env=env)
        try:
            assert proc.stdout is not None
            for line in proc.stdout:
                m = re.search(r"ready control=(\S+) .*data=(\S+)", line)
                if m:
                    address, data = m.group(1), m.group(2)
                    break
            _wait_warm(data)
            c = Client.connect(address, shm=False)
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
        finally:
            os.kill(proc.pid, signal.SIGTERM)
            proc.wait(timeout=30)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dram", default="4GiB")
    args = ap.parse_args()
    print("| arena | first 40 puts of 16 MiB, p50 ms | next 40 (reused space), p50 ms |")
    print("|---|---|---|")
    for prefault in (False, True):
        first, second = run(args.dram, prefault)
        name = "pre-faulted" if prefault else "cold"
        print(f"| {name} | {first:.2f} | {second:.2f} |")


if __name__ == "__main__":
    main()
