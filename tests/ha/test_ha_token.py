"""The cluster token guards HA masters, etcd-following nodes and clients that find the leader
through etcd, exactly as it guards the embedded master."""

from __future__ import annotations

import pytest

from kvstore.client import Client
from kvstore.errors import UnauthenticatedError
from tests.etcd_harness import etcd, ha_factory  # noqa: F401 - fixtures

TOKEN = "s3cret-token-for-ha-test-0123456789"


def test_ha_cluster_with_a_token(ha_factory, monkeypatch) -> None:  # noqa: F811
    monkeypatch.setenv("KVSTORE_TOKEN", TOKEN)  # every daemon started below inherits it
    cluster = ha_factory(num_masters=2, num_nodes=1)
    with Client.connect(cluster.url, timeout=10, token=TOKEN) as c:
        c.put("k", b"v" * 100)
        assert c.get("k") == b"v" * 100
    with pytest.raises(UnauthenticatedError):
        Client.connect(cluster.url, timeout=10, token="wrong-token-0123456789")
    for d in [*cluster.masters, *cluster.nodes]:
        assert TOKEN not in "".join(d.lines), "the token leaked into a daemon's output"
