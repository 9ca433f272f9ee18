"""The routing vocabulary stands under the router and the simulator: it imports neither."""

import subprocess
import sys

import pytest

ROUTING_MODULES = [
    "kvstore.routing",
    "kvstore.routing.cost",
    "kvstore.routing.policy",
    "kvstore.routing.slo",
]

FORBIDDEN = (
    "kvstore.master",
    "kvstore.client",
    "kvstore.node",
    "kvstore.router",
    "kvstore.sim",
    "kvstore.replay",
    "aiohttp",
)


@pytest.mark.timeout(60)
def test_routing_imports_no_router_simulator_or_io() -> None:
    code = (
        "import importlib, sys\n"
        f"for name in {ROUTING_MODULES!r}:\n"
        "    importlib.import_module(name)\n"
        f"bad = sorted(m for m in sys.modules if m.startswith({FORBIDDEN!r}))\n"
        "print(','.join(bad))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=50, check=True
    )
    assert result.stdout.strip() == ""
