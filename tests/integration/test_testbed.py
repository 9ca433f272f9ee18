"""The multi-host test bed (``kvstore testbed``): a cluster across network namespaces as hosts.

One bed for the module: 4 hosts in 2 racks; the master on h0 (rack 0, no node: the clients'
host), nodes on h1 (rack 0), h2 and h3 (rack 1), started with ``--shm``. Nothing here measures
time: the shaping is checked in ``tc``'s own words, the rest by what the clients read.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Callable

import pytest

from kvstore.cli.testbed import (
    SHM_BASE,
    Testbed,
    TestbedCluster,
    parse_rate,
    remove_leftovers,
    start_cluster,
)
from tests.support import wait_until
from tests.testbed_harness import bed_or_skip, client_on, testbed_factory  # noqa: F401

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def bed(testbed_factory: Callable[..., Testbed]) -> Testbed:  # noqa: F811 - the fixture
    return testbed_factory(4, 2, inter_rack_rate="1gbit", intra_rack_rate="10gbit")


@pytest.fixture(scope="module")
def cluster(bed: Testbed) -> TestbedCluster:
    return start_cluster(
        bed,
        node_args=("--shm",),
        master_args=("--heartbeat-interval", "0.2", "--node-ttl", "1.5"),
    )


def _node_ids(cluster: TestbedCluster) -> dict[str, str]:
    """Host name -> node id."""
    return {n.host.name: n.ready["id"] for n in cluster.nodes}


def test_hosts_racks_and_shaped_links(bed: Testbed) -> None:
    assert [(h.name, h.rack) for h in bed.hosts] == [("h0", 0), ("h1", 0), ("h2", 1), ("h3", 1)]
    assert len({h.address for h in bed.hosts}) == 4
    for rack in (0, 1):  # each uplink shaped each way at the inter-rack rate
        for dev in (f"up{rack}", f"dn{rack}"):
            tbf = [q for q in bed.qdiscs(bed.fabric, dev) if q["kind"] == "tbf"]
            assert tbf and tbf[0]["options"]["rate"] == parse_rate("1gbit") // 8, (dev, tbf)
            kinds = {q["kind"] for q in bed.qdiscs(bed.fabric, dev)}
            assert ("netem" in kinds) == bed.netem
    for host in bed.hosts:  # each NIC at the intra-rack rate
        tbf = [q for q in bed.qdiscs(host.netns, "eth0") if q["kind"] == "tbf"]
        assert tbf[0]["options"]["rate"] == parse_rate("10gbit") // 8


def test_put_get_across_hosts_over_tcp_never_shm(bed: Testbed, cluster: TestbedCluster) -> None:
    ids = _node_ids(cluster)
    h0, h1 = bed.hosts[0], bed.hosts[1]
    keys = [[f"across-{i}", (1 << 20) + i] for i in range(6)]
    seen = client_on(
        bed,
        h0,
        {"master": cluster.master_url, "put": keys, "get": keys, "shm_nodes": list(ids.values())},
    )
    assert set(seen["got"].values()) == {"ok"}, seen
    assert not any(seen["shm"].values()), f"shm across hosts: {seen['shm']}"
    # the same node's arena is mapped by a client on its own host: shm works within a host
    local = client_on(
        bed, h1, {"master": cluster.master_url, "get": keys, "shm_nodes": [ids["h1"]]}
    )
    assert set(local["got"].values()) == {"ok"}
    assert local["shm"] == {ids["h1"]: True}


def test_a_rack_cut_off_the_other_rack_reads_its_replicas(
    bed: Testbed, cluster: TestbedCluster
) -> None:
    h0 = bed.hosts[0]
    rack = {h.address: h.rack for h in bed.hosts}
    keys = [[f"cut-{i}", 64 << 10] for i in range(24)]
    placed = client_on(
        bed,
        h0,
        {"master": cluster.master_url, "put": keys, "replicas": 2, "locate": [k for k, _ in keys]},
    )
    both = [  # a replica in each rack (all of them, where placement spreads replicas by rack)
        [k, s] for k, s in keys if {rack[a.split(":")[0]] for a in placed["locations"][k]} == {0, 1}
    ]
    assert len(both) >= 4, placed["locations"]
    admin = cluster.masters[0].ready["admin"]
    rack1 = {n.ready["id"] for n in cluster.nodes if n.host.rack == 1}
    bed.cut_rack(1)
    try:

        def rack1_gone() -> bool:
            with urllib.request.urlopen(f"{admin}/api/v1/nodes", timeout=5) as r:
                nodes = json.loads(r.read())["nodes"]
            return all(n["state"] != "active" for n in nodes if n["node_id"] in rack1)

        wait_until(rack1_gone, timeout=30, interval=0.2, what="the master to lose rack 1")
        seen = client_on(bed, h0, {"master": cluster.master_url, "get": both, "timeout": 5.0})
        assert set(seen["got"].values()) == {"ok"}, seen
    finally:
        bed.heal_rack(1)


def _leftovers(prefix: str) -> list[str]:
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    found = [line.split()[0] for line in names.splitlines() if line.startswith(prefix)]
    found += ["link"] if prefix.replace("-", "") in links else []
    found += ["shm"] if (SHM_BASE / prefix).exists() else []
    return found


def test_cleanup_at_close_and_after_a_crash() -> None:
    bed = bed_or_skip(2, 2)
    sleeper = bed.start(bed.hosts[1], ["sleep", "300"])
    assert _leftovers(bed.prefix)
    assert bed.prefix not in " ".join(remove_leftovers())  # a live run is spared
    bed.close()
    assert _leftovers(bed.prefix) == []
    assert sleeper.proc.poll() is not None
    # a run whose owner dies by SIGKILL: `kvstore testbed down` removes what it left
    code = (
        "from kvstore.cli.testbed import Testbed\nb = Testbed(2, 2)\nprint(b.prefix, flush=True)\n"
    )
    code += "b.start(b.hosts[0], ['sleep', '300'])\nimport time; time.sleep(300)\n"
    owner = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert owner.stdout is not None
    prefix = owner.stdout.readline().strip()
    try:
        wait_until(lambda: bool(_leftovers(prefix)), timeout=10, what="the crashed run's bed")
    finally:
        os.kill(owner.pid, signal.SIGKILL)
        owner.wait()
    down = subprocess.run(
        [sys.executable, "-m", "kvstore", "testbed", "down"], capture_output=True, text=True
    )
    assert down.returncode == 0 and prefix in down.stdout, down
    assert _leftovers(prefix) == []
