"""The simulator stands beside the router, not under the master: it imports neither."""

import subprocess
import sys

import pytest

SIM_MODULES = [
    "kvstore.sim",
    "kvstore.sim.__main__",
    "kvstore.sim.cluster",
    "kvstore.sim.engine",
    "kvstore.sim.experiments",
    "kvstore.sim.kvboth",
    "kvstore.sim.policies",
    "kvstore.sim.replay",
    "kvstore.sim.report",
    "kvstore.sim.scheduler",
    "kvstore.sim.simulator",
    "kvstore.sim.default_slo",
    "kvstore.sim.trace",
]

FORBIDDEN = ("kvstore.master", "kvstore.client", "kvstore.router", "kvstore.replay", "kvstore.node")


@pytest.mark.timeout(60)
def test_simulator_imports_no_master_client_or_router() -> None:
    code = (
        "import importlib, sys\n"
        f"for name in {SIM_MODULES!r}:\n"
        "    importlib.import_module(name)\n"
        f"bad = sorted(m for m in sys.modules if m.startswith({FORBIDDEN!r}))\n"
        "print(','.join(bad))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=50, check=True
    )
    assert result.stdout.strip() == ""


@pytest.mark.timeout(60)
def test_python_m_kvstore_sim_help() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "kvstore.sim", "--help"],
        capture_output=True,
        text=True,
        timeout=50,
    )
    assert result.returncode == 0
    assert result.stdout.startswith("usage: python -m kvstore.sim")
