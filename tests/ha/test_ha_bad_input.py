"""Bad input around etcd: no etcd at start, foreign keys under our prefix, colliding manifests,
and a crashed node leaving through its etcd lease."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest

from kvstore import protocol
from kvstore.address import Address
from kvstore.client import Client
from kvstore.errors import MasterUnavailableError
from kvstore.etcd import EtcdStore
from kvstore.etcd_keys import EtcdLayout
from tests.etcd_harness import etcd, free_port, ha_factory  # noqa: F401 - fixtures
from tests.support import wait_until

FAST = ("--heartbeat-interval", "0.5", "--node-ttl", "30")


def _run(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvstore", "--log-level", "error", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_unreachable_etcd_at_start_is_a_clear_error(tmp_path) -> None:
    dead = f"127.0.0.1:{free_port()}"
    master = _run(
        "master", "--port", "0", "--admin-port", "0", "--etcd", dead, "--etcd-attempts", "2"
    )
    assert master.returncode == 2
    assert f"etcd at {dead} unreachable after 2 tries" in master.stderr
    node = _run(
        "node", "--master", f"etcd://{dead}", "--data-dir", str(tmp_path / "n"), "--dram", "1MiB"
    )
    assert node.returncode == 2 and "unreachable after 5 tries" in node.stderr
    bad = _run("master", "--port", "0", "--etcd", "nonsense")
    assert bad.returncode == 2 and "HOST:PORT" in bad.stderr
    with pytest.raises(MasterUnavailableError, match="no leading master"):
        Client.connect(f"etcd://{dead}", timeout=1)


def test_foreign_keys_under_our_prefix_are_ignored(etcd, ha_factory) -> None:  # noqa: F811
    layout = EtcdLayout()

    async def plant() -> None:
        store = await EtcdStore.connect([Address.parse(etcd.endpoint)])
        try:
            await store.put(layout.leader_key, b"\x00 not a leader record")  # no lease
            lease = await store.grant_lease(60)
            await store.put(layout.node_key("intruder"), b"garbage", lease.lease_id)
            await store.put(layout.nodes_prefix + b"a/b", b'{"data": "h:1"}', lease.lease_id)
            await store.put(f"{layout.prefix}/something-else".encode(), b"?")
        finally:
            await store.close()

    asyncio.run(plant())
    cluster = ha_factory(num_masters=2, num_nodes=2, master_args=FAST)
    with Client.connect(cluster.url, timeout=10) as c:
        c.put("k", b"v" * 100)
        assert c.get("k") == b"v" * 100
        assert c.stats()["num_nodes"] == 2
    assert any("foreign value" in ln for m in cluster.masters for ln in m.lines)


def _impostor_register(addr: Address, epoch: int, manifest: list[object]) -> dict[str, object]:
    conn = protocol.FramedSocket.connect(addr.host, addr.port, timeout=10)
    try:
        return conn.call(
            "register",
            {
                "node_id": "impostor",
                "host": "127.0.0.1",
                "port": 9,
                "secret": b"x" * 32,
                "segments": [["dram", "dram", 1 << 20, ""]],
                "epoch": epoch,
                "manifest": manifest,
            },
        )["admission"]
    finally:
        conn.close()


def test_colliding_manifest_claims_are_rejected_and_logged(ha_factory) -> None:  # noqa: F811
    cluster = ha_factory(num_masters=2, num_nodes=2, master_args=FAST)
    with Client.connect(cluster.url, timeout=10) as c:
        values = {f"k{i}": bytes([i]) * (1000 + i) for i in range(20)}
        assert c.batch_put(list(values), list(values.values())) == [None] * 20
        # A failover: the new leader learns k0..k19 from the two real nodes' manifests.
        cluster.leader().kill()
        leader = cluster.leader(timeout=30)
        wait_until(lambda: c.stats()["num_nodes"] == 2, timeout=30, what="nodes to follow")
        assert c.batch_get(list(values)) == list(values.values())
        c.put("fresh", b"f" * 10)  # committed by the new leader itself
        addr = Address.parse(leader.field("control"))
        adm = _impostor_register(
            addr,
            c._control.epoch,
            [
                ["dram", 0, b"k3", 1003, 12345, 1],  # older than the real node's k3
                ["dram", 2048, b"fresh", 10, 999, 1 << 62],  # the live table wins
                ["dram", 4096, b"ghost", 100, 1, 1],
                ["dram", 4160, b"overlap", 100, 2, 1],  # inside ghost's extent
                ["dram", 8192, b"", 10, 1, 1],  # empty key
                ["nvme", 0, b"elsewhere", 10, 1, 1],  # no such segment
                "junk",
            ],
        )
        assert (adm["num_admitted"], adm["num_rejected"]) == (1, 6), adm
        reasons = " | ".join(adm["reasons"])
        assert "newer version" in reasons and "live table" in reasons and "not free" in reasons
        assert c.batch_get(list(values)) == list(values.values())
        assert c.get("fresh") == b"f" * 10
        assert c.batch_exists(["ghost", "overlap", "elsewhere"]) == [True, False, False]
        c.put("still-serving", b"s")
        assert c.get("still-serving") == b"s"
    assert any("manifest claim rejected" in ln for ln in leader.lines)


def test_a_crashed_node_leaves_within_its_lease_ttl(ha_factory) -> None:  # noqa: F811
    # --node-ttl 30: heartbeats alone would keep it for 30 s; its etcd lease (2 s) drops it.
    cluster = ha_factory(num_masters=1, num_nodes=2, master_args=FAST)
    with Client.connect(cluster.url, timeout=10) as c:
        wait_until(lambda: c.stats()["num_nodes"] == 2, what="two nodes")
        cluster.nodes[0].kill()
        wait_until(lambda: c.stats()["num_nodes"] == 1, timeout=15, what="the dead node to leave")
