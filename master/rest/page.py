"""``GET /``: the status page, one self-contained HTML file (no build step, vanilla JS).

The page polls the JSON API (``/api/v1/cluster``, ``/api/v1/nodes``, ``/api/v1/history``) and
draws nodes, tier fill, hit rate and request rate over the last minutes. When the API wants a
token, the page asks for it and keeps it in the tab's ``sessionStorage`` only. Given a tenant's
token, the same page shows that tenant's view: the JSON it loads is the tenant's own
(``security.py``: its objects and bytes, hits and misses, the nodes and their capacity; no request
rate, which is every tenant's together).
"""

from __future__ import annotations

from functools import cache
from importlib import resources

from aiohttp import web


@cache
def _html() -> bytes:
    return resources.files("kvstore.master.rest").joinpath("status.html").read_bytes()


async def status_page(request: web.Request) -> web.Response:
    return web.Response(
        body=_html(),
        content_type="text/html",
        charset="utf-8",
        headers={
            "Cache-Control": "no-store",
            "Content-Security-Policy": "default-src 'self'; script-src 'unsafe-inline'; "
            "style-src 'unsafe-inline'; img-src data:",
        },
    )
