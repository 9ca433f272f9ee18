"""etcd hiccups under load, with a real etcd: paused (SIGSTOP/SIGCONT), restarted, or cut off from
the leader by a real network partition (a veth pair between namespaces of our own).

After each fault: exactly one master serves and holds every node, every other master is a
standby again (none stuck answering NOT_LEADER while it still claims to serve), no daemon lost a
thread to an exception, and every acknowledged object reads back with its exact bytes. A leader
cut from etcd refuses, on its admin REST API too, to change anything while it cannot prove it
leads. Figures are printed: run with ``-s`` to see them.
"""

from __future__ import annotations

import json
import os
import time
import urllib.error
import urllib.request

import pytest

from kvstore.client import Client
from tests.etcd_harness import (  # noqa: F401 - fixtures
    HACluster,
    LoadProcess,
    check_all_readable,
    etcd,
    ha_factory,
    master_says,
    master_stats,
    wait_settled,
)
from tests.netns import CuttableLink
from tests.support import wait_until

FAST = ("--heartbeat-interval", "0.5", "--node-ttl", "4")
FAULTS = {
    "pause-1s": lambda e: e.pause(1.0),
    "pause-3s": lambda e: e.pause(3.0),
    "pause-6s": lambda e: e.pause(6.0),
    "restart-3s": lambda e: e.restart(downtime_s=3.0),
}


def _no_thread_died(cluster: HACluster) -> None:
    for d in [*cluster.masters, *cluster.nodes]:
        died = [ln for ln in d.lines if "Exception in thread" in ln or "Traceback" in ln]
        assert not died, f"{d.args[0]} lost a thread: {''.join(d.lines[-40:])}"


@pytest.mark.parametrize("fault", list(FAULTS))
def test_etcd_fault_under_load(ha_factory, tmp_path, fault: str) -> None:  # noqa: F811
    cluster = ha_factory(num_masters=2, num_nodes=2, master_args=FAST)
    load = LoadProcess(cluster.url, tmp_path / "load")
    try:
        load.wait_acks(50)
        t_fault = time.time()
        FAULTS[fault](cluster.etcd)
        t_back = time.time()
        leader = wait_settled(cluster, timeout=40)
        t_settled = time.time()
        load.wait_acks(50, after=t_settled)
        summary = load.finish()
    finally:
        load.kill()
    acks = load.acks()
    bad = check_all_readable(cluster.url, acks)
    print(
        f"\nETCD {fault} under load: one serving leader {t_settled - t_back:.2f}s after etcd came "
        f"back ({t_back - t_fault:.1f}s of fault); {len(acks)} acknowledged, {bad} wrong or "
        f"missing; load: {summary}"
    )
    assert bad == 0, f"{bad} acknowledged objects lost or wrong"
    assert summary["gets_wrong"] == 0
    assert wait_settled(cluster, timeout=20) is leader
    _no_thread_died(cluster)


def _rest(method: str, url: str, body: object | None = None) -> tuple[int, dict[str, object]]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method)
    req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def test_leader_cut_from_etcd_is_fenced_on_rest_and_comes_back_as_a_standby(etcd, tmp_path) -> None:  # noqa: F811
    link = CuttableLink(etcd.client_port, tag=os.getpid() % 4096)
    cluster = HACluster(tmp_path / "ha", etcd, FAST)
    load: LoadProcess | None = None
    try:
        cut = cluster.add_master(link.endpoint)  # reaches etcd only through the link
        assert cluster.leader() is cut
        other = cluster.add_master()
        for _ in range(2):
            cluster.add_node()
        wait_until(lambda: (master_stats(cut) or {}).get("num_nodes") == 2, what="two nodes")
        with Client.connect(cluster.url, timeout=10) as c:
            c.put("held/a", b"a" * 1000)
            c.put("held/b", b"b" * 1000)
        admin = cut.field("admin")
        node_id = _rest("GET", f"{admin}/api/v1/nodes")[1]["nodes"][0]["node_id"]
        load = LoadProcess(cluster.url, tmp_path / "load")
        load.wait_acks(50)

        link.cut()
        t_cut = time.time()
        # Its lease expires in etcd: the other master takes over and the nodes follow it; the
        # cut one refuses on the control protocol (it cannot know yet that it lost).
        assert wait_settled(cluster, timeout=40, cut_off=cut) is other
        t_other = time.time()
        # ... and so is every mutating admin route, the readiness probe and the table's reads.
        for method, path, body in [
            ("DELETE", "/api/v1/objects/held/a", None),
            ("POST", "/api/v1/evict", {"keys": ["held/b"]}),
            ("POST", "/api/v1/evict", {"prefix": "held/"}),
            ("POST", f"/api/v1/nodes/{node_id}/drain", None),
            ("GET", "/ready", None),
            # ... and so is every read of its stale table.
            ("GET", "/api/v1/objects/held/a", None),
            ("GET", "/api/v1/nodes", None),
            ("GET", "/api/v1/cluster", None),
        ]:
            status, reply = _rest(method, admin + path, body)
            assert (status, reply.get("error", {}).get("name")) == (503, "NOT_LEADER"), (
                method,
                path,
                status,
                reply,
            )
        assert _rest("GET", f"{admin}/health")[0] == 200  # alive, just not leading
        load.wait_acks(50, after=t_other)

        link.heal()
        t_heal = time.time()
        # etcd says its lease is gone: it becomes a standby (and could lead again).
        wait_until(lambda: master_says(cut) == "standby", timeout=20, what="a standby again")
        t_standby = time.time()
        leader = wait_settled(cluster, timeout=30)
        assert leader is other
        load.wait_acks(50, after=t_standby)
        # A working standby: it leads again (a second term in one process) when it must.
        other.kill()
        t_kill = time.time()
        assert wait_settled(cluster, timeout=40) is cut
        load.wait_acks(50, after=t_kill)
        summary = load.finish()
        acks = load.acks()
        with Client.connect(cluster.url, timeout=10) as c:
            assert c.get("held/a") == b"a" * 1000 and c.get("held/b") == b"b" * 1000
        bad = check_all_readable(cluster.url, acks)
        print(
            f"\nLEADER CUT FROM ETCD under load: the other master served with both nodes "
            f"{t_other - t_cut:.2f}s after the cut; the cut one was a standby "
            f"{t_standby - t_heal:.2f}s after the link healed, and led again after a kill -9 of "
            f"the other; {len(acks)} acknowledged, {bad} "
            f"wrong or missing; load: {summary}"
        )
        assert bad == 0 and summary["gets_wrong"] == 0
        _no_thread_died(cluster)
    finally:
        if load is not None:
            load.kill()
        cluster.stop()
        link.close()
