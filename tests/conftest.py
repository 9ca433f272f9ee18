"""Shared fixtures: real daemons in real processes, started and stopped by PID."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.support import Cluster, start_master


@pytest.fixture
def cluster_factory(tmp_path: Path) -> Iterator[Callable[..., Cluster]]:
    made: list[Cluster] = []

    def make(
        num_nodes: int = 2,
        dram: str = "256MiB",
        master_args: tuple[str, ...] = (),
        node_args: tuple[str, ...] = (),
    ) -> Cluster:
        c = Cluster(tmp_path / f"c{len(made)}", start_master(*master_args), node_args=node_args)
        made.append(c)
        for _ in range(num_nodes):
            c.add_node(dram, extra=node_args)
        return c

    yield make
    for c in made:
        c.stop()
