"""The client's RDMA transport: the memory-region cache (pure), the fallback to TCP against a
real cluster whose node offers RDMA that cannot be used here, and (marked ``rdma``) the real
one-sided path where a device exists."""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import time
from types import SimpleNamespace

import numpy as np
import pytest
import xxhash

from kvstore import grants, protocol, rdma
from kvstore.client import Client
from kvstore.client.rdma import MrCache, RdmaTransport
from kvstore.client.transport import ReadItem, TcpTransport, WriteItem
from kvstore.errors import (
    ChecksumMismatchError,
    KeyNotFoundError,
    OutOfRangeError,
    TransportUnavailableError,
)
from kvstore.node import rdma_verbs
from kvstore.node.arena import ShmArena
from kvstore.node.rdma_verbs import NodeRdma
from kvstore.node.server import DataServer
from kvstore.types import Location
from tests.support import has_rdma_device, wait_until


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
    for i in (0, 1, 0, 2):  # one batch each; touching 0 again makes 1 the least recently used
        _lkey(cache, memoryview(bufs[i]))
        cache.end_batch()
    assert len(cache) == 2 and len(reg.live) == 2
    addrs = {r.addr for r in reg.live.values()}
    assert rdma.address_of(memoryview(bufs[1])) not in addrs
    cache.close()
    assert not reg.live and len(cache) == 0


def test_a_batch_never_evicts_its_own_buffers() -> None:
    reg = Registrar()
    cache = MrCache(reg.register, reg.deregister, capacity=2)
    bufs = [bytearray(4096) for _ in range(3)]
    keys = [_lkey(cache, memoryview(b)) for b in bufs]  # one batch over three buffers
    assert len(reg.live) == 3 and {r.lkey for r in reg.live.values()} == set(keys)
    cache.end_batch()  # its operations completed: back to the capacity, oldest out
    assert len(cache) == 2 and rdma.address_of(memoryview(bufs[0])) not in {
        r.addr for r in reg.live.values()
    }


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
    # One fallback line for the whole client, whatever the cause on this host (no pyverbs for this
    # Python on a fresh machine; pyverbs but no device where python3-pyverbs is installed).
    lines = [r.getMessage() for r in caplog.records if "RDMA off" in r.getMessage()]
    assert len(lines) == 1, [r.getMessage() for r in caplog.records]
    assert lines[0].startswith("client") and lines[0].endswith("; using TCP"), lines
    host, port = cluster.nodes[0].field("data").split(":")
    conn = protocol.FramedSocket.connect(host, int(port), timeout=5)
    try:
        stats = conn.call("stats", {})
    finally:
        conn.close()
    assert stats["num_reads"] >= 7 and stats["num_writes"] == len(values)  # all over TCP


@pytest.mark.rdma
@pytest.mark.skipif(not has_rdma_device(), reason="no RDMA device on this host")
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


# ------------------------------------------------------------------ software loopback
# No device exists where these tests run. The stand-ins below do what an RC queue pair does in
# one process: one-sided copies between registered addresses, refused (like a NIC's
# IBV_WC_REM_ACCESS_ERR) unless the remote range lies inside the region its rkey names. Node
# and client run in this process around a real DataServer and real sockets, so the client's
# planning (addresses, ranges, grant checks), the node's rdma_connect/rdma_commit and the
# queue-pair teardown on disconnect all run.
class Fabric:
    def __init__(self) -> None:
        self.regions: dict[int, rdma.MemoryRegion] = {}  # rkey -> remotely accessible region
        self.qps: dict[int, LoopbackQp] = {}
        self.next_key = 1
        self.fail_ops = False


class LoopbackContext:
    def __init__(self, fabric: Fabric, name: str) -> None:
        self.fabric = fabric
        self.device = rdma.RdmaDevice(name)
        self.port, self.gid, self.lid, self.mtu = 1, bytes(range(16)), 0, 4096
        self.mrs = rdma.MemoryRegionTable()
        self._keep: dict[str, memoryview] = {}

    def register(self, name: str, buf: memoryview, remote: bool) -> rdma.MemoryRegion:
        key = self.fabric.next_key
        self.fabric.next_key += 1
        region = rdma.MemoryRegion(name, rdma.address_of(buf), buf.nbytes, key, key)
        self.mrs.add(region)
        self._keep[name] = buf
        if remote:
            self.fabric.regions[key] = region
        return region

    def deregister(self, name: str) -> None:
        region = self.mrs.remove(name)
        self.fabric.regions.pop(region.rkey, None)
        del self._keep[name]

    def close(self) -> None:
        pass


class LoopbackQp:
    def __init__(self, ctx: LoopbackContext) -> None:
        self.ctx = ctx
        self.qpn = len(ctx.fabric.qps) + 1
        ctx.fabric.qps[self.qpn] = self
        self.remote: rdma.QpEndpoint | None = None
        self.closed = False

    def endpoint(self, psn: int) -> rdma.QpEndpoint:
        return rdma.QpEndpoint(self.ctx.gid, self.ctx.lid, self.qpn, psn, self.ctx.mtu)

    def connect(self, remote: rdma.QpEndpoint, psn: int) -> None:
        self.remote = remote

    def run(self, ops: list[rdma.RdmaOp]) -> None:
        assert self.remote is not None
        peer = self.ctx.fabric.qps.get(self.remote.qpn)
        if self.closed or peer is None or peer.closed or self.ctx.fabric.fail_ops:
            raise TransportUnavailableError("RDMA completion status 12 (retry exceeded)")
        for op in ops:
            region = self.ctx.fabric.regions.get(op.rkey)
            if region is None or not (region.addr <= op.raddr <= region.end - op.length):
                raise TransportUnavailableError("RDMA completion status 10 (remote access)")
            src, dst = (op.laddr, op.raddr) if op.write else (op.raddr, op.laddr)
            ctypes.memmove(dst, src, op.length)

    def close(self) -> None:
        self.closed = True


@pytest.fixture
def loopback(tmp_path):
    """A real DataServer (in this process) serving RDMA through the loopback fabric."""
    fabric = Fabric()
    arena = ShmArena(tmp_path / "arena.dram", 1 << 20)
    server = DataServer({"dram": arena}, grants.new_secret())
    node_ctx = LoopbackContext(fabric, "loop0")
    node_ctx.register("dram", arena.view, remote=True)
    service = NodeRdma(node_ctx, max_qps=2, make_qp=LoopbackQp)
    rdma_verbs.serve(server, service)
    server.start()
    made: list[tuple[RdmaTransport, TcpTransport]] = []

    def client() -> RdmaTransport:
        tcp = TcpTransport(5.0)
        t = RdmaTransport(
            rdma.RdmaDevice("loop0"),
            tcp.pool,
            rdma.RdmaSettings(),
            open_context=lambda: LoopbackContext(fabric, "loop0"),
            make_qp=LoopbackQp,
        )
        t.learn("n0", service.offer())
        made.append((t, tcp))
        return t

    def loc(op: str, offset: int, size: int, ttl_ms: int = 60_000) -> Location:
        g = grants.sign(
            server.secret, op, b"k", "dram", offset, size, int(time.time() * 1000) + ttl_ms
        )
        return Location("n0", server.host, server.port, g)

    yield SimpleNamespace(
        server=server,
        service=service,
        fabric=fabric,
        client=client,
        loc=loc,
        arena=arena,
        tcp=lambda: made[-1][1],
    )
    for t, tcp in made:
        t.close()
        tcp.close()
    server.stop()
    arena.close()


def test_loopback_write_commit_and_read(loopback) -> None:
    t = loopback.client()
    value = np.arange(5000, dtype=np.uint8)
    w = WriteItem(loopback.loc(grants.OP_WRITE, 4096, value.nbytes), memoryview(value), 0)
    w.checksum = xxhash.xxh3_64_intdigest(value)
    placed, rest = t.write([w])
    assert placed == [w] and rest == []
    assert bytes(loopback.arena.view[4096 : 4096 + 5000]) == value.tobytes()  # one-sided
    assert len(loopback.server.manifest) == 0  # not committed yet
    loopback.tcp().call_per_node(
        "rdma_commit", placed, lambda i: [i.location.grant.to_wire(), i.checksum]
    )
    assert w.result is None and len(loopback.server.manifest) == 1
    dest = np.zeros(5000, dtype=np.uint8)
    r = ReadItem(loopback.loc(grants.OP_READ, 4096, 5000), memoryview(dest))
    assert t.read([r]) == [] and r.result is None and r.filled == 5000
    assert np.array_equal(dest, value)
    part = np.zeros(30, dtype=np.uint8)  # token-granular: two ranges of the object
    r = ReadItem(loopback.loc(grants.OP_READ, 4096, 5000), memoryview(part), [[0, 10], [100, 20]])
    assert t.read([r]) == [] and r.result is None
    assert np.array_equal(part, np.concatenate([value[:10], value[100:120]]))
    assert loopback.server.num_reads == 0  # no read went through the node's CPU
    assert len(loopback.service.book) == 1


def test_loopback_commit_checks_the_checksum(loopback) -> None:
    t = loopback.client()
    value = memoryview(b"x" * 100)
    w = WriteItem(loopback.loc(grants.OP_WRITE, 0, 100), value, checksum=12345)
    placed, _ = t.write([w])
    loopback.tcp().call_per_node(
        "rdma_commit", placed, lambda i: [i.location.grant.to_wire(), i.checksum]
    )
    assert isinstance(w.result, ChecksumMismatchError) and len(loopback.server.manifest) == 0


def test_loopback_keeps_to_the_grant(loopback) -> None:
    t = loopback.client()
    dest = memoryview(bytearray(16))
    bad_range = ReadItem(loopback.loc(grants.OP_READ, 0, 16), dest, [[8, 16]])
    expired = ReadItem(loopback.loc(grants.OP_READ, 0, 16, ttl_ms=-1000), memoryview(bytearray(16)))
    wrong_op = ReadItem(loopback.loc(grants.OP_WRITE, 0, 16), memoryview(bytearray(16)))
    outside = ReadItem(loopback.loc(grants.OP_READ, (1 << 20) - 8, 16), memoryview(bytearray(16)))
    rest = t.read([bad_range, expired, wrong_op, outside])
    assert isinstance(bad_range.result, OutOfRangeError)  # a bad request: not retried over TCP
    assert rest == [expired, wrong_op, outside]  # TCP (the node) decides those
    assert not loopback.fabric.qps and all(not i.filled for i in rest)  # nothing even connected


def test_loopback_queue_pair_bound_and_teardown(loopback, caplog) -> None:
    rdma._logged.clear()
    clients = [loopback.client() for _ in range(3)]
    items = [
        ReadItem(loopback.loc(grants.OP_READ, 0, 8), memoryview(bytearray(8))) for _ in clients
    ]
    with caplog.at_level(logging.INFO, logger="kvstore"):
        rests = [c.read([i]) for c, i in zip(clients, items, strict=True)]
    assert rests[:2] == [[], []] and rests[2] == [items[2]]  # the third: max_qps=2, so TCP
    assert not clients[2].serves("n0") and len(loopback.service.book) == 2
    assert sum("at most 2 RDMA queue pairs" in r.getMessage() for r in caplog.records) == 1
    clients[0].close()  # its TCP connection closes: the node destroys its queue pair
    wait_until(lambda: len(loopback.service.book) == 1, what="queue pair torn down")
    node_qps = [qp for qp in loopback.fabric.qps.values() if qp.ctx is loopback.service.ctx]
    assert sum(qp.closed for qp in node_qps) == 2  # the refused one at once, client 0's now


def test_loopback_queue_pair_error_falls_back_for_that_node(loopback, caplog) -> None:
    rdma._logged.clear()
    t = loopback.client()
    ok = ReadItem(loopback.loc(grants.OP_READ, 0, 8), memoryview(bytearray(8)))
    assert t.read([ok]) == []
    loopback.fabric.fail_ops = True
    item = ReadItem(loopback.loc(grants.OP_READ, 0, 8), memoryview(bytearray(8)))
    with caplog.at_level(logging.INFO, logger="kvstore"):
        assert t.read([item]) == [item] and item.result is None  # left for TCP, no error
        again = ReadItem(loopback.loc(grants.OP_READ, 0, 8), memoryview(bytearray(8)))
        assert t.read([again]) == [again]  # the node stays on TCP
    assert sum("RDMA off" in r.getMessage() for r in caplog.records) == 1
    wait_until(lambda: len(loopback.service.book) == 0, what="failed session closed")
    assert t.dropped == {"n0"}  # the data path asks the master for the node's offer again
    loopback.fabric.fail_ops = False
    t.learn("n0", loopback.service.offer())  # the same offer: the node stays on TCP
    assert not t.serves("n0")
    restarted = dataclasses.replace(loopback.service.offer(), lid=7)
    t.learn("n0", restarted)  # a new offer (the node restarted): RDMA is tried again
    assert t.serves("n0")


def test_loopback_splits_large_ranges(loopback, monkeypatch) -> None:
    monkeypatch.setattr(rdma, "MAX_OP_BYTES", 1000)
    t = loopback.client()
    value = np.random.default_rng(7).integers(0, 256, 4500, dtype=np.uint8)
    loopback.arena.view[8192 : 8192 + 4500] = value.tobytes()
    dest = np.zeros(4500, dtype=np.uint8)
    r = ReadItem(loopback.loc(grants.OP_READ, 8192, 4500), memoryview(dest))
    assert t.read([r]) == [] and np.array_equal(dest, value)
