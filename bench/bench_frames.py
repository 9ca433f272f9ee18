"""Per-frame CPU cost of the wire helpers, in one process over a socketpair (no scheduling noise).

Run:  .venv/bin/python bench/bench_frames.py [--markdown]

Measures what every small request pays on each side: sending a payload-less request frame and
receiving a response frame (header, then body), with a small (4 KiB-get sized) msgpack body.
Prints the best of 300 rounds of 64 frames, µs per frame. ``--markdown`` also writes the table
into docs/benchmarks.md (see bench/markdown.py).
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import timeit
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[1]))  # for bench.markdown

from bench import markdown  # noqa: E402
from kvstore import protocol  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--markdown", action="store_true", help="write into docs/benchmarks.md")
    opts = ap.parse_args()
    a, b = socket.socketpair()
    sender, receiver = protocol.FramedSocket(a), protocol.FramedSocket(b)
    grant = ["r", b"some/key/0001", "dram-0", 12345, 4096, 1_800_000_000_000, b"s" * 16]
    args = {"items": [[grant, None]]}
    reply = protocol.encode_response(7, [[0, [4096, 123, [["n0", "127.0.0.1", 4000, grant]]]]])
    n = 64  # frames in flight at once: well under the socket buffer

    def send() -> None:
        sender.send_request("read", args)

    def drain() -> None:
        header = receiver.read_header()
        receiver.read_body(header)

    def send_reply() -> None:
        sender.send_frame(reply)

    def recv_reply() -> None:
        receiver.read_response()

    rows = []
    for name, produce, consume in (
        ("send_request (no payload)", send, drain),
        ("read_response (small body)", send_reply, recv_reply),
    ):
        best_send = best_recv = float("inf")
        for _ in range(300):
            t = timeit.timeit(produce, number=n)
            best_send = min(best_send, t / n * 1e6)
            t = timeit.timeit(consume, number=n)
            best_recv = min(best_recv, t / n * 1e6)
        rows.append((name, best_send, best_recv))
    print("| frame | send µs | receive µs |")
    print("|---|---|---|")
    for name, s, r in rows:
        print(f"| {name} | {s:.2f} | {r:.2f} |")
    a.close()
    b.close()
    if opts.markdown:
        note = (
            "Best of 300 rounds of 64 frames, µs per frame, one process over a socketpair; "
            f"load average {os.getloadavg()[0]:.1f}."
        )
        table = markdown.table(
            ["frame", "send µs", "receive µs"], [(n, f"{s:.2f}", f"{r:.2f}") for n, s, r in rows]
        )
        markdown.write_table("frames", f"{table}\n\n{note}")


if __name__ == "__main__":
    main()
