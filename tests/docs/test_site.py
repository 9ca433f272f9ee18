"""The documentation site: ``mkdocs build --strict`` succeeds, and the built site works in headless
Chromium (the home page and a reference page show the navigation, and a search finds a
reference page).

Needs docs/requirements.txt in the running interpreter (``make test`` installs it) and Debian's
``chromium`` (installed by ``.ci/run``); each part skips with its reason where they are absent.
The browser is driven over the DevTools protocol (aiohttp's websocket client), so the checks run
after the page's own scripts did: the search runs in Material's web worker.

``DOCS_SCREENSHOT=1`` also saves the home page as ``docs/assets/home.png`` (the committed one);
a plain run writes nothing in the tree.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import functools
import http.server
import importlib.util
import itertools
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.support import CHROMIUM
from tests.support import FLAGS as CHROMIUM_FLAGS

ROOT = Path(__file__).resolve().parents[2]
SCREENSHOT = ROOT / "docs" / "assets" / "home.png"
FLAGS = [*CHROMIUM_FLAGS, "--window-size=1280,900"]


def _missing_docs_packages() -> list[str]:
    missing = []
    for module in ("mkdocs", "material", "mkdocstrings", "mkdocstrings_handlers.python"):
        try:
            found = importlib.util.find_spec(module) is not None
        except ModuleNotFoundError:
            found = False
        if not found:
            missing.append(module)
    return missing


pytestmark = pytest.mark.skipif(
    bool(_missing_docs_packages()),
    reason=f"mkdocs not installed in {sys.executable} (missing {_missing_docs_packages()}): "
    "pip install -r docs/requirements.txt",
)
needs_chromium = pytest.mark.skipif(
    CHROMIUM is None, reason="headless Chromium not installed (apt-get install chromium)"
)


def _nav_pages() -> list[str]:
    """The pages mkdocs.yml's nav lists (``Title: path.md`` lines)."""
    text = (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    nav = text.split("\nnav:\n", 1)[1]
    return re.findall(r":\s*([\w./-]+\.md)\s*$", nav, flags=re.MULTILINE)


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The site, built with ``--strict`` into a temporary folder."""
    out = tmp_path_factory.mktemp("site")
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{proc.stderr[-4000:]}"
    return out


def test_strict_build_makes_every_page(site: Path) -> None:
    for page in _nav_pages():
        html = site / (
            "index.html" if page == "index.md" else page.removesuffix(".md") + "/index.html"
        )
        assert html.exists(), f"{page} was not built"
    index = json.loads((site / "search" / "search_index.json").read_text(encoding="utf-8"))
    locations = {doc["location"].split("#", 1)[0] for doc in index["docs"]}
    assert "reference/env/" in locations
    python_api = (site / "reference" / "python" / "index.html").read_text(encoding="utf-8")
    assert 'id="kvstore.client.Client"' in python_api  # mkdocstrings rendered the SDK


# ------------------------------------------------------------------------ the site in a browser


@pytest.fixture(scope="module")
def served(site: Path) -> Iterator[str]:
    """The built site over HTTP on a free loopback port (Material's search worker needs HTTP)."""
    handler = functools.partial(_QuietHandler, directory=str(site))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
        pass


class _Page:
    """One Chromium tab over the DevTools protocol: navigate, evaluate, screenshot."""

    def __init__(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        self.ws = ws
        self._ids = itertools.count(1)
        self._events: list[str] = []

    async def call(self, method: str, **params: Any) -> dict[str, Any]:
        """Send one command and return its result (events that arrive meanwhile are kept)."""
        ident = next(self._ids)
        await self.ws.send_json({"id": ident, "method": method, "params": params})
        while True:
            msg = await self.ws.receive_json(timeout=30)
            if msg.get("id") == ident:
                assert "error" not in msg, msg
                return msg.get("result", {})
            if "method" in msg:
                self._events.append(msg["method"])

    async def evaluate(self, expression: str) -> Any:
        result = await self.call("Runtime.evaluate", expression=expression, returnByValue=True)
        assert "exceptionDetails" not in result, result
        return result["result"].get("value")

    async def open(self, url: str) -> None:
        """Load ``url`` and return once its load event fired (its scripts have started)."""
        self._events.clear()
        result = await self.call("Page.navigate", url=url)
        assert not result.get("errorText"), result
        deadline = time.monotonic() + 30
        while "Page.loadEventFired" not in self._events:
            assert time.monotonic() < deadline, f"timed out loading {url}"
            msg = await self.ws.receive_json(timeout=30)
            if "method" in msg:
                self._events.append(msg["method"])

    async def wait_for(self, expression: str, what: str, timeout: float = 30.0) -> Any:
        deadline = time.monotonic() + timeout
        while True:
            value = await self.evaluate(expression)
            if value:
                return value
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            await asyncio.sleep(0.1)


async def _with_page(body: Any) -> Any:
    """Run ``body(page)`` in a fresh headless Chromium; the browser is gone afterwards."""
    assert CHROMIUM is not None
    # (a helper process of Chromium may still write into its profile for a moment after the
    # browser's group was ended: what is left there is not worth failing the test for)
    with tempfile.TemporaryDirectory(
        prefix="kvstore-chromium-", ignore_cleanup_errors=True
    ) as profile:
        proc = subprocess.Popen(
            [
                CHROMIUM,
                *FLAGS,
                "--remote-debugging-port=0",
                f"--user-data-dir={profile}",
                "about:blank",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,  # its own process group: ended whole, helpers included
        )
        try:
            port_file = Path(profile) / "DevToolsActivePort"
            deadline = time.monotonic() + 30
            while not (port_file.exists() and port_file.read_text().count("\n") >= 1):
                assert proc.poll() is None, "chromium exited at start"
                assert time.monotonic() < deadline, "chromium opened no DevTools port"
                await asyncio.sleep(0.1)
            port = int(port_file.read_text().split()[0])
            async with aiohttp.ClientSession() as session:
                async with session.get(f"http://127.0.0.1:{port}/json/list") as resp:
                    targets = await resp.json(content_type=None)
                url = next(t["webSocketDebuggerUrl"] for t in targets if t["type"] == "page")
                async with session.ws_connect(url, max_msg_size=0) as ws:
                    page = _Page(ws)
                    await page.call("Page.enable")
                    await page.call("Runtime.enable")
                    return await body(page)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


_NAV_LINKS = """[...document.querySelectorAll('nav.md-nav--primary a.md-nav__link')]
    .map(a => new URL(a.href, location.href).pathname)"""
_NAV_SECTIONS = """[...document.querySelectorAll('nav.md-nav--primary label.md-nav__link')]
    .map(l => l.textContent.trim())"""


@needs_chromium
def test_home_and_reference_pages_have_navigation(served: str) -> None:
    async def body(page: _Page) -> dict[str, Any]:
        seen = {}
        for path in ("/", "/reference/metrics/"):
            await page.open(served + path)
            seen[path] = {
                "title": await page.evaluate("document.title"),
                "h1": await page.evaluate("document.querySelector('article h1')?.textContent"),
                "links": await page.evaluate(_NAV_LINKS),
                "sections": await page.evaluate(_NAV_SECTIONS),
                "search": await page.evaluate(
                    "!!document.querySelector('input.md-search__input[name=query]')"
                ),
            }
        if os.environ.get("DOCS_SCREENSHOT") == "1":
            await page.open(served + "/")
            shot = await page.call("Page.captureScreenshot", format="png")
            SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
            SCREENSHOT.write_bytes(base64.b64decode(shot["data"]))
        return seen

    seen = asyncio.run(_with_page(body))
    expected = {"/" if p == "index.md" else "/" + p.removesuffix(".md") + "/" for p in _nav_pages()}
    for path, got in seen.items():
        assert got["search"], f"{path}: no search box"
        assert "kvstore" in got["title"], got["title"]
        assert expected <= set(got["links"]), f"{path}: nav lacks {expected - set(got['links'])}"
        assert "Reference" in got["sections"], got["sections"]
    assert seen["/reference/metrics/"]["h1"].strip().startswith("Metrics")


@needs_chromium
def test_search_finds_a_reference_page(served: str) -> None:
    async def body(page: _Page) -> list[str]:
        await page.open(served + "/?q=KVSTORE_TOKEN_FILE")
        await page.wait_for(
            "document.querySelectorAll('.md-search-result__item').length > 0",
            "search results (Material's search worker)",
        )
        return await page.evaluate(
            "[...document.querySelectorAll('.md-search-result__item a')].map(a => a.href)"
        )

    hrefs = asyncio.run(_with_page(body))
    assert any("/reference/env/" in h for h in hrefs), hrefs
