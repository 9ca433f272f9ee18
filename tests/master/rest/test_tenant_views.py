"""What a tenant's token sees on the admin REST API, on a real master and storage node with two
tenants (acme, bolt) and the operator: its own metrics series, its own prompt trees' events and
the shared namespaces', the nodes; every write and every route not opened refused (403) and
changing nothing; the operator still sees everything."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvstore.client import Client, KVCache, Namespace
from kvstore.master.admin import init_app
from kvstore.master.prefix import scoped_digest
from kvstore.master.rest.routes import TENANT_NODE_FIELDS
from kvstore.master.rest.security import TENANT_ROUTES
from kvstore.master.rest.state import TENANT_VIEWS_KEY, AdminConfig
from kvstore.master.service import MasterService, ServiceSlot
from tests.support import Cluster, create_tenant, start_master

SECRET = "operator-secret-for-tenant-views"
QUICK = ("--heartbeat-interval", "0.2")
L, H, D, BS = 2, 2, 8, 16


def ns(model: str) -> Namespace:
    return Namespace(
        model=model, dtype="float16", num_layers=L, num_kv_heads=H, head_dim=D, block_size=BS
    )


def kv(n: int, seed: int) -> list[tuple[np.ndarray, np.ndarray]]:
    base = np.random.default_rng(seed).standard_normal((L, 2, n, H, D)).astype(np.float16)
    return [(base[i, 0], base[i, 1]) for i in range(L)]


def call(
    c: Cluster, method: str, path: str, token: str | None, body: object = None
) -> tuple[int, Any]:
    """(status, answer: JSON or text) of one admin call."""
    headers = {"Content-Type": "application/json"}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(c.admin + path, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            status, raw, ctype = resp.status, resp.read(), resp.headers.get("Content-Type", "")
    except urllib.error.HTTPError as err:
        status, raw, ctype = err.code, err.read(), err.headers.get("Content-Type", "")
    return status, json.loads(raw) if "json" in ctype else raw.decode()


class Pool:
    def __init__(self, cluster: Cluster, acme: str, bolt: str) -> None:
        self.cluster, self.acme, self.bolt = cluster, acme, bolt


@pytest.fixture(scope="module")
def pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pool]:
    tmp: Path = tmp_path_factory.mktemp("tenant_views")
    token_file = tmp / "token"
    token_file.write_text(SECRET + "\n")
    flags = ("--token-file", str(token_file))
    c = Cluster(tmp, start_master(*flags, *QUICK), node_args=flags)
    try:
        c.add_node("64MiB")
        acme = create_tenant(c.admin, SECRET, "acme", dram=1 << 20)
        bolt = create_tenant(c.admin, SECRET, "bolt")
        yield Pool(c, acme, bolt)
    finally:
        c.stop()


def store(p: Pool, token: str, model: str, first: int, num_blocks: int, seed: int) -> None:
    tokens = np.arange(first, first + num_blocks * BS)
    with Client.connect(p.cluster.address, token=token) as client:
        cache = KVCache(client, ns(model))
        assert cache.store(tokens, kv(len(tokens), seed)) == num_blocks * BS
        client.put(f"plain-{model}".encode(), b"x" * 100)


def sse(p: Pool, token: str, query: str) -> list[tuple[str, dict[str, Any]]]:
    """Every event of a bounded stream (``duration_s`` in ``query`` ends it)."""
    status, text = call(p.cluster, "GET", f"/api/v1/events?{query}", token)
    assert status == 200, text
    out = []
    for chunk in text.split("\n\n"):
        lines = [ln for ln in chunk.split("\n") if ln and not ln.startswith((":", "retry:"))]
        kind = next((ln[7:] for ln in lines if ln.startswith("event: ")), None)
        if kind is not None:
            data = "".join(ln[6:] for ln in lines if ln.startswith("data: "))
            out.append((kind, json.loads(data)))
    return out


def test_views_and_policy_agree() -> None:
    """Every route security.TENANT_ROUTES opens has its tenant view, and no view is left over."""
    app = init_app(ServiceSlot(MasterService()), settings=AdminConfig(token=None))
    assert set(app[TENANT_VIEWS_KEY]) == TENANT_ROUTES
    routes = {(r.method, r.resource.canonical) for r in app.router.routes() if r.resource}
    assert routes >= TENANT_ROUTES


def test_metrics_show_a_tenant_only_its_own_series(pool: Pool) -> None:
    store(pool, pool.acme, "acme-model", 0, 2, 1)
    store(pool, pool.bolt, "bolt-model", 0, 2, 2)
    status, mine = call(pool.cluster, "GET", "/metrics", pool.acme)
    assert status == 200
    samples = [ln for ln in mine.splitlines() if ln and not ln.startswith("#")]
    assert samples, mine
    names = {ln.split("{")[0].split(" ")[0] for ln in samples}
    assert 'tenant="bolt"' not in mine and "bolt" not in mine
    assert all('tenant="acme"' in ln for ln in samples if ln.startswith("kvstore_tenant_"))
    assert 'kvstore_tenant_objects{tenant="acme"}' in mine
    assert {"kvstore_nodes_alive", "kvstore_tier_capacity_bytes"} <= names
    assert not names & {"kvstore_requests_total", "kvstore_objects", "kvstore_prefix_index_blocks"}
    # B likewise; the operator sees both, and every family.
    bolt = call(pool.cluster, "GET", "/metrics", pool.bolt)[1]
    assert 'tenant="acme"' not in bolt and 'kvstore_tenant_objects{tenant="bolt"}' in bolt
    full = call(pool.cluster, "GET", "/metrics", SECRET)[1]
    assert 'tenant="acme"' in full and 'tenant="bolt"' in full and "kvstore_requests_total" in full


def test_events_show_a_tenant_only_its_own_trees_and_shared_ones(pool: Pool) -> None:
    acme_ns, bolt_ns, common = ns("acme-ev"), ns("bolt-ev"), ns("common-ev")
    store(pool, pool.acme, "acme-ev", 1000, 2, 3)
    store(pool, pool.bolt, "bolt-ev", 1000, 2, 4)
    status, _ = call(
        pool.cluster, "PUT", f"/api/v1/shared-namespaces/{common.digest.hex()}", SECRET
    )
    assert status == 200
    # The operator's snapshot: every tree (a tenant's under a digest of its own).
    start = call(pool.cluster, "GET", "/api/v1/events/snapshot", SECRET)[1]
    bolt_tree = scoped_digest("bolt", bolt_ns.digest).hex()
    bolt_blocks = set(start["namespaces"][bolt_tree])
    assert len(bolt_blocks) == 2
    mine = call(pool.cluster, "GET", "/api/v1/events/snapshot", pool.acme)[1]
    assert len(mine["namespaces"][acme_ns.digest.hex()]) == 2, "under the digest A knows"
    text = json.dumps(mine)
    assert bolt_ns.digest.hex() not in text and bolt_tree not in text
    assert not any(b in text for b in bolt_blocks)

    # New events after the snapshot: A's own, B's private ones, and B's in the shared namespace.
    store(pool, pool.acme, "acme-ev", 5000, 1, 5)
    store(pool, pool.bolt, "bolt-ev", 5000, 3, 6)
    store(pool, pool.bolt, "common-ev", 7000, 2, 7)
    query = f"since={start['seq']}&epoch={start['epoch']}&duration_s=1"
    everything = sse(pool, SECRET, query)
    seen = sse(pool, pool.acme, query)
    assert [k for k, _ in seen] == ["stored", "stored"]
    assert {ev["namespace"] for _, ev in seen} == {acme_ns.digest.hex(), common.digest.hex()}
    assert len(everything) == 3, "the operator sees B's private event too"
    bolt_new = {b for _, ev in everything for b in ev["blocks"]} - {
        b for _, ev in seen for b in ev["blocks"]
    }
    assert len(bolt_new) == 3
    text = json.dumps(seen)
    assert bolt_ns.digest.hex() not in text and not any(b in text for b in bolt_new | bolt_blocks)
    # A namespace it names is its own digest; B's namespace named by A is A's (empty) tree.
    only = sse(pool, pool.acme, f"namespace={bolt_ns.digest.hex()}&duration_s=0.5")
    assert [k for k, _ in only] == ["snapshot"] and only[0][1]["namespaces"] == {}


def test_nodes_cluster_and_history_for_a_tenant(pool: Pool) -> None:
    status, nodes = call(pool.cluster, "GET", "/api/v1/nodes", pool.acme)
    assert status == 200
    full = call(pool.cluster, "GET", "/api/v1/nodes", SECRET)[1]
    assert [n["node_id"] for n in nodes["nodes"]] == [n["node_id"] for n in full["nodes"]]
    assert all(tuple(n) == TENANT_NODE_FIELDS for n in nodes["nodes"])
    one_id = nodes["nodes"][0]["node_id"]
    status, one = call(pool.cluster, "GET", f"/api/v1/nodes/{one_id}", pool.acme)
    assert status == 200 and one["node_id"] == one_id
    assert call(pool.cluster, "GET", "/api/v1/nodes/nope", pool.acme)[0] == 404
    status, mine = call(pool.cluster, "GET", "/api/v1/cluster", pool.acme)
    assert status == 200 and mine["tenant"] == "acme" and mine["quotas"] == {"dram": 1 << 20}
    assert mine["num_nodes"] == 1 and "bolt" not in json.dumps(mine)
    status, hist = call(pool.cluster, "GET", "/api/v1/history", pool.acme)
    assert status == 200 and "bolt" not in json.dumps(hist)
    assert all("num_requests" not in s for s in hist["samples"])
    # The status page's HTML is open to all; the openapi document is the same for a tenant.
    assert call(pool.cluster, "GET", "/", pool.acme)[0] == 200
    assert call(pool.cluster, "GET", "/api/v1/openapi.json", pool.acme)[0] == 200


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        ("POST", "/api/v1/tenants", {"name": "evil"}),
        ("GET", "/api/v1/tenants", None),
        ("GET", "/api/v1/tenants/bolt", None),
        ("PATCH", "/api/v1/tenants/acme", {"quotas": {"dram": None}}),
        ("DELETE", "/api/v1/tenants/bolt", None),
        ("GET", "/api/v1/shared-namespaces", None),
        ("PUT", f"/api/v1/shared-namespaces/{'ab' * 16}", None),
        ("POST", "/api/v1/nodes/node0/drain", None),
        ("GET", "/api/v1/objects", None),
        ("GET", "/api/v1/objects/plain-bolt-model", None),
        ("DELETE", "/api/v1/objects/plain-bolt-model", None),
        ("POST", "/api/v1/evict", {"prefix": "\u0000"}),
        ("POST", "/api/v1/prefix/match", {"keys": ["plain-bolt-model"]}),
    ],
)
def test_a_tenants_writes_and_unopened_routes_are_refused(
    pool: Pool, method: str, path: str, body: object
) -> None:
    with Client.connect(pool.cluster.address, token=pool.bolt) as bolt:
        bolt.put(b"plain-bolt-model", b"b" * 100)
    before = [
        call(pool.cluster, "GET", p, SECRET)[1]
        for p in ("/api/v1/tenants", "/api/v1/shared-namespaces", "/api/v1/nodes")
    ]
    num_objects = call(pool.cluster, "GET", "/api/v1/cluster", SECRET)[1]["num_objects"]
    status, answer = call(pool.cluster, method, path, pool.acme, body)
    assert status == 403 and answer["error"]["name"] == "FORBIDDEN", answer
    after = [
        call(pool.cluster, "GET", p, SECRET)[1]
        for p in ("/api/v1/tenants", "/api/v1/shared-namespaces", "/api/v1/nodes")
    ]
    for b, a in zip(before, after, strict=True):
        for n in a.get("nodes", []):  # (heartbeat ages move on)
            n.pop("last_heartbeat_s_ago")
        for n in b.get("nodes", []):
            n.pop("last_heartbeat_s_ago")
    assert before == after
    assert call(pool.cluster, "GET", "/api/v1/cluster", SECRET)[1]["num_objects"] == num_objects


def test_without_a_token_nothing_is_read_once_tenants_exist(pool: Pool) -> None:
    """Public reads (on by default) would show every tenant's figures and keys to anyone: with
    tenants, a call without a token is refused everywhere but the health routes."""
    for path in ("/metrics", "/api/v1/nodes", "/api/v1/objects", "/api/v1/cluster"):
        status, answer = call(pool.cluster, "GET", path, None)
        assert status == 401 and "tenants" in str(answer), (path, answer)
    assert call(pool.cluster, "GET", "/health", None)[0] == 200
    assert call(pool.cluster, "GET", "/metrics", SECRET)[0] == 200
