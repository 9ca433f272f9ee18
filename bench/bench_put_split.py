"""Where a small put's time goes: the host's floor for its messages, and the store's split.

Run:  .venv/bin/python bench/bench_put_split.py [--ops 2000] [--repeat 2] [--markdown]

A small put through a blank (``kvstore.client.blanks``) is two round trips in turn: the write to
the key's node, then the commit (``put_end``) at the master. A ``get_into`` under lease reads is
one, to the node (``kvstore.placement``). This prints, p50 of ``--ops`` operations a row:

1. **the host's floor for those messages**: 64-byte round trips over loopback TCP between bare
   Python processes, the client waiting as the store's client does (``poll(2)`` with a zero
   timeout, then ``sched_yield``, until the reply is there), each server sleeping in ``recv``:
   one round trip to one server, and a round trip to each of two servers in turn (a put's
   pattern).
2. **the store** (``kvstore up --shm``: the master, and the node as its child; this process a
   client with lease reads and blanks, as bench_peers.py's ``kvstore`` row): ``put`` and
   ``get_into`` of distinct 4 KiB keys (each read once, after its put), p50 without timers;
   then, per call, the mean split measured with timers around the client's own calls:

   - *node call*: the call to the node (``shm_commit`` for a put, ``read_keys`` for a get),
     of which *waiting*: inside the socket read until the reply's bytes are there;
   - *master call*: ``put_end``, of which *waiting* likewise;
   - *outside*: the rest of the client's work (keys, blanks, the copy into the node's shared
     memory, the checksum, the answer's checks).

   The timers add about a µs each, so the split's total is a little over the bare p50. What is
   not waiting is this process's Python and its system calls (sends included).

``--repeat`` runs section 2 that many times, each on keys of its own. ``--markdown`` also writes
the tables into docs/benchmarks.md (region ``put-split``; see bench/markdown.py).
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import select
import socket
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import markdown  # noqa: E402
from kvstore import protocol  # noqa: E402
from kvstore.cli.embedded import EmbeddedCluster  # noqa: E402
from kvstore.client import Client  # noqa: E402
from kvstore.client import control as control_mod  # noqa: E402
from kvstore.client import transport as transport_mod  # noqa: E402

SIZE = 4096
MSG = 64
READY_TIMEOUT_S = 60.0
WARM_OPS = 300


# ============================================================ 1. the host's floor


def _sleeping_echo(listener: socket.socket) -> None:
    """Echo each message back, sleeping in ``recv`` between them (a server with nothing to do)."""
    conn, _ = listener.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    buf = bytearray(MSG)
    with conn:
        while True:
            n = conn.recv_into(buf, MSG, socket.MSG_WAITALL)
            if n < MSG:
                return
            conn.sendall(buf)


@contextmanager
def echo_servers(count: int) -> Iterator[list[socket.socket]]:
    """``count`` echoing child processes; yields a connected socket to each (TCP_NODELAY)."""
    ctx = multiprocessing.get_context("fork")
    procs, conns = [], []
    try:
        for _ in range(count):
            listener = socket.create_server(("127.0.0.1", 0))
            p = ctx.Process(target=_sleeping_echo, args=(listener,), daemon=True)
            p.start()
            procs.append(p)
            conn = socket.create_connection(listener.getsockname())
            listener.close()
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conns.append(conn)
        yield conns
    finally:
        for c in conns:
            c.close()
        for p in procs:
            p.join(5)
            if p.is_alive():
                p.kill()
                p.join()


def _round_trip(conn: socket.socket, poller: Any, msg: bytes, buf: bytearray) -> None:
    """One round trip, the reply awaited as the store's client awaits one."""
    conn.sendall(msg)
    got = 0
    view = memoryview(buf)
    while got < MSG:
        while not poller.poll(0):
            os.sched_yield()
        n = conn.recv_into(view[got:])
        if not n:
            raise SystemExit("bench_put_split: an echo server hung up")
        got += n


def host_floor(ops: int) -> list[tuple[str, float]]:
    """Section 1's rows: (name, p50 µs)."""
    msg, buf = b"x" * MSG, bytearray(MSG)
    rows = []
    for count, name in (
        (1, "one round trip (a get's pattern)"),
        (2, "a round trip to each of two servers in turn (a put's pattern)"),
    ):
        with echo_servers(count) as conns:
            pollers = []
            for c in conns:
                p = select.poll()
                p.register(c.fileno(), select.POLLIN)
                pollers.append(p)

            def one(_: int, conns: list[socket.socket] = conns, pollers: list = pollers) -> None:
                for c, p in zip(conns, pollers, strict=True):
                    _round_trip(c, p, msg, buf)

            p50_us(one, WARM_OPS)
            rows.append((name, p50_us(one, ops)))
    return rows


def p50_us(fn: Callable[[int], object], n: int) -> float:
    times = []
    for i in range(n):
        t0 = time.perf_counter()
        fn(i)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


# ============================================================ 2. the store


class Split:
    """Timers around the client's calls to the node and the master, and around its socket
    reads (waiting), installed on the classes for the ``with`` block only."""

    NODE = (
        (transport_mod.TcpTransport, "call_per_node"),
        (transport_mod.TcpTransport, "read_keys"),
        (transport_mod.TcpTransport, "write_begin"),
        (transport_mod.TcpTransport, "write_end"),
        (transport_mod.TcpTransport, "read_begin"),
        (transport_mod.TcpTransport, "read_end"),
    )
    MASTER = (
        (control_mod.FixedChannel, "call"),
        (control_mod.FixedChannel, "call_overlapped"),
    )

    def __init__(self) -> None:
        self.ns: dict[str, int] = defaultdict(int)
        self._where: str | None = None  # the outermost call in progress: "node" or "master"
        self._saved: list[tuple[type, str, Any]] = []

    def _wrap(self, cls: type, name: str, where: str) -> None:
        orig = getattr(cls, name)
        split = self

        def timed(*args: Any, **kwargs: Any) -> Any:
            if split._where is not None:  # (a call inside another: counted in it)
                return orig(*args, **kwargs)
            split._where = where
            t0 = time.perf_counter_ns()
            try:
                return orig(*args, **kwargs)
            finally:
                split.ns[f"{where} call"] += time.perf_counter_ns() - t0
                split._where = None

        self._saved.append((cls, name, orig))
        setattr(cls, name, timed)

    def __enter__(self) -> Split:
        for cls, name in self.NODE:
            self._wrap(cls, name, "node")
        for cls, name in self.MASTER:
            self._wrap(cls, name, "master")
        orig_fill = protocol.FramedSocket._fill
        split = self

        def fill(fs: protocol.FramedSocket, *args: Any, **kwargs: Any) -> None:
            t0 = time.perf_counter_ns()
            try:
                orig_fill(fs, *args, **kwargs)
            finally:
                split.ns[f"{split._where or 'other'} waiting"] += time.perf_counter_ns() - t0

        self._saved.append((protocol.FramedSocket, "_fill", orig_fill))
        protocol.FramedSocket._fill = fill  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        for cls, name, orig in reversed(self._saved):
            setattr(cls, name, orig)
        self._saved.clear()


def store_rows(client: Client, ops: int, tag: str) -> list[tuple[str, float, dict[str, float]]]:
    """Section 2 for one set of keys: (call, p50 µs untimed, mean split µs) for put and
    get_into."""
    value = os.urandom(SIZE)
    buf = bytearray(SIZE)
    for i in range(WARM_OPS):  # warm: blanks of this size held, connections open
        client.put(f"split/warm/{tag}/{i}", value)
        client.get_into(f"split/warm/{tag}/{i}", buf)
    out = []
    calls: list[tuple[str, Callable[[str], object]]] = [
        ("put", lambda k: client.put(k, value)),
        ("get_into", lambda k: client.get_into(k, buf)),
    ]
    for phase in ("bare", "split"):
        keys = [f"split/{phase}/{tag}/{i}" for i in range(ops)]
        for name, call in calls:
            if phase == "bare":
                out.append((name, p50_us(lambda i, call=call: call(keys[i]), ops), {}))
                continue
            with Split() as split:
                t0 = time.perf_counter_ns()
                for k in keys:
                    call(k)
                total = time.perf_counter_ns() - t0
            mean = {k: v / ops / 1e3 for k, v in split.ns.items()}
            calls_us = sum(v for k, v in mean.items() if k.endswith(" call"))
            mean["total"] = total / ops / 1e3
            mean["outside"] = mean["total"] - calls_us
            row = next(r for r in out if r[0] == name)
            row[2].update(mean)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ops", type=int, default=2000, help="operations per row")
    ap.add_argument("--repeat", type=int, default=2, help="runs of section 2")
    ap.add_argument("--markdown", action="store_true", help="write into docs/benchmarks.md")
    args = ap.parse_args()
    ops = args.ops
    print(f"bench_put_split: p50 of {ops} operations a row, {os.cpu_count()} cores", flush=True)

    floor = host_floor(ops)
    tables = [
        [
            "| the host: 64 B round trips, bare Python processes, servers asleep | p50 µs |",
            "| --- | ---: |",
            *(f"| {name} | {us:.0f} |" for name, us in floor),
        ]
    ]
    print("\n" + "\n".join(tables[-1]), flush=True)

    cols = ["p50 µs", "split total", "node call", "waiting", "master call", "waiting", "outside"]
    keys = ["total", "node call", "node waiting", "master call", "master waiting", "outside"]
    lines = [
        "| the store, 4 KiB, distinct keys (µs; the split: means, with timers) | "
        + " | ".join(cols)
        + " |",
        "| --- |" + " ---: |" * len(cols),
    ]
    with (
        tempfile.TemporaryDirectory(prefix="bench-put-split-") as tmp,
        EmbeddedCluster(str(Path(tmp) / "data"), "1GiB", ["--shm"]) as cluster,
    ):
        cluster.wait_warm(READY_TIMEOUT_S)
        with Client.connect(cluster.address, shm=True, lease_reads=True, blanks=True) as c:
            for r in range(args.repeat):
                for name, p50, mean in store_rows(c, ops, f"r{r}"):
                    cells = [f"{p50:.0f}", *(f"{mean.get(k, 0.0):.0f}" for k in keys)]
                    lines.append(f"| {name} (run {r + 1}) | " + " | ".join(cells) + " |")
                    print(lines[-1], flush=True)
    tables.append(lines)
    print("\n" + "\n".join(tables[-1]))
    if args.markdown:
        note = (
            f"p50 of {ops} operations a row; the store: `kvstore up --shm`, one client with "
            f"lease reads and blanks; load average {os.getloadavg()[0]:.1f}."
        )
        markdown.write_table("put-split", "\n\n".join(["\n".join(t) for t in tables] + [note]))


if __name__ == "__main__":
    main()
