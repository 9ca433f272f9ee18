"""Shared by the adapter tests: a small pool (one master, one node, real processes) per module,
and seeded prompts."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kvstore.client import Client
from tests.support import Cluster, start_master


@pytest.fixture(scope="module")
def pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Client]:
    cluster = Cluster(Path(tmp_path_factory.mktemp("pool")), start_master())
    try:
        cluster.add_node("128MiB")
        with Client.connect(cluster.address) as client:
            yield client
    finally:
        cluster.stop()
