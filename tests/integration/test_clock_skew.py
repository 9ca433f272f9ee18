"""Grants expire by the master's clock, whatever the wall clocks of the nodes say.

Each daemon here is a real process whose wall clock (``time.time``) is set an hour off by a
``sitecustomize`` module on its path; the test process keeps the true time. A node an hour
ahead of the master used to refuse every fresh grant; a master an hour ahead of its nodes (or a
node an hour behind) had them accept grants long past their expiry and return the bytes.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvstore.client import Client
from kvstore.errors import GrantInvalidError
from tests.support import Cluster, Daemon, wait_until

HOUR_S = 3600.0
SKEW = """\
import os
import time

_skew = float(os.environ["KVSTORE_TEST_CLOCK_SKEW_S"])
_time, _time_ns = time.time, time.time_ns
time.time = lambda: _time() + _skew
time.time_ns = lambda: _time_ns() + int(_skew * 1e9)
"""


def _skewed(tmp: Path, skew_s: float) -> dict[str, str]:
    """The environment of a process whose wall clock runs ``skew_s`` seconds off."""
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "sitecustomize.py").write_text(SKEW)
    return {"PYTHONPATH": str(tmp), "KVSTORE_TEST_CLOCK_SKEW_S": str(skew_s)}


@pytest.fixture(
    params=[("master", HOUR_S), ("nodes", HOUR_S), ("nodes", -HOUR_S)],
    ids=["master-an-hour-ahead", "nodes-an-hour-ahead", "nodes-an-hour-behind"],
)
def skewed_cluster(
    request: pytest.FixtureRequest, tmp_path: Path
) -> Iterator[tuple[Cluster, float]]:
    """Two nodes and a master with a one-second lease; the master's or the nodes' clock off.
    Yields the cluster and the master's skew (seconds)."""
    who, skew_s = request.param
    env = _skewed(tmp_path / "skew", skew_s)
    master = Daemon(
        ["master", "--port", "0", "--admin-port", "0", "--lease", "1"],
        ready=r"kvstore master ready",
        env=env if who == "master" else None,
    )
    cluster = Cluster(tmp_path, master)
    try:
        for i in range(2):
            if who == "nodes":
                args = ["node", "--master", cluster.address, "--port", "0", "--dram", "64MiB"]
                args += ["--data-dir", str(tmp_path / f"n{i}")]
                cluster.nodes.append(Daemon(args, ready=r"kvstore node ready", env=env))
            else:
                cluster.add_node("64MiB")
        yield cluster, skew_s if who == "master" else 0.0
    finally:
        cluster.stop()


def test_a_grant_holds_until_the_masters_clock_says_it_ends(
    skewed_cluster: tuple[Cluster, float],
) -> None:
    cluster, master_skew_s = skewed_cluster
    value = b"kv" * 40_000
    with Client.connect(cluster.address, shm=False, lease_reads=False) as c:
        assert c.batch_put([b"skew/a", b"skew/b"], [value, value[:1000]]) == [None, None]
        # A fresh grant reads (a node ahead of the master refused it).
        info = c.locate("skew/a")
        buf = bytearray(len(value))
        assert c.read_located(info, buf) == len(value) and bytes(buf) == value
        # Once it has ended by the master's clock, no node serves it (a node behind the
        # master, or a master ahead of its nodes, served it for another hour).
        expires_ms = min(loc.grant.expires_ms for loc in info.locations)
        master_ms = lambda: (time.time() + master_skew_s) * 1000  # noqa: E731
        wait_until(lambda: master_ms() > expires_ms + 100, timeout=30, what="the lease's end")
        with pytest.raises(GrantInvalidError):
            c.read_located(info, buf)
        c.release_lease(info)
        # A new lease reads again.
        assert c.get("skew/b") == value[:1000]
