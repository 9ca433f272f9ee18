"""Where a small read's time goes: the host's round trip, each hop of a get, waking a process.

Run:  .venv/bin/python bench/bench_hops.py [--ops 400] [--repeat 1] [--reads-only] [--markdown]

A read of a key the client has not located asks the master where it is, then reads it from its
node: two round trips between three processes. This prints, p50 of ``--ops`` operations each:

1. **the host**: a round trip of 32 bytes over loopback TCP between two bare Python processes
   (``socket.recv_into`` and ``sendall``, nothing else): with the peer sleeping in ``recv`` (as a
   server that has nothing to do does), and with the peer spinning on a non-blocking socket.
   Also the kernel's idle driver and its ``guest_halt_poll_ns`` (0: a virtual CPU with nothing to
   run halts at once, and waking it again is a trip through the hypervisor).
2. **each hop of the store, back to back** (a real ``kvstore master`` and ``kvstore node``, each
   its own process, node warm; this process a ``Client`` over TCP, every read asking the master):
   ``batch_exists`` of one key (a master round trip), ``batch_locate`` of 1 and 16 keys,
   ``batch_read_located`` of 1 and 16 located 4 KiB objects (a node round trip), the master round
   trip and a one-object node read alternating (the two hops of a get, without its work), and
   the whole ``get_into`` / ``batch_get_into`` of distinct keys, each read once (first, on the
   fresh node; ``--repeat`` times, each on keys of its own; ``--reads-only``: these rows alone,
   to compare two versions of the code run after run).
3. **the master after an idle gap**: ``batch_locate`` of 16 distinct keys, each call after this
   process spun for a gap of 0 to 1,000 µs (as it does while it reads from a node between two
   locates): once the master's polling window (``kvstore.polling``) is over, it sleeps, and the
   next request pays for waking it.

``--markdown`` also writes the tables into docs/benchmarks.md (see bench/markdown.py).
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
from bench_small import master_and_node  # noqa: E402

from bench import markdown  # noqa: E402
from kvstore.client import Client  # noqa: E402
from kvstore.client.reads import LocatedRead  # noqa: E402

SIZE = 4096
BATCH = 16
GAPS_US = (0, 100, 200, 400, 1000)
IDLE_FILES = (
    "/sys/devices/system/cpu/cpuidle/current_driver",
    "/sys/module/haltpoll/parameters/guest_halt_poll_ns",
)


def p50_us(
    fn: Callable[[int], object], n: int, before: Callable[[int], object] | None = None
) -> float:
    """The median wall time of ``fn(i)`` for ``i`` in ``range(n)``, in µs (``before(i)`` runs
    first, untimed)."""
    times = []
    for i in range(n):
        if before is not None:
            before(i)
        t0 = time.perf_counter()
        fn(i)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def _echo(listener: socket.socket, spin: bool) -> None:
    conn, _ = listener.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    conn.setblocking(not spin)
    buf = bytearray(64)
    while True:
        try:
            n = conn.recv_into(buf)
        except BlockingIOError:
            continue  # spinning: look again at once
        if not n:
            return
        conn.sendall(buf[:n])


def host_rtt_us(spin: bool, n: int) -> float:
    """The p50 round trip of 32 bytes to an echoing child process (sleeping in ``recv`` or
    spinning), in µs."""
    listener = socket.create_server(("127.0.0.1", 0))
    pid = os.fork()
    if pid == 0:  # the child: echo until the parent hangs up
        try:
            _echo(listener, spin)
        finally:
            os._exit(0)
    address = listener.getsockname()
    listener.close()
    try:
        with socket.create_connection(address) as conn:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            msg, buf = b"x" * 32, bytearray(64)

            def one(_: int) -> None:
                conn.sendall(msg)
                got = 0
                while got < len(msg):
                    got += conn.recv_into(memoryview(buf)[got:])

            p50_us(one, 200)  # warm-up
            return p50_us(one, n)
    finally:
        os.kill(pid, signal.SIGKILL)  # (it exits on its own once we hang up; or never connected)
        os.waitpid(pid, 0)


def spin_for(us: float) -> None:
    end = time.perf_counter() + us / 1e6
    while time.perf_counter() < end:
        pass


def store_rows(
    client: Client, n: int, repeat: int, reads_only: bool
) -> tuple[list[tuple[str, float]], list[tuple[int, float]]]:
    """Section 2's rows (name, p50 µs; the whole reads ``repeat`` times, each on keys of its
    own) and section 3's (gap µs, p50 µs); ``reads_only``: the whole reads alone."""
    rng = np.random.default_rng(0)
    values = [rng.integers(0, 256, SIZE, dtype=np.uint8) for _ in range(BATCH)]
    bufs = [np.empty(SIZE, dtype=np.uint8) for _ in range(BATCH)]
    sets = tuple(f"get{k}/{r}" for r in range(repeat) for k in (1, BATCH))
    if not reads_only:
        sets += ("locate1", "locate16", "read1", "read16", "alternate", *map(str, GAPS_US))
    keys = {s: [f"hops/{s}/{i}" for i in range(n * BATCH)] for s in sets}
    for ks in keys.values():  # every row reads keys of its own, each once
        for lo in range(0, len(ks), 1000):
            chunk = ks[lo : lo + 1000]
            vals = [values[i % BATCH] for i in range(len(chunk))]
            if any(r is not None for r in client.batch_put(chunk, vals)):
                raise SystemExit("bench_hops: a put failed")

    def batch(s: str, i: int, k: int) -> list[str]:
        return keys[s][i * k : (i + 1) * k]

    def locate(s: str, k: int) -> Callable[[int], None]:
        def fn(i: int) -> None:
            client.release_leases(client.batch_locate(batch(s, i, k)))  # type: ignore[arg-type]

        return fn

    def read(s: str, k: int, master_too: bool = False) -> float:
        """p50 of ``batch_read_located`` of ``k`` objects located beforehand (their leases
        given back after the row); ``master_too``: each after a master round trip."""
        located = [client.batch_locate(batch(s, i, k)) for i in range(n)]

        def fn(i: int) -> None:
            if master_too:
                client.batch_exists(["x"])
            reads = [
                LocatedRead(info, memoryview(b))
                for info, b in zip(located[i], bufs[:k], strict=True)
            ]
            client.batch_read_located(reads)
            if any(r.result != SIZE for r in reads):
                raise SystemExit(f"bench_hops: a located read failed: {reads[0].result!r}")

        us = p50_us(fn, n)
        client.release_leases(info for infos in located for info in infos)  # type: ignore[misc]
        return us

    rows: list[tuple[str, float]] = []
    for r in range(repeat):
        tag = f" (both hops){f', repeat {r + 1}' if repeat > 1 else ''}"
        get1, get16 = keys[f"get1/{r}"], f"get{BATCH}/{r}"
        rows.append(
            (f"get_into, 1 x 4 KiB{tag}", p50_us(lambda i: client.get_into(get1[i], bufs[0]), n))
        )
        rows.append(
            (
                f"batch_get_into, {BATCH} x 4 KiB{tag}",
                p50_us(lambda i: client.batch_get_into(batch(get16, i, BATCH), bufs), n),
            )
        )
    if reads_only:
        return rows, []
    rows += [
        ("master round trip: batch_exists, 1 key", p50_us(lambda i: client.batch_exists(["x"]), n)),
        ("batch_locate, 1 key", p50_us(locate("locate1", 1), n)),
        (f"batch_locate, {BATCH} keys", p50_us(locate("locate16", BATCH), n)),
        ("node round trip: batch_read_located, 1 x 4 KiB", read("read1", 1)),
        (f"batch_read_located, {BATCH} x 4 KiB", read("read16", BATCH)),
        (
            "the two round trips alternating: batch_exists, then batch_read_located of 1",
            read("alternate", 1, master_too=True),
        ),
    ]
    gaps = [
        (gap, p50_us(locate(str(gap), BATCH), n, before=lambda i, g=gap: spin_for(g)))
        for gap in GAPS_US
    ]
    return rows, gaps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ops", type=int, default=400, help="operations per row")
    ap.add_argument("--repeat", type=int, default=1, help="runs of the whole-read rows")
    ap.add_argument("--reads-only", action="store_true", help="the whole-read rows alone")
    ap.add_argument("--markdown", action="store_true", help="write into docs/benchmarks.md")
    args = ap.parse_args()
    n = args.ops
    print(f"bench_hops: p50 of {n} operations a row, {os.cpu_count()} cores")
    idle = []
    for path in IDLE_FILES:
        value = Path(path).read_text().strip() if Path(path).exists() else "(none)"
        print(f"  {path}: {value}")
        idle.append(f"`{path}`: {value}")
    # The tables as printed, each a list of lines; the page gets the same ones.
    tables: list[list[str]] = []
    if not args.reads_only:
        tables.append(
            [
                "| the host: 32 B round trip, two bare Python processes | p50 µs |",
                "| --- | ---: |",
                f"| peer sleeping in recv | {host_rtt_us(False, n * 4):.0f} |",
                f"| peer spinning | {host_rtt_us(True, n * 4):.0f} |",
            ]
        )
        print("\n" + "\n".join(tables[-1]))

    with (
        master_and_node("512MiB", "bench-hops-") as (control, _),
        Client.connect(control) as client,
    ):
        rows, gaps = store_rows(client, n, args.repeat, args.reads_only)
    tables.append(
        [
            "| the store, back to back (TCP, distinct keys, every read asks the master) | p50 µs |",
            "| --- | ---: |",
            *(f"| {name} | {us:.0f} |" for name, us in rows),
        ]
    )
    print("\n" + "\n".join(tables[-1]))
    if gaps:
        tables.append(
            [
                f"| batch_locate of {BATCH} keys after the client spun for | p50 µs |",
                "| --- | ---: |",
                *(f"| {gap} µs | {us:.0f} |" for gap, us in gaps),
            ]
        )
        print("\n" + "\n".join(tables[-1]))
    if args.markdown:
        note = (
            f"p50 of {n} operations a row ({n * 4} for the host's round trips); "
            + "; ".join(idle)
            + f"; load average {os.getloadavg()[0]:.1f}."
        )
        markdown.write_table("hops", "\n\n".join(["\n".join(t) for t in tables] + [note]))


if __name__ == "__main__":
    main()
