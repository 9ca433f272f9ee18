"""The status page in headless Chromium against a live cluster: what it shows after its JS ran.

Needs Debian's ``chromium`` (installed by ``.ci/run``); skips where it is absent. Leaves a
screenshot in ``tests/artifacts/status_page.png``.
"""

from __future__ import annotations

import html.parser
import json
import subprocess
import tempfile
import urllib.request
from pathlib import Path

import pytest

from kvstore.client import Client
from tests.support import CHROMIUM, FLAGS, wait_until

ARTIFACTS = Path(__file__).resolve().parent.parent / "artifacts"

pytestmark = pytest.mark.skipif(
    CHROMIUM is None, reason="headless Chromium not installed (apt-get install chromium)"
)


def _chromium(*args: str, timeout: float = 90.0) -> str:
    with tempfile.TemporaryDirectory(prefix="kvstore-chromium-") as profile:
        proc = subprocess.run(
            [CHROMIUM, *FLAGS, f"--user-data-dir={profile}", *args],
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


class _Texts(html.parser.HTMLParser):
    """Text by element id, and the rows of each table body."""

    def __init__(self) -> None:
        super().__init__()
        self.by_id: dict[str, str] = {}
        self.rows: dict[str, int] = {}
        self.attrs_of: dict[str, dict[str, str]] = {}
        self._stack: list[str | None] = []
        self._table: str | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = {k: v or "" for k, v in attrs}
        self.attrs_of.setdefault(tag, a)
        if tag == "table":
            self._table = a.get("id")
        if tag == "tr" and self._table and self._stack and "tbody" in self._stack:
            self.rows[self._table] = self.rows.get(self._table, 0) + 1
        self._stack.append(a.get("id") if tag != "tbody" else "tbody")

    def handle_endtag(self, tag: str) -> None:
        if self._stack:
            self._stack.pop()

    def handle_data(self, data: str) -> None:
        for ident in self._stack:
            if ident and ident != "tbody":
                self.by_id[ident] = self.by_id.get(ident, "") + data


def test_status_page_shows_the_cluster(cluster_factory) -> None:
    cluster = cluster_factory(num_nodes=2, dram="64MiB")
    with Client.connect(cluster.address) as c:
        keys = [f"page/{i}" for i in range(50)]
        c.batch_put(keys, [b"x" * 65536] * 50)
        c.batch_get(keys + ["page/missing"])

    def samples() -> int:
        with urllib.request.urlopen(f"{cluster.admin}/api/v1/history", timeout=5) as r:
            return len(json.loads(r.read())["samples"])

    wait_until(lambda: samples() >= 3, timeout=30, what="three history samples")

    dom = _chromium("--virtual-time-budget=8000", "--dump-dom", cluster.admin + "/")
    page = _Texts()
    page.feed(dom)
    assert page.attrs_of["body"].get("data-loaded") == "1", dom[-3000:]
    assert page.by_id["num-nodes"].strip() == "2"
    assert page.by_id["num-objects"].strip() == "50"
    assert page.rows.get("nodes") == 2
    assert page.rows.get("tiers") == 1 and "dram" in page.by_id.get("tiers", "")
    assert page.by_id["hit-rate"].strip().endswith("%")
    assert page.by_id["req-rate"].strip() not in ("", "–")
    assert page.by_id.get("error", "").strip() == ""

    ARTIFACTS.mkdir(exist_ok=True)
    shot = ARTIFACTS / "status_page.png"
    shot.unlink(missing_ok=True)
    _chromium(
        "--virtual-time-budget=8000",
        "--window-size=1100,900",
        f"--screenshot={shot}",
        cluster.admin + "/",
    )
    assert shot.exists() and shot.stat().st_size > 10_000
