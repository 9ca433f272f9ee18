"""The kernel sources ship as package data: an installed (non-editable) wheel finds them, and the
build is quiet (no setuptools warning about a folder missing from the packages list)."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

from kvstore.cuda.kernels import KERNEL_DIR

ROOT = Path(__file__).resolve().parents[2]


def test_wheel_ships_the_kernel_sources_beside_their_loader(tmp_path: Path) -> None:
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w",
         str(tmp_path), str(ROOT)],
        capture_output=True, text=True, timeout=240, check=False,
    )  # fmt: skip
    assert built.returncode == 0, built.stderr[-2000:]
    assert "absent from the `packages` configuration" not in built.stdout + built.stderr
    (wheel,) = tmp_path.glob("kvstore-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    sources = sorted(p.name for p in KERNEL_DIR.glob("*.cu"))
    assert sources, f"no kernel sources in {KERNEL_DIR}"
    # kernels.py finds them as Path(__file__).with_name(KERNEL_DIR.name): the same layout in the wheel.
    assert "kvstore/cuda/kernels.py" in names
    assert {f"kvstore/cuda/{KERNEL_DIR.name}/{s}" for s in sources} <= names
