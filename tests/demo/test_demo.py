"""``kvstore demo --engine hf`` as a user runs it: embedded cluster, two worker processes, a table."""

from __future__ import annotations

import subprocess
import sys


def test_demo_prints_a_row_per_prompt_all_equal_to_colocated() -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvstore",
            "demo",
            "--engine",
            "hf",
            "--model",
            "tiny-gpt2",
            "--block-size",
            "16",
            "--max-new-tokens",
            "4",
            "--dram",
            "64MiB",
        ],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [line for line in out.stdout.splitlines() if line[:2] in ("1:", "2:", "3:", "4:")]
    assert len(rows) == 4, out.stdout
    assert all(r.rstrip().endswith("yes") for r in rows), out.stdout
    cached = [int(r[46:].split()[1]) for r in rows]
    assert cached[0] == 0 and all(c >= 690 for c in cached[1:]), out.stdout
    assert "embedded cluster at" in out.stdout
