"""Bearer-token checks for the admin API.

Mutating calls (POST/PUT/PATCH/DELETE) always need the cluster token when one is configured;
read-only calls need it unless ``public_reads``, except the KV events (``TOKEN_ALWAYS``): they
name the blocks of every prompt, so they need the token whenever one is set. So do the tenant
routes (``/api/v1/tenants...``, ``/api/v1/shared-namespaces...``): tenants are the operator's
business. Probes (``/health``,
``/ready``) and the status page's HTML are always open: the page asks for the token itself when
the API refuses it.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from aiohttp import web

from kvstore import auth
from kvstore.errors import UnauthenticatedError
from kvstore.master.rest.state import SETTINGS_KEY

ALWAYS_OPEN = frozenset({"/health", "/ready", "/"})
#: Reads that need the token even with ``public_reads``.
TOKEN_ALWAYS = frozenset({"/api/v1/events", "/api/v1/events/snapshot"})
#: POST routes that change nothing (a query with a body).
READ_ONLY_POSTS = frozenset({"/api/v1/prefix/match"})
_READ_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})


#: Routes under these need the token for every method: the tenants, and which namespaces they
#: share, are the operator's business.
TOKEN_ALWAYS_UNDER = ("/api/v1/tenants", "/api/v1/shared-namespaces")


def needs_token(method: str, path: str, public_reads: bool) -> bool:
    """Whether a call to ``method path`` must carry the token (when one is configured)."""
    if path in ALWAYS_OPEN:
        return False
    if path in TOKEN_ALWAYS or path.startswith(TOKEN_ALWAYS_UNDER):
        return True
    reads = method in _READ_METHODS or (method == "POST" and path in READ_ONLY_POSTS)
    return not (reads and public_reads)


@web.middleware
async def auth_middleware(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    settings = request.app[SETTINGS_KEY]
    if (
        settings.token is not None
        and needs_token(request.method, request.path, settings.public_reads)
        and not auth.bearer_ok(request.headers.get("Authorization"), settings.token)
    ):
        raise UnauthenticatedError("missing or wrong bearer token")
    return await handler(request)
