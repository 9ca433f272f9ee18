"""The admin API's routes: readiness, metrics, nodes, objects, prefix match, evict, history,
tenants; and the tenant views of metrics, cluster, history and nodes (``security.py``: a
tenant's token is answered by these, never by the operator's handlers).

Handlers read the service on the event loop (it is single-threaded) and push anything that
grows with the number of objects (sorting, filtering) to a thread with ``asyncio.to_thread``.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import json
import re
from typing import Any

from aiohttp import web

from kvstore.errors import (
    ErrorCode,
    InvalidRequestError,
    KeyNotFoundError,
    KVStoreError,
    NodeUnavailableError,
)
from kvstore.keys import Namespace, as_token_array
from kvstore.limits import MAX_KEY_BYTES, encode_key
from kvstore.master.metrics import CONTENT_TYPE
from kvstore.master.rest.history import History, history_ctx
from kvstore.master.rest.state import (
    HISTORY_KEY,
    METRICS_KEY,
    SERVICE_KEY,
    SETTINGS_KEY,
    TENANTS_KEY,
    open_to_tenants,
)
from kvstore.master.service import MasterService
from kvstore.master.table import ObjectMeta
from kvstore.tenants import prefix_of

DEFAULT_PAGE = 100
MAX_PAGE = 1000
MAX_JSON_KEYS = 10000


# ------------------------------------------------------------------ helpers
def key_text(key: bytes) -> str:
    """A key for JSON: its UTF-8 text (undecodable bytes as ``\\xNN``)."""
    return key.decode("utf-8", "backslashreplace")


def _int_param(request: web.Request, name: str, default: int, lo: int, hi: int) -> int:
    raw = request.query.get(name)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise InvalidRequestError(f"{name} must be an integer") from None
    if not lo <= value <= hi:
        raise InvalidRequestError(f"{name} must be in {lo}..{hi}")
    return value


async def json_body(request: web.Request, allowed: frozenset[str]) -> dict[str, Any]:
    """The request's JSON object body.

    Args:
        request: the request.
        allowed: the fields the route knows; any other is refused.

    Raises:
        InvalidRequestError: not JSON, not an object, or an unknown field.
    """
    try:
        body = await request.json(loads=json.loads)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise InvalidRequestError("the body is not valid JSON") from None
    except RecursionError:  # arrays or objects nested deeper than the decoder's stack
        raise InvalidRequestError("the body's JSON is nested too deeply") from None
    if not isinstance(body, dict):
        raise InvalidRequestError("the body must be a JSON object")
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise InvalidRequestError(
            f"unknown field(s): {', '.join(repr(u[:64]) for u in unknown[:5])}"
        )
    return body


def _key_list(body: dict[str, Any], name: str = "keys") -> list[bytes]:
    keys = body.get(name)
    if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
        raise InvalidRequestError(f"{name!r} must be a list of strings")
    if len(keys) > MAX_JSON_KEYS:
        raise InvalidRequestError(f"at most {MAX_JSON_KEYS} keys per call")
    return [encode_key(k) for k in keys]


def encode_cursor(key: bytes) -> str:
    return base64.urlsafe_b64encode(key).decode().rstrip("=")


CURSOR_PATTERN = r"^(?:[A-Za-z0-9_-]{4})*(?:[A-Za-z0-9_-]{2,3})?$"
_CURSOR_RE = re.compile(CURSOR_PATTERN)
MAX_CURSOR_CHARS = 4 * ((MAX_KEY_BYTES + 2) // 3)


def decode_cursor(text: str) -> bytes:
    """The key a cursor points after (unpadded base64url of it).

    Raises:
        InvalidRequestError: not unpadded base64url of 1..511 bytes.
    """
    if not text or len(text) > MAX_CURSOR_CHARS or not _CURSOR_RE.match(text):
        raise InvalidRequestError("bad cursor")
    try:
        raw = base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
    except (binascii.Error, ValueError):
        raise InvalidRequestError("bad cursor") from None
    if not raw or len(raw) > MAX_KEY_BYTES:
        raise InvalidRequestError("bad cursor")
    return raw


def _node_json(svc: MasterService, node_id: str) -> dict[str, Any]:
    node = svc.nodes[node_id]
    segments = [
        {
            "name": s.name,
            "tier": s.tier,
            "capacity_bytes": s.allocator.capacity,
            "used_bytes": s.allocator.used_bytes,
        }
        for s in node.segments.values()
    ]
    return {
        "node_id": node.node_id,
        "address": f"{node.host}:{node.port}",
        "state": node.state,
        # Where it stands (kvstore node --host-id --rack --zone; "" rack or zone: the default)
        **node.site.to_json(),
        "last_heartbeat_s_ago": round(max(0.0, svc.clock() - node.last_seen), 3),
        "capacity_bytes": sum(s["capacity_bytes"] for s in segments),
        "used_bytes": sum(s["used_bytes"] for s in segments),
        "segments": segments,
    }


def _object_json(svc: MasterService, obj: ObjectMeta) -> dict[str, Any]:
    replicas = []
    for r in obj.replicas:
        node = svc.nodes.get(r.node_id)
        seg = node.segments.get(r.segment) if node is not None else None
        replicas.append(
            {
                "node_id": r.node_id,
                "segment": r.segment,
                "tier": seg.tier if seg is not None else None,
                "state": "complete",
            }
        )
    return {
        "key": key_text(obj.key),
        "key_hex": obj.key.hex(),
        "size": obj.size,
        "checksum": f"{obj.checksum:016x}",
        "replicas": replicas,
    }


# ------------------------------------------------------------------ probes and metrics
async def ready(request: web.Request) -> web.Response:
    """200 once a storage node is registered, else 503 (NODE_UNAVAILABLE)."""
    svc = request.app[SERVICE_KEY].service
    if not svc.nodes:
        raise NodeUnavailableError("no storage node is registered yet")
    return web.json_response({"status": "ready", "num_nodes": len(svc.nodes)})


async def metrics(request: web.Request) -> web.Response:
    """Prometheus text format."""
    # Collected on the loop: the collector reads the single-threaded service.
    body = request.app[METRICS_KEY].exposition()
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})


async def history(request: web.Request) -> web.Response:
    """Recent samples behind the status page."""
    return web.json_response(request.app[HISTORY_KEY].to_json())


# ------------------------------------------------------------------ nodes
async def nodes(request: web.Request) -> web.Response:
    """Every registered storage node, sorted by id."""
    svc = request.app[SERVICE_KEY].service
    return web.json_response({"nodes": [_node_json(svc, n) for n in sorted(svc.nodes)]})


async def node(request: web.Request) -> web.Response:
    """One node; 404 (NODE_NOT_FOUND) for an unknown id."""
    svc = request.app[SERVICE_KEY].service
    node_id = request.match_info["node_id"]
    if node_id not in svc.nodes:
        raise KVStoreError(f"no node {node_id[:128]!r}", code=ErrorCode.NODE_NOT_FOUND)
    return web.json_response(_node_json(svc, node_id))


# ------------------------------------------------------------------ objects
def _page(keys: list[bytes], prefix: bytes, after: bytes | None, limit: int) -> list[bytes]:
    """Sorted keys with ``prefix`` strictly after ``after``; at most ``limit + 1`` (a thread)."""
    chosen = sorted(k for k in keys if k.startswith(prefix) and (after is None or k > after))
    return chosen[: limit + 1]


async def list_objects(request: web.Request) -> web.Response:
    """Objects sorted by key, ``limit`` at a time; ``next_cursor`` continues after the page."""
    svc = request.app[SERVICE_KEY].service
    limit = _int_param(request, "limit", DEFAULT_PAGE, 1, MAX_PAGE)
    prefix_text = request.query.get("prefix", "")
    prefix = prefix_text.encode("utf-8", "surrogatepass")
    if len(prefix) > MAX_KEY_BYTES:
        raise InvalidRequestError(f"prefix is longer than {MAX_KEY_BYTES} bytes")
    cursor = request.query.get("cursor")
    after = decode_cursor(cursor) if cursor is not None else None
    snapshot = list(svc.objects)  # C-speed copy on the loop; the sort runs in a thread
    page = await asyncio.to_thread(_page, snapshot, prefix, after, limit)
    more = len(page) > limit
    page = page[:limit]
    items = [_object_json(svc, svc.objects[k]) for k in page if k in svc.objects]
    return web.json_response(
        {"objects": items, "next_cursor": encode_cursor(page[-1]) if more and page else None}
    )


def _path_key(request: web.Request) -> bytes:
    return encode_key(request.match_info["key"])


async def get_object(request: web.Request) -> web.Response:
    """One object's size, checksum and replicas."""
    svc = request.app[SERVICE_KEY].service
    key = _path_key(request)
    obj = svc.objects.get(key)
    if obj is None:
        raise KeyNotFoundError(f"key {key_text(key[:64])!r} not found")
    return web.json_response(_object_json(svc, obj))


async def delete_object(request: web.Request) -> web.Response:
    """Remove one object (the token is checked by the middleware)."""
    svc = request.app[SERVICE_KEY].service
    err = svc.remove([_path_key(request)])[0]
    if err is not None:
        raise err
    return web.json_response({"deleted": 1})


# ------------------------------------------------------------------ prefix match, evict
MAX_JSON_TOKENS = 1 << 20


async def prefix_match(request: web.Request) -> web.Response:
    """What of a prompt is cached.

    Two forms: ``{"namespace": {...}, "tokens": [ids]}`` asks the master's prefix index (block
    keys computed by the master; answers token-granular and feeds the hit ratio), and
    ``{"keys": [...]}`` counts how many leading keys of a chain of object keys are stored.
    """
    svc = request.app[SERVICE_KEY].service
    body = await json_body(request, frozenset({"keys", "namespace", "tokens"}))
    if "keys" in body:
        if "namespace" in body or "tokens" in body:
            raise InvalidRequestError("give 'keys', or 'namespace' and 'tokens'")
        keys = _key_list(body)
        num_matched = 0
        for k in keys:
            if k not in svc.objects:
                break
            num_matched += 1
        request.app[METRICS_KEY].record_prefix_match(num_matched, len(keys))
        return web.json_response({"num_matched": num_matched, "num_queried": len(keys)})
    if "namespace" not in body or "tokens" not in body:
        raise InvalidRequestError("give 'keys', or 'namespace' and 'tokens'")
    raw_ns = body["namespace"]
    if isinstance(raw_ns, dict):
        for value in raw_ns.values():
            if isinstance(value, str):
                try:
                    value.encode("utf-8")
                except UnicodeEncodeError:
                    raise InvalidRequestError("namespace strings must be valid UTF-8") from None
    namespace = Namespace.from_dict(raw_ns)
    raw_tokens = body["tokens"]
    if not isinstance(raw_tokens, list) or len(raw_tokens) > MAX_JSON_TOKENS:
        raise InvalidRequestError(f"'tokens' must be a list of at most {MAX_JSON_TOKENS} ids")
    tokens = as_token_array(raw_tokens)
    match = svc.prefix.match(namespace, tokens, svc.objects.__contains__)
    return web.json_response(
        {
            "num_tokens": match.num_tokens,
            "num_queried_tokens": len(tokens),
            "block_size": match.block_size,
            "blocks": [{"key_hex": k.hex(), "num_tokens": n} for k, n in match.blocks],
        }
    )


async def evict(request: web.Request) -> web.Response:
    """Remove objects by key list or by prefix (``limit`` caps a prefix eviction)."""
    svc = request.app[SERVICE_KEY].service
    body = await json_body(request, frozenset({"keys", "prefix", "limit"}))
    if "limit" in body and "prefix" not in body:
        raise InvalidRequestError("'limit' goes with 'prefix'")
    if ("keys" in body) == ("prefix" in body):
        raise InvalidRequestError("give exactly one of 'keys' or 'prefix'")
    if "keys" in body:
        keys = _key_list(body)
    else:
        prefix = body["prefix"]
        if not isinstance(prefix, str) or not prefix:
            raise InvalidRequestError("'prefix' must be a non-empty string")
        limit = body.get("limit", MAX_JSON_KEYS)
        if not isinstance(limit, int) or isinstance(limit, bool) or not 1 <= limit <= MAX_JSON_KEYS:
            raise InvalidRequestError(f"'limit' must be an integer in 1..{MAX_JSON_KEYS}")
        raw = prefix.encode("utf-8", "surrogatepass")
        snapshot = list(svc.objects)
        keys = await asyncio.to_thread(_page, snapshot, raw, None, limit - 1)
    results = svc.remove([k for k in keys if k in svc.objects])
    num_evicted = sum(r is None for r in results)
    return web.json_response({"num_evicted": num_evicted, "num_missing": len(keys) - num_evicted})


# ------------------------------------------------------------------ tenants (operator only)
async def create_tenant(request: web.Request) -> web.Response:
    """A new tenant: the answer carries its token, the only time it is ever shown."""
    body = await json_body(request, frozenset({"name", "quotas"}))
    if "name" not in body:
        raise InvalidRequestError("give the tenant's 'name'")
    tenant, token = await request.app[TENANTS_KEY].create(body["name"], body.get("quotas"))
    pending = await _nodes_take_tenants(request)
    return web.json_response(
        {"name": tenant.name, "quotas": tenant.quotas, "token": token, "nodes_pending": pending},
        status=201,
    )


async def _nodes_take_tenants(request: web.Request) -> list[str]:
    """Wait (a few heartbeats at most) until every live node has confirmed the tenant directory,
    so that a created token opens every node, and a deleted one none, when the answer comes.
    Returns the nodes that had not confirmed by then (a node slow or gone)."""
    slot = request.app[SERVICE_KEY]
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 3 * slot.service.config.heartbeat_interval_s + 1.0
    while (behind := slot.service.tenants_behind()) and loop.time() < deadline:
        await asyncio.sleep(0.05)
    return behind


async def list_tenants(request: web.Request) -> web.Response:
    book = request.app[TENANTS_KEY]
    return web.json_response({"tenants": [t.to_json() for t in book.list()]})


async def show_tenant(request: web.Request) -> web.Response:
    return web.json_response(request.app[TENANTS_KEY].show(request.match_info["name"]).to_json())


async def set_tenant(request: web.Request) -> web.Response:
    """Change a tenant's quotas: a tier set to null loses its quota, one left out keeps it."""
    body = await json_body(request, frozenset({"quotas"}))
    if "quotas" not in body:
        raise InvalidRequestError("give 'quotas'")
    book = request.app[TENANTS_KEY]
    tenant = await book.set_quotas(request.match_info["name"], body["quotas"])
    return web.json_response(tenant.to_json())


async def delete_tenant(request: web.Request) -> web.Response:
    """Delete a tenant (its token stops working) and every object it stored."""
    name = request.match_info["name"]
    await request.app[TENANTS_KEY].delete(name)
    slot = request.app[SERVICE_KEY]
    own = prefix_of(name)
    keys = [k for k in slot.service.objects if k.startswith(own)]
    removed = 0
    step = slot.service.config.max_batch
    for lo in range(0, len(keys), step):
        if lo:
            await asyncio.sleep(0)  # other requests run between two batches
        svc = slot.service
        batch = [k for k in keys[lo : lo + step] if k in svc.objects]
        removed += sum(r is None for r in svc.remove(batch))
    pending = await _nodes_take_tenants(request)
    return web.json_response(
        {"deleted": name, "objects_removed": removed, "nodes_pending": pending}
    )


# ------------------------------------------------------------ shared namespaces (operator only)
async def share_namespace(request: web.Request) -> web.Response:
    """Mark a namespace shared: every tenant's blocks of it are stored once and hit by all.
    Answered once the live nodes took it, so every tenant may read its blocks there."""
    digest = await request.app[TENANTS_KEY].share(request.match_info["digest"])
    pending = await _nodes_take_tenants(request)
    return web.json_response({"digest": digest.hex(), "shared": True, "nodes_pending": pending})


async def unshare_namespace(request: web.Request) -> web.Response:
    """Make a namespace private to each tenant again (its blocks stored so far stay)."""
    digest = await request.app[TENANTS_KEY].unshare(request.match_info["digest"])
    pending = await _nodes_take_tenants(request)
    return web.json_response({"digest": digest.hex(), "shared": False, "nodes_pending": pending})


async def list_shared_namespaces(request: web.Request) -> web.Response:
    return web.json_response({"namespaces": [d.hex() for d in request.app[TENANTS_KEY].shared()]})


# ------------------------------------------------------------ shared prefixes (operator only)
async def share_prefix(request: web.Request) -> web.Response:
    """Share a leading token range of one namespace's prompts (a system prompt): its blocks
    are stored once and hit by every tenant; each block after it stays its writer's. Answered
    once the live nodes took it."""
    body = await json_body(request, frozenset({"namespace", "tokens"}))
    if "namespace" not in body or "tokens" not in body:
        raise InvalidRequestError("give the prefix's 'namespace' and 'tokens'")
    book = request.app[TENANTS_KEY]
    prefix = await book.share_prefix(request.match_info["name"], body["namespace"], body["tokens"])
    pending = await _nodes_take_tenants(request)
    return web.json_response({**prefix.to_json(), "shared": True, "nodes_pending": pending})


async def unshare_prefix(request: web.Request) -> web.Response:
    """Make a shared prefix's range private to each tenant again (its blocks stay)."""
    prefix = await request.app[TENANTS_KEY].unshare_prefix(request.match_info["name"])
    pending = await _nodes_take_tenants(request)
    return web.json_response({**prefix.to_json(), "shared": False, "nodes_pending": pending})


async def list_shared_prefixes(request: web.Request) -> web.Response:
    book = request.app[TENANTS_KEY]
    return web.json_response({"prefixes": [p.to_json() for p in book.prefixes()]})


# ------------------------------------------------------------------ a tenant's views
#: What a tenant sees of a node: cluster facts (which nodes serve it, their state, capacity and
#: fill, per segment), none of which names a key or a tenant. A field is shown to tenants only
#: once it is named here: one added to :func:`_node_json` later stays the operator's.
TENANT_NODE_FIELDS = (
    "node_id",
    "address",
    "state",
    "host_id",
    "rack",
    "zone",
    "last_heartbeat_s_ago",
    "capacity_bytes",
    "used_bytes",
    "segments",
)
TENANT_SEGMENT_FIELDS = ("name", "tier", "capacity_bytes", "used_bytes")
#: A tenant's own figures in its history samples (``TenantQuotas.describe``'s counts).
_TENANT_SAMPLED = ("num_hits", "num_misses", "num_objects")
TENANT_HISTORY_KEY = web.AppKey("tenant_history", History)


def tenant_node_json(svc: MasterService, node_id: str) -> dict[str, Any]:
    """:func:`_node_json` cut to :data:`TENANT_NODE_FIELDS` (and its segments likewise)."""
    full = _node_json(svc, node_id)
    out = {f: full[f] for f in TENANT_NODE_FIELDS}
    out["segments"] = [{f: s[f] for f in TENANT_SEGMENT_FIELDS} for s in full["segments"]]
    return out


def _cluster_capacity(svc: MasterService) -> tuple[int, int]:
    """(capacity, used) bytes over every node's segments."""
    capacity = used = 0
    for node in svc.nodes.values():
        for seg in node.segments.values():
            capacity += seg.allocator.capacity
            used += seg.allocator.used_bytes
    return capacity, used


def _tenant_figures(svc: MasterService, tenant: str) -> dict[str, Any]:
    fig = svc.quotas.describe(tenant)
    used = fig["used_bytes"]
    assert isinstance(used, dict), "describe's used_bytes is per tier"
    out = {name: fig[name] for name in _TENANT_SAMPLED}
    out["used_bytes"] = sum(used.values())
    return out


def tenant_sample(svc: MasterService) -> dict[str, Any]:
    """One sample of the tenants' history: the cluster's nodes and capacity, and per tenant its
    own figures (``O(tenants)``; a view picks its tenant's out)."""
    capacity, _ = _cluster_capacity(svc)
    return {
        "num_nodes": len(svc.nodes),
        "capacity_bytes": capacity,
        "tenants": {t: _tenant_figures(svc, t) for t in svc.quotas.tenants()},
    }


async def tenant_metrics(request: web.Request, tenant: str) -> web.Response:
    """``/metrics`` for a tenant: its own ``kvstore_tenant_*`` series and the cluster facts of
    ``metrics.TENANT_CLUSTER_FAMILIES``; never another tenant's series."""
    body = request.app[METRICS_KEY].exposition(tenant)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})


async def tenant_cluster(request: web.Request, tenant: str) -> web.Response:
    """``/api/v1/cluster`` for a tenant: how many nodes serve and their capacity (cluster facts),
    and its own objects, bytes (every replica) and quotas; nothing of the other tenants, nor the
    cluster's fill (its own ``used_bytes`` takes that place)."""
    svc = request.app[SERVICE_KEY].service
    capacity, _ = _cluster_capacity(svc)
    own = _tenant_figures(svc, tenant)
    return web.json_response(
        {
            "tenant": tenant,
            "num_nodes": len(svc.nodes),
            "capacity_bytes": capacity,
            "num_objects": own["num_objects"],
            "used_bytes": own["used_bytes"],
            "quotas": svc.quotas.describe(tenant)["quotas"],
        }
    )


async def tenant_history(request: web.Request, tenant: str) -> web.Response:
    """``/api/v1/history`` for a tenant: per sample, the nodes and capacity and its own hits,
    misses, objects and bytes (no request counts: those are every tenant's together)."""
    hist = request.app[TENANT_HISTORY_KEY]
    zero = dict.fromkeys((*_TENANT_SAMPLED, "used_bytes"), 0)
    samples = [
        {
            "t": s["t"],
            "num_nodes": s["num_nodes"],
            "capacity_bytes": s["capacity_bytes"],
            **s["tenants"].get(tenant, zero),
        }
        for s in hist.samples
    ]
    return web.json_response({"interval_s": hist.interval_s, "samples": samples})


async def tenant_nodes(request: web.Request, tenant: str) -> web.Response:
    """``/api/v1/nodes`` for a tenant: every node, with :data:`TENANT_NODE_FIELDS` only."""
    svc = request.app[SERVICE_KEY].service
    return web.json_response({"nodes": [tenant_node_json(svc, n) for n in sorted(svc.nodes)]})


async def tenant_node(request: web.Request, tenant: str) -> web.Response:
    """``/api/v1/nodes/{node_id}`` for a tenant, as :func:`tenant_nodes` shows it."""
    svc = request.app[SERVICE_KEY].service
    node_id = request.match_info["node_id"]
    if node_id not in svc.nodes:
        raise KVStoreError(f"no node {node_id[:128]!r}", code=ErrorCode.NODE_NOT_FOUND)
    return web.json_response(tenant_node_json(svc, node_id))


def add_routes(app: web.Application) -> None:
    """Register every route of this module on ``app``, and its tenant views."""
    app.router.add_get("/ready", ready)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/api/v1/history", history)
    app.router.add_get("/api/v1/nodes", nodes)
    app.router.add_get("/api/v1/nodes/{node_id}", node)
    app.router.add_get("/api/v1/objects", list_objects)
    app.router.add_get("/api/v1/objects/{key:.+}", get_object)
    app.router.add_delete("/api/v1/objects/{key:.+}", delete_object)
    app.router.add_post("/api/v1/prefix/match", prefix_match)
    app.router.add_post("/api/v1/evict", evict)
    app.router.add_post("/api/v1/tenants", create_tenant)
    app.router.add_get("/api/v1/tenants", list_tenants)
    app.router.add_get("/api/v1/tenants/{name}", show_tenant)
    app.router.add_patch("/api/v1/tenants/{name}", set_tenant)
    app.router.add_delete("/api/v1/tenants/{name}", delete_tenant)
    app.router.add_get("/api/v1/shared-namespaces", list_shared_namespaces)
    app.router.add_put("/api/v1/shared-namespaces/{digest}", share_namespace)
    app.router.add_delete("/api/v1/shared-namespaces/{digest}", unshare_namespace)
    open_to_tenants(app, "GET", "/metrics", tenant_metrics)
    open_to_tenants(app, "GET", "/api/v1/cluster", tenant_cluster)
    open_to_tenants(app, "GET", "/api/v1/history", tenant_history)
    open_to_tenants(app, "GET", "/api/v1/nodes", tenant_nodes)
    open_to_tenants(app, "GET", "/api/v1/nodes/{node_id}", tenant_node)
    settings = app[SETTINGS_KEY]
    slot = app[SERVICE_KEY]
    app[TENANT_HISTORY_KEY] = History(
        lambda: tenant_sample(slot.service),
        settings.history_interval_s,
        settings.history_window_s,
    )
    app.cleanup_ctx.append(history_ctx(TENANT_HISTORY_KEY))
    app.router.add_get("/api/v1/shared-prefixes", list_shared_prefixes)
    app.router.add_put("/api/v1/shared-prefixes/{name}", share_prefix)
    app.router.add_delete("/api/v1/shared-prefixes/{name}", unshare_prefix)
