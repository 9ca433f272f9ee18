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
from tests.support import Daemon


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
