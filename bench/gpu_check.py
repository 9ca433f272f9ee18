"""The GPU check: what kvstore runs on a machine with one CUDA GPU, PyTorch and CuPy, but no vLLM,
no etcd and no network.

Here (with the network):  make gpu-wheels   puts the wheels that machine lacks into .gpu-wheels/
There (the GPU machine):   make gpu-check    (python3 bench/gpu_check.py)

It installs .gpu-wheels/*.whl (kvstore itself, lmdb, pytest-timeout) into a private folder, copies
tests/ and bench/ out of the checkout (so that ``import kvstore`` finds the installed package and
not the core folder of the checkout), and then

1. runs the test files that hold the ``gpu``-marked tests, all of their cases (the CPU cases too,
   as the reference): the HBM tier, CUDA tensors through put/get over TCP and shared memory, and
   the vLLM connector's worker side on CUDA caches in every layout, each through a real master
   and storage node started on that machine;
2. runs ``bench/bench_cuda.py --quick``: put/get of CUDA tensors and the connector's save/load
   per layout against a plain pinned copy of the same bytes on that card;
3. prints one table: each test's outcome, then the bench's table.

Exits 1 if a test failed, or if no CUDA device was found (``--allow-cpu`` runs the same steps on
a machine without one, which is how the script itself is checked).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WHEELS = ROOT / ".gpu-wheels"
#: The test files that hold the ``gpu``-marked tests (tests/test_gpu_check.py keeps this list true).
GPU_TEST_FILES = (
    "tests/node/test_hbm.py",
    "tests/integration/test_cuda_staging.py",
    "tests/adapters/test_vllm_worker.py",
)
#: What may travel with the tree to the GPU machine.
CARRY_LIMIT = 64 << 20


def install_wheels(folder: Path, site: Path) -> list[tuple[str, int]]:
    """Install the wheels of ``folder`` into ``site`` (no index, no dependencies); their names
    and sizes."""
    wheels = sorted(folder.glob("*.whl"))
    if not wheels:
        return []
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
         "--no-cache-dir", "--upgrade", "--target", str(site), *map(str, wheels)],
        check=True,
    )  # fmt: skip
    return [(w.name, w.stat().st_size) for w in wheels]


def run_tests(work: Path, env: dict[str, str]) -> list[tuple[str, str]]:
    """Run the GPU test files from ``work``; ``(test id, outcome)`` per test case."""
    report = work / "junit.xml"
    subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs",
         f"--junitxml={report}", *GPU_TEST_FILES],
        cwd=work, env=env, check=False,
    )  # fmt: skip
    if not report.exists():
        return [("pytest", "did not run")]
    out = []
    for case in ET.parse(report).iter("testcase"):
        name = f"{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name')}"
        tags = {child.tag for child in case}
        outcome = (
            "FAILED"
            if tags & {"failure", "error"}
            else "skipped"
            if "skipped" in tags
            else "passed"
        )
        out.append((name, outcome))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--allow-cpu", action="store_true", help="run without a CUDA device")
    ap.add_argument("--wheels", type=Path, default=WHEELS, help="the carried wheels' folder")
    args = ap.parse_args()
    import torch  # the GPU machine's own build

    has_gpu = torch.cuda.is_available()
    device = torch.cuda.get_device_name() if has_gpu else "no CUDA device"
    print(f"gpu-check: python {sys.version.split()[0]}, torch {torch.__version__}, {device}")
    if not has_gpu and not args.allow_cpu:
        print("gpu-check: no CUDA device here (torch.cuda.is_available() is False)")
        return 1
    with tempfile.TemporaryDirectory(prefix="kvstore-gpu-check-") as tmp:
        work = Path(tmp)
        site = work / "site"
        carried = install_wheels(args.wheels, site)
        for folder in ("tests", "bench"):
            shutil.copytree(
                ROOT / folder, work / folder, ignore=shutil.ignore_patterns("__pycache__")
            )
        shutil.copy(ROOT / "pyproject.toml", work / "pyproject.toml")  # markers, timeouts
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        if carried:
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), env.get("PYTHONPATH")]))
        cases = run_tests(work, env)
        bench = subprocess.run(
            [sys.executable, "bench/bench_cuda.py", "--quick"],
            cwd=work, env=env, capture_output=True, text=True, check=False,
        )  # fmt: skip
    total = sum(size for _, size in carried)
    print(
        f"\ncarried wheels ({total / 2**20:.1f} MiB of the {CARRY_LIMIT >> 20} MiB a run may carry):"
    )
    for name, size in carried:
        print(f"  {name}  {size / 2**20:.2f} MiB")
    if not carried:
        print("  none (.gpu-wheels/ is empty: kvstore must then be installed in this interpreter)")
    print("\n| test | outcome |\n|---|---|")
    for name, outcome in cases:
        print(f"| {name} | {outcome} |")
    print(f"\nbench/bench_cuda.py --quick (exit {bench.returncode}):")
    print(bench.stdout.rstrip() or "(no output)")
    if bench.returncode != 0:
        print(bench.stderr[-3000:])
    failed = [n for n, o in cases if o not in ("passed", "skipped")]
    ran_gpu = any(o == "passed" and "cuda" in n.lower() for n, o in cases)
    print(
        f"\ngpu-check: {sum(o == 'passed' for _, o in cases)} passed, {len(failed)} failed, "
        f"{sum(o == 'skipped' for _, o in cases)} skipped; GPU cases ran: {ran_gpu}"
    )
    return 1 if failed or bench.returncode != 0 or (has_gpu and not ran_gpu) else 0


if __name__ == "__main__":
    sys.exit(main())
