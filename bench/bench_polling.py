"""The polling window's sweep: what each ``KVSTORE_POLL_US`` gives one client and takes from four.

Run:  .venv/bin/python bench/bench_polling.py [--windows 0,50,100,200,400] [--ops 1500]
      [--clients 4] [--rounds 2] [--markdown]

For each window, ``--rounds`` times in turn (so a slow minute of the host hits every window
alike), it starts an embedded cluster (``kvstore up --dram 1GiB``: master and node processes)
with that window, then client processes with the same window (each reads it from the
environment when it starts):

- one client alone, distinct 4 KiB keys, each put once and read once: ``put`` p50, ``get_into``
  p50 with lease reads (``Client.connect(addr, lease_reads=True)``: the one-hop read from the key's
  home node) and without (every read asks the master first);
- ``--clients`` clients at once, each putting then reading its own distinct 4 KiB keys with lease
  reads: gets per second of all together (more busy processes than cores: here a poller takes a
  core that a server needs).

Prints the best round of each cell, and the load average. ``--markdown`` also writes the table
into docs/benchmarks.md (region ``polling``; see bench/markdown.py). What a CPU-bound neighbour
loses to polling is ``bench/bench_poll_cost.py``'s.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.append(str(Path(__file__).resolve().parents[1]))  # for bench.markdown

from bench import markdown  # noqa: E402
from kvstore.cli.embedded import EmbeddedCluster  # noqa: E402
from kvstore.client import Client  # noqa: E402

SIZE = 4 << 10
#: Rows of the one-client measurement, in the table's order.
ALONE = ("put", "get_into, lease reads (one hop)", "get_into, ask the master")


def _p50_us(samples: list[float]) -> float:
    return float(np.percentile(np.array(samples), 50) * 1e6)


def worker_alone(address: str, ops: int, tag: str) -> dict[str, float]:
    """One client's p50s (µs) of :data:`ALONE`, distinct keys, each read once after its put."""
    value = np.random.default_rng(0).integers(0, 256, SIZE, dtype=np.uint8)
    buf = np.empty_like(value)
    out: dict[str, float] = {}
    for lease in (True, False):
        with Client.connect(address, lease_reads=lease, shm=False) as c:
            keys = [f"{tag}/{int(lease)}/{i}" for i in range(ops)]
            for i in range(50):  # connections up, the live-node view fetched: not measured
                c.put(f"{tag}/{int(lease)}/warm{i}", value)
                c.get_into(f"{tag}/{int(lease)}/warm{i}", buf)
            puts, gets = [], []
            for k in keys:
                t0 = time.perf_counter()
                c.put(k, value)
                puts.append(time.perf_counter() - t0)
            for k in keys:
                t0 = time.perf_counter()
                c.get_into(k, buf)
                gets.append(time.perf_counter() - t0)
            assert np.array_equal(buf, value)
            c.batch_remove(keys)
        if lease:
            out[ALONE[0]] = _p50_us(puts)
            out[ALONE[1]] = _p50_us(gets)
        else:
            out[ALONE[2]] = _p50_us(gets)
    return out


def worker_many(address: str, ops: int, tag: str) -> dict[str, float]:
    """One of several clients: puts ``ops`` distinct keys, says ``ready`` and waits for ``go``
    (so all clients read together), then reads each key once (lease reads); returns the start
    and end times of its reads (``time.time``, to combine across processes)."""
    value = np.full(SIZE, 7, np.uint8)
    buf = np.empty_like(value)
    with Client.connect(address, lease_reads=True, shm=False) as c:
        keys = [f"{tag}/{i}" for i in range(ops)]
        c.batch_put(keys, [value] * len(keys))
        c.get_into(keys[0], buf)
        print("ready", flush=True)
        sys.stdin.readline()
        t0 = time.time()
        for k in keys:
            c.get_into(k, buf)
        t1 = time.time()
        c.batch_remove(keys)
    return {"start": t0, "end": t1, "n": float(len(keys))}


def _spawn(address: str, window: str, mode: str, ops: int, tag: str) -> subprocess.Popen[str]:
    cmd = [sys.executable, __file__, "--worker", mode, "--address", address, "--ops", str(ops)]
    env = {**os.environ, "KVSTORE_POLL_US": window}
    return subprocess.Popen(
        [*cmd, "--tag", tag], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )


def _result(proc: subprocess.Popen[str]) -> dict[str, float]:
    out, _ = proc.communicate(timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"a worker exited with {proc.returncode}")
    return json.loads(out.strip().splitlines()[-1])


def one_round(window: str, ops: int, clients: int, tag: str) -> dict[str, float]:
    """The cells of one window in one round."""
    env = {"KVSTORE_POLL_US": window}
    with tempfile.TemporaryDirectory() as tmp, EmbeddedCluster(tmp, "1GiB", env=env) as cluster:
        cluster.wait_warm()
        cells = _result(_spawn(cluster.address, window, "alone", ops, f"{tag}/a"))
        procs = [
            _spawn(cluster.address, window, "many", ops, f"{tag}/m{i}") for i in range(clients)
        ]
        for p in procs:  # each has put its keys
            assert p.stdout is not None and p.stdout.readline().strip() == "ready"
        for p in procs:
            assert p.stdin is not None
            p.stdin.write("go\n")
            p.stdin.flush()
        many = [_result(p) for p in procs]
        # From the first reader's start to the last one's end: every read of every client.
        span = max(m["end"] for m in many) - min(m["start"] for m in many)
        cells["many"] = sum(m["n"] for m in many) / span
        return cells


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--windows", default="0,50,100,200,400", help="KVSTORE_POLL_US values")
    ap.add_argument("--ops", type=int, default=1500, help="keys per client")
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--markdown", action="store_true", help="write into docs/benchmarks.md")
    ap.add_argument("--worker", choices=("alone", "many"), help=argparse.SUPPRESS)
    ap.add_argument("--address", help=argparse.SUPPRESS)
    ap.add_argument("--tag", default="t", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        work = worker_alone if args.worker == "alone" else worker_many
        print(json.dumps(work(args.address, args.ops, args.tag)))
        return
    windows = [w.strip() for w in args.windows.split(",")]
    best: dict[str, dict[str, float]] = {w: {} for w in windows}
    for r in range(args.rounds):
        for w in windows:
            got = one_round(w, args.ops, args.clients, f"r{r}w{w}")
            for name, v in got.items():
                old = best[w].get(name)
                better = old is None or (v > old if name == "many" else v < old)
                best[w][name] = v if better else old  # type: ignore[assignment]
            print(
                f"round {r + 1}, window {w}: " + ", ".join(f"{k} {v:.0f}" for k, v in got.items())
            )
    head = (
        "| KVSTORE_POLL_US | "
        + " | ".join(f"{name} p50 µs" for name in ALONE)
        + f" | {args.clients} clients, gets/s |"
    )
    lines = [head, "|" + "---|" * (len(ALONE) + 2)]
    for w in windows:
        cells = " | ".join(f"{best[w][name]:.0f}" for name in ALONE)
        lines.append(f"| {w} | {cells} | {best[w]['many']:.0f} |")
    note = (
        f"One client alone: {args.ops} distinct 4 KiB keys, each put once then read once, TCP; "
        f"{args.clients} clients: each reads its own {args.ops} distinct keys once (lease reads), "
        f"all together. Best of {args.rounds} rounds, windows in turn; `kvstore up --dram 1GiB`, "
        f"{os.cpu_count()} cores; load average {os.getloadavg()[0]:.1f}."
    )
    print("\n".join(lines) + "\n\n" + note)
    if args.markdown:
        markdown.write_table("polling", "\n".join(lines) + "\n\n" + note)


if __name__ == "__main__":
    main()
