"""Aggregate small-get throughput with several client processes at once, polling on and off.

Run:  .venv/bin/python bench/bench_concurrency.py [--clients 4] [--seconds 4]

For each polling window (``KVSTORE_POLL_US`` = 0 and the default) it starts an embedded cluster
(``kvstore up``: master and node processes), then ``--clients`` client processes that each
``get_into`` their own 4 KiB key for ``--seconds``: once with every read asking the master, once
with lease reads. Prints one table of gets per second, all clients together. With more busy
processes than cores, polling before sleeping trades CPU for latency (see kvstore/polling.py).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import tempfile
import time

import numpy as np

from kvstore.client import Client
from kvstore.embedded import EmbeddedCluster


def _worker(address: str, key: str, lease: bool, seconds: float, out: mp.Queue) -> None:
    c = Client.connect(address, lease_reads=lease, shm=False)
    value = np.ones(4096, np.uint8)
    c.put(key, value)
    buf = np.empty_like(value)
    for _ in range(50):
        c.get_into(key, buf)
    n, t0 = 0, time.monotonic()
    while time.monotonic() - t0 < seconds:
        c.get_into(key, buf)
        n += 1
    assert np.array_equal(buf, value)
    c.close()
    out.put(n / seconds)


def run(poll_us: str, clients: int, seconds: float) -> dict[str, float]:
    env = {"KVSTORE_POLL_US": poll_us}
    with tempfile.TemporaryDirectory() as tmp, EmbeddedCluster(tmp, "256MiB", env=env) as cluster:
        # Spawned workers import kvstore afresh and read the window from the environment.
        os.environ["KVSTORE_POLL_US"] = poll_us
        ctx = mp.get_context("spawn")
        out: dict[str, float] = {}
        for lease in (False, True):
            q: mp.Queue = ctx.Queue()
            ps = [
                ctx.Process(target=_worker, args=(cluster.address, f"k{i}", lease, seconds, q))
                for i in range(clients)
            ]
            for p in ps:
                p.start()
            total = sum(q.get(timeout=120) for _ in ps)
            for p in ps:
                p.join(timeout=30)
            out["lease reads" if lease else "ask the master"] = total
        return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--seconds", type=float, default=4.0)
    args = ap.parse_args()
    rows = {p: run(p, args.clients, args.seconds) for p in ("0", "100")}
    print(f"| KVSTORE_POLL_US | {args.clients} clients, ask the master | lease reads |")
    print("|---|---|---|")
    for p, r in rows.items():
        print(f"| {p} | {r['ask the master']:.0f} gets/s | {r['lease reads']:.0f} gets/s |")


if __name__ == "__main__":
    main()
