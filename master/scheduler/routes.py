"""The scheduler's route on the master's admin API: ``POST /api/v1/schedule``.

Decode the JSON body, call :func:`schedule_request`, return the decision; the admin app's error
middleware maps ``KVStoreError`` to a 4xx JSON body.
"""

from __future__ import annotations

import json

from aiohttp import web

from kvstore.errors import InvalidRequestError

from .api import SchedulerState, schedule_request
from .cluster import ClusterConfig, ClusterState

SCHEDULER_KEY = web.AppKey("scheduler", SchedulerState)
MAX_BODY_BYTES = 8 << 20


async def schedule(request: web.Request) -> web.Response:
    if request.content_length is not None and request.content_length > MAX_BODY_BYTES:
        raise InvalidRequestError(f"body larger than {MAX_BODY_BYTES} bytes")
    try:
        body = json.loads(await request.read())
    except (ValueError, UnicodeDecodeError):
        raise InvalidRequestError("body is not valid JSON") from None
    except RecursionError:
        raise InvalidRequestError("body's JSON is nested too deeply") from None
    return web.json_response(schedule_request(request.app[SCHEDULER_KEY], body))


def add_routes(app: web.Application, state: SchedulerState | None = None) -> None:
    """Mount the route, with a default cluster view unless ``state`` is given."""
    app[SCHEDULER_KEY] = state or SchedulerState(ClusterState.build(ClusterConfig()))
    app.router.add_post("/api/v1/schedule", schedule)
