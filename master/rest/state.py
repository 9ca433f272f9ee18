"""Typed application state shared by the admin routes (``web.AppKey``)."""

from __future__ import annotations

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
