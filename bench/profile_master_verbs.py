"""The master's own Python per request, verb by verb, with no socket: what a small request costs
the master beyond the wire (framing, wake-ups and polling are ``bench/bench_hops.py``'s and
``bench/cpu_per_op.py``'s).

Run:  .venv/bin/python bench/profile_master_verbs.py [--n 5000] [--top 15] [--markdown]

Builds a :class:`~kvstore.master.service.MasterService` with two nodes in this process and
serves decoded requests through :func:`kvstore.master.server.dispatch_now` (what the RPC edge
calls for a small request, metrics observer included), distinct keys of 4 KiB: ``put_start`` then
``put_end`` of each key, then ``get_locations`` and ``exists``; then puts through blanks
(``kvstore.client.blanks``): ``put_blanks`` of 8 a node (its cost per blank started) and the
``put_end`` that commits a blank naming its key. Prints µs per request of each verb (the median
of 5 rounds), then, under cProfile, the functions with the most own time over
one more round of each. ``--markdown`` also writes the table into docs/benchmarks.md (region
``master-verbs``; see bench/markdown.py).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.append(str(Path(__file__).resolve().parents[1]))  # for bench.markdown

from bench import markdown  # noqa: E402
from kvstore import protocol  # noqa: E402
from kvstore.master.metrics import MasterMetrics  # noqa: E402
from kvstore.master.server import dispatch_now  # noqa: E402
from kvstore.master.service import MasterConfig, MasterService, ServiceSlot  # noqa: E402
from kvstore.types import SegmentSpec  # noqa: E402

SIZE = 4 << 10
BLANK_END = "put_end, naming a blank's key"
BLANKS = "put_blanks, per blank started"


def _reply(frame: bytes | None) -> Any:
    assert frame is not None, "served in chunks: not a small request"
    body = frame[protocol.HEADER_SIZE :]
    return protocol.decode_response(body).unwrap()


def one_round(svc: MasterService, observer: MasterMetrics, n: int, tag: str) -> dict[str, float]:
    """Seconds per request of each verb over ``n`` distinct keys."""
    keys = [f"{tag}/{i}".encode() for i in range(n)]
    spent = {
        "put_start": 0.0,
        "put_end": 0.0,
        "get_locations": 0.0,
        "exists": 0.0,
        BLANK_END: 0.0,
        BLANKS: 0.0,
    }

    def serve(verb: str, args: dict[str, Any], i: int, row: str = "") -> Any:
        request = protocol.Request(i, verb, args)
        t0 = time.perf_counter()
        frame = dispatch_now(svc, request, observer)
        spent[row or verb] += time.perf_counter() - t0
        return _reply(frame)

    for i, key in enumerate(keys):
        start = {"keys": [key], "sizes": [SIZE], "exclude": [], "batch_grants": True}
        ticket = serve("put_start", start, i)[0]
        assert ticket[0] == 0, ticket
        serve("put_end", {"put_ids": [ticket[1][0]], "checksums": [1]}, i)
    for i, key in enumerate(keys):
        serve("get_locations", {"keys": [key], "batch_grants": True}, i)
        serve("exists", {"keys": [key]}, i)
    done = 0
    while done < n:
        for put_id, _ in serve("put_blanks", {"size": SIZE, "count": 8}, done, BLANKS):
            if done < n:
                args = {
                    "put_ids": [put_id],
                    "checksums": [1],
                    "keys": [b"%s/b/%d" % (tag.encode(), done)],
                }
                assert serve("put_end", args, done, BLANK_END) == [[0, None]]
                done += 1
    return {verb: s / n for verb, s in spent.items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=5000, help="distinct keys a round")
    ap.add_argument("--top", type=int, default=15, help="functions listed from the profile")
    ap.add_argument("--markdown", action="store_true", help="write into docs/benchmarks.md")
    args = ap.parse_args()
    svc = MasterService(MasterConfig())
    for node in ("n1", "n2"):
        spec = SegmentSpec(name="dram0", tier="dram", capacity=1 << 34)
        svc.register(node, "127.0.0.1", 9, b"s" * 32, [spec])
    observer = MasterMetrics(ServiceSlot(svc))
    rounds = [one_round(svc, observer, args.n, f"r{r}") for r in range(5)]
    lines = ["| verb, one key | master µs per request |", "| --- | ---: |"]
    for verb in rounds[0]:
        lines.append(f"| {verb} | {statistics.median(r[verb] for r in rounds) * 1e6:.1f} |")
    note = (
        f"The master's Python alone (no socket): median of 5 rounds of {args.n} distinct 4 KiB "
        "keys, served by `dispatch_now` with the metrics observer, two nodes."
    )
    print("\n".join(lines) + "\n\n" + note)
    if args.markdown:
        markdown.write_table("master-verbs", "\n".join(lines) + "\n\n" + note)
    prof = cProfile.Profile()
    run: Callable[[], object] = lambda: one_round(svc, observer, args.n, "profiled")  # noqa: E731
    prof.runcall(run)
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(args.top)
    print(out.getvalue())


if __name__ == "__main__":
    main()
