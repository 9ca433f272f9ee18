"""Per-key cost of small objects: batch_put then batch_get of many tiny distinct keys, over TCP.

Run:  .venv/bin/python bench/bench_small.py [--rounds N] [--keys K] [--size B] [--profile DIR]
      [--heap N] [--markdown]

Starts a real master and one storage node, each its own process (``kvstore master``,
``kvstore node``), then from this process, for each of ``--rounds`` rounds of fresh keys:
``batch_put`` of ``--keys`` distinct keys of ``--size`` bytes, then ``batch_get`` of the same keys
(each read once; the client is ``Client.connect(addr)`` as is: every read asks the master).
Prints keys/s of each (best and median round) and, per key, the CPU µs spent in the master, the
node and the client (from /proc and ``time.process_time``), so a change shows where it saved.

Then the cyclic garbage collector's share: collections and their seconds in each process over
the timed rounds (the client's through ``gc.callbacks``, master's and node's from their
``kvstore_gc_*`` metrics). ``--heap N`` first gives the client N live container objects, as an
engine's heap holds (the client runs inside one): a full collection walks all of them.

``--profile DIR``: the client runs under cProfile and master and node under py-spy (sampling,
every thread; attached by PID, stopped with SIGINT so it writes its file); the top entries by
own time of each are printed and the raw files kept in DIR.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import cProfile
import gc
import io
import os
import pstats
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[1]))  # for bench.markdown

from bench import markdown  # noqa: E402
from kvstore import protocol  # noqa: E402
from kvstore.client import Client  # noqa: E402
from kvstore.gc_policy import CollectorPauses  # noqa: E402
from kvstore.processes import parse_ready  # noqa: E402

READY_TIMEOUT_S = 30.0
TICKS = os.sysconf("SC_CLK_TCK")


def start(args: list[str], ready: str) -> tuple[subprocess.Popen[str], str]:
    """``python -m kvstore ARGS`` in a child process, and its ready line.

    Raises:
        RuntimeError: it exited, or printed no ready line within READY_TIMEOUT_S.
    """
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvstore", "--log-level", "warning", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    assert proc.stdout is not None
    deadline = time.monotonic() + READY_TIMEOUT_S
    for line in proc.stdout:  # a daemon prints its ready line or exits within its start timeout
        if re.search(ready, line):
            return proc, line
        if time.monotonic() > deadline:
            break
    proc.kill()
    raise RuntimeError(f"{args[0]} did not start")


def field(line: str, name: str) -> str:
    ready = parse_ready(line)
    assert ready is not None and name in ready, f"no {name!r} in {line!r}"
    return str(ready[name])


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` (all threads)."""
    parts = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(parts[11]) + int(parts[12])) / TICKS


def wait_warm(data: str, timeout: float = 120.0) -> None:
    """Wait until the node's arena is pre-faulted (it warms up in the background), so that
    the node's CPU figures are the store's, not its warm-up's.

    Raises:
        TimeoutError: not warm within ``timeout`` seconds.
    """
    host, port = data.rsplit(":", 1)
    conn = protocol.FramedSocket.connect(host, int(port), timeout=10)
    try:
        deadline = time.monotonic() + timeout
        while not conn.call("stats", {}).get("arenas_warm", True):
            if time.monotonic() > deadline:
                raise TimeoutError("the node did not warm up in time")
            time.sleep(0.05)  # polling a state, bounded by the deadline
    finally:
        conn.close()


def stop(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


@contextlib.contextmanager
def master_and_node(dram: str, prefix: str) -> Iterator[tuple[str, str]]:
    """A ``kvstore master`` and one ``kvstore node --dram DRAM`` (its data under a fresh
    temporary folder named ``PREFIX...``), each its own process, the node warm; yields the
    master's control address and the node's ready line (``field(line, "admin")``: its admin
    URL). Both are stopped after."""
    master, mline = start(["master", "--port", "0", "--admin-port", "0"], r"kvstore master ready")
    node = None
    try:
        control = field(mline, "control")
        node, nline = start(
            [
                *("node", "--master", control, "--port", "0", "--admin-port", "0"),
                *("--dram", dram, "--data-dir", tempfile.mkdtemp(prefix=prefix)),
            ],
            r"kvstore node ready",
        )
        wait_warm(field(nline, "data"))
        yield control, nline
    finally:
        if node is not None:
            stop(node)
        stop(master)


def pyspy_attach(pid: int, out: Path) -> subprocess.Popen[bytes] | None:
    exe = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(exe).exists():
        print("py-spy not found: no master/node profile", file=sys.stderr)
        return None
    return subprocess.Popen(
        [exe, "record", "--pid", str(pid), "--rate", "500", "--format", "raw", "-o", str(out)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def pyspy_top(path: Path, n: int) -> str:
    """The top ``n`` functions by own samples (leaf frames) of a py-spy raw profile."""
    own: collections.Counter[str] = collections.Counter()
    total = 0
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack:
            continue
        leaf = stack.split(";")[-1]
        if "(threading.py" in leaf or "(selectors.py" in leaf or "select (" in leaf:
            continue  # idle threads waiting
        c = int(count)
        own[re.sub(r"\s*\((.*?)/site-packages/|\s*\(/work/[^/]+/", " (", leaf)] += c
        total += c
    rows = [f"{c / max(total, 1) * 100:5.1f}%  {name}" for name, c in own.most_common(n)]
    return f"  ({total} busy samples)\n" + "\n".join("  " + r for r in rows)


def gc_metrics(admin: str) -> tuple[float, float] | None:
    """A daemon's collections and their seconds (all generations) from its ``/metrics``; None
    where it exports none."""
    with urllib.request.urlopen(f"{admin}/metrics", timeout=10) as r:
        text = r.read().decode()
    total = {"kvstore_gc_collections_total": 0.0, "kvstore_gc_pause_seconds_total": 0.0}
    found = False
    for line in text.splitlines():
        name = line.split("{", 1)[0]
        if name in total:
            total[name] += float(line.rsplit(" ", 1)[1])
            found = True
    if not found:
        return None
    return total["kvstore_gc_collections_total"], total["kvstore_gc_pause_seconds_total"]


def gc_used(
    before: tuple[float, float] | None, after: tuple[float, float] | None
) -> tuple[float, float] | None:
    """Collections and seconds between two :func:`gc_metrics` readings (None: either had none)."""
    if before is None or after is None:
        return None
    return after[0] - before[0], after[1] - before[1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--keys", type=int, default=1000)
    ap.add_argument("--size", type=int, default=16)
    ap.add_argument("--profile", type=Path, default=None)
    ap.add_argument("--heap", type=int, default=0, help="live objects the client holds")
    ap.add_argument("--markdown", action="store_true", help="write into docs/benchmarks.md")
    args = ap.parse_args()
    heap = [[i] for i in range(args.heap)]  # noqa: F841 - held for the collector to walk

    tmp = tempfile.mkdtemp(prefix="bench-small-")
    master, mline = start(["master", "--port", "0", "--admin-port", "0"], r"kvstore master ready")
    node = None
    spies: list[tuple[str, subprocess.Popen[bytes], Path]] = []
    try:
        address = field(mline, "control")
        node, nline = start(
            [
                *("node", "--master", address, "--port", "0", "--admin-port", "0"),
                *("--dram", "256MiB", "--data-dir", tmp),
            ],
            r"kvstore node ready",
        )
        admins = {"master": field(mline, "admin"), "node": field(nline, "admin")}
        wait_warm(field(nline, "data"))
        client = Client.connect(address)
        value = bytes(range(256)) * (args.size // 256 + 1)
        value = value[: args.size]
        # Warm-up round (connections, first allocations), not measured.
        warm = [f"warm/{i}".encode() for i in range(args.keys)]
        assert all(r is None for r in client.batch_put(warm, [value] * len(warm)))
        assert all(r == value for r in client.batch_get(warm))

        prof = None
        if args.profile is not None:
            args.profile.mkdir(parents=True, exist_ok=True)
            for name, proc in (("master", master), ("node", node)):
                out = args.profile / f"{name}.txt"
                spy = pyspy_attach(proc.pid, out)
                if spy is not None:
                    spies.append((name, spy, out))
            time.sleep(0.5)  # NOTE: not synchronisation: lets py-spy attach before we measure
            prof = cProfile.Profile()

        put_rates: list[float] = []
        get_rates: list[float] = []
        cpu = collections.Counter[str]()
        collector = CollectorPauses()  # the client's, while its calls run
        gc_before = {name: gc_metrics(admin) for name, admin in admins.items()}
        for r in range(args.rounds):
            keys = [f"r{r}/k{i}".encode() for i in range(args.keys)]
            values = [value] * len(keys)
            for phase, fn in (
                ("put", lambda k=keys, v=values: client.batch_put(k, v)),
                ("get", lambda k=keys: client.batch_get(k)),
            ):
                m0, n0, c0 = cpu_s(master.pid), cpu_s(node.pid), time.process_time()
                t0 = time.perf_counter()
                if prof is not None:
                    prof.enable()
                gc.callbacks.append(collector)
                out = fn()
                gc.callbacks.remove(collector)
                if prof is not None:
                    prof.disable()
                dt = time.perf_counter() - t0
                c1, m1, n1 = time.process_time(), cpu_s(master.pid), cpu_s(node.pid)
                if phase == "put":
                    assert all(x is None for x in out), out[:3]
                    put_rates.append(len(keys) / dt)
                else:
                    assert all(x == value for x in out), out[:3]
                    get_rates.append(len(keys) / dt)
                cpu[f"{phase} master"] += m1 - m0
                cpu[f"{phase} node"] += n1 - n0
                cpu[f"{phase} client"] += c1 - c0
                cpu[f"{phase} wall"] += dt
        client.close()
        daemon_gc = {name: gc_used(gc_before[name], gc_metrics(a)) for name, a in admins.items()}

        n = args.rounds * args.keys
        lines = [
            f"bench_small: {args.rounds} rounds x {args.keys} keys x {args.size} B, TCP, 1 node; "
            f"load average {os.getloadavg()[0]:.1f}",
            "",
            "| op        | best keys/s | median keys/s | wall µs/key | master | node | client |",
            "| --------- | ----------: | ------------: | ----------: | -----: | ---: | -----: |",
        ]
        for phase, rates in (("batch_put", put_rates), ("batch_get", get_rates)):
            p = phase[6:]
            lines.append(
                f"| {phase} | {max(rates):11,.0f} | {statistics.median(rates):13,.0f} "
                f"| {cpu[f'{p} wall'] / n * 1e6:11.1f} "
                f"| {cpu[f'{p} master'] / n * 1e6:6.1f} | {cpu[f'{p} node'] / n * 1e6:4.1f} "
                f"| {cpu[f'{p} client'] / n * 1e6:6.1f} |"
            )
        lines += ["", "(master / node / client: CPU µs per key; /proc tick resolution, 10 ms)"]
        young, middle, full = collector.num_collections
        seconds = sum(collector.seconds)
        figures = [
            f"client {young}/{middle}/{full} collections (gen 0/1/2), {seconds:.3f} s"
            f" ({seconds / (2 * n) * 1e6:.2f} µs a key; heap {args.heap:,} objects)"
        ]
        for name, got in daemon_gc.items():
            figures.append(
                f"{name} -" if got is None else f"{name} {got[0]:.0f} collections, {got[1]:.3f} s"
            )
        lines += ["", "collector over the timed rounds: " + "; ".join(figures)]
        print("\n".join(lines))
        if args.markdown:
            markdown.write_table("small", "\n".join(lines))

        if prof is not None:
            for name, spy, out in spies:
                spy.send_signal(signal.SIGINT)
                spy.wait(timeout=30)
                if out.exists():
                    print(f"\n{name} (py-spy, own time):\n{pyspy_top(out, 20)}")
            s = io.StringIO()
            prof.dump_stats(str(args.profile / "client.prof"))
            pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(20)
            body = s.getvalue()
            print("\nclient (cProfile, tottime):\n" + body[body.find("   ncalls") :])
            spies = []
    finally:
        for _, spy, _ in spies:
            if spy.poll() is None:
                spy.send_signal(signal.SIGINT)
                spy.wait(timeout=30)
        if node is not None:
            stop(node)
        stop(master)
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
