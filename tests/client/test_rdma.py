"""The client's RDMA transport: the memory-region cache (pure), the fallback to TCP against a
real cluster whose node offers RDMA that cannot be used here, and (marked ``rdma``) the real
one-sided path where a device exists."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from kvstore import protocol, rdma
from kvstore.client import Client
from kvstore.client.rdma import MrCache
from kvstore.errors import KeyNotFoundError, TransportUnavailableError


def _has_device() -> bool:
    try:
        return bool(rdma.discover())
    except TransportUnavailableError:
        return False


class Registrar:
    """Stands in for ``ibv_reg_mr``/``ibv_dereg_mr``: records what the cache asks for."""

    def __init__(self) -> None:
        self.live: dict[str, rdma.MemoryRegion] = {}
        self.num_registered = 0

    def register(self, name: str, buf: memoryview) -> rdma.MemoryRegion:
        self.num_registered += 1
        region = rdma.MemoryRegion(name, rdma.address_of(buf), buf.nbytes, 100 + len(name), 0)
        self.live[name] = region
        return region

    def deregister(self, name: str) -> None:
        del self.live[name]


def _lkey(cache: MrCache, view: memoryview) -> int:
    return cache.lkey(view, rdma.address_of(view))


def test_slices_of_one_buffer_share_one_registration() -> None:
    reg = Registrar()
    cache = MrCache(reg.register, reg.deregister, capacity=4)
    staging = np.zeros(1 << 16, dtype=np.uint8)
    views = [memoryview(staging)[i : i + 4096] for i in range(0, 1 << 16, 4096)]
    keys = {_lkey(cache, v) for v in views}
    assert len(keys) == 1 and reg.num_registered == 1 and len(cache) == 1
    (region,) = reg.live.values()
    assert region.length == staging.nbytes  # the whole array, not the first slice
    _lkey(cache, memoryview(b"read-only value"))  # a read-only source registers too
    assert reg.num_registered == 2


def test_cache_is_bounded_and_releases_least_recently_used() -> None:
    reg = Registrar()
    cache = MrCache(reg.register, reg.deregister, capacity=2)
    bufs = [bytearray(4096) for _ in range(3)]
    _lkey(cache, memoryview(bufs[0]))
    _lkey(cache, memoryview(bufs[1]))
    _lkey(cache, memoryview(bufs[0]))  # touch: buffer 1 is now the least recently used
    _lkey(cache, memoryview(bufs[2]))
    assert len(cache) == 2 and len(reg.live) == 2
    addrs = {r.addr for r in reg.live.values()}
    assert rdma.address_of(memoryview(bufs[1])) not in addrs
    cache.close()
    assert not reg.live and len(cache) == 0


def test_registered_buffers_stay_alive_while_cached() -> None:
    reg = Registrar()
    cache = MrCache(reg.register, reg.deregister)
    buf = bytearray(4096)
    _lkey(cache, memoryview(buf))
    with pytest.raises(BufferError):  # the cache holds an export: the memory cannot move
        buf.extend(b"x")
    cache.close()
    buf.extend(b"x")


def test_client_falls_back_to_tcp_once_when_rdma_cannot_be_used(
    cluster_factory, monkeypatch, caplog
) -> None:
    """The node publishes an RDMA offer (test hook) but neither side can open a device."""
    monkeypatch.setenv(rdma.TEST_DEVICE_ENV, "pretend0")
    cluster = cluster_factory()  # the node process inherits the hook
    rdma._logged.clear()
    rng = np.random.default_rng(5)
    values = {
        f"r{i}": rng.integers(0, 256, n, dtype=np.uint8) for i, n in enumerate([1, 4096, 1 << 20])
    }
    with caplog.at_level(logging.INFO, logger="kvstore"), Client.connect(cluster.address) as c:
        offers = c._control.call("node_transports", {})
        assert [t["rdma"]["device"] for t in offers.values()] == ["pretend0"]
        assert all(e is None for e in c.batch_put(list(values), list(values.values())))
        for k, v in values.items():
            assert c.get(k) == v.tobytes()
            buf = np.empty_like(v)
            assert c.get_into(k, buf) == v.nbytes and np.array_equal(buf, v)
        got = c.batch_get(["r0", "missing", "r2"])
        assert got[0] == values["r0"].tobytes() and isinstance(got[1], KeyNotFoundError)
        assert got[2] == values["r2"].tobytes()
        assert c._data.rdma is not None and not c._data.rdma.serves(next(iter(offers)))
    lines = [r.getMessage() for r in caplog.records if "RDMA" in r.getMessage()]
    assert len(lines) == 1 and "using TCP" in lines[0], lines
    host, port = cluster.nodes[0].field("data").split(":")
    conn = protocol.FramedSocket.connect(host, int(port), timeout=5)
    try:
        stats = conn.call("stats", {})
    finally:
        conn.close()
    assert stats["num_reads"] >= 7 and stats["num_writes"] == len(values)  # all over TCP


@pytest.mark.rdma
@pytest.mark.skipif(not _has_device(), reason="no RDMA device on this host")
def test_put_and_get_go_through_rdma(cluster_factory) -> None:  # pragma: no cover - hardware
    cluster = cluster_factory()
    rng = np.random.default_rng(6)
    values = {
        f"d{i}": rng.integers(0, 256, n, dtype=np.uint8)
        for i, n in enumerate([1, 4096, 1 << 20, 16 << 20])
    }
    with Client.connect(cluster.address, shm=False) as c:
        assert all(e is None for e in c.batch_put(list(values), list(values.values())))
        for k, v in values.items():
            assert c.get(k) == v.tobytes()
            buf = np.empty_like(v)
            assert c.get_into(k, buf) == v.nbytes and np.array_equal(buf, v)
        node_id = next(iter(c._control.call("node_transports", {})))
        assert c._data.rdma is not None and c._data.rdma.serves(node_id)
    host, port = cluster.nodes[0].field("data").split(":")
    conn = protocol.FramedSocket.connect(host, int(port), timeout=5)
    try:
        stats = conn.call("stats", {})
    finally:
        conn.close()
    assert stats["num_reads"] == 0  # every byte read one-sided, past the node's CPU
    assert stats["num_writes"] == len(values)  # each committed by rdma_commit
