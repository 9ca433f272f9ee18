"""Node identity across a failover: the new leader learns the node's key from its registration,
so an impostor registering the node's id with the new leader is refused, and the node keeps
serving its objects."""

from __future__ import annotations

import os

import pytest

from kvstore.client import Client
from kvstore.errors import ForbiddenError
from tests.etcd_harness import etcd, ha_factory  # noqa: F401 - fixtures
from tests.integration.test_node_identity import SECRET as TOKEN
from tests.integration.test_node_identity import claims, impostor_call, nodes
from tests.support import wait_until

FAST = ("--heartbeat-interval", "0.5", "--node-ttl", "4")


def test_an_impostor_is_refused_by_the_leader_after_a_failover(
    ha_factory,  # noqa: F811
    monkeypatch,
) -> None:
    monkeypatch.setenv("KVSTORE_TOKEN", TOKEN)  # every daemon started below inherits it
    cluster = ha_factory(num_masters=2, num_nodes=1, master_args=FAST)
    old = cluster.leader()
    value = os.urandom(3000)
    with Client.connect(cluster.url, timeout=20, token=TOKEN) as c:
        c.put("kept", value)
        [(node_id, address)] = nodes(old.field("admin")).items()
        old.kill()  # SIGKILL: the standby takes over with an empty table
        new = cluster.leader(timeout=60)
        assert new is not old
        wait_until(
            lambda: nodes(new.field("admin")) == {node_id: address},
            timeout=60,
            what="the node registered with the new leader",
        )
        for verb, args in claims(node_id):
            with pytest.raises(ForbiddenError):
                impostor_call(new.field("control"), verb, args)
        assert nodes(new.field("admin")) == {node_id: address}
        assert c.get("kept") == value
