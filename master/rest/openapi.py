"""The admin API's OpenAPI 3.0 document, served at ``/api/v1/openapi.json``.

Hand-written next to the routes it describes; ``tests/master/test_admin_openapi.py`` checks the
live API against it with schemathesis.
"""

from __future__ import annotations

import copy
from typing import Any

from aiohttp import web

from kvstore.keys import DTYPE_BYTES, HASH_ALGORITHMS
from kvstore.limits import MAX_KEY_BYTES
from kvstore.master.rest.event_stream import MAX_STREAMS
from kvstore.master.rest.routes import CURSOR_PATTERN, MAX_CURSOR_CHARS
from kvstore.master.rest.security import (
    READ_ONLY_POSTS,
    SAME_FOR_TENANTS,
    TENANT_ROUTES,
    TOKEN_ALWAYS,
    TOKEN_ALWAYS_UNDER,
)
from kvstore.master.rest.state import SETTINGS_KEY
from kvstore.tenants import NAME_RE
from kvstore.types import NODE_STATES, TIER_ORDER

_ERROR = {"$ref": "#/components/schemas/Error"}
#: Operations that stream until the client hangs up (server-sent events): a generic API fuzzer
#: must not call them (it would wait forever); their tests bound them with ``duration_s``.
STREAM_PATHS = frozenset({"/api/v1/events"})


def _errors(*statuses: int) -> dict[str, Any]:
    return {
        str(s): {
            "description": "an error with our error code",
            "content": {"application/json": {"schema": _ERROR}},
        }
        for s in statuses
    }


def _ok(schema: dict[str, Any], description: str = "ok") -> dict[str, Any]:
    return {
        "200": {"description": description, "content": {"application/json": {"schema": schema}}}
    }


def _obj(
    props: dict[str, Any], required: list[str] | None = None, strict: bool = False
) -> dict[str, Any]:
    schema = {"type": "object", "properties": props, "required": required or list(props)}
    if strict:  # request bodies: the server refuses unknown fields
        schema["additionalProperties"] = False
    return schema


_INT = {"type": "integer", "minimum": 0}
_STR = {"type": "string"}
_NULLABLE_STR = {"type": "string", "nullable": True}
#: Nodes that had not confirmed a tenant change when the answer was sent (normally none).
_PENDING = {"type": "array", "items": {"type": "string"}}
#: Keys are 1..511 bytes of UTF-8; JSON Schema counts characters, which equal bytes for ASCII.
_KEY = {
    "type": "string",
    "minLength": 1,
    "maxLength": MAX_KEY_BYTES,
    "description": f"1..{MAX_KEY_BYTES} bytes of UTF-8",
}
_KEY_PATH = {"name": "key", "in": "path", "required": True, "schema": _KEY}
_KEYS_BODY = {
    "required": True,
    "content": {
        "application/json": {
            "schema": _obj(
                {
                    "keys": {
                        "type": "array",
                        "maxItems": 10000,
                        "items": _KEY,
                    }
                },
                strict=True,
            )
        }
    },
}
_SECURED = [{"bearer": []}]
_READ_ERRORS = (400, 401)

U32_MAX = (1 << 32) - 1
_U32 = {"type": "integer", "minimum": 0, "maximum": U32_MAX}
_POS_U32 = {"type": "integer", "minimum": 1, "maximum": U32_MAX}
_NS_STR = {"type": "string", "minLength": 1, "maxLength": 1024}
NAMESPACE = _obj(
    {
        "model": _NS_STR,
        "dtype": {"type": "string", "enum": sorted(DTYPE_BYTES)},
        "num_layers": _POS_U32,
        "num_kv_heads": _POS_U32,
        "head_dim": _POS_U32,
        "block_size": _POS_U32,
        "salt": {**_NS_STR, "nullable": True},
        "tp_rank": {**_U32, "description": "must be < tp_size"},
        "tp_size": _POS_U32,
        "hash_algorithm": {"type": "string", "enum": list(HASH_ALGORITHMS)},
    },
    ["model", "dtype", "num_layers", "num_kv_heads", "head_dim"],
    strict=True,
)

SEGMENT = _obj(
    {"name": _STR, "tier": _STR, "capacity_bytes": _INT, "used_bytes": _INT},
)
NODE = _obj(
    {
        "node_id": _STR,
        "address": _STR,
        "state": {"type": "string", "enum": list(NODE_STATES)},
        "host_id": {**_STR, "description": "the host it declared (kvstore node --host-id)"},
        "rack": {**_STR, "description": "its rack; empty: the default rack"},
        "zone": {**_STR, "description": "its zone; empty: the default zone"},
        "last_heartbeat_s_ago": {"type": "number", "minimum": 0},
        "capacity_bytes": _INT,
        "used_bytes": _INT,
        "segments": {"type": "array", "items": SEGMENT},
    }
)
OBJECT = _obj(
    {
        "key": _STR,
        "key_hex": _STR,
        "size": _INT,
        "checksum": _STR,
        "replicas": {
            "type": "array",
            "items": _obj({"node_id": _STR, "segment": _STR, "tier": _NULLABLE_STR, "state": _STR}),
        },
    }
)


_NAMESPACE_QUERY = {
    "name": "namespace",
    "in": "query",
    "description": "only these namespaces (digest, 32 hex digits; repeatable)",
    "schema": {
        "type": "array",
        "maxItems": 64,
        "items": {"type": "string", "pattern": "^[0-9a-fA-F]{32}$"},
    },
    "style": "form",
    "explode": True,
}
_SEQ = {"type": "integer", "minimum": 0, "maximum": (1 << 53) - 1}
_EVENT_PATHS: dict[str, Any] = {
    "/api/v1/events": {
        "get": {
            "summary": "KV events as server-sent events (text/event-stream), resumable",
            "description": "Events `stored`, `evicted`, `removed`, `moved` (data: JSON with seq, "
            "kind, namespace, blocks, and src_tier/dst_tier for moves), each with `id: "
            "EPOCH.SEQ`. Without a position the stream starts with a `snapshot` event (every "
            "indexed block per namespace); a position the master cannot serve (another epoch, "
            "events no longer held) gets a `resync` event, then a snapshot. Reconnect with "
            "`Last-Event-ID` to resume. Ends with an `error` event if this master stops "
            "leading. Only a leading master serves it (503 NOT_LEADER otherwise); at most "
            f"{MAX_STREAMS} streams are open at once (503 OVERLOADED). Needs the token whenever "
            "one is set.",
            "x-kvstore-stream": True,
            "parameters": [
                {"name": "since", "in": "query", "schema": _SEQ},
                {"name": "epoch", "in": "query", "schema": _SEQ},
                _NAMESPACE_QUERY,
                {
                    "name": "duration_s",
                    "in": "query",
                    "description": "end the stream after this long (default: a day)",
                    "schema": {
                        "type": "number",
                        "exclusiveMinimum": True,
                        "minimum": 0,
                        "maximum": 86400,
                    },
                },
                {
                    "name": "Last-Event-ID",
                    "in": "header",
                    "schema": {"type": "string", "pattern": "^[0-9]{1,16}([.][0-9]{1,16})?$"},
                },
            ],
            "responses": {
                "200": {
                    "description": "the event stream",
                    "content": {"text/event-stream": {"schema": _STR}},
                },
                **_errors(400, 401, 503),
            },
        }
    },
    "/api/v1/events/snapshot": {
        "get": {
            "summary": "every block in the prefix index per namespace, and the event position "
            "(epoch, seq) it reflects: follow /api/v1/events from there",
            "parameters": [_NAMESPACE_QUERY],
            "responses": {
                **_ok(
                    _obj(
                        {
                            "epoch": _INT,
                            "seq": _INT,
                            "namespaces": {
                                "type": "object",
                                "additionalProperties": {"type": "array", "items": _STR},
                            },
                        }
                    )
                ),
                **_errors(400, 401, 503),
            },
        }
    },
}


_TENANT_NAME = {"type": "string", "pattern": NAME_RE.pattern, "description": "a-z, 0-9, - and _"}
_QUOTA = {"type": "integer", "minimum": 0, "description": "bytes"}
_QUOTAS = {
    "type": "object",
    "properties": {t: _QUOTA for t in TIER_ORDER},
    "additionalProperties": False,
    "description": "bytes per tier; a tier left out has no quota",
}
_QUOTA_CHANGES = {
    "type": "object",
    "properties": {t: {**_QUOTA, "nullable": True} for t in TIER_ORDER},
    "additionalProperties": False,
    "description": "bytes per tier; null removes that tier's quota, a tier left out keeps it",
}
TENANT = _obj({"name": _STR, "quotas": _QUOTAS, "created_ms": _INT})
_TENANT_PATH = {"name": "name", "in": "path", "required": True, "schema": _STR}


def _json_body(schema: dict[str, Any]) -> dict[str, Any]:
    return {"required": True, "content": {"application/json": {"schema": schema}}}


#: The tenant routes: the operator's token always (security.TOKEN_ALWAYS_UNDER).
_TENANT_PATHS: dict[str, Any] = {
    "/api/v1/tenants": {
        "post": {
            "summary": "create a tenant; the answer carries its token, shown only this once",
            "requestBody": _json_body(
                _obj({"name": _TENANT_NAME, "quotas": _QUOTAS}, ["name"], strict=True)
            ),
            "responses": {
                "201": {
                    "description": "created",
                    "content": {
                        "application/json": {
                            "schema": _obj(
                                {
                                    "name": _STR,
                                    "quotas": _QUOTAS,
                                    "token": _STR,
                                    "nodes_pending": _PENDING,
                                }
                            )
                        }
                    },
                },
                **_errors(400, 401, 409),
            },
        },
        "get": {
            "summary": "every tenant",
            "responses": {
                **_ok(_obj({"tenants": {"type": "array", "items": TENANT}})),
                **_errors(401),
            },
        },
    },
    "/api/v1/tenants/{name}": {
        "get": {
            "summary": "one tenant",
            "parameters": [_TENANT_PATH],
            "responses": {**_ok(TENANT), **_errors(401, 404)},
        },
        "patch": {
            "summary": "change a tenant's quotas",
            "parameters": [_TENANT_PATH],
            "requestBody": _json_body(_obj({"quotas": _QUOTA_CHANGES}, strict=True)),
            "responses": {**_ok(TENANT), **_errors(400, 401, 404)},
        },
        "delete": {
            "summary": "delete a tenant (its token stops working) and every object it stored",
            "parameters": [_TENANT_PATH],
            "responses": {
                **_ok(_obj({"deleted": _STR, "objects_removed": _INT, "nodes_pending": _PENDING})),
                **_errors(401, 404),
            },
        },
    },
}


#: A KV namespace's digest: 16 bytes as 32 hex characters.
_DIGEST_HEX = {"type": "string", "pattern": "^[0-9a-fA-F]{32}$"}
_SHARED = _obj({"digest": _DIGEST_HEX, "shared": {"type": "boolean"}, "nodes_pending": _PENDING})
_DIGEST_PATH = {
    "name": "digest",
    "in": "path",
    "required": True,
    "description": "the namespace's digest, 32 hex characters",
    "schema": _DIGEST_HEX,
}
#: The shared namespaces' routes: the operator's token always, as the tenants'.
_SHARED_PATHS: dict[str, Any] = {
    "/api/v1/shared-namespaces": {
        "get": {
            "summary": "the namespaces every tenant shares",
            "responses": {
                **_ok(_obj({"namespaces": {"type": "array", "items": _DIGEST_HEX}})),
                **_errors(401),
            },
        },
    },
    "/api/v1/shared-namespaces/{digest}": {
        "put": {
            "summary": "share a namespace: its blocks are stored once and hit by every tenant",
            "parameters": [_DIGEST_PATH],
            "responses": {**_ok(_SHARED), **_errors(400, 401)},
        },
        "delete": {
            "summary": "make a namespace each tenant's own again (blocks stored so far stay)",
            "parameters": [_DIGEST_PATH],
            "responses": {**_ok(_SHARED), **_errors(400, 401, 404)},
        },
    },
}

_PREFIX = _obj(
    {
        "name": _TENANT_NAME,
        "namespace": _DIGEST_HEX,
        "model": _STR,
        "block_size": _INT,
        "num_tokens": _INT,
        "num_blocks": _INT,
        "created_ms": _INT,
    }
)
_PREFIX_CHANGE = _obj(
    {**_PREFIX["properties"], "shared": {"type": "boolean"}, "nodes_pending": _PENDING}
)
_PREFIX_PATH = {
    "name": "name",
    "in": "path",
    "required": True,
    "description": "the shared prefix's name (a-z, 0-9, - and _)",
    "schema": _TENANT_NAME,
}
#: The shared prefixes' routes: the operator's token always, as the tenants'.
_PREFIX_PATHS: dict[str, Any] = {
    "/api/v1/shared-prefixes": {
        "get": {
            "summary": "the leading token ranges every tenant shares",
            "responses": {
                **_ok(_obj({"prefixes": {"type": "array", "items": _PREFIX}})),
                **_errors(401),
            },
        },
    },
    "/api/v1/shared-prefixes/{name}": {
        "put": {
            "summary": "share a leading token range of one namespace's prompts (a system"
            " prompt): its full blocks are stored once and hit by every tenant",
            "parameters": [_PREFIX_PATH],
            "requestBody": _json_body(
                _obj(
                    {
                        "namespace": NAMESPACE,
                        "tokens": {
                            "type": "array",
                            "maxItems": 1 << 20,
                            "items": {"type": "integer", "minimum": 0, "maximum": U32_MAX},
                            "description": "the range's token ids: one full block of the "
                            "namespace's block_size at least, 4096 blocks at most",
                        },
                    },
                    ["namespace", "tokens"],
                    strict=True,
                )
            ),
            "responses": {**_ok(_PREFIX_CHANGE), **_errors(400, 401, 409)},
        },
        "delete": {
            "summary": "make a shared prefix each tenant's own again (blocks stored so far stay)",
            "parameters": [_PREFIX_PATH],
            "responses": {**_ok(_PREFIX_CHANGE), **_errors(401, 404)},
        },
    },
}


def document(secured_reads: bool = True, secured_writes: bool = True) -> dict[str, Any]:
    """The OpenAPI document (a fresh dict each call), for how this master guards itself.

    Args:
        secured_reads: whether read-only operations need the bearer token.
        secured_writes: whether mutating operations need it (false only without a token).

    Returns:
        The document as a JSON-ready dict.
    """
    doc = _document()
    doc["paths"].update(copy.deepcopy(_EVENT_PATHS))
    doc["paths"].update(copy.deepcopy(_TENANT_PATHS))
    doc["paths"].update(copy.deepcopy(_SHARED_PATHS))
    doc["paths"].update(copy.deepcopy(_PREFIX_PATHS))
    for path, item in doc["paths"].items():
        for method, op in item.items():
            if "security" in op:
                continue  # always open (probes)
            _tenant_rule(path, method, op, secured_writes)
            mutating = method != "get" and path not in READ_ONLY_POSTS
            # (the events need the token whenever one is set: security.TOKEN_ALWAYS)
            always = path in TOKEN_ALWAYS or path.startswith(TOKEN_ALWAYS_UNDER)
            guarded = secured_writes if mutating or always else secured_reads
            if not guarded:
                op["security"] = []
                op["responses"].pop("401", None)
    return doc


_TENANT_VIEW_WORDS = (
    "A tenant's token may call it and gets its own view: only its own figures, series, "
    "prompt trees and events, and the cluster facts that name no tenant and no key "
    "(docs/operating/tenants.md)."
)


def _tenant_rule(path: str, method: str, op: dict[str, Any], tenants_possible: bool) -> None:
    """Say on ``op`` whether a tenant's token may call it (``x-kvstore-tenant``, and a sentence
    in its description); one it may not call answers 403 to a tenant. Without a cluster token
    there are no tenants, and nothing is said."""
    if not tenants_possible:
        return
    route = (method.upper(), path)
    if route in TENANT_ROUTES:
        op["x-kvstore-tenant"] = "own-view"
        rule = _TENANT_VIEW_WORDS
    elif route in SAME_FOR_TENANTS:
        op["x-kvstore-tenant"] = "same"
        rule = "A tenant's token may call it too (the answer is the same for everyone)."
    else:
        op["x-kvstore-tenant"] = "forbidden"
        rule = "The operator's only: a tenant's token gets 403 FORBIDDEN."
        op["responses"]["403"] = _errors(403)["403"]
    op["description"] = f"{op['description']} {rule}" if op.get("description") else rule


def _document() -> dict[str, Any]:
    return {
        "openapi": "3.0.3",
        "info": {
            "title": "kvstore master admin API",
            "version": "1",
            "description": "Errors are JSON bodies {error: {error_code, name, message}} carrying "
            "kvstore error codes (error_code is not the HTTP status: KEY_NOT_FOUND is 200 in a "
            "404 response). Mutating calls need the cluster token as a bearer token "
            "when one is configured; reads need it unless the master serves public reads. "
            "A tenant's token opens only the reads marked x-kvstore-tenant own-view (its own "
            "view of them) or same; every other operation answers it 403 FORBIDDEN.",
        },
        "components": {
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
            "schemas": {
                "Error": _obj(
                    {
                        "error": _obj(
                            {"error_code": {"type": "integer"}, "name": _STR, "message": _STR}
                        )
                    }
                ),
                "Node": NODE,
                "Object": OBJECT,
            },
        },
        "security": _SECURED,
        "paths": {
            "/health": {
                "get": {
                    "summary": "liveness",
                    "security": [],
                    "responses": _ok(_obj({"status": _STR})),
                }
            },
            "/ready": {
                "get": {
                    "summary": "readiness: at least one storage node is registered",
                    "security": [],
                    "responses": {**_ok(_obj({"status": _STR, "num_nodes": _INT})), **_errors(503)},
                }
            },
            "/metrics": {
                "get": {
                    "summary": "Prometheus metrics (text format)",
                    "responses": {
                        "200": {
                            "description": "metrics",
                            "content": {"text/plain": {"schema": _STR}},
                        },
                        **_errors(401),
                    },
                }
            },
            "/api/v1/openapi.json": {
                "get": {
                    "summary": "this document",
                    "responses": {**_ok({"type": "object"}), **_errors(401)},
                }
            },
            "/api/v1/cluster": {
                "get": {
                    "summary": "cluster figures",
                    "responses": {
                        **_ok(
                            {
                                "type": "object",
                                "required": ["num_nodes", "num_objects", "capacity_bytes"],
                                "properties": {
                                    "num_nodes": _INT,
                                    "num_objects": _INT,
                                    "capacity_bytes": _INT,
                                    "used_bytes": _INT,
                                },
                            }
                        ),
                        **_errors(401),
                    },
                }
            },
            "/api/v1/history": {
                "get": {
                    "summary": "recent samples of the cluster's counters (status page)",
                    "responses": {
                        **_ok(
                            _obj(
                                {
                                    "interval_s": {"type": "number"},
                                    "samples": {"type": "array", "items": {"type": "object"}},
                                }
                            )
                        ),
                        **_errors(401),
                    },
                }
            },
            "/api/v1/nodes": {
                "get": {
                    "summary": "storage nodes",
                    "responses": {
                        **_ok(_obj({"nodes": {"type": "array", "items": NODE}})),
                        **_errors(401),
                    },
                }
            },
            "/api/v1/nodes/{node_id}": {
                "get": {
                    "summary": "one storage node",
                    "parameters": [
                        {
                            "name": "node_id",
                            "in": "path",
                            "required": True,
                            "schema": {"type": "string"},
                        }
                    ],
                    "responses": {**_ok(NODE), **_errors(401, 404)},
                }
            },
            "/api/v1/objects": {
                "get": {
                    "summary": "objects, sorted by key, a page at a time",
                    "parameters": [
                        {
                            "name": "prefix",
                            "in": "query",
                            "schema": {
                                "type": "string",
                                "maxLength": MAX_KEY_BYTES,
                                "description": f"at most {MAX_KEY_BYTES} bytes of UTF-8",
                            },
                        },
                        {
                            "name": "limit",
                            "in": "query",
                            "schema": {"type": "integer", "minimum": 1, "maximum": 1000},
                        },
                        {
                            "name": "cursor",
                            "in": "query",
                            "schema": {
                                "type": "string",
                                "minLength": 2,
                                "maxLength": MAX_CURSOR_CHARS,
                                "pattern": CURSOR_PATTERN,
                            },
                        },
                    ],
                    "responses": {
                        **_ok(
                            _obj(
                                {
                                    "objects": {"type": "array", "items": OBJECT},
                                    "next_cursor": _NULLABLE_STR,
                                }
                            )
                        ),
                        **_errors(*_READ_ERRORS),
                    },
                }
            },
            "/api/v1/objects/{key}": {
                "get": {
                    "summary": "one object",
                    "parameters": [_KEY_PATH],
                    "responses": {**_ok(OBJECT), **_errors(400, 401, 404)},
                },
                "delete": {
                    "summary": "remove one object (needs the token)",
                    "parameters": [_KEY_PATH],
                    "responses": {**_ok(_obj({"deleted": _INT})), **_errors(400, 401, 404)},
                },
            },
            "/api/v1/prefix/match": {
                "post": {
                    "summary": "what of a prompt is cached: by tokens through the prefix index, "
                    "or how many leading keys of a chain of object keys are stored",
                    "requestBody": {
                        "required": True,
                        "content": {
                            "application/json": {
                                "schema": {
                                    "oneOf": [
                                        _KEYS_BODY["content"]["application/json"]["schema"],
                                        _obj(
                                            {
                                                "namespace": NAMESPACE,
                                                "tokens": {
                                                    "type": "array",
                                                    "maxItems": 1 << 20,
                                                    "items": {
                                                        "type": "integer",
                                                        "minimum": 0,
                                                        "maximum": U32_MAX,
                                                    },
                                                },
                                            },
                                            strict=True,
                                        ),
                                    ]
                                }
                            }
                        },
                    },
                    "responses": {
                        **_ok(
                            {
                                "oneOf": [
                                    _obj({"num_matched": _INT, "num_queried": _INT}),
                                    _obj(
                                        {
                                            "num_tokens": _INT,
                                            "num_queried_tokens": _INT,
                                            "block_size": _INT,
                                            "blocks": {
                                                "type": "array",
                                                "items": _obj(
                                                    {"key_hex": _STR, "num_tokens": _INT}
                                                ),
                                            },
                                        }
                                    ),
                                ]
                            }
                        ),
                        **_errors(400, 401, 413),
                    },
                }
            },
            "/api/v1/evict": {
                "post": {
                    "summary": "remove objects by key list or by prefix (needs the token)",
                    "requestBody": {
                        "required": True,
                        "content": {
                            "application/json": {
                                "schema": {
                                    "oneOf": [
                                        _KEYS_BODY["content"]["application/json"]["schema"],
                                        _obj(
                                            {
                                                "prefix": {"type": "string", "minLength": 1},
                                                "limit": {
                                                    "type": "integer",
                                                    "minimum": 1,
                                                    "maximum": 10000,
                                                },
                                            },
                                            ["prefix"],
                                            strict=True,
                                        ),
                                    ]
                                }
                            }
                        },
                    },
                    "responses": {
                        **_ok(_obj({"num_evicted": _INT, "num_missing": _INT})),
                        **_errors(400, 401, 413),
                    },
                }
            },
        },
    }


async def openapi(request: web.Request) -> web.Response:
    settings = request.app[SETTINGS_KEY]
    secured = settings.token is not None
    return web.json_response(document(secured and not settings.public_reads, secured))
