"""``kvstore demo`` (vLLM) as a user runs it: the pool, three real vLLM servers, a table; and
Ctrl-C, which must stop every process at once and exit non-zero."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from kvstore.demo import realmodel

REPO = Path(__file__).resolve().parents[2]
ENGINE_BIN = REPO / ".venv-vllm" / "bin"
MODEL = realmodel.model_dir("smollm2")

pytestmark = [
    pytest.mark.engine,
    pytest.mark.slow,
    pytest.mark.skipif(
        not (ENGINE_BIN / "python").exists(), reason=".venv-vllm is absent (make test builds it)"
    ),
    pytest.mark.skipif(
        not realmodel.is_complete(MODEL), reason=f"no model at {MODEL} (make test fetches it)"
    ),
    pytest.mark.timeout(900),
]


def _demo(*args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [str(ENGINE_BIN / "python"), "-m", "kvstore", "demo", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its own group, as a terminal's foreground job is
    )


def _group_members(pgid: int) -> list[int]:
    members = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":  # fields: state, ppid, pgrp, ...
            members.append(int(entry))
    return members


def test_the_demo_prints_a_row_per_question_with_kv_from_the_pool() -> None:
    proc = _demo("--questions", "2", "--max-tokens", "16")
    try:
        out, _ = proc.communicate(timeout=840)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGINT)
            proc.wait(timeout=60)
    assert proc.returncode == 0, out[-4000:]
    assert "pool (embedded cluster) at" in out and out.count("starting vLLM") == 3
    rows = re.findall(
        r"^(\d): .{30,}?\s+(\d+)\s+(\d+)\s+(\d+)ms\s+(\d+)ms\s+(.+?)\s+(yes|NO)\s+(yes|NO)$",
        out,
        re.M,
    )
    assert [r[0] for r in rows] == ["1", "2"], out
    for _, num_tokens, num_cached, _, _, _, equal_local, _ in rows:
        # Everything but the last partial block came from the pool.
        assert 0 < int(num_cached) < int(num_tokens) and int(num_tokens) - int(num_cached) <= 32
        # The pool's KV is exact: decode answers as one instance using its own prefix cache.
        assert equal_local == "yes", out
    assert out.count("   answer: ") == 2
    assert "cached: prompt tokens decode loaded from the pool" in out  # the legend


def test_ctrl_c_stops_every_process_at_once_and_exits_non_zero() -> None:
    proc = _demo("--questions", "1")
    assert proc.stdout is not None
    pids = []
    deadline = time.monotonic() + 120
    for line in proc.stdout:  # the demo prints each server's pid as it starts it
        if m := re.search(r"starting vLLM \w+ +pid (\d+)", line):
            pids.append(int(m.group(1)))
        if len(pids) == 3 or time.monotonic() > deadline:
            break
    assert len(pids) == 3
    # Wait until every engine has started its own children (API server, engine core, worker).
    deadline = time.monotonic() + 240
    while not all(len(_group_members(pid)) >= 2 for pid in pids):
        assert time.monotonic() < deadline, [_group_members(p) for p in pids]
        time.sleep(0.2)  # polling a state, bounded by the deadline
    os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in a terminal does
    assert proc.wait(timeout=120) != 0
    left = {pid: _group_members(pid) for pid in pids}
    assert not any(left.values()), left
    assert not _group_members(proc.pid)  # nor the embedded cluster
