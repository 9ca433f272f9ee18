"""Fixtures of the node's master-link tests (tests/node/test_agent*.py): a scripted master and
a node started against it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.node.test_agent import FakeMaster, NodeRig


@pytest.fixture
def master() -> Iterator[FakeMaster]:
    m = FakeMaster()
    yield m
    m.close()


@pytest.fixture
def rig(tmp_path: Path, master: FakeMaster) -> Iterator[NodeRig]:
    r = NodeRig(tmp_path, master)
    yield r
    r.close()
