"""Bearer-token checks for the admin API: who calls (the operator, a tenant, or nobody), and
what each may call.

**The operator** holds the cluster token and may call everything.

**Nobody** (no token, or one that is neither the cluster's nor a tenant's): mutating calls
(POST/PUT/PATCH/DELETE) always need the cluster token when one is configured; read-only calls
need it unless ``public_reads``, except the KV events (``TOKEN_ALWAYS``): they name the blocks of
every prompt, so they need the token whenever one is set. So do the tenant routes
(``/api/v1/tenants...``, ``/api/v1/shared-namespaces...``): tenants are the operator's business.
Refused calls answer 401 (``UNAUTHENTICATED``).

**A tenant** (a token that ``service.tenants`` resolves, ``kvstore.tenants.TenantDirectory``)
may call the reads in :data:`TENANT_ROUTES` and nothing else: each is answered by the route's
*tenant view* (registered with ``state.open_to_tenants`` by the module that owns the route),
which shows only the tenant's own figures and the cluster facts that name no tenant and no key;
the operator's handler never runs for a tenant. Every other route, every write and every route
added later (default deny) answers 403 (``FORBIDDEN``): the caller is known, the call is not
its to make, as a tenant's connection is refused a verb on the RPC edge. What each view shows
is written in its docstring and in ``docs/operating/tenants.md``.

NOTE: with ``public_reads`` (the default) a caller without a token reads the operator's
unfiltered views of the public reads; a pool with tenants runs ``--no-public-reads``.

Probes (``/health``, ``/ready``) and the status page's HTML are always open, to a tenant too:
the page asks for the token itself when the API refuses it.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from aiohttp import web

from kvstore import auth
from kvstore.errors import ForbiddenError, UnauthenticatedError
from kvstore.master.rest.fence import check_fence
from kvstore.master.rest.state import (
    READ_METHODS,
    READ_ONLY_POSTS,
    SERVICE_KEY,
    SETTINGS_KEY,
    TENANT_VIEWS_KEY,
)

__all__ = ["READ_ONLY_POSTS", "TENANT_ROUTES", "auth_middleware", "needs_token"]

ALWAYS_OPEN = frozenset({"/health", "/ready", "/"})
#: Reads that need the token even with ``public_reads``.
TOKEN_ALWAYS = frozenset({"/api/v1/events", "/api/v1/events/snapshot"})

#: Routes under these need the token for every method: the tenants, and which namespaces and
#: prefixes they share, are the operator's business.
TOKEN_ALWAYS_UNDER = ("/api/v1/tenants", "/api/v1/shared-namespaces", "/api/v1/shared-prefixes")

#: What a tenant's token may call: ``(method, route pattern)``, each answered by its tenant view.
TENANT_ROUTES = frozenset(
    {
        ("GET", "/metrics"),
        ("GET", "/api/v1/cluster"),
        ("GET", "/api/v1/history"),
        ("GET", "/api/v1/nodes"),
        ("GET", "/api/v1/nodes/{node_id}"),
        ("GET", "/api/v1/events"),
        ("GET", "/api/v1/events/snapshot"),
    }
)
#: Reads whose answer is the same for everyone (it names no tenant, key or figure): a tenant
#: gets the operator's handler.
SAME_FOR_TENANTS = frozenset({("GET", "/api/v1/openapi.json")})


def needs_token(method: str, path: str, public_reads: bool) -> bool:
    """Whether a call to ``method path`` must carry the token (when one is configured)."""
    if path in ALWAYS_OPEN:
        return False
    if path in TOKEN_ALWAYS or path.startswith(TOKEN_ALWAYS_UNDER):
        return True
    reads = method in READ_METHODS or (method == "POST" and path in READ_ONLY_POSTS)
    return not (reads and public_reads)


def _bearer(authorization: str | None) -> str | None:
    """The token of an ``Authorization: Bearer TOKEN`` header, else None."""
    if not authorization:
        return None
    scheme, _, value = authorization.partition(" ")
    if scheme.lower() != "bearer":
        return None
    return value.strip() or None


def _route(request: web.Request) -> tuple[str, str] | None:
    """``(method, route pattern)`` of a routed request (HEAD as GET); None for no route."""
    resource = request.match_info.route.resource
    if resource is None:
        return None
    method = "GET" if request.method == "HEAD" else request.method
    return method, resource.canonical


@web.middleware
async def auth_middleware(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    settings = request.app[SETTINGS_KEY]
    if settings.token is None or request.path in ALWAYS_OPEN:
        return await handler(request)  # (no cluster token: no tenants either)
    authorization = request.headers.get("Authorization")
    if auth.bearer_ok(authorization, settings.token):
        return await handler(request)  # the operator
    offered = _bearer(authorization)
    tenant = request.app[SERVICE_KEY].service.tenants.resolve(offered) if offered else None
    if tenant is not None:
        return await _tenant_call(request, handler, tenant)
    # Public reads are for a pool without tenants: once one exists, what an anonymous read
    # shows (keys, tenants' figures) would cross tenants, so every read needs a token.
    has_tenants = len(request.app[SERVICE_KEY].service.tenants) > 0
    if needs_token(request.method, request.path, settings.public_reads and not has_tenants):
        why = " (the pool has tenants: reads need a token too)" if has_tenants else ""
        raise UnauthenticatedError("missing or wrong bearer token" + why)
    return await handler(request)


async def _tenant_call(
    request: web.Request,
    handler: Callable[[web.Request], Awaitable[web.StreamResponse]],
    tenant: str,
) -> web.StreamResponse:
    """A tenant's call: its route's tenant view, or 403 (an unknown path: the usual 404/405)."""
    route = _route(request)
    if route is None:
        return await handler(request)
    if route in SAME_FOR_TENANTS:
        return await handler(request)
    view = request.app.get(TENANT_VIEWS_KEY, {}).get(route) if route in TENANT_ROUTES else None
    if view is None:
        raise ForbiddenError(f"a tenant's token may not call {route[0]} {route[1][:128]}")
    check_fence(request)  # the fence middleware comes after this one: the view asks it here
    return await view(request, tenant)
