"""Tenants are kept in etcd: a new leader after a failover knows them (and the shared
namespaces and prefixes), their tokens open it and its nodes, and their objects are still
theirs."""

from __future__ import annotations

from kvstore import protocol
from kvstore.address import Address
from kvstore.client import Client
from kvstore.errors import UnauthenticatedError
from kvstore.keys import Namespace
from tests.etcd_harness import etcd, ha_factory  # noqa: F401 - fixtures
from tests.support import Daemon, admin_json, wait_until

TOKEN = "s3cret-token-for-tenant-ha-0123456789"


def _admin(master: Daemon, method: str, path: str, body: object = None) -> dict:
    return admin_json(master.field("admin"), method, path, body, TOKEN)


def _hello(address: str, token: str) -> dict:
    where = Address.parse(address)
    conn = protocol.FramedSocket.connect(where.host, where.port, timeout=10)
    try:
        return conn.call("hello", {"token": token})
    except UnauthenticatedError:
        return {}
    finally:
        conn.close()


def _puts_work(url: str, token: str) -> bool:
    """Whether a put with ``token`` goes through (every node knows the tenant by then)."""
    try:
        with Client.connect(url, timeout=10, token=token) as c:
            c.put("probe", b"p")
        return True
    except UnauthenticatedError:
        return False


def test_tenants_survive_a_leader_failover(ha_factory, monkeypatch) -> None:  # noqa: F811
    monkeypatch.setenv("KVSTORE_TOKEN", TOKEN)  # every daemon started below inherits it
    cluster = ha_factory(num_masters=2, num_nodes=1)
    old = cluster.leader()
    made = _admin(old, "POST", "/api/v1/tenants", {"name": "acme", "quotas": {"dram": 1 << 24}})
    token = made["token"]
    shared = "ab" * 16  # a namespace digest, in hex
    _admin(old, "PUT", f"/api/v1/shared-namespaces/{shared}")
    namespace = Namespace(
        model="m", dtype="float16", num_layers=1, num_kv_heads=1, head_dim=4, block_size=4
    )
    body = {"namespace": namespace.to_dict(), "tokens": list(range(9))}
    _admin(old, "PUT", "/api/v1/shared-prefixes/system", body)
    wait_until(lambda: _puts_work(cluster.url, token), what="the node takes the tenant")
    with Client.connect(cluster.url, timeout=10, token=token) as c:
        c.put("mine", b"acme's bytes")
    old.kill()
    new = cluster.leader(timeout=30)
    assert new is not old
    assert _admin(new, "GET", "/api/v1/tenants/acme")["quotas"] == {"dram": 1 << 24}
    assert _admin(new, "GET", "/api/v1/shared-namespaces")["namespaces"] == [shared]
    [prefix] = _admin(new, "GET", "/api/v1/shared-prefixes")["prefixes"]
    assert (prefix["name"], prefix["num_blocks"]) == ("system", 2)
    assert prefix["namespace"] == namespace.digest.hex()
    assert _hello(new.field("control"), token).get("tenant") == "acme"

    def reads_back() -> bool:
        try:
            with Client.connect(cluster.url, timeout=10, token=token) as c:
                return c.get("mine") == b"acme's bytes"
        except Exception:  # noqa: BLE001 - until the node re-registered with the new leader
            return False

    wait_until(reads_back, timeout=30, what="acme reads its object from the new leader")
    # A delete on the new leader stops the token there.
    _admin(new, "DELETE", "/api/v1/tenants/acme")
    assert _hello(new.field("control"), token) == {}
