"""The experimental RDMA package keeps the layers: the core half imports no client or master, and
a client importing it does not load the node's half."""

import subprocess
import sys

import pytest

from kvstore import rdma
from kvstore.rdma import devices, ibverbs, wire


@pytest.mark.timeout(60)
def test_core_half_imports_no_client_master_or_node() -> None:
    code = (
        "import sys, kvstore.rdma\n"
        "print(','.join(sorted(m for m in sys.modules\n"
        "    if m.startswith(('kvstore.client', 'kvstore.master', 'kvstore.node', 'kvstore.node.rdma')))))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=50, check=True
    )
    assert result.stdout.strip() == ""


@pytest.mark.timeout(60)
def test_node_half_imports_no_client_or_master() -> None:
    code = (
        "import sys, kvstore.node.rdma\n"
        "print(','.join(sorted(m for m in sys.modules\n"
        "    if m.startswith(('kvstore.client', 'kvstore.master')))))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=50, check=True
    )
    assert result.stdout.strip() == ""


@pytest.mark.parametrize("name", [n for n in rdma.__all__ if callable(getattr(rdma, n))])
def test_package_names_are_the_modules_own(name: str) -> None:
    obj = getattr(rdma, name)
    owner = {m.__name__: m for m in (devices, ibverbs, wire)}[obj.__module__]
    assert getattr(owner, name) is obj


def test_docstring_says_experimental_and_what_is_tested() -> None:
    doc = rdma.__doc__ or ""
    assert doc.startswith("EXPERIMENTAL")
    assert "What *is* tested" in doc and "Not tested" in doc
