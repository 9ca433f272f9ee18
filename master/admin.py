"""The master's admin REST API (aiohttp): probes, metrics, cluster, nodes, objects, status page.

Errors map to JSON bodies carrying our error codes; blocking work never runs on the loop. The
routes live in ``kvstore.master.rest`` (one module per area); this module assembles them.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable
from http import HTTPStatus
from typing import Any

from aiohttp import web, web_protocol, web_server

from kvstore.errors import ErrorCode, KVStoreError
from kvstore.master.metrics import MasterMetrics
from kvstore.master.rest import event_stream as event_routes
from kvstore.master.rest import openapi, page, routes
from kvstore.master.rest.fence import FENCE_KEY, AdminFence, fence_middleware
from kvstore.master.rest.history import History, history_ctx
from kvstore.master.rest.security import auth_middleware
from kvstore.master.rest.state import (
    HISTORY_KEY,
    METRICS_KEY,
    SERVICE_KEY,
    SETTINGS_KEY,
    TENANTS_KEY,
    AdminConfig,
)
from kvstore.master.service import MasterService, ServiceSlot
from kvstore.master.tenant_book import TenantBook

log = logging.getLogger(__name__)

_HTTP_STATUS = {
    ErrorCode.KEY_NOT_FOUND: 404,
    ErrorCode.NODE_NOT_FOUND: 404,
    ErrorCode.NODE_UNAVAILABLE: 503,
    ErrorCode.UNAUTHENTICATED: 401,
    ErrorCode.FORBIDDEN: 403,
    ErrorCode.NO_SPACE: 507,
    ErrorCode.NOT_LEADER: 503,
    ErrorCode.MASTER_UNAVAILABLE: 503,
    ErrorCode.OVERLOADED: 503,
    ErrorCode.INTERNAL: 500,
}


def error_body(err: KVStoreError) -> dict[str, object]:
    """The JSON body of an error: ``{"error": {"error_code", "name", "message"}}``.

    ``error_code`` is the kvstore error code (the same number as on the wire, e.g. 200 for
    KEY_NOT_FOUND), named so that nobody reads it as the HTTP status (that one is 404 then).
    """
    return {"error": {"error_code": int(err.code), "name": err.code.name, "message": err.message}}


def http_status(err: KVStoreError) -> int:
    """The HTTP status for an error code (4xx for the caller's mistakes)."""
    if err.code in _HTTP_STATUS:
        return _HTTP_STATUS[err.code]
    return 400 if 100 <= err.code < 200 else 409


@web.middleware
async def error_middleware(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    try:
        return await handler(request)
    except KVStoreError as err:
        headers = {"WWW-Authenticate": "Bearer"} if err.code == ErrorCode.UNAUTHENTICATED else None
        return web.json_response(error_body(err), status=http_status(err), headers=headers)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        code = ErrorCode.INVALID_REQUEST
        message = exc.reason
        if exc.status == 404:
            message = f"no route {request.method} {request.path[:128]}"
        body = {"error": {"error_code": int(code), "name": code.name, "message": message}}
        return web.Response(
            status=exc.status, text=json.dumps(body), content_type="application/json"
        )
    except Exception:
        # Never a 500 with the exception's text in it: the text may hold anything.
        log.exception("admin %s %s failed", request.method, request.path[:128])
        body = {
            "error": {
                "error_code": int(ErrorCode.INTERNAL),
                "name": "INTERNAL",
                "message": "internal error",
            }
        }
        return web.json_response(body, status=500)


async def health(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def cluster(request: web.Request) -> web.Response:
    return web.json_response(request.app[SERVICE_KEY].service.stats())


async def drain_node(request: web.Request) -> web.Response:
    """``POST /api/v1/nodes/{id}/drain``: move the node's objects elsewhere, then retire it.

    Answers 202 with the drain status (``state``, ``num_objects_left``); POST again to poll.
    """
    status = request.app[SERVICE_KEY].service.drain_node(request.match_info["id"])
    return web.json_response(status, status=202 if status["state"] != "retired" else 200)


def _history_sample(service: MasterService, metrics: MasterMetrics) -> dict[str, float]:
    capacity = used = 0
    for node in service.nodes.values():
        for seg in node.segments.values():
            capacity += seg.allocator.capacity
            used += seg.allocator.used_bytes
    return {
        "num_requests": metrics.num_requests,
        "num_hits": metrics.num_hits,
        "num_misses": metrics.num_misses,
        "num_nodes": len(service.nodes),
        "num_objects": len(service.objects),
        "used_bytes": used,
        "capacity_bytes": capacity,
    }


def init_app(
    slot: ServiceSlot,
    metrics: MasterMetrics | None = None,
    settings: AdminConfig | None = None,
    fence: AdminFence | None = None,
    tenants: TenantBook | None = None,
) -> web.Application:
    """Build the admin application around a live service (nothing starts at import time).

    Args:
        slot: holds the master's service (routes read the current term's per request).
        metrics: the master's metrics (the RPC edge records into the same object); a fresh
            one when None.
        settings: token, public reads, history sampling.
        fence: with HA masters, the leadership fence every mutation and ``/ready`` obey.
        tenants: the master's tenants (``/api/v1/tenants``); a book of its own when None.

    Returns:
        The application; its history sampler runs while the app runs (``cleanup_ctx``).
    """
    settings = settings or AdminConfig()
    metrics = metrics or MasterMetrics(slot)
    app = web.Application(
        middlewares=[error_middleware, auth_middleware, fence_middleware],
        # Longest legitimate URL: a 511-byte prefix and a cursor, percent-encoded (~15 KiB).
        # Anything the HTTP parser refuses still gets our JSON error body (AdminRunner).
        handler_args={"max_line_size": 64 << 10},
    )
    app[SERVICE_KEY] = slot
    app[METRICS_KEY] = metrics
    app[SETTINGS_KEY] = settings
    if fence is not None:
        app[FENCE_KEY] = fence
    if tenants is None:
        tenants = TenantBook(has_cluster_token=settings.token is not None)
    app[TENANTS_KEY] = tenants
    app[HISTORY_KEY] = History(
        lambda: _history_sample(slot.service, metrics),
        settings.history_interval_s,
        settings.history_window_s,
    )
    app.cleanup_ctx.append(history_ctx(HISTORY_KEY))
    app.router.add_get("/", page.status_page)
    app.router.add_get("/health", health)
    app.router.add_get("/api/v1/cluster", cluster)
    app.router.add_get("/api/v1/openapi.json", openapi.openapi)
    routes.add_routes(app)
    event_routes.add_routes(app)
    app.router.add_post("/api/v1/nodes/{id}/drain", drain_node)
    return app


class _JsonErrorHandler(web_protocol.RequestHandler):
    """aiohttp's connection handler, but errors raised before routing (a request line or
    header over the limit, a malformed request) answer with our JSON error body: the
    middlewares never see those requests, so without this they get aiohttp's plain text."""

    def handle_error(
        self,
        request: Any,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        super().handle_error(request, status, exc, message)  # logs it; raises if sent already
        code = ErrorCode.INTERNAL if status >= 500 else ErrorCode.INVALID_REQUEST
        try:
            phrase = HTTPStatus(status).phrase
        except ValueError:
            phrase = "error"
        # Never the parser's own text: it quotes the raw request (headers, perhaps a token).
        text = (
            f"{status} {phrase}: the request line or headers are malformed or too long"
            if status < 500
            else "internal error"
        )
        body = {"error": {"error_code": int(code), "name": code.name, "message": text}}
        out = web.Response(status=status, text=json.dumps(body), content_type="application/json")
        out.force_close()  # as aiohttp does: the framing of this connection is not trusted
        return out


class _JsonErrorServer(web_server.Server):
    def __call__(self) -> web_protocol.RequestHandler:
        return _JsonErrorHandler(self, loop=self._loop, **self._kwargs)


class AdminRunner(web.AppRunner):
    """An ``AppRunner`` whose pre-routing errors are JSON too (see :class:`_JsonErrorHandler`)."""

    async def _make_server(self) -> web_server.Server:
        server = await super()._make_server()
        server.__class__ = _JsonErrorServer  # same state, one overridden factory method
        return server


__all__ = [
    "AdminRunner",
    "init_app",
    "error_body",
    "http_status",
    "AdminConfig",
    "SERVICE_KEY",
]
