"""A long-running pool under churn: the storage node's memory does not grow with the number of
put/get/remove cycles it has served."""

from __future__ import annotations

from kvstore.client import Client


def _rss_anon_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no RssAnon")


def test_a_nodes_memory_stays_flat_over_put_get_remove_cycles(cluster_factory) -> None:
    cluster = cluster_factory(num_nodes=2, dram="4MiB")
    keys = [f"churn/{i}" for i in range(100)]
    values = [bytes([i]) * (512 if i % 2 else 2048) for i in range(100)]

    def cycles(n: int) -> None:
        for _ in range(n):
            assert c.batch_put(keys, values) == [None] * 100
            assert c.batch_get(keys[::7]) == values[::7]
            assert c.batch_remove(keys) == [None] * 100

    with Client.connect(cluster.address) as c:
        cycles(1000)  # warm: arenas, memos and claims at their working size
        before = [_rss_anon_mib(n.pid) for n in cluster.nodes]
        cycles(3000)  # ~290 B a put before the fix: +40 MiB on each node
        after = [_rss_anon_mib(n.pid) for n in cluster.nodes]
    grown = [round(a - b, 1) for a, b in zip(after, before, strict=True)]
    assert max(grown) < 12, f"node RssAnon grew {grown} MiB over 3000 more cycles"
