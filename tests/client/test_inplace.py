"""Zero-copy reads in place (kvstore.client.inplace): views of same-host objects in the node's
shared memory, checked by checksum, trusted only while their grants hold."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import numpy as np
import pytest

from kvstore import grants
from kvstore.client import Client
from kvstore.client.inplace import InPlaceReads
from kvstore.client.transport import checksum
from kvstore.errors import KeyNotFoundError
from kvstore.types import Location, ObjectInfo
from tests.support import wait_until

SIZE = 64 << 10


def _values(n: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(11)
    return {f"inplace/{i}": rng.integers(0, 256, SIZE, dtype=np.uint8) for i in range(n)}


def test_views_are_the_objects_bytes_and_go_on_exit(cluster_factory) -> None:
    cluster = cluster_factory(node_args=("--shm",))
    values = _values(4)
    with Client.connect(cluster.address) as c:
        c.batch_put(list(values), list(values.values()))
        infos = c.batch_locate([*values, "inplace/missing"])
        assert isinstance(infos[-1], KeyNotFoundError)
        found = [i for i in infos if isinstance(i, ObjectInfo)]
        with c.read_in_place(found) as reads:
            assert len(reads) == 4 and all(reads.mapped(i) for i in range(4))
            views = [reads.view(i) for i in range(4)]
            for v, want in zip(views, values.values(), strict=True):
                assert v is not None and v.readonly
                assert np.array_equal(np.frombuffer(v, np.uint8), want)
            assert reads.intact()
        assert not reads.mapped(0) and reads.view(0) is None
        with pytest.raises(ValueError):
            bytes(views[0])  # released: the mapping is not pinned past the block
        c.release_leases(found)


def test_without_shared_memory_every_view_is_none(cluster_factory) -> None:
    cluster = cluster_factory()  # node without --shm: reads go over TCP
    values = _values(2)
    with Client.connect(cluster.address) as c:
        c.batch_put(list(values), list(values.values()))
        infos = [i for i in c.batch_locate(list(values)) if isinstance(i, ObjectInfo)]
        with c.read_in_place(infos) as reads:
            assert not reads.mapped(0) and not reads.mapped(1)
            assert reads.view(0) is None and reads.view(1) is None
        c.release_leases(infos)


def test_a_corrupt_replica_gets_no_view_and_is_reported(cluster_factory) -> None:
    cluster = cluster_factory(node_args=("--shm",))
    values = _values(2)
    with Client.connect(cluster.address) as c:
        c.batch_put(list(values), list(values.values()))
        infos = [i for i in c.batch_locate(list(values)) if isinstance(i, ObjectInfo)]
        loc = infos[1].locations[0]
        arena = Path("/dev/shm") / f"kvstore-{loc.node_id}.arena"
        with open(arena, "r+b") as f:  # behind the store's back
            f.seek(loc.grant.offset + 100)
            f.write(b"\xff" * 16)
        with c.read_in_place(infos) as reads:
            assert reads.mapped(1), "mapped: the check comes when the bytes are taken"
            assert reads.view(0) is not None and reads.view(1) is None
            assert not reads.mapped(1)
        c.release_leases(infos)
        # Reported on close: the master dropped its only replica, so the key is gone (a
        # read would otherwise have found the same fault).
        assert isinstance(c.batch_locate(["inplace/1"])[0], KeyNotFoundError)
        buf = np.empty(SIZE, np.uint8)
        assert c.get_into("inplace/0", buf) == SIZE and np.array_equal(buf, values["inplace/0"])


def test_a_view_stays_intact_while_its_node_is_dropped_and_comes_back(cluster_factory) -> None:
    """A reader holds a view; both nodes stop long enough to be declared dead, come back with
    the same arenas and register again, and a writer fills the pool: the view's bytes do not
    change while ``intact()`` says they cannot have (the master keeps the extents a lease was
    on out of the new allocators until the lease ends)."""
    cluster = cluster_factory(
        dram="2MiB", master_args=("--lease", "120", "--node-ttl", "2"), node_args=("--shm",)
    )
    value = np.random.default_rng(5).integers(0, 256, SIZE, dtype=np.uint8)
    with Client.connect(cluster.address) as c, Client.connect(cluster.address) as writer:
        c.put("inplace/held", value)
        infos = [i for i in c.batch_locate(["inplace/held"]) if isinstance(i, ObjectInfo)]
        with c.read_in_place(infos) as reads:
            view = reads.view(0)
            assert view is not None
            for node in cluster.nodes:
                os.kill(node.pid, signal.SIGSTOP)
            try:
                wait_until(lambda: c.stats()["num_nodes"] == 0, timeout=60, what="nodes dropped")
            finally:
                for node in cluster.nodes:
                    os.kill(node.pid, signal.SIGCONT)
            wait_until(lambda: c.stats()["num_nodes"] == 2, timeout=60, what="nodes back")
            fill = np.full(SIZE, 0xAB, np.uint8)
            keys = [f"inplace/fill/{i}" for i in range(2 * (2 << 20) // SIZE)]
            put = writer.batch_put(keys, [fill] * len(keys))
            assert sum(r is None for r in put) >= len(keys) // 2, "the writer filled the pool"
            assert reads.intact()
            assert np.array_equal(np.frombuffer(view, np.uint8), value)
        c.release_leases(infos)


def _info(expires_ms: int, data: bytes) -> ObjectInfo:
    g = grants.Grant(grants.OP_READ, b"k", "seg", 0, len(data), expires_ms, b"")
    return ObjectInfo(len(data), checksum(memoryview(data)), [Location("n1", "h", 1, g)], 7)


def test_intact_only_while_every_grant_holds() -> None:
    data = b"x" * 4096
    infos = [_info(10_000, data), _info(20_000, data)]
    now = [9_000.0]
    reads = InPlaceReads(
        infos, lambda locs: [memoryview(data) for _ in locs], clock_ms=lambda: now[0]
    )
    assert reads.view(0) is not None and reads.view(1) is not None
    assert reads.intact()
    now[0] = 10_000.0  # the earliest grant ran out: a copy may have raced a reuse
    assert not reads.intact()
    reads.close()


def test_views_of_the_wrong_size_or_no_location_are_refused() -> None:
    data = b"y" * 4096
    good, short = _info(10_000, data), _info(10_000, data)
    nowhere = ObjectInfo(4096, good.checksum, [], 0)
    views = {
        id(good.locations[0]): memoryview(data),
        id(short.locations[0]): memoryview(data[:100]),
    }
    reads = InPlaceReads(
        [good, short, nowhere], lambda locs: [views[id(loc)] for loc in locs], clock_ms=lambda: 0.0
    )
    assert [reads.mapped(i) for i in range(3)] == [True, False, False]
    assert reads.view(0) is not None and reads.view(1) is None and reads.view(2) is None
    reads.close()


def test_a_view_that_fails_its_checksum_is_reported_once_on_close() -> None:
    data = b"z" * 4096
    info = _info(10_000, data)
    wrong = ObjectInfo(info.size, info.checksum ^ 1, info.locations, info.lease)
    reported: list[list[list]] = []
    reads = InPlaceReads(
        [wrong, info], lambda locs: [memoryview(data) for _ in locs], reported.append, lambda: 0.0
    )
    assert reads.view(0) is None and reads.view(1) is not None
    assert reported == []
    reads.close()
    g = info.locations[0].grant
    assert reported == [[[g.key, "n1", g.segment, g.offset, wrong.checksum]]]
