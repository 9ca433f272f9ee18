"""A node's id is proven by the identity key in its data directory: a token holder registering a
live node's (public) id is refused and the real node keeps its objects; the real node restarted
on its directory is accepted."""

from __future__ import annotations

import json
import os
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvstore import auth, protocol
from kvstore.client import Client
from kvstore.errors import ForbiddenError
from tests.support import Cluster, start_master, start_node, wait_until

SECRET = "node-identity-token-0123456789abcdef"


def nodes(admin: str) -> dict[str, str]:
    """Node id -> data address, as anyone sees them in the public REST listing."""
    with urllib.request.urlopen(f"{admin}/api/v1/nodes", timeout=10) as r:
        return {n["node_id"]: n["address"] for n in json.load(r)["nodes"]}


def impostor_call(control: str, verb: str, args: dict[str, Any]) -> Any:
    """One call from a token holder that is not the node it claims to be."""
    host, port = control.rsplit(":", 1)
    conn = protocol.FramedSocket.connect(host, int(port), timeout=10)
    try:
        auth.hello(conn, auth.Token(SECRET))
        return conn.call(verb, args)
    finally:
        conn.close()


def register_args(node_id: str, **extra: Any) -> dict[str, Any]:
    return {
        "node_id": node_id,
        "host": "127.0.0.1",
        "port": 9,
        "secret": os.urandom(32),
        "segments": [["dram", "dram", 1 << 20, ""]],
        **extra,
    }


def claims(node_id: str) -> list[tuple[str, dict[str, Any]]]:
    return [
        ("register", register_args(node_id, identity=os.urandom(32))),
        ("register", register_args(node_id)),  # proves nothing
        ("heartbeat", {"node_id": node_id}),
        ("heartbeat", {"node_id": node_id, "identity": os.urandom(32)}),
    ]


@pytest.fixture
def secured(tmp_path: Path) -> Iterator[Cluster]:
    token_file = tmp_path / "token"
    token_file.write_text(SECRET + "\n")
    flags = ("--token-file", str(token_file))
    c = Cluster(tmp_path, start_master(*flags, "--node-ttl", "3"), node_args=flags)
    yield c
    c.stop()


def test_an_impostor_cannot_take_a_live_nodes_id(secured: Cluster) -> None:
    node = secured.add_node("32MiB")
    with Client.connect(secured.address, token=SECRET) as c:
        c.put("precious", b"p" * 5000)
        [(node_id, address)] = nodes(secured.admin).items()
        for verb, args in claims(node_id):
            with pytest.raises(ForbiddenError):
                impostor_call(secured.address, verb, args)
        # The real node still holds the id, at its own address, with its objects.
        assert nodes(secured.admin) == {node_id: address} == {node_id: node.field("data")}
        assert c.get("precious") == b"p" * 5000


def test_the_real_node_restarted_on_its_data_dir_is_accepted(secured: Cluster) -> None:
    node = secured.add_node("32MiB")
    [node_id] = nodes(secured.admin)
    node.kill()
    again = start_node(secured.address, secured.tmp / "node0", "32MiB", *secured.node_args)
    secured.nodes.append(again)
    wait_until(
        lambda: nodes(secured.admin) == {node_id: again.field("data")},
        timeout=30,
        what="the restarted node registered under its id",
    )
    with Client.connect(secured.address, token=SECRET) as c:
        c.put("after", b"a" * 100)
        assert c.get("after") == b"a" * 100
    # And the id is still its own: a claim with another key is refused.
    with pytest.raises(ForbiddenError):
        impostor_call(secured.address, *claims(node_id)[0])
