"""The embedded ``kvstore up`` path, started and stopped as a user would."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from kvstore.client import Client
from tests.support import Daemon, wait_until


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_up_serves_a_client_in_another_process_and_stops_cleanly(
    tmp_path: Path, sig: signal.Signals
) -> None:
    up = Daemon(
        ["up", "--port", "0", "--data-dir", str(tmp_path), "--dram", "64MiB"],
        ready=r"kvstore up: ready",
    )
    address = up.field("control")
    assert "client connects to" in "".join(up.lines)
    code = (
        "import sys\nfrom kvstore.client import Client\n"
        "c = Client.connect(sys.argv[1])\nc.put('k', b'v' * 1000)\nassert c.get('k') == b'v' * 1000\nprint('ok')"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, address], capture_output=True, text=True, timeout=60
    )
    assert out.stdout.strip() == "ok", out.stderr
    with urllib.request.urlopen(f"{up.field('admin')}/api/v1/cluster", timeout=5) as r:
        cluster = json.load(r)
    assert cluster["num_nodes"] == 1 and cluster["num_objects"] == 1

    node_pids = [
        int(p)
        for p in subprocess.run(
            ["pgrep", "-f", str(tmp_path / "node-0")], capture_output=True, text=True
        ).stdout.split()
    ]
    assert node_pids, "the embedded node runs as its own process"
    os.kill(up.pid, sig)
    assert up.proc.wait(timeout=20) == 0
    up.wait_for(r"kvstore up: stopped", timeout=5)
    for pid in node_pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    with pytest.raises(Exception):  # noqa: B017 - anything but success: nobody is listening
        Client.connect(address, timeout=2)


def _one_clear_line(out: subprocess.CompletedProcess[str], *expect: str) -> None:
    """Failed (exit code not 0), said so in one line on stderr, no traceback."""
    lines = [ln for ln in out.stderr.splitlines() if ln.strip()]
    assert out.returncode != 0, out
    assert len(lines) == 1 and "Traceback" not in out.stderr, out.stderr
    for word in expect:
        assert word in lines[0], lines[0]


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
    return subprocess.run(
        [sys.executable, "-m", "kvstore", "--log-level", "warning", *args],
        capture_output=True,
        text=True,
        timeout=90,
        env={**clean, "HOME": "/nonexistent"},
    )


@pytest.mark.parametrize(
    ("flags", "expect"),
    [
        (["--dram", "lots"], ["bad size", "lots"]),
        (["--nvme", "heaps"], ["bad size", "heaps"]),
        (["--port", "{busy}"], ["is already in use", "--port"]),
    ],
    ids=["bad-dram", "bad-nvme", "port-in-use"],
)
def test_up_fails_with_one_clear_line(tmp_path: Path, flags: list[str], expect: list[str]) -> None:
    import socket

    with socket.create_server(("127.0.0.1", 0)) as busy:
        port = str(busy.getsockname()[1])
        args = [f.replace("{busy}", port) for f in flags]
        if "--port" not in args:
            args += ["--port", "0"]
        out = _run("up", "--data-dir", str(tmp_path), *args)
    _one_clear_line(out, "kvstore up", *expect)
    assert "failed to start" not in out.stderr


def test_status_at_a_port_that_is_not_http_fails_with_one_clear_line(tmp_path: Path) -> None:
    from tests.support import start_master

    master = start_master()
    try:
        control = master.field("control")
        out = _run("status", "--admin", f"http://{control}", "--timeout", "10")
        _one_clear_line(out, "kvstore status", "HTTP")
    finally:
        master.stop()


def _children(pid: int) -> list[int]:
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        out += [int(c) for c in (task / "children").read_text().split()]
    return out


def _free_port() -> int:
    import socket

    with socket.create_server(("127.0.0.1", 0)) as s:
        return s.getsockname()[1]


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    # A zombie has exited already (its parent has not reaped it yet).
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"


def test_kill_9_of_up_takes_its_node_along_and_a_restart_on_the_same_dir_works(
    tmp_path: Path,
) -> None:
    from tests.support import wait_until

    port, node_port = _free_port(), _free_port()
    flags = ["up", "--port", str(port), "--admin-port", "0", "--node-port", str(node_port)]
    flags += ["--data-dir", str(tmp_path), "--dram", "32MiB", "--nvme", "32MiB"]
    up = Daemon(flags, ready=r"kvstore up: ready")
    nodes: list[int] = []
    try:
        with Client.connect(f"127.0.0.1:{port}", timeout=10) as c:
            c.put("k", b"v" * 100)
        nodes = _children(up.pid)
        assert len(nodes) == 1, nodes
        up.kill()  # SIGKILL: no chance to stop the node itself
        wait_until(lambda: _gone(nodes[0]), timeout=30, what="the orphaned node to exit")
    finally:
        up.kill()
        for pid in nodes:  # the test failed: stop what it started anyway
            if not _gone(pid):
                os.kill(pid, signal.SIGKILL)
    again = Daemon(flags, ready=r"kvstore up: ready")
    try:
        with Client.connect(f"127.0.0.1:{port}", timeout=10) as c:
            c.put("k2", b"w" * 100)
            assert c.get("k2") == b"w" * 100
        assert again.field("data").endswith(f":{node_port}")
    finally:
        assert again.stop() == 0


def _metric(text: str, name: str) -> float:
    """The value of an unlabelled Prometheus sample ``name`` in an exposition ``text``."""
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"no {name} in the metrics")


def test_the_master_of_up_runs_with_the_collectors_policy(tmp_path: Path) -> None:
    """``kvstore up`` runs a master in its own process, so it sets the master's collector
    policy as ``kvstore master`` does: start-up frozen out of the full collections' way, and
    the collections' pauses recorded (kvstore/gc_policy.py); and its loop's lag is sampled."""
    up = Daemon(
        ["up", "--port", "0", "--data-dir", str(tmp_path), "--dram", "32MiB"],
        ready=r"kvstore up: ready",
    )
    try:
        with urllib.request.urlopen(f"{up.field('admin')}/metrics", timeout=5) as r:
            text = r.read().decode()
        assert _metric(text, "kvstore_gc_frozen_objects") > 1000, "start-up was not frozen"
        assert 'kvstore_gc_collections_total{generation="2"}' in text

        def lag_samples() -> float:
            with urllib.request.urlopen(f"{up.field('admin')}/metrics", timeout=5) as r:
                return _metric(r.read().decode(), "kvstore_loop_lag_seconds_count")

        wait_until(lambda: lag_samples() > 0, timeout=30, what="the loop's lag sampled")
    finally:
        assert up.stop() == 0
