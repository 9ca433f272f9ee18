"""Aggregate small-get throughput with several client processes at once, polling on and off;
or (``--threads N``) one client shared by N threads against N clients.

Run:  .venv/bin/python bench/bench_concurrency.py [--clients 4] [--seconds 4] [--markdown]
      .venv/bin/python bench/bench_concurrency.py --threads 8 [--keys 4000] [--rounds 3] [--markdown]

``--threads``: one embedded cluster (node warm: ``arenas_warm``), then three setups, each
putting ``--keys`` distinct 64 KiB keys (split among the threads) and reading each once over
TCP: 1 thread on 1 client; N threads on one shared client; N threads on N clients. Prints one
table of puts/s and gets/s (best of ``--rounds``) and how busy the host's CPUs were meanwhile
(``/proc/stat``): what one thread leaves idle is what more threads can use.

For each polling window (``KVSTORE_POLL_US`` = 0 and the default) it starts an embedded cluster
(``kvstore up``: master and node processes), then ``--clients`` client processes that each
``get_into`` their own 4 KiB key for ``--seconds``: once with every read asking the master, once
with lease reads. Prints one table of gets per second, all clients together. With more busy
processes than cores, polling before sleeping trades CPU for latency (see kvstore/polling.py).

``--markdown`` also writes the table into docs/benchmarks.md (see bench/markdown.py): the region
``concurrency``, or ``concurrency-threads`` with ``--threads``.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

sys.path.append(str(Path(__file__).resolve().parents[1]))  # for bench.markdown

from bench import markdown  # noqa: E402
from kvstore.cli.embedded import EmbeddedCluster  # noqa: E402
from kvstore.client import Client  # noqa: E402


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


VALUE_BYTES = 64 << 10


def host_cpu() -> tuple[int, int]:
    """The host's CPU ticks since boot, all and idle (``/proc/stat``)."""
    with open("/proc/stat") as f:
        ticks = [int(x) for x in f.readline().split()[1:]]
    return sum(ticks), ticks[3] + ticks[4]  # idle + iowait


def busy_since(before: tuple[int, int]) -> float:
    """The share of the host's CPU time busy since ``before`` (:func:`host_cpu`)."""
    total, idle = host_cpu()
    return 1 - (idle - before[1]) / max(1, total - before[0])


def _in_threads(num_threads: int, work: Callable[[int], None]) -> float:
    """Run ``work(t)`` in ``num_threads`` threads started together; returns the wall seconds
    from the common start to the last one's end."""
    start = threading.Barrier(num_threads + 1)
    errors: list[BaseException] = []

    def body(t: int) -> None:
        start.wait(timeout=60)
        try:
            work(t)
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            errors.append(exc)

    threads = [threading.Thread(target=body, args=(t,)) for t in range(num_threads)]
    for th in threads:
        th.start()
    start.wait(timeout=60)
    t0 = time.perf_counter()
    for th in threads:
        th.join(timeout=600)
    seconds = time.perf_counter() - t0
    if errors:
        raise errors[0]
    return seconds


def _shared_vs_separate(
    address: str, num_threads: int, shared: bool, num_keys: int, tag: str
) -> tuple[float, float, float, float]:
    """Put then get ``num_keys`` distinct keys with ``num_threads`` threads on one shared
    client (``shared``) or one client each. Returns (puts/s, gets/s) and the host's CPU busy
    share during each."""
    num_clients = 1 if shared else num_threads
    clients = [Client.connect(address, shm=False) for _ in range(num_clients)]
    per = num_keys // num_threads
    keys = [[f"{tag}/{t}/{i}" for i in range(per)] for t in range(num_threads)]
    values = [np.full(VALUE_BYTES, t % 251, np.uint8) for t in range(num_threads)]
    try:
        for c in clients:  # connections up and locations of transports known: not measured
            c.put(f"{tag}/warm", values[0])
            c.get(f"{tag}/warm")

        def put(t: int) -> None:
            c = clients[0 if shared else t]
            for k in keys[t]:
                c.put(k, values[t])

        def get(t: int) -> None:
            c = clients[0 if shared else t]
            buf = np.empty(VALUE_BYTES, np.uint8)
            for k in keys[t]:
                c.get_into(k, buf)
            assert buf[0] == t % 251

        before = host_cpu()
        put_s = _in_threads(num_threads, put)
        put_busy, before = busy_since(before), host_cpu()
        get_s = _in_threads(num_threads, get)
        get_busy = busy_since(before)
        for t in range(num_threads):
            clients[0].batch_remove(keys[t])
        return per * num_threads / put_s, per * num_threads / get_s, put_busy, get_busy
    finally:
        for c in clients:
            c.close()


def run_threads(num_threads: int, num_keys: int, rounds: int) -> list[str]:
    """Print puts/s and gets/s: 1 thread, ``num_threads`` on one client, on their own; returns
    the table's lines."""
    setups = [
        ("1 thread, 1 client", 1, True),
        (f"{num_threads} threads, 1 shared client", num_threads, True),
        (f"{num_threads} threads, {num_threads} clients", num_threads, False),
    ]
    with tempfile.TemporaryDirectory() as tmp, EmbeddedCluster(tmp, "1GiB") as cluster:
        cluster.wait_warm()
        best: dict[str, tuple[float, float, float, float]] = {}
        for r in range(rounds):
            for name, n, shared in setups:
                got = _shared_vs_separate(cluster.address, n, shared, num_keys, f"r{r}{n}{shared}")
                old = best.get(name, (0.0, 0.0, 0.0, 0.0))
                # The best round of puts and of gets, each with its host CPU busy share.
                put = (got[0], got[2]) if got[0] > old[0] else (old[0], old[2])
                get = (got[1], got[3]) if got[1] > old[1] else (old[1], old[3])
                best[name] = (put[0], get[0], put[1], get[1])
    lines = [
        f"| {num_keys} distinct 64 KiB keys, TCP, {os.cpu_count()} cores | puts/s "
        "| gets/s | host CPU busy, puts / gets |",
        "|---|---|---|---|",
    ]
    base = best[setups[0][0]]
    for name, _, _ in setups:
        p, g, pb, gb = best[name]
        lines.append(
            f"| {name} | {p:.0f} ({p / base[0]:.2f}x) | {g:.0f} ({g / base[1]:.2f}x) "
            f"| {pb * 100:.0f}% / {gb * 100:.0f}% |"
        )
    print("\n".join(lines))
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--seconds", type=float, default=4.0)
    ap.add_argument("--threads", type=int, default=0, help="shared-client mode (see above)")
    ap.add_argument("--keys", type=int, default=4000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--markdown", action="store_true", help="write into docs/benchmarks.md")
    args = ap.parse_args()
    if args.threads:
        lines = run_threads(args.threads, args.keys, args.rounds)
        if args.markdown:
            note = (
                f"Best of {args.rounds} rounds; each key put then read once (`get_into`); "
                f"the node warm; load average {os.getloadavg()[0]:.1f}."
            )
            markdown.write_table("concurrency-threads", "\n".join(lines) + "\n\n" + note)
        return
    rows = {p: run(p, args.clients, args.seconds) for p in ("0", "100")}
    lines = [
        f"| KVSTORE_POLL_US | {args.clients} clients, ask the master | lease reads |",
        "|---|---|---|",
    ]
    for p, r in rows.items():
        lines.append(f"| {p} | {r['ask the master']:.0f} gets/s | {r['lease reads']:.0f} gets/s |")
    print("\n".join(lines))
    if args.markdown:
        note = (
            f"Gets per second of all {args.clients} client processes together, each reading its "
            f"own 4 KiB key over TCP for {args.seconds:g} s; `kvstore up`, {os.cpu_count()} "
            f"cores; load average {os.getloadavg()[0]:.1f}."
        )
        markdown.write_table("concurrency", "\n".join(lines) + "\n\n" + note)


if __name__ == "__main__":
    main()
