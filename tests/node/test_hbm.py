"""The HBM tier (GPU memory through torch). Skipped where no CUDA GPU exists."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvstore.errors import InvalidRequestError, OutOfRangeError
from kvstore.node.hbm import gpu_available, open_hbm
from kvstore.node.tiers import StoredObject, checksum_of


def test_without_a_gpu_the_node_runs_without_hbm(caplog: pytest.LogCaptureFixture) -> None:
    if gpu_available():
        pytest.skip("a GPU is present")
    assert open_hbm(1 << 20) is None
    assert "no CUDA GPU" in caplog.text
    assert open_hbm(0) is None


@pytest.mark.gpu
@pytest.mark.skipif(not gpu_available(), reason="needs a CUDA GPU (torch sees none)")
def test_hbm_round_trip() -> None:
    tier = open_hbm(8 << 20)
    assert tier is not None
    data = os.urandom(1 << 20)
    obj = StoredObject("hbm", 4096, b"k", len(data), checksum_of(data))
    assert tier.write([(obj, memoryview(data))]) == [None]
    assert bytes(tier.read(4096, len(data))) == data
    bad = StoredObject("hbm", 8 << 20, b"k", 1, 0)
    assert isinstance(tier.write([(bad, memoryview(b"x"))])[0], OutOfRangeError)
    with pytest.raises(OutOfRangeError):
        tier.read(8 << 20, 1)
    tier.close()


@pytest.mark.gpu
@pytest.mark.skipif(not gpu_available(), reason="needs a CUDA GPU (torch sees none)")
def test_hbm_bad_size() -> None:
    from kvstore.node.hbm import HbmTier

    with pytest.raises(InvalidRequestError):
        HbmTier(0)


@pytest.mark.gpu
@pytest.mark.skipif(not gpu_available(), reason="needs a CUDA GPU (torch sees none)")
def test_puts_land_in_hbm_and_demote_to_dram(cluster_factory, tmp_path: Path) -> None:
    from kvstore.client import Client
    from tests.support import wait_until

    cluster = cluster_factory(
        num_nodes=1,
        dram="16MiB",
        master_args=("--heartbeat-interval", "0.1", "--node-ttl", "1"),
        node_args=("--hbm", "4MiB"),
    )
    with Client.connect(cluster.address) as c:
        values = {f"h/{i}": os.urandom(256 << 10) for i in range(24)}
        assert c.batch_put(list(values), list(values.values())) == [None] * 24
        assert c.locate("h/23").locations[0].grant.segment in ("hbm", "dram")
        wait_until(lambda: c.stats()["eviction"]["num_demotions"] > 0, timeout=30)
        assert c.batch_get(list(values)) == list(values.values())
        assert c.stats()["tiers"]["hbm"]["num_replicas"] > 0
