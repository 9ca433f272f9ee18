"""Blanks across real processes (``kvstore.client.blanks``): a small put writes into room the
master started ahead and commits naming its key, two round trips instead of three; it reads
back like any put (through the master and in one hop from its home), a node that dies with
blanks on it costs a put nothing but the usual way, and a client gives its blanks back when it
closes. Two storage nodes (one of them over shared memory), mixed sizes, several clients."""

from __future__ import annotations

import os
import random
import threading

import numpy as np

from kvstore.client import Client
from kvstore.client.blanks import MAX_BLANK_BYTES
from kvstore.errors import KVStoreError
from kvstore.placement import Homes
from tests.support import wait_until

FAST = ("--heartbeat-interval", "0.2", "--node-ttl", "2")
#: Sizes a client puts one at a time: the first three go through blanks, the last is too large.
SIZES = [1000, 4096, 60_000, MAX_BLANK_BYTES + 1]


def _num_pending(c: Client) -> int:
    return int(c._control.call("stats", {})["num_pending"])


def _put_one_by_one(c: Client, prefix: str, n: int, seed: int) -> dict[str, bytes]:
    rng = random.Random(seed)
    values = {f"{prefix}/{i}": os.urandom(rng.choice(SIZES)) for i in range(n)}
    for k, v in values.items():
        c.put(k, v)
    return values


def test_small_puts_go_through_blanks_and_read_back_everywhere(cluster_factory) -> None:
    cluster = cluster_factory(num_nodes=1, dram="64MiB")
    cluster.add_node("64MiB", extra=("--shm",))
    written: dict[str, bytes] = {}
    errors: list[BaseException] = []
    writers = [Client.connect(cluster.address) for _ in range(3)]
    try:

        def write(i: int) -> None:
            try:
                written.update(_put_one_by_one(writers[i], f"w{i}", 60, i))
            except BaseException as err:  # noqa: BLE001 - raised in the test's thread below
                errors.append(err)

        threads = [threading.Thread(target=write, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert not errors, errors
        # Most small puts went through blanks (each size's first did not), every writer's.
        small = [k for k, v in written.items() if len(v) <= MAX_BLANK_BYTES]
        assert all(w._puts.num_into_blanks > 0 for w in writers)
        assert sum(w._puts.num_into_blanks for w in writers) >= len(small) // 2
        with (
            Client.connect(cluster.address) as plain,
            Client.connect(cluster.address, lease_reads=True) as one_hop,
        ):
            for k, v in written.items():
                assert plain.get(k) == v
            # Each object lies on its key's home: a one-hop reader finds every one there.
            nodes = {loc.node_id for k in written for loc in plain.locate(k).locations}
            homes = Homes(sorted(nodes))
            assert all(
                plain.locate(k).locations[0].node_id == homes.home(k.encode()) for k in small
            )
            buf = np.empty(MAX_BLANK_BYTES + 1, np.uint8)
            for k in small:
                n = one_hop.get_into(k, buf)
                assert buf[:n].tobytes() == written[k]
            assert one_hop._reads.num_one_hop == len(small)
            # An overwrite through a blank replaces the value, for the master and in one hop.
            into_blanks = writers[0]._puts.num_into_blanks
            for key in [k for k in small if k.startswith("w0/")][:10]:
                new = os.urandom(len(written[key]))
                writers[0].put(key, new)
                assert plain.get(key) == new
                n = one_hop.get_into(key, buf)
                assert buf[:n].tobytes() == new
            assert writers[0]._puts.num_into_blanks > into_blanks
            # A key stored again since this writer's blanks were started: its blank would be
            # the older version (versions go by when their put started), so the put goes the
            # usual way, and the newest value is read everywhere.
            with Client.connect(cluster.address, blanks=False) as other:
                for key in [k for k in small if k.startswith("w0/")][10:20]:
                    other.put(key, os.urandom(len(written[key])))
                    new = os.urandom(len(written[key]))
                    into_blanks = writers[0]._puts.num_into_blanks
                    writers[0].put(key, new)
                    assert writers[0]._puts.num_into_blanks == into_blanks
                    assert plain.get(key) == new
                    n = one_hop.get_into(key, buf)
                    assert buf[:n].tobytes() == new
            # Blanks held are pending puts; the writers give them back when they close.
            stats = plain._control.call("stats", {})
            assert stats["num_pending"] == stats["num_blanks"] > 0
            for w in writers:
                w.close()
            assert _num_pending(plain) == 0
    finally:
        for w in writers:
            w.close()


def test_a_node_that_dies_with_blanks_on_it_costs_a_put_only_the_usual_way(
    cluster_factory,
) -> None:
    cluster = cluster_factory(num_nodes=2, dram="64MiB", master_args=FAST)
    with Client.connect(cluster.address, timeout=5) as c:
        before = _put_one_by_one(c, "before", 20, 1)
        for i in range(3):
            before[f"4k/{i}"] = os.urandom(4096)
            c.put(f"4k/{i}", before[f"4k/{i}"])
        victim = cluster.nodes[0]
        victim_id = victim.field("id")
        assert set(c._puts.blanks.held()[4096]) == {victim_id, cluster.nodes[1].field("id")}
        assert c._puts.blanks.held()[4096][victim_id] > 0
        victim.kill()
        # Every put still lands, whether its key's blank was on the dead node or not: a write
        # there fails and the put goes the usual way, elsewhere (so do the puts after it whose
        # key's home is the dead node: its blanks are dropped).
        after = {f"after/{i}": os.urandom(4096) for i in range(30)}
        into_blanks = c._puts.num_into_blanks
        for k, v in after.items():
            c.put(k, v)
        assert c._puts.num_into_blanks - into_blanks < len(after)
        for k, v in after.items():
            assert c.get(k) == v
        wait_until(lambda: _num_live(c) == 1, timeout=30, what="the master drops the node")
        for k, v in after.items():
            c.put(k, v[::-1])
            assert c.get(k) == v[::-1]
        lost = 0
        for k, v in before.items():
            try:
                assert c.get(k) == v
            except KVStoreError:
                lost += 1  # (on the dead node: one replica, gone with it)
        assert lost < len(before)


def _num_live(c: Client) -> int:
    return len(c._control.call("live_nodes", {})["nodes"])
