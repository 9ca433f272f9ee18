"""Typed application state shared by the admin routes (``web.AppKey``)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from aiohttp import web

from kvstore.auth import Token
from kvstore.master.metrics import MasterMetrics
from kvstore.master.rest.history import History
from kvstore.master.service import ServiceSlot
from kvstore.master.tenant_book import TenantBook


@dataclass(frozen=True, slots=True)
class AdminConfig:
    """How the admin API guards itself.

    Attributes:
        token: the cluster token; None serves everyone (no authentication configured).
        public_reads: whether read-only endpoints are open without the token. Mutating calls
            always need it (when a token is configured); ``/health``, ``/ready`` and the status
            page's HTML are always open.
        history_interval_s: seconds between samples of the status page's history.
        history_window_s: how far back the history reaches.
    """

    token: Token | None = None
    public_reads: bool = True
    history_interval_s: float = 2.0
    history_window_s: float = 600.0


#: The slot of the current term's service: routes read ``app[SERVICE_KEY].service`` per request.
SERVICE_KEY = web.AppKey("service", ServiceSlot)
METRICS_KEY = web.AppKey("metrics", MasterMetrics)
SETTINGS_KEY = web.AppKey("settings", AdminConfig)
HISTORY_KEY = web.AppKey("history", History)
#: The master's tenants (absent: an app built without them refuses the tenant routes).
TENANTS_KEY = web.AppKey("tenants", TenantBook)

#: Which POST routes change nothing (a query with a body): the token and the fence treat them
#: as reads.
READ_ONLY_POSTS = frozenset({"/api/v1/prefix/match"})
READ_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})

#: A tenant's view of a route: ``(request, tenant name) -> response``. A tenant's request is
#: answered by its route's view, never by the operator's handler (``security.py``).
TenantView = Callable[[web.Request, str], Awaitable[web.StreamResponse]]
#: ``(method, route pattern) -> view``, filled by the modules that own the routes.
TENANT_VIEWS_KEY = web.AppKey("tenant_views", dict[tuple[str, str], TenantView])


def open_to_tenants(app: web.Application, method: str, route: str, view: TenantView) -> None:
    """Answer a tenant's ``method route`` (``route`` as registered, e.g.
    ``/api/v1/nodes/{node_id}``) with ``view``.

    ``security.TENANT_ROUTES`` lists what a tenant may call (a test checks that every route
    there has its view and no view is left over).
    """
    views = app.setdefault(TENANT_VIEWS_KEY, {})
    views[(method, route)] = view
