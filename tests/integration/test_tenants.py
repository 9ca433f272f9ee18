"""Tenants on a real cluster: two tenants and the operator share one pool, and no tenant reaches
another's objects by any verb, even with its exact keys."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kvstore import protocol
from kvstore.address import Address
from kvstore.client import Client, KVCache, Namespace
from kvstore.errors import ForbiddenError, KeyNotFoundError, KVStoreError, UnauthenticatedError
from kvstore.tenants import prefix_of
from tests.support import Cluster, admin_json, admin_text

SECRET = "operator-secret-token"
#: Heartbeats 5x as often: a tenant create is answered once every node confirmed it in one.
QUICK = ("--heartbeat-interval", "0.2")
L, H, D, BS = 2, 2, 8, 16


def ns() -> Namespace:
    return Namespace(
        model="tiny", dtype="float16", num_layers=L, num_kv_heads=H, head_dim=D, block_size=BS
    )


def make_kv(n: int, seed: int) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(seed)
    base = rng.standard_normal((L, 2, n, H, D)).astype(np.float16)
    return [(base[i, 0], base[i, 1]) for i in range(L)]


def admin(cluster: Cluster, method: str, path: str, body: object = None) -> dict:
    return admin_json(cluster.admin, method, path, body, SECRET)


def node_knows(address: str, token: str) -> bool:
    """Whether a node's data port takes ``token`` at hello (it has the master's directory)."""
    where = Address.parse(address)
    conn = protocol.FramedSocket.connect(where.host, where.port, timeout=10)
    try:
        return conn.call("hello", {"token": token}).get("authenticated") is True
    except UnauthenticatedError:
        return False
    finally:
        conn.close()


def wait_for_nodes(cluster: Cluster, *tokens: str) -> None:
    """Every node takes every token as soon as the tenant is created: the master answers a
    create only once each live node has confirmed the new directory (in its heartbeats)."""
    nodes = admin(cluster, "GET", "/api/v1/nodes")["nodes"]
    assert len(nodes) == len(cluster.nodes)
    for node in nodes:
        for token in tokens:
            assert node_knows(node["address"], token), node


@pytest.fixture
def pool(cluster_factory, tmp_path: Path) -> tuple[Cluster, str, str]:
    token_file = tmp_path / "token"
    token_file.write_text(SECRET + "\n")
    flags = ("--token-file", str(token_file))
    cluster = cluster_factory(
        num_nodes=2, dram="64MiB", master_args=(*flags, *QUICK), node_args=flags
    )
    created = [admin(cluster, "POST", "/api/v1/tenants", {"name": n}) for n in ("acme", "bolt")]
    assert [c["nodes_pending"] for c in created] == [[], []]
    a, b = (c["token"] for c in created)
    wait_for_nodes(cluster, a, b)
    return cluster, a, b


SIZES = {b"small": 7, b"page": 4096, b"big": 300_000}


def test_tenants_never_reach_each_other(pool) -> None:
    cluster, token_a, token_b = pool
    with (
        Client.connect(cluster.address, token=token_a) as a,
        Client.connect(cluster.address, token=token_b) as b,
        Client.connect(cluster.address, token=SECRET) as op,
    ):
        for key, size in SIZES.items():
            a.put(key, bytes([1]) * size)
        a.put(b"only-a", b"secret of a")
        # B cannot read, find, list or remove A's objects, even by their exact keys.
        for key in [*SIZES, b"only-a"]:
            with pytest.raises(KeyNotFoundError):
                b.get(key)
            assert not b.exists(key)
        assert b.list_keys() == []
        assert b.batch_remove([b"only-a"])[0] is not None
        assert a.get(b"only-a") == b"secret of a", "B's remove touched nothing of A's"
        # A key naming A's part of the key space from B is refused, never A's object.
        with pytest.raises(KVStoreError):
            b.get(prefix_of("acme") + b"only-a")
        # The same key from B is B's own object; A's is unchanged.
        for key, size in SIZES.items():
            b.put(key, bytes([2]) * size)
        for key, size in SIZES.items():
            assert a.get(key) == bytes([1]) * size
            assert b.get(key) == bytes([2]) * size
        assert sorted(a.list_keys()) == sorted([*SIZES, b"only-a"])
        assert sorted(b.list_keys()) == sorted(SIZES)
        assert b.stats()["num_objects"] == len(SIZES)
        # The operator sees both, under their stored keys.
        stored = set(op.list_keys())
        for key in SIZES:
            assert prefix_of("acme") + key in stored and prefix_of("bolt") + key in stored
        assert op.get(prefix_of("acme") + b"only-a") == b"secret of a"
        # Node verbs are not a tenant's.
        with pytest.raises(ForbiddenError):
            b._control.call("heartbeat", {"node_id": "x"})
        # Nor are blanks (puts started ahead, placed against no quota): the tenant's small put
        # that asks for them (its second of a size) is told so, its commit served all the same,
        # and its puts go the usual way since.
        for i in range(3):
            a.put(b"small/%d" % i, bytes([i]) * 100)
        assert a._puts.blanks is not None and not a._puts.blanks.enabled
        assert a._puts.num_into_blanks == 0
        assert [a.get(b"small/%d" % i) for i in range(3)] == [bytes([i]) * 100 for i in range(3)]
        assert op.stats()["num_blanks"] == 0
        with pytest.raises(ForbiddenError):
            a._control.call("put_blanks", {"size": 10, "count": 1})


def test_prefix_index_and_events_are_per_tenant(pool) -> None:
    cluster, token_a, token_b = pool
    tokens = np.arange(100, 100 + 4 * BS)
    with (
        Client.connect(cluster.address, token=token_a) as a,
        Client.connect(cluster.address, token=token_b) as b,
    ):
        kv_a, kv_b = KVCache(a, ns()), KVCache(b, ns())
        assert kv_a.store(tokens, make_kv(len(tokens), 1)) == 4 * BS
        assert kv_a.lookup(tokens) == 4 * BS
        assert kv_b.lookup(tokens) == 0, "B never matches A's blocks"
        snap_b = b.events_snapshot()
        assert snap_b["num_blocks"] == 0 and not snap_b["namespaces"]
        got_b = b.poll_events(0, None, max_events=1000, wait_s=0)
        assert got_b["events"] == []
        snap_a = a.events_snapshot()
        assert snap_a["num_blocks"] == 4 and list(snap_a["namespaces"]) == [ns().digest]
        got_a = a.poll_events(0, None, max_events=1000, wait_s=0)
        assert got_a["events"] and all(e["namespace"] == ns().digest for e in got_a["events"])
        # B stores the same prompt: its own blocks, its own hit, A's unchanged.
        assert kv_b.store(tokens, make_kv(len(tokens), 2)) == 4 * BS
        out = [
            (np.zeros((len(tokens), H, D), np.float16), np.zeros((len(tokens), H, D), np.float16))
            for _ in range(L)
        ]
        assert kv_a.load(tokens, out) == 4 * BS
        assert np.array_equal(out[0][0], make_kv(len(tokens), 1)[0][0])
        kv_a.close()
        kv_b.close()


def test_delete_removes_objects_and_closes_connections(pool) -> None:
    cluster, token_a, token_b = pool
    with (
        Client.connect(cluster.address, token=token_a) as a,
        Client.connect(cluster.address, token=token_b) as b,
        Client.connect(cluster.address, token=SECRET) as op,
    ):
        for i in range(5):
            a.put(f"k{i}", b"x" * (100 * (i + 1)))
        b.put("k0", b"b's")
        done = admin(cluster, "DELETE", "/api/v1/tenants/acme")
        assert done == {"deleted": "acme", "objects_removed": 5, "nodes_pending": []}
        for node in admin(cluster, "GET", "/api/v1/nodes")["nodes"]:  # revoked on every node
            assert not node_knows(node["address"], token_a)
        with pytest.raises(UnauthenticatedError):
            a.exists("k0")
        assert b.get("k0") == b"b's"
        assert not [k for k in op.list_keys() if k.startswith(prefix_of("acme"))]
    with pytest.raises(KVStoreError):
        Client.connect(cluster.address, token=token_a).exists("k0")


def tenant_used(cluster: Cluster, tenant: str, tier: str) -> int:
    """The master's ``kvstore_tenant_used_bytes`` for one tenant and tier, from ``/metrics``."""
    text = admin_text(cluster.admin + "/metrics", SECRET)
    want = f'kvstore_tenant_used_bytes{{tenant="{tenant}",tier="{tier}"}}'
    for line in text.splitlines():
        if line.startswith(want):
            return int(float(line.rsplit(" ", 1)[1]))
    return 0


def test_a_tenant_over_its_quota_evicts_its_own_never_anothers(cluster_factory, tmp_path) -> None:
    """A writes five times its DRAM quota while B holds a working set within its own: B loses
    nothing, and A's usage never passes its quota by more than the batch in flight."""
    token_file = tmp_path / "token"
    token_file.write_text(SECRET + "\n")
    flags = ("--token-file", str(token_file))
    cluster = cluster_factory(
        num_nodes=2, dram="48MiB", master_args=(*flags, *QUICK), node_args=flags
    )
    size, batch = 256 << 10, 8
    quota_a = 4 << 20
    a_token = admin(
        cluster, "POST", "/api/v1/tenants", {"name": "acme", "quotas": {"dram": quota_a}}
    )
    b_token = admin(
        cluster, "POST", "/api/v1/tenants", {"name": "bolt", "quotas": {"dram": 32 << 20}}
    )
    wait_for_nodes(cluster, a_token["token"], b_token["token"])
    rng = np.random.default_rng(7)
    with (
        Client.connect(cluster.address, token=a_token["token"]) as a,
        Client.connect(cluster.address, token=b_token["token"]) as b,
    ):
        working = {f"b{i}": rng.bytes(size - 64 * i) for i in range(48)}  # mixed sizes, 11.7 MiB
        for i in range(0, len(working), batch):
            keys = list(working)[i : i + batch]
            assert b.batch_put(keys, [working[k] for k in keys]) == [None] * len(keys)
        written = 0
        last: dict[str, bytes] = {}
        while written < 5 * quota_a:
            last = {f"a{written + j * size}": rng.bytes(size) for j in range(batch)}
            results = a.batch_put(list(last), list(last.values()))
            assert results == [None] * batch, results
            written += batch * size
            assert tenant_used(cluster, "acme", "dram") <= quota_a + batch * size
        assert tenant_used(cluster, "acme", "dram") <= quota_a + batch * size
        for key, value in working.items():  # B lost nothing to A's churn
            assert b.get(key) == value
        for key, value in last.items():  # A's newest batch is there; its oldest made room
            assert a.get(key) == value
        assert len(a.list_keys()) < written // size


def test_a_tenant_is_never_handed_a_whole_arena_transport(cluster_factory, tmp_path) -> None:
    """Mapping a node's shared-memory arena (or an RDMA queue pair) opens every object on it;
    a tenant's client is told of TCP only and serves itself over it, the operator keeps shm."""
    token_file = tmp_path / "token"
    token_file.write_text(SECRET + "\n")
    flags = ("--token-file", str(token_file))
    cluster = cluster_factory(
        num_nodes=2, dram="32MiB", master_args=(*flags, *QUICK), node_args=(*flags, "--shm")
    )
    token = admin(cluster, "POST", "/api/v1/tenants", {"name": "acme"})["token"]
    wait_for_nodes(cluster, token)
    with (
        Client.connect(cluster.address, token=token, shm=True) as a,
        Client.connect(cluster.address, token=SECRET, shm=True) as op,
    ):
        offered_op = op._control.call("node_transports", {})
        assert len(offered_op) == 2 and all("shm" in t for t in offered_op.values())
        offered_a = a._control.call("node_transports", {})
        assert set(offered_a) == set(offered_op)
        assert all("shm" not in t and "rdma" not in t for t in offered_a.values())
        values = {f"k{i}": bytes([i]) * (4096 * (i + 1)) for i in range(6)}
        assert a.batch_put(list(values), list(values.values())) == [None] * len(values)
        assert [a.get(k) for k in values] == list(values.values())


def test_the_mooncake_api_as_two_tenants(pool, monkeypatch) -> None:
    """A program written for Mooncake's store API takes its tenant from ``KVSTORE_TOKEN``:
    the same key under two tenants is two objects, and neither sees the other's."""
    from kvstore.client.compat.mooncake import MooncakeDistributedStore

    cluster, token_a, token_b = pool
    stores = []
    for token in (token_a, token_b):
        monkeypatch.setenv("KVSTORE_TOKEN", token)
        s = MooncakeDistributedStore()
        assert s.setup("127.0.0.1", "", 0, 16 << 20, "tcp", "", cluster.address) == 0
        stores.append(s)
    a, b = stores
    try:
        assert a.put("prompt/0", b"A" * 5000) == 0
        assert a.put("only-a", b"a's") == 0
        assert b.is_exist("only-a") == 0 and b.get("only-a") == b""
        assert b.put("prompt/0", b"B" * 300) == 0
        assert a.get("prompt/0") == b"A" * 5000 and b.get("prompt/0") == b"B" * 300
        assert a.is_exist("only-a") == 1
    finally:
        for s in stores:
            s.close()
