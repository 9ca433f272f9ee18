"""One-hop reads across real processes (kvstore.placement): a lease-read client reads a key from
its home node without asking the master, and every way that could go wrong is a miss that the
master answers: an evicted key, a demoted one, a dead home node, a node cut off from the master
(which stops serving by key before the master could fence it). Two storage nodes, mixed object
sizes, a writer and readers in other connections."""

from __future__ import annotations

import contextlib
import os
import random
import signal

import numpy as np
import pytest

from kvstore import protocol
from kvstore.client import Client
from kvstore.errors import ErrorCode, KeyNotFoundError, KVStoreError, NodeUnavailableError
from tests.support import wait_until

FAST = ("--heartbeat-interval", "0.2", "--node-ttl", "2")
SIZES = [1000, 4096, 70_000, 300_000, 1 << 20]


def _values(n: int, seed: int) -> dict[str, bytes]:
    rng = random.Random(seed)
    return {f"oh/{seed}/{i}": os.urandom(rng.choice(SIZES)) for i in range(n)}


def _read_into(c: Client, keys: list[str], room: int = 1 << 20) -> list[bytes | KVStoreError]:
    """Each key read with ``get_into`` into a buffer of ``room`` bytes: its bytes or error."""
    out: list[bytes | KVStoreError] = []
    buf = np.empty(room, np.uint8)
    for k in keys:
        try:
            n = c.get_into(k, buf)
            out.append(buf[:n].tobytes())
        except KVStoreError as err:
            out.append(err)
    return out


def test_reads_go_to_the_home_node_in_one_hop_even_while_the_master_is_paused(
    cluster_factory,
) -> None:
    cluster = cluster_factory(num_nodes=2, dram="64MiB")
    values = _values(48, 1)
    with (
        Client.connect(cluster.address) as writer,
        Client.connect(cluster.address, lease_reads=True, timeout=5) as reader,
    ):
        keys = list(values)
        assert writer.batch_put(keys, list(values.values())) == [None] * len(keys)
        # Both nodes hold data (placement spreads keys by their home).
        assert len({writer.locate(k).locations[0].node_id for k in keys}) == 2
        half = len(keys) // 2
        assert _read_into(reader, keys[:half]) == [values[k] for k in keys[:half]]
        assert reader._reads.num_one_hop == half  # every key was at home: none asked the master
        os.kill(cluster.master.pid, signal.SIGSTOP)
        try:
            # Keys this reader never read, with the master answering nothing: one hop each.
            assert _read_into(reader, keys[half:]) == [values[k] for k in keys[half:]]
        finally:
            os.kill(cluster.master.pid, signal.SIGCONT)
        # A buffer too small for the object: the master's way, and its error.
        big = next(k for k in keys if len(values[k]) == 1 << 20)
        with pytest.raises(KVStoreError, match="too small"):
            reader.get_into(big, np.empty(1000, np.uint8))


def test_get_and_batch_get_read_in_one_hop_too(cluster_factory) -> None:
    """Reads into new bytes (the size not known beforehand) go to the home node as well: each
    key gets room in the client's scratch buffer, and a key larger than its room goes the usual
    way (after which the client gives keys room for that size), as does any miss."""
    cluster = cluster_factory(num_nodes=2, dram="64MiB")
    values = _values(40, 2)
    large = {f"oh/large/{i}": os.urandom((3 << 20) + i) for i in range(3)}
    with (
        Client.connect(cluster.address) as writer,
        Client.connect(cluster.address, lease_reads=True, timeout=5) as reader,
    ):
        keys = list(values)
        assert writer.batch_put(keys, list(values.values())) == [None] * len(keys)
        assert writer.batch_put(list(large), list(large.values())) == [None] * len(large)
        small = [k for k in keys if len(values[k]) <= 300_000]
        big = next(k for k in keys if len(values[k]) == 1 << 20)
        assert reader.get(small[12]) == values[small[12]]  # (the first read learns the nodes)
        os.kill(cluster.master.pid, signal.SIGSTOP)
        try:
            assert reader.batch_get(small[:8]) == [values[k] for k in small[:8]]
            assert [reader.get(k) for k in small[8:12]] == [values[k] for k in small[8:12]]
            assert reader.get(big) == values[big]  # (1 MiB of room to start with)
        finally:
            os.kill(cluster.master.pid, signal.SIGCONT)
        assert reader._reads.num_one_hop == 14
        # 40 keys share 4 MiB of room: the larger ones miss it and ask the master, in one batch.
        assert reader.batch_get(keys) == [values[k] for k in keys]
        misses = sum(len(values[k]) > (4 << 20) // len(keys) for k in keys)
        hops = 14 + len(keys) - misses
        assert misses and reader._reads.num_one_hop == hops
        # 3 MiB: more than a key's room; the master's way once, then room for it.
        first, *rest = large
        assert reader.get(first) == large[first]
        assert reader._reads.num_one_hop == hops
        assert [reader.get(k) for k in rest] == [large[k] for k in rest]
        assert reader._reads.num_one_hop == hops + len(rest)
        assert isinstance(reader.batch_get(["oh/none"])[0], KeyNotFoundError)


def test_a_key_evicted_and_its_bytes_reused_is_a_miss_never_other_bytes(cluster_factory) -> None:
    cluster = cluster_factory(num_nodes=2, dram="8MiB", master_args=FAST)
    expected: dict[str, bytes] = {}
    with (
        Client.connect(cluster.address) as writer,
        Client.connect(cluster.address, lease_reads=True) as reader,
    ):
        for round_ in range(6):  # 6 x ~6 MiB into 16 MiB of DRAM: the first rounds are evicted
            batch = _values(12, 100 + round_)
            assert writer.batch_put(list(batch), list(batch.values())) == [None] * len(batch)
            expected.update(batch)
            got = _read_into(reader, list(expected))
            for k, v in zip(expected, got, strict=True):
                assert v == expected[k] or isinstance(v, KeyNotFoundError), (k, v)
        misses = [k for k, v in zip(expected, got, strict=True) if isinstance(v, KeyNotFoundError)]
        assert misses, "nothing was evicted: the test did not test eviction"
        assert reader._reads.num_one_hop > 0


def test_a_demoted_key_is_read_from_where_it_went(cluster_factory) -> None:
    cluster = cluster_factory(
        num_nodes=2, dram="4MiB", master_args=FAST, node_args=("--nvme", "32MiB")
    )
    rng = random.Random(7)
    first = {f"dm/{i}": os.urandom(64 << 10) for i in range(12)}
    with (
        Client.connect(cluster.address) as writer,
        Client.connect(cluster.address, lease_reads=True) as reader,
    ):
        assert writer.batch_put(list(first), list(first.values())) == [None] * len(first)
        assert _read_into(reader, list(first)) == list(first.values())
        hops = reader._reads.num_one_hop
        assert hops == len(first)
        # 3x the cluster's DRAM after them: the first keys go down to NVMe.
        written, i = 0, 0
        while written < 24 << 20:
            keys = [f"dm/more/{i + j}" for j in range(8)]
            vals = [os.urandom(rng.randrange(16 << 10, 256 << 10)) for _ in keys]
            assert writer.batch_put(keys, vals) == [None] * len(keys)
            written += sum(map(len, vals))
            i += 8

        def demoted() -> list[str]:
            return [k for k in first if writer.locate(k).locations[0].grant.segment == "nvme"]

        wait_until(lambda: len(demoted()) > 0, timeout=30, what="a first key on NVMe")
        on_nvme = demoted()
        assert _read_into(reader, on_nvme) == [first[k] for k in on_nvme]
        assert reader._reads.num_one_hop == hops  # none of them came by key: the master's way


def test_a_dead_home_node_sends_the_read_to_the_master_and_its_other_replica(
    cluster_factory,
) -> None:
    cluster = cluster_factory(num_nodes=3, dram="64MiB", master_args=FAST)
    values = _values(24, 3)
    with (
        Client.connect(cluster.address) as writer,
        Client.connect(cluster.address, lease_reads=True, timeout=5) as reader,
    ):
        for k, v in values.items():
            writer.put(k, v, replicas=2)
        assert _read_into(reader, list(values)) == list(values.values())
        victim = cluster.nodes[0]
        victim.kill()
        # Every key still reads, from its other replica: nothing waits past its timeout.
        assert _read_into(reader, list(values)) == list(values.values())


def test_a_node_cut_off_from_the_master_stops_serving_by_key(cluster_factory) -> None:
    """The fence rule: the master fences a node only after ``node_ttl_s`` without a
    heartbeat, and the node stops serving by key after half of that."""
    cluster = cluster_factory(num_nodes=2, dram="64MiB", master_args=FAST)
    with Client.connect(cluster.address, lease_reads=True, timeout=5) as c:
        c.put("fence/k", b"v" * 5000)
        node_id = c.locate("fence/k").locations[0].node_id
        host, port = next(
            (h, p) for n, h, p in c._control.call("live_nodes", {})["nodes"] if n == node_id
        )

        def answer() -> int:
            conn = protocol.FramedSocket.connect(host, port, timeout=5)
            try:
                conn.call("hello", {})
                conn.send_request("read_keys", {"items": [[b"fence/k", 5000]]})
                response, payload_len = conn.read_response()
                conn.discard(payload_len, memoryview(bytearray(1 << 16)))
                r = response.unwrap()[0]
                return 0 if r[0] == 5000 else r[0]
            finally:
                conn.close()

        assert answer() == 0
        os.kill(cluster.master.pid, signal.SIGSTOP)
        try:
            wait_until(
                lambda: answer() == int(ErrorCode.NODE_UNAVAILABLE),
                timeout=10,
                what="the node to stop serving by key",
            )
            # The client's one-hop read is refused; asking the paused master times out: the
            # node's bytes are not read while it may be fenced.
            with pytest.raises((NodeUnavailableError, KVStoreError)):
                c.get_into("fence/k", bytearray(5000))
        finally:
            os.kill(cluster.master.pid, signal.SIGCONT)
        # Heartbeats again: the node serves by key again (if the master declared it dead
        # meanwhile, it registered again without what its DRAM held: the key is then a miss).
        wait_until(
            lambda: answer() != int(ErrorCode.NODE_UNAVAILABLE),
            timeout=15,
            what="serving by key again after heartbeats",
        )
        buf = bytearray(5000)
        with contextlib.suppress(KeyNotFoundError):
            assert c.get_into("fence/k", buf) == 5000 and bytes(buf) == b"v" * 5000
        hops = c._reads.num_one_hop
        keys = [f"fence/new/{i}" for i in range(8)]
        c.batch_put(keys, [b"w" * 5000] * 8)
        for k in keys:
            assert c.get_into(k, buf) == 5000 and bytes(buf) == b"w" * 5000
        assert c._reads.num_one_hop > hops
