"""Topology with real processes: nodes declare their host, rack and zone (``kvstore node
--host-id --rack --zone``), clients theirs (``Client.connect(host_id=, rack=, zone=)``); puts
land near their writer, replicas in distinct racks, reads get the nearest replica first, and a
lost rack's copies are made again in another rack."""

from __future__ import annotations

import os
from typing import Any

import pytest

from kvstore.client import Client
from kvstore.client.adapters.vllm_config import ConnectorConfig
from kvstore.errors import InvalidRequestError
from tests.support import Cluster, admin_json, wait_until

KIB = 1024
#: Node name -> (host id, rack): rack a has two hosts, racks b and c one each.
HOSTS = {"a1": ("ha1", "ra"), "a2": ("ha2", "ra"), "b1": ("hb1", "rb"), "c1": ("hc1", "rc")}


def start(cluster_factory: Any, hosts: dict[str, tuple[str, str]], *master_args: str) -> Cluster:
    cluster: Cluster = cluster_factory(num_nodes=0, master_args=master_args)
    for name, (host_id, rack) in hosts.items():
        cluster.add_node("1MiB", name, extra=("--host-id", host_id, "--rack", rack))
    return cluster


def node_ids(cluster: Cluster) -> dict[str, str]:
    """Host id -> node id, as the admin API shows the nodes."""
    nodes = admin_json(cluster.admin, "GET", "/api/v1/nodes")["nodes"]
    return {n["host_id"]: n["node_id"] for n in nodes}


def holders(client: Client, key: str) -> list[str]:
    """The node ids of ``key``'s replicas, in the order the master answers this client."""
    info = client.locate(key)
    client.release_lease(info)
    return [loc.node_id for loc in info.locations]


def test_nodes_show_where_they_stand(cluster_factory) -> None:
    cluster = start(cluster_factory, HOSTS)
    nodes = admin_json(cluster.admin, "GET", "/api/v1/nodes")["nodes"]
    assert sorted((n["host_id"], n["rack"], n["zone"]) for n in nodes) == sorted(
        (h, r, "") for h, r in HOSTS.values()
    )


def test_a_put_lands_on_the_writer_s_host_while_it_has_room_then_in_its_rack(
    cluster_factory,
) -> None:
    # 1 MiB nodes with a high watermark of 0.5: eight 64 KiB objects fill one to its mark.
    cluster = start(cluster_factory, HOSTS, "--high-watermark", "0.5", "--low-watermark", "0.4")
    ids = node_ids(cluster)
    with Client.connect(cluster.address, host_id="ha1", rack="ra") as c:
        values = [os.urandom(64 * KIB - 64) for _ in range(12)]
        keys = [f"k/{i}" for i in range(12)]
        assert c.batch_put(keys[:8], values[:8]) == [None] * 8
        assert {holders(c, k)[0] for k in keys[:8]} == {ids["ha1"]}
        for k, v in zip(keys[8:], values[8:], strict=True):  # one at a time, as well
            c.put(k, v)
        assert {holders(c, k)[0] for k in keys[8:]} == {ids["ha2"]}, "the rack's other host"
        assert c.batch_get(keys) == values
        # Its puts go where there is room near it when they are put: it takes no blanks (room
        # started ahead, kvstore.client.blanks), and holds none.
        assert not c._puts.blanks.enabled and c._puts.num_into_blanks == 0
        assert c._control.call("stats", {})["num_blanks"] == 0


def test_replicas_go_to_two_racks_and_reads_get_the_nearest_first(cluster_factory) -> None:
    cluster = start(cluster_factory, HOSTS)
    ids = node_ids(cluster)
    rack_of = {ids[h]: r for h, r in HOSTS.values()}
    with Client.connect(cluster.address, host_id="hb1", rack="rb") as writer:
        values = [os.urandom(4 * KIB) for _ in range(10)]
        keys = [f"r/{i}" for i in range(10)]
        assert writer.batch_put(keys, values, replicas=2) == [None] * 10
        for k in keys:
            first, second = holders(writer, k)
            assert first == ids["hb1"], "the writer's host first, for the writer too"
            assert rack_of[second] != "rb"
    # Every reader gets the replica nearest it first: its host's, else its rack's.
    for host_id, rack in HOSTS.values():
        with Client.connect(cluster.address, host_id=host_id, rack=rack) as reader:
            for k in keys:
                order = holders(reader, k)
                if ids[host_id] in order:
                    assert order[0] == ids[host_id]
                elif any(rack_of[n] == rack for n in order):
                    assert rack_of[order[0]] == rack
            assert reader.batch_get(keys) == values


def test_a_lost_rack_s_copies_are_made_again_in_another_rack(cluster_factory) -> None:
    hosts = {
        "a1": ("ha1", "ra"),
        "b1": ("hb1", "rb"),
        "b2": ("hb2", "rb"),
        "c1": ("hc1", "rc"),
        "c2": ("hc2", "rc"),
    }
    cluster = start(cluster_factory, hosts, "--node-ttl", "1.0", "--heartbeat-interval", "0.2")
    ids = node_ids(cluster)
    rack_of = {ids[h]: r for h, r in hosts.values()}
    with Client.connect(cluster.address, host_id="ha1", rack="ra") as c:
        values = [os.urandom(2 * KIB) for _ in range(8)]
        keys = [f"x/{i}" for i in range(8)]
        assert c.batch_put(keys, values, replicas=2) == [None] * 8
        for k in keys:
            assert [rack_of[n] for n in holders(c, k)][0] == "ra"
        survivors = {k: holders(c, k)[1] for k in keys}
        cluster.nodes[0].kill()  # rack a's only node: SIGKILL by PID

        def restored() -> bool:
            for k in keys:
                order = holders(c, k)
                if len(order) != 2:
                    return False
                racks = {rack_of[n] for n in order}
                # The survivor's rack has a second node: the copy must go to the third rack.
                assert racks != {rack_of[survivors[k]]}, (k, order)
                if len(racks) != 2:
                    return False
            return True

        wait_until(restored, timeout=30, what="two copies in two racks again")
        assert c.batch_get(keys) == values


def test_the_vllm_connector_declares_its_site() -> None:
    cfg = ConnectorConfig.from_extra({"master": "h:1", "host_id": "ha1", "rack": "ra"})
    assert (cfg.host_id, cfg.rack, cfg.zone) == ("ha1", "ra", None)
    for bad in ({"rack": 3}, {"zone": "z" * 129}):
        with pytest.raises(InvalidRequestError):
            ConnectorConfig.from_extra({"master": "h:1", **bad})
