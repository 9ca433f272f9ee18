"""The admin API's OpenAPI 3.0 document, served at ``/api/v1/openapi.json``.

Hand-written next to the routes it describes; ``tests/master/test_admin_openapi.py`` checks the
live API against it with schemathesis.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

_ERROR = {"$ref": "#/components/schemas/Error"}


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


def _obj(props: dict[str, Any], required: list[str] | None = None) -> dict[str, Any]:
    return {"type": "object", "properties": props, "required": required or list(props)}


_INT = {"type": "integer", "minimum": 0}
_STR = {"type": "string"}
_NULLABLE_STR = {"type": "string", "nullable": True}
_KEY_PATH = {
    "name": "key",
    "in": "path",
    "required": True,
    "schema": {"type": "string", "minLength": 1, "maxLength": 511},
}
_KEYS_BODY = {
    "required": True,
    "content": {
        "application/json": {
            "schema": _obj(
                {
                    "keys": {
                        "type": "array",
                        "maxItems": 10000,
                        "items": {"type": "string", "minLength": 1, "maxLength": 127},
                    }
                }
            )
        }
    },
}
_SECURED = [{"bearer": []}]
_READ_ERRORS = (400, 401)

SEGMENT = _obj(
    {"name": _STR, "tier": _STR, "capacity_bytes": _INT, "used_bytes": _INT},
)
NODE = _obj(
    {
        "node_id": _STR,
        "address": _STR,
        "state": {"type": "string", "enum": ["alive"]},
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


def document() -> dict[str, Any]:
    """The OpenAPI document (a fresh dict each call)."""
    return {
        "openapi": "3.0.3",
        "info": {
            "title": "kvstore master admin API",
            "version": "1",
            "description": "Errors are JSON bodies {error: {code, name, message}} carrying "
            "kvstore error codes. Mutating calls need the cluster token as a bearer token "
            "when one is configured; reads need it unless the master serves public reads.",
        },
        "components": {
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
            "schemas": {
                "Error": _obj(
                    {"error": _obj({"code": {"type": "integer"}, "name": _STR, "message": _STR})}
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
                            "schema": {"type": "string", "minLength": 1, "maxLength": 128},
                        }
                    ],
                    "responses": {**_ok(NODE), **_errors(401, 404)},
                }
            },
            "/api/v1/objects": {
                "get": {
                    "summary": "objects, sorted by key, a page at a time",
                    "parameters": [
                        {"name": "prefix", "in": "query", "schema": {"type": "string"}},
                        {
                            "name": "limit",
                            "in": "query",
                            "schema": {"type": "integer", "minimum": 1, "maximum": 1000},
                        },
                        {"name": "cursor", "in": "query", "schema": {"type": "string"}},
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
                    "summary": "how many leading keys of a chain of block keys are stored",
                    "requestBody": _KEYS_BODY,
                    "responses": {
                        **_ok(_obj({"num_matched": _INT, "num_queried": _INT})),
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
    return web.json_response(document())
