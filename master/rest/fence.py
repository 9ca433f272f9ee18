"""The leadership fence on the admin API: with HA masters, only a leader that can prove its lease
changes anything or reports ready.

The control protocol checks :class:`~kvstore.master.ha.Leadership` before every request; the
admin API must obey the same fence, or a leader cut off from etcd (still reachable by operators)
would delete and evict from its stale table while another master leads, or answer for objects
the leader has since removed. Every mutating route, ``/ready``, the KV event routes and every read
of the cluster's table (objects, nodes, prefix match, cluster totals) ask the fence first, as the
control protocol does; ``/health``, ``/metrics``, the history and the status page still answer
(they describe this master). Without HA there is no fence and nothing changes.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Protocol

from aiohttp import web

from kvstore.errors import KVStoreError
from kvstore.master.rest.state import READ_METHODS, READ_ONLY_POSTS


class AdminFence(Protocol):
    """Whether this master may change the cluster now (see ``Leadership.admin_check``)."""

    def admin_check(self) -> KVStoreError | None: ...


FENCE_KEY = web.AppKey("fence", AdminFence)
#: Reads fenced like mutations: probes that say the master serves, and every read of the table
#: (a master that may not lead must not pass its table off as the leader's).
FENCED_READS = frozenset(
    {
        "/ready",
        "/api/v1/events",
        "/api/v1/events/snapshot",
        "/api/v1/cluster",
        "/api/v1/prefix/match",
    }
)
#: Reads of the table under a path: ``/api/v1/objects``, ``/api/v1/objects/KEY``, the nodes likewise.
FENCED_READ_TREES = ("/api/v1/objects", "/api/v1/nodes")


def is_fenced(method: str, path: str) -> bool:
    """Whether ``method path`` needs a leader (a mutation, the readiness probe, a table read)."""
    if path in FENCED_READS:
        return True
    if any(path == tree or path.startswith(tree + "/") for tree in FENCED_READ_TREES):
        return True
    return method not in READ_METHODS and not (method == "POST" and path in READ_ONLY_POSTS)


@web.middleware
async def fence_middleware(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """Refuse (``NOT_LEADER``, 503) a fenced call while this master may not lead."""
    check_fence(request)
    return await handler(request)


def check_fence(request: web.Request) -> None:
    """Raise the fence's error for a fenced call while this master may not lead (a tenant's
    request is answered by its view in ``security.py``, past this middleware: it asks here).

    Raises:
        KVStoreError: ``NOT_LEADER`` (503).
    """
    fence = request.app.get(FENCE_KEY)
    if fence is not None and is_fenced(request.method, request.path):
        err = fence.admin_check()
        if err is not None:
            raise err
