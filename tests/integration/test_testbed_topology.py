"""Placement and read order on the multi-host test bed: the topology rules of
``master/locality.py`` with every process on a host of its own (its own namespace, address and
``/dev/shm``), each declaring its site as the bed starts it (``--host-id/--rack`` on the nodes,
``$KVSTORE_HOST_ID``/``$KVSTORE_RACK`` on every process: ``Testbed.site_env``).

One bed for the module: 4 hosts in 2 racks; the master on h0 (rack 0, no node), nodes on h1
(rack 0), h2 and h3 (rack 1), 2 MiB of DRAM each under a high watermark of 0.5. A rack cut off
is ``test_testbed.py``'s; here nothing is cut and nothing is timed: every check is where the
master put an object, or the order it answers a reader in.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from kvstore.cli.testbed import NODE_PORT, Host, Testbed, TestbedCluster, start_cluster
from tests.testbed_harness import client_on, testbed_factory  # noqa: F401

pytestmark = pytest.mark.timeout(300)

#: Objects the fill test writes: 64 KiB with the object header, 16 fill a node to its mark.
FILL_SIZE = (64 << 10) - 64


@pytest.fixture(scope="module")
def bed(testbed_factory: Callable[..., Testbed]) -> Testbed:  # noqa: F811 - the fixture
    return testbed_factory(4, 2)


@pytest.fixture(scope="module")
def cluster(bed: Testbed) -> TestbedCluster:
    return start_cluster(
        bed, dram="2MiB", master_args=("--high-watermark", "0.5", "--low-watermark", "0.4")
    )


def _host_of(bed: Testbed) -> dict[str, Host]:
    """A node's ``HOST:PORT`` (as a client's location shows it) -> its host."""
    return {f"{h.address}:{NODE_PORT}": h for h in bed.hosts}


def _on_each(bed: Testbed, asks: dict[Host, dict[str, Any]]) -> dict[Host, Any]:
    """``client_on`` on several hosts at once; each host's answer."""
    with ThreadPoolExecutor(len(asks)) as pool:
        futures = {h: pool.submit(client_on, bed, h, ask) for h, ask in asks.items()}
        return {h: f.result() for h, f in futures.items()}


def test_a_put_lands_on_the_writer_s_host_else_in_its_rack(
    bed: Testbed, cluster: TestbedCluster
) -> None:
    host_of = _host_of(bed)
    asks = {
        h: {
            "master": cluster.master_url,
            "put": [[f"own/{h.name}/{i}", 4096] for i in range(4)],
            "locate": [f"own/{h.name}/{i}" for i in range(4)],
        }
        for h in bed.hosts
    }
    seen = _on_each(bed, asks)
    h0, h1 = bed.hosts[0], bed.hosts[1]
    for writer, answer in seen.items():
        where = {host_of[locs[0]].name for locs in answer["locations"].values()}
        # h0 runs no node: its puts go to its rack's one node, h1
        assert where == {(h1 if writer is h0 else writer).name}, (writer.name, answer)


def test_replicas_in_two_racks_and_each_reader_gets_its_rack_s_first(
    bed: Testbed, cluster: TestbedCluster
) -> None:
    host_of = _host_of(bed)
    writers = [bed.hosts[1], bed.hosts[3]]  # one in each rack
    keys = {w: [[f"two/{w.name}/{i}", 4096] for i in range(8)] for w in writers}
    put = {w: {"master": cluster.master_url, "put": keys[w], "replicas": 2} for w in writers}
    _on_each(bed, put)
    every = [k for pairs in keys.values() for k in pairs]
    read = {"master": cluster.master_url, "locate": [k for k, _ in every], "get": every}
    seen = _on_each(bed, {r: read for r in bed.hosts})
    for reader, answer in seen.items():
        assert set(answer["got"].values()) == {"ok"}, (reader.name, answer["got"])
        for key, locs in answer["locations"].items():
            holders = [host_of[a] for a in locs]
            assert sorted(h.rack for h in holders) == [0, 1], (key, locs)
            writer = next(w for w in writers if key.startswith(f"two/{w.name}/"))
            assert writer in holders, f"{key}: the writer's host holds a replica"
            first = holders[0]
            assert first.rack == reader.rack, f"{reader.name} reads {key} from {first.name}"
            if reader in holders:
                assert first is reader, f"{reader.name} holds {key} but reads it elsewhere"


def test_a_full_host_fills_its_rack_next_never_the_other_rack(
    bed: Testbed, cluster: TestbedCluster
) -> None:
    host_of = _host_of(bed)
    h2, h3 = bed.hosts[2], bed.hosts[3]
    keys = [[f"fill/{i}", FILL_SIZE] for i in range(24)]  # 1.5 MiB: more than h3 has to its mark
    seen = client_on(
        bed,
        h3,
        {"master": cluster.master_url, "put": keys, "locate": [k for k, _ in keys], "get": keys},
    )
    assert set(seen["got"].values()) == {"ok"}, seen["got"]
    where = [host_of[seen["locations"][k][0]] for k, _ in keys]
    on_h3 = where.index(h2) if h2 in where else len(where)
    # its own host while that stays under the mark, then the rack's other host: in that order
    assert where == [h3] * on_h3 + [h2] * (len(where) - on_h3), [h.name for h in where]
    assert 0 < on_h3 < len(where), [h.name for h in where]
