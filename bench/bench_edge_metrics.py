"""Cost of metrics and the auth gate at the master's RPC edge (in-process, no sockets).

Prints µs per ``dispatch`` of a batch verb with and without the metrics observer.
Run: ``.venv/bin/python bench/bench_edge_metrics.py``
"""

from __future__ import annotations

import time

from kvstore import protocol
from kvstore.master.metrics import MasterMetrics
from kvstore.master.server import dispatch
from kvstore.master.service import MasterConfig, MasterService, ServiceSlot
from kvstore.types import SegmentSpec


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


if __name__ == "__main__":
    main()
