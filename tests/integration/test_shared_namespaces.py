"""Shared namespaces on a real cluster: a namespace the operator shares is stored once and hit
by every tenant (B loads A's bytes), one not shared stays each tenant's own, unsharing makes new
lookups private again, and only the operator may change which namespaces are shared."""

from __future__ import annotations

import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from kvstore.client import Client, KVCache, Namespace
from kvstore.errors import ForbiddenError
from kvstore.tenants import prefix_of
from tests.integration.test_tenants import (
    BS,
    QUICK,
    SECRET,
    D,
    H,
    L,
    admin,
    make_kv,
    ns,
    wait_for_nodes,
)
from tests.support import Cluster

SHARED_PATH = "/api/v1/shared-namespaces"


def private_ns() -> Namespace:
    return Namespace(
        model="private", dtype="float16", num_layers=L, num_kv_heads=H, head_dim=D, block_size=BS
    )


def status_of(cluster: Cluster, method: str, path: str, token: str | None = SECRET) -> int:
    """The HTTP status of an admin call (``token`` None: no Authorization header)."""
    headers = {} if token is None else {"Authorization": f"Bearer {token}"}
    req = urllib.request.Request(cluster.admin + path, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status
    except urllib.error.HTTPError as err:
        return err.code


def empty_kv(n: int) -> list[tuple[np.ndarray, np.ndarray]]:
    return [(np.zeros((n, H, D), np.float16), np.zeros((n, H, D), np.float16)) for _ in range(L)]


@pytest.fixture
def pool(cluster_factory, tmp_path: Path) -> tuple[Cluster, str, str]:
    token_file = tmp_path / "token"
    token_file.write_text(SECRET + "\n")
    flags = ("--token-file", str(token_file))
    cluster = cluster_factory(
        num_nodes=2, dram="64MiB", master_args=(*flags, *QUICK), node_args=flags
    )
    created = [admin(cluster, "POST", "/api/v1/tenants", {"name": n}) for n in ("acme", "bolt")]
    a, b = (c["token"] for c in created)
    wait_for_nodes(cluster, a, b)
    return cluster, a, b


def test_a_shared_namespace_is_hit_by_every_tenant(pool) -> None:
    cluster, token_a, token_b = pool
    digest = ns().digest.hex()
    assert admin(cluster, "PUT", f"{SHARED_PATH}/{digest}") == {
        "digest": digest,
        "shared": True,
        "nodes_pending": [],
    }
    assert admin(cluster, "GET", SHARED_PATH) == {"namespaces": [digest]}
    tokens = np.arange(100, 100 + 4 * BS)
    private_tokens = np.arange(500, 500 + 2 * BS)
    with (
        Client.connect(cluster.address, token=token_a) as a,
        Client.connect(cluster.address, token=token_b) as b,
        Client.connect(cluster.address, token=SECRET) as op,
    ):
        kv_a, kv_b = KVCache(a, ns()), KVCache(b, ns())
        mine_a, mine_b = KVCache(a, private_ns()), KVCache(b, private_ns())
        kv = make_kv(len(tokens), 1)
        assert kv_a.store(tokens, kv) == 4 * BS
        assert mine_a.store(private_tokens, make_kv(len(private_tokens), 3)) == 2 * BS
        # B hits A's blocks of the shared namespace and loads A's bytes, bit for bit.
        assert kv_b.lookup(tokens) == 4 * BS
        out = empty_kv(len(tokens))
        assert kv_b.load(tokens, out) == 4 * BS
        for (k, v), (k_out, v_out) in zip(kv, out, strict=True):
            assert k.tobytes() == k_out.tobytes() and v.tobytes() == v_out.tobytes()
        # ... but never A's blocks of a namespace not shared.
        assert mine_a.lookup(private_tokens) == 2 * BS
        assert mine_b.lookup(private_tokens) == 0
        # The shared blocks are stored once, as named (no tenant's); A's private ones are A's.
        stored = op.list_keys(prefix=b"kv/")
        assert sum(k.startswith(b"kv/" + digest.encode() + b"/") for k in stored) == 4
        acme_kv = [k for k in op.list_keys(prefix=prefix_of("acme") + b"kv/")]
        assert len(acme_kv) == 2 and all(private_ns().digest.hex().encode() in k for k in acme_kv)
        # B's events and snapshot show the shared namespace under its own digest.
        snap_b = b.events_snapshot()
        assert list(snap_b["namespaces"]) == [ns().digest] and snap_b["num_blocks"] == 4
        got_b = b.poll_events(0, None, max_events=1000, wait_s=0)
        assert got_b["events"] and {e["namespace"] for e in got_b["events"]} == {ns().digest}
        # Unsharing: new lookups by B are B's own again, so they miss.
        done = admin(cluster, "DELETE", f"{SHARED_PATH}/{digest}")
        assert done["shared"] is False and done["digest"] == digest
        assert admin(cluster, "GET", SHARED_PATH) == {"namespaces": []}
        assert kv_b.lookup(tokens) == 0
        for cache in (kv_a, kv_b, mine_a, mine_b):
            cache.close()


def test_bad_digests_change_nothing_and_only_the_operator_shares(pool) -> None:
    cluster, token_a, _ = pool
    digest = ns().digest.hex()
    for bad in ("abc", digest[:-1], digest + "0", "z" * 32, digest[:30] + "-x"):
        assert status_of(cluster, "PUT", f"{SHARED_PATH}/{bad}") == 400, bad
        assert status_of(cluster, "DELETE", f"{SHARED_PATH}/{bad}") == 400, bad
    assert admin(cluster, "GET", SHARED_PATH) == {"namespaces": []}
    assert status_of(cluster, "DELETE", f"{SHARED_PATH}/{digest}") == 404  # not shared
    for token in (token_a, None):  # a tenant's token, or none, opens nothing here
        assert status_of(cluster, "PUT", f"{SHARED_PATH}/{digest}", token) in (401, 403)
        assert status_of(cluster, "GET", SHARED_PATH, token) in (401, 403)
    assert admin(cluster, "GET", SHARED_PATH) == {"namespaces": []}


def test_a_node_serves_shared_blocks_but_refuses_anothers_private_ones(pool) -> None:
    """B's grant for a shared block passes the node's data-port rule; A's grant for its own
    private object, replayed by B's client on the node's data port, is still refused."""
    cluster, token_a, token_b = pool
    admin(cluster, "PUT", f"{SHARED_PATH}/{ns().digest.hex()}")
    tokens = np.arange(7, 7 + 2 * BS)
    with (
        Client.connect(cluster.address, token=token_a) as a,
        Client.connect(cluster.address, token=token_b) as b,
        Client.connect(cluster.address, token=SECRET) as op,
    ):
        kv_a = KVCache(a, ns())
        assert kv_a.store(tokens, make_kv(len(tokens), 5)) == 2 * BS
        kv_a.close()
        a.put(b"only-a", b"a's secret")
        [shared_key, _] = op.list_keys(prefix=b"kv/" + ns().digest.hex().encode() + b"/")
        want = op.get(shared_key)
        assert b.get(shared_key) == want  # B names the block as stored: the shared object
        info = b.locate(shared_key)  # B's own grant for the shared block, used on the node
        buffer = bytearray(len(want))
        assert b.read_located(info, buffer) == len(want) and bytes(buffer) == want
        b.release_lease(info)
        theirs = a.locate(b"only-a")  # A's grant for its private object, replayed by B
        with pytest.raises(ForbiddenError):
            b.read_located(theirs, bytearray(len(b"a's secret")))
        a.release_lease(theirs)
        assert a.get(b"only-a") == b"a's secret"
