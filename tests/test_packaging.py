"""The wheel holds every layer's folder under the one ``kvstore`` namespace (what a user installs,
and what the GPU check carries to a machine without this checkout), and the build is quiet."""

from __future__ import annotations

import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_wheel_ships_every_package_and_the_status_page(tmp_path: Path) -> None:
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w",
         str(tmp_path), str(ROOT)],
        capture_output=True, text=True, timeout=240, check=False,
    )  # fmt: skip
    assert built.returncode == 0, built.stderr[-2000:]
    assert "absent from the `packages` configuration" not in built.stdout + built.stderr
    (wheel,) = tmp_path.glob("kvstore-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    dirs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    for package, folder in dirs.items():
        for source in (ROOT / folder).rglob("*.py"):
            if "__pycache__" in source.parts:
                continue
            inside = source.relative_to(ROOT / folder).as_posix()
            assert f"{package.replace('.', '/')}/{inside}" in names, f"{source} is not in the wheel"
    assert any(n.startswith("kvstore/master/rest/") and n.endswith(".html") for n in names)
    assert not {n.split("/")[0] for n in names} & {"client", "master", "node", "apps"}
