"""How ``kvstore demo`` (vLLM) stops, without vLLM: each "server" is a plain child process
group standing in for one (a parent that serves ``/health`` and a grandchild, optionally deaf
to SIGTERM as a vLLM server still starting is), started through the demo's own VLLMServer."""

from __future__ import annotations

import functools
import io
import os
import shutil
import signal
import sys
from pathlib import Path

import pytest

from kvstore.demo import vllm_demo
from kvstore.demo.vllm_server import VLLMServer

FAKE_SERVER = f"""#!{sys.executable}
import http.server, os, signal, subprocess, sys
if os.environ.get("FAKE_DEAF_TO_TERM"):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the grandchild inherits it
subprocess.Popen(["sleep", "600"])  # an engine's own child, in the server's group
port = int(sys.argv[sys.argv.index("--port") + 1])

class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args):
        pass

http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
"""


@pytest.fixture
def fake_python(tmp_path: Path) -> str:
    path = tmp_path / "fake-python"
    path.write_text(FAKE_SERVER)
    path.chmod(0o755)
    return str(path)


def _group_alive(pgid: int) -> bool:
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


def test_stop_all_ends_every_group_and_kills_the_deaf_ones(
    fake_python: str, tmp_path: Path
) -> None:
    servers = []
    for name, deaf in (("a", True), ("b", False), ("c", True)):
        env = {"FAKE_DEAF_TO_TERM": "1"} if deaf else {}
        servers.append(VLLMServer("m", name, tmp_path / f"{name}.log", python=fake_python, env=env))
    for server in servers:
        server.wait_ready(timeout=60)
    vllm_demo.stop_all(servers, grace_s=0.5)
    # SIGTERM to all at once, one shared grace, then SIGKILL to the groups that did not heed it
    assert [s.proc.returncode for s in servers] == [
        -signal.SIGKILL,
        -signal.SIGTERM,
        -signal.SIGKILL,
    ]
    assert not any(_group_alive(s.pid) for s in servers)  # nor any engine's own child


@pytest.mark.parametrize("when", ["start", "questions"])
def test_ctrl_c_stops_says_so_prints_the_rows_it_has_and_keeps_the_logs(
    when: str, fake_python: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKE_DEAF_TO_TERM", "1")
    monkeypatch.setattr(vllm_demo, "STOP_GRACE_S", 0.5)
    monkeypatch.setattr(vllm_demo, "stop_all", functools.partial(vllm_demo.stop_all, grace_s=0.5))
    monkeypatch.setattr(vllm_demo, "VLLMServer", functools.partial(VLLMServer, python=fake_python))
    row = vllm_demo.Row("When is it open?", 300, 288, 0.1, 0.5, 1 << 20, "9-5", "9-5", "9-5")

    def one_row_then_ctrl_c(*args: object) -> None:
        args[-1].append(row)  # type: ignore[attr-defined]
        raise KeyboardInterrupt

    monkeypatch.setattr(vllm_demo, "_ask", one_row_then_ctrl_c)
    said: list[str] = []

    def say(line: str) -> None:
        said.append(line)
        if when == "start" and line.startswith("waiting for the three"):
            raise KeyboardInterrupt  # Ctrl-C while the servers start

    out = io.StringIO()
    with pytest.raises(KeyboardInterrupt):
        vllm_demo.run_vllm_demo("127.0.0.1:1", Path("m"), say=say, out=out)
    pids = [int(line.split("pid ")[1].split()[0]) for line in said if line.startswith("starting")]
    assert len(pids) == 3 and not any(_group_alive(pid) for pid in pids)
    assert "interrupted: stopping the vLLM servers (at most 0.5 s)" in said
    logs = Path(
        said[said.index("interrupted: stopping the vLLM servers (at most 0.5 s)") + 1].removeprefix(
            "stopped; the servers' logs are kept in "
        )
    )
    try:
        assert sorted(p.name for p in logs.iterdir()) == [
            "decode.log",
            "prefill.log",
            "reference.log",
        ]
        if when == "questions":
            assert "1: When is it open?" in out.getvalue() and "answer: 9-5" in out.getvalue()
            assert said[-1] == "interrupted after 1 of 4 questions: the rows above"
        else:
            assert out.getvalue() == ""
    finally:
        shutil.rmtree(logs)
