"""Lease reads (``Client.connect(..., lease_reads=True)``): a key read within the master's read
lease is reread straight from its node, and what that may and may not return."""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest

from kvstore.client import Client
from kvstore.errors import KeyNotFoundError
from tests.support import wait_until

LEASE_S = 2.0


@pytest.fixture
def cluster(cluster_factory):
    return cluster_factory(master_args=("--lease", str(LEASE_S)))


def test_leased_key_reads_while_the_master_is_paused(cluster) -> None:
    with Client.connect(cluster.address, lease_reads=True, timeout=5) as c:
        c.put("a", b"x" * 5000)
        c.batch_put(["b", "c"], [b"y" * 100, b"z" * 70000])
        assert c.get("a") == b"x" * 5000
        buf = np.empty(70000, np.uint8)
        c.batch_get_into(["b", "c"], [buf[:100], buf])  # now located, under lease
        buf[:] = 0
        os.kill(cluster.master.pid, signal.SIGSTOP)
        try:
            # The master answers nothing now; these are served by the node alone.
            assert c.get("a") == b"x" * 5000
            assert c.batch_get_into(["c"], [buf]) == [70000]
            assert bytes(buf) == b"z" * 70000
        finally:
            os.kill(cluster.master.pid, signal.SIGCONT)


def test_plain_clients_still_ask_the_master(cluster) -> None:
    # Without lease reads every read asks the master: a paused master stalls the read.
    with Client.connect(cluster.address, timeout=1) as c:
        c.put("a", b"x" * 10)
        assert c.get("a") == b"x" * 10
        os.kill(cluster.master.pid, signal.SIGSTOP)
        try:
            with pytest.raises(Exception):  # noqa: B017 - timeout or unavailable, both typed
                c.get("a")
        finally:
            os.kill(cluster.master.pid, signal.SIGCONT)


def test_own_overwrite_and_remove_are_seen_at_once(cluster) -> None:
    with Client.connect(cluster.address, lease_reads=True) as c:
        c.put("k", b"old" * 100)
        assert c.get("k") == b"old" * 100
        c.put("k", b"new" * 200)
        assert c.get("k") == b"new" * 200
        buf = bytearray(600)
        assert c.get_into("k", buf) == 600 and bytes(buf) == b"new" * 200
        c.remove("k")
        with pytest.raises(KeyNotFoundError):
            c.get("k")


def test_another_clients_overwrite_is_seen_within_one_lease(cluster) -> None:
    with (
        Client.connect(cluster.address, lease_reads=True) as reader,
        Client.connect(cluster.address) as writer,
    ):
        writer.put("k", b"1" * 4096)
        assert reader.get("k") == b"1" * 4096
        writer.put("k", b"2" * 8192)
        # Until the reader's lease ends it may still see the old value, whole; never a mix.
        start = time.monotonic()
        seen = reader.get("k")
        assert seen in (b"1" * 4096, b"2" * 8192)
        wait_until(lambda: reader.get("k") == b"2" * 8192, timeout=LEASE_S + 10)
        assert time.monotonic() - start < LEASE_S + 10
        writer.remove("k")
        wait_until(lambda: not _readable(reader, "k"), timeout=LEASE_S + 10)


def _readable(c: Client, key: str) -> bool:
    try:
        c.get(key)
        return True
    except KeyNotFoundError:
        return False


def test_leased_read_of_a_dead_node_falls_back_to_the_master(cluster) -> None:
    cluster.add_node()
    with Client.connect(cluster.address, lease_reads=True, timeout=5) as c:
        c.put("r", b"q" * 3000, replicas=2)
        assert c.get("r") == b"q" * 3000
        info = c.locate("r")
        first = info.locations[0].node_id
        # Kill the node the cached answer points at; the read must not fail while a replica lives.
        victim = next(
            n
            for n in cluster.nodes
            if _node_id(n) == first  # the ready line names the node id
        )
        victim.kill()
        assert c.get("r") == b"q" * 3000
        buf = bytearray(3000)
        assert c.get_into("r", buf) == 3000 and bytes(buf) == b"q" * 3000


def _node_id(daemon) -> str:
    return daemon.field("id")


@pytest.mark.parametrize("write", ["put", "remove"])
def test_a_lookup_racing_this_clients_write_is_not_kept(cluster, write: str) -> None:
    """Thread B's lookup is answered with the old place, then A writes; B's late answer must not
    be cached, or A would reread the old value under lease."""
    import threading

    c = Client.connect(cluster.address, lease_reads=True)
    assert c._reads.homes is not None
    c._reads.homes.enabled = False  # (one-hop reads never fill the location cache raced here)
    try:
        c.put("k", b"old" * 100)
        answered, written = threading.Event(), threading.Event()
        locations = c._reads.locate

        def slow_locations(keys):  # B is descheduled between the answer and caching it
            r = locations(keys)
            if threading.current_thread().name == "B":
                answered.set()
                assert written.wait(10)
            return r

        c._reads.locate = slow_locations  # type: ignore[method-assign]
        seen: list[bytes] = []
        b = threading.Thread(target=lambda: seen.append(c.get("k")), name="B")
        c._cache.forget([b"k"])
        b.start()
        assert answered.wait(10)
        if write == "put":
            c.put("k", b"new" * 100)
        else:
            c.remove("k")
        written.set()
        b.join(10)
        assert seen == [b"old" * 100]
        if write == "put":
            assert c.get("k") == b"new" * 100
        else:
            with pytest.raises(KeyNotFoundError):
                c.get("k")
    finally:
        c.close()


def test_a_restarted_master_voids_leases_held_from_its_earlier_life(tmp_path) -> None:
    """The new master holds nothing of the node's DRAM; the node registers with a new secret, so
    a lease read of the old answer is refused at the node and the client asks the new master."""
    import socket

    from tests.support import Cluster, Daemon

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args = ["master", "--port", str(port), "--admin-port", "0", "--lease", "60"]
    cluster = Cluster(tmp_path / "c", Daemon(args, ready=r"kvstore master ready"))
    try:
        cluster.add_node()
        with Client.connect(cluster.address, lease_reads=True, timeout=5) as c:
            c.put("k", b"old" * 1000)
            assert c.get("k") == b"old" * 1000  # located: leased for ~60 s
            cluster.master.stop()
            cluster.master = Daemon(args, ready=r"kvstore master ready")
            wait_until(lambda: _registered(c), timeout=30, what="the node to register again")
            with pytest.raises(KeyNotFoundError):
                c.get("k")
    finally:
        cluster.stop()


def _registered(c: Client) -> bool:
    try:
        return c.stats()["tiers"].get("dram", {}).get("capacity_bytes", 0) > 0
    except Exception:  # noqa: BLE001 - master not back yet
        return False
