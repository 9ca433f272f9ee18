"""The master's admin REST API (aiohttp): health and cluster figures.

Errors map to JSON bodies carrying our error codes; blocking work never runs on the loop.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable

from aiohttp import web
from kvstore.master.scheduler import routes as scheduler_routes
from kvstore.master.service import MasterService

from kvstore.errors import ErrorCode, KVStoreError

log = logging.getLogger(__name__)

SERVICE_KEY = web.AppKey("service", MasterService)

_HTTP_STATUS = {
    ErrorCode.KEY_NOT_FOUND: 404,
    ErrorCode.UNAUTHENTICATED: 401,
    ErrorCode.FORBIDDEN: 403,
    ErrorCode.NO_SPACE: 507,
    ErrorCode.NOT_LEADER: 503,
    ErrorCode.MASTER_UNAVAILABLE: 503,
    ErrorCode.INTERNAL: 500,
}


def error_body(err: KVStoreError) -> dict[str, object]:
    return {"error": {"code": int(err.code), "name": err.code.name, "message": err.message}}


def http_status(err: KVStoreError) -> int:
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
        return web.json_response(error_body(err), status=http_status(err))
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        code = ErrorCode.KEY_NOT_FOUND if exc.status == 404 else ErrorCode.INVALID_REQUEST
        body = {"error": {"code": int(code), "name": code.name, "message": exc.reason}}
        return web.Response(
            status=exc.status, text=json.dumps(body), content_type="application/json"
        )


async def health(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def cluster(request: web.Request) -> web.Response:
    return web.json_response(request.app[SERVICE_KEY].stats())


def init_app(service: MasterService) -> web.Application:
    """Build the admin application around a live service (nothing starts at import time)."""
    app = web.Application(middlewares=[error_middleware])
    app[SERVICE_KEY] = service
    app.router.add_get("/health", health)
    app.router.add_get("/api/v1/cluster", cluster)
    scheduler_routes.add_routes(app)
    return app
