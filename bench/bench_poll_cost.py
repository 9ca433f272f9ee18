"""What polling costs a CPU-bound neighbour: an engine's threads on the host of master and node.

Run:  .venv/bin/python bench/bench_poll_cost.py [--seconds 8] [--rounds 2] [--markdown]

Starts a real ``kvstore master`` and ``kvstore node`` (each its own process, node warm) with
``KVSTORE_POLL_US`` 0 and then the default, ``--rounds`` times in turn; in each, two burner
processes (one a core, as an engine's compute threads) count for ``--seconds`` while this
process reads a distinct 4 KiB key every 5 ms (~150 reads/s, every read asking the master).
Prints per window the burners' iterations (millions) and the reads' p50: what the store's
polling (``kvstore.polling``) takes from the neighbour, and what it gives the reads.
``--markdown`` also writes the table into docs/benchmarks.md (see bench/markdown.py).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
from bench_small import master_and_node  # noqa: E402

from bench import markdown  # noqa: E402
from kvstore.client import Client  # noqa: E402

SIZE = 4096
KEYS = 4000
READ_EVERY_S = 0.005


def burner(seconds: float, out: mp.Queue) -> None:
    n = 0
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        for _ in range(1000):
            n += 1
    out.put(n)


def one_run(seconds: float) -> tuple[float, float]:
    """Burners' iterations (millions) and the reads' p50 (µs) with the environment's window."""
    with (
        master_and_node("256MiB", "bench-poll-cost-") as (control, _),
        Client.connect(control) as client,
    ):
        value, buf = np.ones(SIZE, np.uint8), np.empty(SIZE, np.uint8)
        keys = [f"cost/{i}" for i in range(KEYS)]
        for lo in range(0, KEYS, 1000):
            if any(r is not None for r in client.batch_put(keys[lo : lo + 1000], [value] * 1000)):
                raise SystemExit("bench_poll_cost: a put failed")
        ctx = mp.get_context("fork")
        out: mp.Queue = ctx.Queue()
        burners = [ctx.Process(target=burner, args=(seconds, out)) for _ in range(2)]
        for p in burners:
            p.start()
        times = []
        end = time.perf_counter() + seconds
        i = 0
        while time.perf_counter() < end:
            t0 = time.perf_counter()
            client.get_into(keys[i % KEYS], buf)
            times.append(time.perf_counter() - t0)
            i += 1
            time.sleep(READ_EVERY_S)  # the load's pace, not synchronisation
        total = sum(out.get(timeout=seconds + 60) for _ in burners)
        for p in burners:
            p.join(timeout=30)
        return total / 1e6, statistics.median(times) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--markdown", action="store_true", help="write into docs/benchmarks.md")
    args = ap.parse_args()
    default = os.environ.get("KVSTORE_POLL_US")
    rows: list[tuple[str, float, float]] = []
    for _ in range(args.rounds):
        for window in ("0", default):
            if window is None:
                os.environ.pop("KVSTORE_POLL_US", None)
            else:
                os.environ["KVSTORE_POLL_US"] = window
            rows.append((window or "default", *one_run(args.seconds)))
    lines = [
        f"bench_poll_cost: 2 burners, a 4 KiB read every {READ_EVERY_S * 1e3:.0f} ms, TCP",
        "| KVSTORE_POLL_US | burners' iterations (M) | read p50 µs |",
        "| --- | ---: | ---: |",
        *(f"| {window} | {burned:.1f} | {p50:.0f} |" for window, burned, p50 in rows),
    ]
    print("\n".join(lines))
    if args.markdown:
        head = (
            f"{lines[0]}; {args.rounds} rounds of {args.seconds:g} s per window; "
            f"load average {os.getloadavg()[0]:.1f}"
        )
        markdown.write_table("poll-cost", head + "\n\n" + "\n".join(lines[1:]))


if __name__ == "__main__":
    main()
