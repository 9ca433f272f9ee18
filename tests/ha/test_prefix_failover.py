"""The prefix index survives a failover: the new leader rebuilds it from the nodes' manifests."""

from __future__ import annotations

import numpy as np

from kvstore.client import Client, KVCache, Namespace
from tests.etcd_harness import etcd, ha_factory  # noqa: F401 - fixtures
from tests.support import wait_until

FAST = ("--heartbeat-interval", "0.5", "--node-ttl", "4")
BS = 16


def test_kv_prefix_is_matched_and_loaded_after_kill_9_of_the_leader(ha_factory) -> None:  # noqa: F811
    cluster = ha_factory(num_masters=2, num_nodes=2, master_args=FAST)
    ns = Namespace(
        model="tiny", dtype="float16", num_layers=2, num_kv_heads=2, head_dim=8, block_size=BS
    )
    prompts = [np.arange(6 * BS + 3) + 1000 * i for i in range(4)]
    kv_data = [
        [
            tuple(
                np.random.default_rng(i * 10 + layer)
                .standard_normal((2, len(p), 2, 8))
                .astype(np.float16)
            )
            for layer in range(2)
        ]
        for i, p in enumerate(prompts)
    ]
    with Client.connect(cluster.url, timeout=15) as c:
        kv = KVCache(c, ns)
        for p, layers in zip(prompts, kv_data, strict=True):
            assert kv.store(p, layers) == 6 * BS
        assert all(kv.lookup(p) == 6 * BS for p in prompts)

        old = cluster.leader()
        old.kill()
        new = cluster.leader(timeout=30)
        assert new is not old

        wait_until(
            lambda: all(kv.lookup(p) == 6 * BS for p in prompts),
            timeout=30,
            interval=0.2,
            what="prefix index rebuilt on the new leader",
        )
        for p, layers in zip(prompts, kv_data, strict=True):
            out = [(np.zeros_like(k), np.zeros_like(v)) for k, v in layers]
            assert kv.load(p, out) == 6 * BS
            for (k, v), (ko, vo) in zip(layers, out, strict=True):
                assert np.array_equal(ko[: 6 * BS], k[: 6 * BS]) and np.array_equal(
                    vo[: 6 * BS], v[: 6 * BS]
                )
        kv.close()
