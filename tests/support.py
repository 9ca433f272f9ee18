"""Test support: real daemons in real processes, started and stopped by PID."""

from __future__ import annotations

import json
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from kvstore.processes import parse_ready

READY_TIMEOUT_S = 30.0


class Daemon:
    """A ``python -m kvstore ...`` child process whose stdout we follow line by line."""

    def __init__(self, args: list[str], *, ready: str, env: dict[str, str] | None = None) -> None:
        self.args = args
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvstore", "--log-level", "warning", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, **(env or {})},
        )
        self.lines: list[str] = []
        self._queue: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()
        self.ready_line = self.wait_for(ready)

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)
            self._queue.put(line)
        self._queue.put(None)

    def wait_for(self, pattern: str, timeout: float = READY_TIMEOUT_S) -> str:
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(
                    f"{self.args[0]}: no line matching {pattern!r}; output:\n{''.join(self.lines)}"
                )
            try:
                line = self._queue.get(timeout=left)
            except queue.Empty:
                continue
            if line is None:
                raise RuntimeError(
                    f"{self.args[0]} exited with {self.proc.wait()}; output:\n{''.join(self.lines)}"
                )
            if re.search(pattern, line):
                return line

    @property
    def ready(self) -> dict[str, Any]:
        """The ready record of :attr:`ready_line` (:func:`kvstore.processes.parse_ready`)."""
        record = parse_ready(self.ready_line)
        assert record is not None, f"not a ready record: {self.ready_line!r}"
        return record

    def field(self, name: str) -> str:
        """One field of the ready record, as text (e.g. ``control``, ``admin``, ``data``, ``id``)."""
        record = self.ready
        assert name in record, f"no {name!r} in {self.ready_line!r}"
        return str(record[name])

    @property
    def pid(self) -> int:
        return self.proc.pid

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=10)

    def stop(self, timeout: float = 15.0) -> int:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                return self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)
                raise
        return self.proc.returncode


@dataclass
class Cluster:
    """A master and storage nodes, each its own process."""

    tmp: Path
    master: Daemon
    nodes: list[Daemon] = field(default_factory=list)
    node_args: tuple[str, ...] = ()  # extra flags for every node (e.g. --token-file)

    @property
    def address(self) -> str:
        return self.master.field("control")

    @property
    def admin(self) -> str:
        return self.master.field("admin")

    def add_node(
        self, dram: str = "256MiB", name: str | None = None, extra: tuple[str, ...] = ()
    ) -> Daemon:
        name = name or f"node{len(self.nodes)}"
        node = start_node(self.address, self.tmp / name, dram, *self.node_args, *extra)
        self.nodes.append(node)
        return node

    def stop(self) -> None:
        for d in [*self.nodes, self.master]:
            try:
                d.stop()
            except Exception:  # noqa: BLE001 - stop everything we started, whatever happens
                d.kill()


def start_node(master: str, data_dir: Path, dram: str = "256MiB", *extra: str) -> Daemon:
    """A storage node process registered with ``master`` (``HOST:PORT`` or ``etcd://...``)."""
    return Daemon(
        [
            "node",
            "--master",
            master,
            "--port",
            "0",
            "--dram",
            dram,
            "--data-dir",
            str(data_dir),
            *extra,
        ],
        ready=r"kvstore node ready",
    )


def has_rdma_device() -> bool:
    """Whether this host has an RDMA device pyverbs can open."""
    from kvstore import rdma
    from kvstore.errors import TransportUnavailableError

    try:
        return bool(rdma.discover())
    except TransportUnavailableError:
        return False


def start_master(*extra: str) -> Daemon:
    return Daemon(
        ["master", "--port", "0", "--admin-port", "0", *extra], ready=r"kvstore master ready"
    )


def wait_until(
    predicate: callable, timeout: float = 15.0, interval: float = 0.05, what: str = "condition"
) -> None:
    """Poll ``predicate`` until true; bounded. (Polling a state, not sleeping as synchronisation.)"""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


def flip_arena_byte(cluster: Cluster, node_id: str, offset: int) -> None:
    """Flip one byte of a node's DRAM arena file behind the store's back (silent corruption)."""
    from kvstore.node.arena import default_arena_path

    for i in range(len(cluster.nodes)):
        data_dir = cluster.tmp / f"node{i}"
        if (data_dir / "node_id").read_text().strip() == node_id:
            with open(default_arena_path(node_id, data_dir), "r+b") as f:
                f.seek(offset)
                b = f.read(1)
                f.seek(offset)
                f.write(bytes([b[0] ^ 0xFF]))
            return
    raise AssertionError(f"no node {node_id} in this cluster")


#: Headless Chromium for the browser checks (status page, docs site), and the flags that keep it
#: off the network and out of /dev/shm.
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
    "--hide-scrollbars",
]


def admin_json(base: str, method: str, path: str, body: object = None, token: str = "") -> Any:
    """One admin REST call on ``base`` (``http://HOST:PORT``) with a bearer ``token``: its JSON
    answer (a 4xx or 5xx raises ``urllib.error.HTTPError``)."""
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(base + path, data=data, method=method, headers=headers)
    with urllib.request.urlopen(req, timeout=30) as resp:
        return json.loads(resp.read())


def admin_text(url: str, token: str) -> str:
    """The text answer of one admin GET of ``url`` (``/metrics``) with a bearer ``token``."""
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        return resp.read().decode()


def create_tenant(base: str, operator_token: str, name: str, **quotas: int) -> str:
    """A tenant made on the master whose admin API is ``base``; returns its token (the master
    answers once every live node has taken it)."""
    made = admin_json(
        base, "POST", "/api/v1/tenants", {"name": name, "quotas": quotas}, operator_token
    )
    assert made["nodes_pending"] == [], made
    return made["token"]


def mount_tmpfs(where: Path, size: str) -> Path:
    """A tmpfs of ``size`` (``8m``) mounted at ``where`` (made): a real file system that fills
    up (ENOSPC). Skips the test where mounting is not permitted. Undo with :func:`unmount`."""
    where.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {done.stderr.strip()}")
    return where


def unmount(where: Path) -> None:
    """Unmount ``where`` (lazily where a process still has files open there: detached now,
    freed when they are closed)."""
    if subprocess.run(["umount", str(where)], check=False).returncode != 0:
        subprocess.run(["umount", "-l", str(where)], check=True)
