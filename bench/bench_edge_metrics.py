"""Cost of metrics and the auth gate at the master's RPC edge (in-process, no sockets).

Prints µs per ``dispatch`` of a batch verb with and without the metrics observer.
Run: ``.venv/bin/python bench/bench_edge_metrics.py [--markdown]`` (``--markdown``: also write
the table into docs/benchmarks.md, see bench/markdown.py).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[1]))  # for bench.markdown

from bench import markdown  # noqa: E402
from kvstore import protocol  # noqa: E402
from kvstore.master.metrics import MasterMetrics  # noqa: E402
from kvstore.master.server import dispatch  # noqa: E402
from kvstore.master.service import MasterConfig, MasterService, ServiceSlot  # noqa: E402
from kvstore.types import SegmentSpec  # noqa: E402


def _service(num_keys: int) -> tuple[MasterService, list[bytes]]:
    svc = MasterService(MasterConfig(put_timeout_s=600))
    svc.register("n1", "127.0.0.1", 9001, b"a" * 32, [SegmentSpec("dram", "dram", 1 << 34)])
    keys = [f"bench/{i:08d}".encode() for i in range(num_keys)]
    tickets = svc.put_start(keys, [4096] * num_keys)
    svc.put_end([t.put_id for t in tickets], [1] * num_keys)
    return svc, keys


def _time(fn, repeat: int) -> float:
    fn()
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(repeat):
            fn()
        best = min(best, (time.perf_counter() - start) / repeat)
    return best * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--markdown", action="store_true", help="write into docs/benchmarks.md")
    opts = ap.parse_args()
    rows = []
    print(f"{'verb':<14} {'batch':>6} {'plain µs':>10} {'metrics µs':>11} {'overhead':>9}")
    for batch in (1, 64, 1024):
        svc, keys = _service(batch)
        metrics = MasterMetrics(ServiceSlot(svc))
        for verb, args in (
            ("exists", {"keys": keys}),
            ("get_locations", {"keys": keys}),
        ):
            req = protocol.Request(1, verb, args)
            repeat = max(20, 20000 // batch)
            plain = _time(lambda req=req: dispatch(svc, req), repeat)
            observed = _time(lambda req=req: dispatch(svc, req, metrics), repeat)
            print(
                f"{verb:<14} {batch:>6} {plain:>10.1f} {observed:>11.1f} "
                f"{(observed - plain) / plain:>8.1%}"
            )
            rows.append(
                (
                    verb,
                    batch,
                    f"{plain:.1f}",
                    f"{observed:.1f}",
                    f"{(observed - plain) / plain:.1%}",
                )
            )
    if opts.markdown:
        head = ["verb", "batch", "plain µs", "metrics µs", "overhead"]
        note = (
            "µs per `dispatch` of the verb in process (no sockets), best of 5 runs; "
            f"load average {os.getloadavg()[0]:.1f}."
        )
        markdown.write_table("edge-metrics", f"{markdown.table(head, rows)}\n\n{note}")


if __name__ == "__main__":
    main()
