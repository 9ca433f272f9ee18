"""The prepared GPU check (bench/gpu_check.py, ``make gpu-check``) runs every file that holds a
``gpu``-marked test, and runs end to end here without a GPU (its CPU cases pass, the CUDA ones
skip), so the day a GPU machine is lent the script itself is not what fails."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import gpu_check  # noqa: E402


def test_the_check_runs_every_file_with_a_gpu_test() -> None:
    marked = {
        p.relative_to(ROOT).as_posix()
        for p in (ROOT / "tests").rglob("test_*.py")
        if re.search(r"pytest\.mark\.gpu\b", p.read_text())
    }
    assert marked == set(gpu_check.GPU_TEST_FILES)


def test_the_check_runs_without_a_gpu_when_told_to(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "gpu_check.py"), "--allow-cpu", "--wheels",
         str(tmp_path)],
        capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = re.findall(r"^\| (test_\S+) \| (\w+) \|$", done.stdout, re.M)
    assert {o for _, o in rows} == {"passed", "skipped"}
    assert any(n.endswith("-cpu]") and o == "passed" for n, o in rows)
    assert all(o == "skipped" for n, o in rows if n.endswith("-cuda]"))
    assert "GPU cases ran: False" in done.stdout
