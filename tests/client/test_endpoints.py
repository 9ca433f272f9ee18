"""A client pointed at the wrong port fails at connect, saying what the port is and what to use
(kvstore.client.endpoints), against a real master and node."""

from __future__ import annotations

import pytest

from kvstore.client import Client
from kvstore.errors import WrongEndpointError


def _strip(url: str) -> str:
    return url.split("://", 1)[1]


@pytest.mark.parametrize(
    ("where", "said"),
    [
        ("node data", "is a storage node's data port, not a master"),
        ("master admin", "is an HTTP port (an admin API or the router)"),
        ("node admin", "is an HTTP port (an admin API or the router)"),
        ("admin url", "is an HTTP URL (the master's admin API is one)"),
        ("control url", "is an HTTP URL"),
    ],
)
def test_a_wrong_endpoint_fails_at_connect_and_says_which_to_use(
    cluster_factory, where: str, said: str
) -> None:
    cluster = cluster_factory(num_nodes=1)
    node = cluster.nodes[0]
    address = {
        "node data": node.field("data"),
        "master admin": _strip(cluster.admin),
        # A stdlib HTTP server waits for a line end: the ping times out, then the probe tells.
        "node admin": _strip(node.field("admin")),
        "admin url": cluster.admin,
        "control url": "http://" + cluster.address,
    }[where]
    with pytest.raises(WrongEndpointError) as info:
        Client.connect(address, timeout=1.0)
    message = info.value.message
    assert message.startswith(f"{address} {said}"), message
    assert "kvstore up prints it" in message, message


def test_the_control_port_still_connects(cluster_factory) -> None:
    cluster = cluster_factory(num_nodes=1)
    with Client.connect(cluster.address) as client:
        client.put("k", b"v")
        assert bytes(client.get("k")) == b"v"
