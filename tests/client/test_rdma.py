"""The client's RDMA transport: the memory-region cache (pure), the fallback to TCP against a
real cluster whose node offers RDMA that cannot be used here, and (marked ``rdma``) the real
one-sided path where a device exists."""

from __future__ import annotations

import ctypes
import dataclasses
import itertools
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import xxhash

from kvstore import grants, protocol, rdma
from kvstore.client import Client
from kvstore.client import rdma as client_rdma
from kvstore.client.rdma import MrCache, RdmaTransport
from kvstore.client.transport import ReadItem, TcpTransport, WriteItem
from kvstore.errors import (
    ChecksumMismatchError,
    KeyNotFoundError,
    OutOfRangeError,
    TransportUnavailableError,
)
from kvstore.node import rdma as rdma_node
from kvstore.node.arena import ShmArena
from kvstore.node.rdma import NodeRdma
from kvstore.node.server import DataServer
from kvstore.rdma import ibverbs as rdma_verbs
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


def _lkey(cache: MrCache, view: memoryview, pins: list[str]) -> int:
    return cache.lkey(view, rdma.address_of(view), pins)


def test_slices_of_one_buffer_share_one_registration() -> None:
    reg = Registrar()
    cache = MrCache(reg.register, reg.deregister, capacity=4)
    staging = np.zeros(1 << 16, dtype=np.uint8)
    views = [memoryview(staging)[i : i + 4096] for i in range(0, 1 << 16, 4096)]
    pins: list[str] = []
    keys = {_lkey(cache, v, pins) for v in views}
    assert len(keys) == 1 and reg.num_registered == 1 and len(cache) == 1
    (region,) = reg.live.values()
    assert region.length == staging.nbytes  # the whole array, not the first slice
    _lkey(cache, memoryview(b"read-only value"), pins)  # a read-only source registers too
    assert reg.num_registered == 2
    cache.end_batch(pins)
    assert pins == [] and len(cache) == 2


def test_cache_is_bounded_and_releases_least_recently_used() -> None:
    reg = Registrar()
    cache = MrCache(reg.register, reg.deregister, capacity=2)
    bufs = [bytearray(4096) for _ in range(3)]
    for i in (0, 1, 0, 2):  # one batch each; touching 0 again makes 1 the least recently used
        pins: list[str] = []
        _lkey(cache, memoryview(bufs[i]), pins)
        cache.end_batch(pins)
    assert len(cache) == 2 and len(reg.live) == 2
    addrs = {r.addr for r in reg.live.values()}
    assert rdma.address_of(memoryview(bufs[1])) not in addrs
    cache.close()
    assert not reg.live and len(cache) == 0


def test_a_batch_never_evicts_its_own_buffers() -> None:
    reg = Registrar()
    cache = MrCache(reg.register, reg.deregister, capacity=2)
    bufs = [bytearray(4096) for _ in range(3)]
    pins: list[str] = []
    keys = [_lkey(cache, memoryview(b), pins) for b in bufs]  # one batch over three buffers
    assert len(reg.live) == 3 and {r.lkey for r in reg.live.values()} == set(keys)
    cache.end_batch(pins)  # its operations completed: back to the capacity, oldest out
    assert len(cache) == 2 and rdma.address_of(memoryview(bufs[0])) not in {
        r.addr for r in reg.live.values()
    }


def test_a_batch_never_evicts_another_threads_buffers() -> None:
    """Two batches in flight at once (two threads): one ending trims only what neither uses."""
    reg = Registrar()
    cache = MrCache(reg.register, reg.deregister, capacity=1)
    mine, theirs = bytearray(4096), bytearray(4096)
    my_pins: list[str] = []
    their_pins: list[str] = []
    _lkey(cache, memoryview(mine), my_pins)
    _lkey(cache, memoryview(theirs), their_pins)
    cache.end_batch(their_pins)  # the other batch is done first: mine is still in flight
    assert rdma.address_of(memoryview(mine)) in {r.addr for r in reg.live.values()}
    cache.end_batch(my_pins)
    assert len(cache) == 1


def test_registered_buffers_stay_alive_while_cached() -> None:
    reg = Registrar()
    cache = MrCache(reg.register, reg.deregister)
    buf = bytearray(4096)
    pins: list[str] = []
    _lkey(cache, memoryview(buf), pins)
    cache.end_batch(pins)
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
    rdma.devices._logged.clear()
    rng = np.random.default_rng(5)
    values = {
        f"r{i}": rng.integers(0, 256, n, dtype=np.uint8) for i, n in enumerate([1, 4096, 1 << 20])
    }
    with caplog.at_level(logging.INFO, logger="kvstore"), Client.connect(cluster.address) as c:
        offers = c._control.call("node_transports", {})
        assert [t["rdma"]["device"] for t in offers.values()] == ["pretend0"] * 2
        assert all(e is None for e in c.batch_put(list(values), list(values.values())))
        for k, v in values.items():
            assert c.get(k) == v.tobytes()
            buf = np.empty_like(v)
            assert c.get_into(k, buf) == v.nbytes and np.array_equal(buf, v)
        got = c.batch_get(["r0", "missing", "r2"])
        assert got[0] == values["r0"].tobytes() and isinstance(got[1], KeyNotFoundError)
        assert got[2] == values["r2"].tobytes()
        assert c._data.rdma is not None
        assert not any(c._data.rdma.serves(node_id) for node_id in offers)
    # One fallback line for the whole client, whatever the cause on this host (no pyverbs for this
    # Python on a fresh machine; pyverbs but no device where python3-pyverbs is installed).
    lines = [r.getMessage() for r in caplog.records if "RDMA off" in r.getMessage()]
    assert len(lines) == 1, [r.getMessage() for r in caplog.records]
    assert lines[0].startswith("client") and lines[0].endswith("; using TCP"), lines
    stats = []
    for node in cluster.nodes:
        host, port = node.field("data").split(":")
        conn = protocol.FramedSocket.connect(host, int(port), timeout=5)
        try:
            stats.append(conn.call("stats", {}))
        finally:
            conn.close()
    assert sum(s["num_reads"] for s in stats) >= 7  # all over TCP
    assert sum(s["num_writes"] for s in stats) == len(values)


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
# IBV_WC_REM_ACCESS_ERR) unless the remote range lies inside the region its rkey names, and
# (like IBV_WC_LOC_PROT_ERR) unless the local range lies inside a live registration of the
# lkey's. Nodes and clients run in this process around real DataServers and real sockets, so
# the client's planning (addresses, ranges, grant checks), the node's rdma_connect/rdma_commit
# and the queue-pair teardown on disconnect all run. Hooks per node device (``Stall``) hold a
# node's rdma_connect, or the completion of operations towards it, until the test lets go.
#: Longest a test waits for something that should happen at once (a bound, so a failing test
#: ends; passing runs never wait it out).
BOUND_S = 10.0


class Fabric:
    def __init__(self) -> None:
        self.regions: dict[int, rdma.MemoryRegion] = {}  # rkey -> remotely accessible region
        self.qps: dict[int, LoopbackQp] = {}
        self.keys = itertools.count(1)  # (next() is atomic: contexts register from any thread)
        self.qpns = itertools.count(1)
        self.fail_ops = False
        #: node device name -> called (in the node's thread) as the node connects a queue pair
        self.connect_hooks: dict[str, Callable[[], None]] = {}
        #: node device name -> called (in the client's thread) before operations towards it run
        self.run_hooks: dict[str, Callable[[], None]] = {}


class Stall:
    """A hook that holds whoever calls it until the test opens it (or BOUND_S passes)."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.opened = threading.Event()
        self.num_calls = 0

    def __call__(self) -> None:
        self.num_calls += 1
        self.entered.set()
        self.opened.wait(BOUND_S)

    def open(self) -> None:
        self.opened.set()


class LoopbackContext:
    def __init__(self, fabric: Fabric, name: str) -> None:
        self.fabric = fabric
        self.device = rdma.RdmaDevice(name)
        self.port, self.gid, self.lid, self.mtu = 1, bytes(range(16)), 0, 4096
        self.mrs = rdma.MemoryRegionTable()
        self._keep: dict[str, memoryview] = {}
        self._lock = threading.Lock()  # registrations change while other threads' ops run

    def register(self, name: str, buf: memoryview, remote: bool) -> rdma.MemoryRegion:
        key = next(self.fabric.keys)
        region = rdma.MemoryRegion(name, rdma.address_of(buf), buf.nbytes, key, key)
        with self._lock:
            self.mrs.add(region)
            self._keep[name] = buf
        if remote:
            self.fabric.regions[key] = region
        return region

    def deregister(self, name: str) -> None:
        with self._lock:
            region = self.mrs.remove(name)
            del self._keep[name]
        self.fabric.regions.pop(region.rkey, None)

    def local_ok(self, op: rdma.RdmaOp) -> bool:
        """Whether ``op``'s local range lies inside a live registration with its lkey."""
        with self._lock:
            try:
                return self.mrs.locate(op.laddr, op.length).lkey == op.lkey
            except OutOfRangeError:
                return False

    def close(self) -> None:
        pass


class LoopbackQp:
    def __init__(self, ctx: LoopbackContext) -> None:
        self.ctx = ctx
        self.qpn = next(ctx.fabric.qpns)
        ctx.fabric.qps[self.qpn] = self
        self.remote: rdma.QpEndpoint | None = None
        self.closed = False
        self.running = 0  # threads inside run() at once (an RC queue pair allows one)

    def endpoint(self, psn: int) -> rdma.QpEndpoint:
        return rdma.QpEndpoint(self.ctx.gid, self.ctx.lid, self.qpn, psn, self.ctx.mtu)

    def connect(self, remote: rdma.QpEndpoint, psn: int) -> None:
        hook = self.ctx.fabric.connect_hooks.get(self.ctx.device.name)
        if hook is not None:
            hook()
        self.remote = remote

    def run(self, ops: list[rdma.RdmaOp]) -> None:
        assert self.remote is not None
        self.running += 1
        try:
            assert self.running == 1, "two threads drive one queue pair"
            peer = self.ctx.fabric.qps.get(self.remote.qpn)
            if peer is not None and (hook := self.ctx.fabric.run_hooks.get(peer.ctx.device.name)):
                hook()
            if self.closed or peer is None or peer.closed or self.ctx.fabric.fail_ops:
                raise TransportUnavailableError("RDMA completion status 12 (retry exceeded)")
            for op in ops:
                region = self.ctx.fabric.regions.get(op.rkey)
                if region is None or not (region.addr <= op.raddr <= region.end - op.length):
                    raise TransportUnavailableError("RDMA completion status 10 (remote access)")
                if not self.ctx.local_ok(op):
                    raise TransportUnavailableError("RDMA completion status 4 (local protection)")
                src, dst = (op.laddr, op.raddr) if op.write else (op.raddr, op.laddr)
                ctypes.memmove(dst, src, op.length)
        finally:
            self.running -= 1

    def close(self) -> None:
        self.closed = True


class LoopNode:
    """A real DataServer (in this process) serving RDMA through the loopback fabric."""

    def __init__(self, fabric: Fabric, tmp_path: Path, node_id: str, device: str) -> None:
        self.node_id = node_id
        self.device = device
        self.arena = ShmArena(tmp_path / f"arena-{node_id}.dram", 1 << 20)
        self.server = DataServer({"dram": self.arena}, grants.new_secret())
        self.ctx = LoopbackContext(fabric, device)
        self.ctx.register("dram", self.arena.view, remote=True)
        self.service = NodeRdma(self.ctx, max_qps=2, make_qp=LoopbackQp)
        rdma_node.serve(self.server, self.service)
        self.server.start()

    def loc(self, op: str, offset: int, size: int, ttl_ms: int = 60_000) -> Location:
        g = grants.sign(
            self.server.secret, op, b"k", "dram", offset, size, int(time.time() * 1000) + ttl_ms
        )
        return Location(self.node_id, self.server.host, self.server.port, g)

    def stop(self) -> None:
        self.server.stop()
        self.arena.close()


@pytest.fixture
def loopback(tmp_path):
    """Node ``n0`` (more with ``add_node``) and clients, all on one loopback fabric."""
    fabric = Fabric()
    nodes = [LoopNode(fabric, tmp_path, "n0", "loop0")]
    made: list[tuple[RdmaTransport, TcpTransport]] = []

    def client(timeout: float = 5.0) -> RdmaTransport:
        """A client transport that knows every node started so far."""
        tcp = TcpTransport(timeout)
        t = RdmaTransport(
            rdma.RdmaDevice("loop0"),
            tcp.pool,
            rdma.RdmaConfig(),
            open_context=lambda: LoopbackContext(fabric, "loop0"),
            make_qp=LoopbackQp,
        )
        for node in nodes:
            t.learn(node.node_id, node.service.offer())
        made.append((t, tcp))
        return t

    def add_node(node_id: str) -> LoopNode:
        node = LoopNode(fabric, tmp_path, node_id, f"loop-{node_id}")
        nodes.append(node)
        return node

    n0 = nodes[0]
    yield SimpleNamespace(
        server=n0.server,
        service=n0.service,
        fabric=fabric,
        client=client,
        loc=n0.loc,
        arena=n0.arena,
        tcp=lambda: made[-1][1],
        add_node=add_node,
    )
    for t, tcp in made:
        t.close()
        tcp.close()
    for node in nodes:
        node.stop()


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
        "rdma_commit", placed, lambda i, refs: [refs.wire(i.location.grant), i.checksum]
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
        "rdma_commit", placed, lambda i, refs: [refs.wire(i.location.grant), i.checksum]
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
    rdma.devices._logged.clear()
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
    rdma.devices._logged.clear()
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
    monkeypatch.setattr(rdma_verbs, "MAX_OP_BYTES", 1000)
    t = loopback.client()
    value = np.random.default_rng(7).integers(0, 256, 4500, dtype=np.uint8)
    loopback.arena.view[8192 : 8192 + 4500] = value.tobytes()
    dest = np.zeros(4500, dtype=np.uint8)
    r = ReadItem(loopback.loc(grants.OP_READ, 8192, 4500), memoryview(dest))
    assert t.read([r]) == [] and np.array_equal(dest, value)


# ------------------------------------------------------------------ one slow node, many threads
def _read_item(node: LoopNode | SimpleNamespace, offset: int, size: int) -> ReadItem:
    return ReadItem(node.loc(grants.OP_READ, offset, size), memoryview(bytearray(size)))


def _fill(node: LoopNode, seed: int) -> bytes:
    """Put known bytes at the start of a node's arena (as an earlier write would have)."""
    data = np.random.default_rng(seed).integers(0, 256, 1 << 16, dtype=np.uint8).tobytes()
    node.arena.view[: len(data)] = data
    return data


def _in_thread(target: Callable[[], object]) -> tuple[threading.Thread, list[object]]:
    """Run ``target`` in a thread; the list gets its result."""
    out: list[object] = []
    th = threading.Thread(target=lambda: out.append(target()), daemon=True)
    th.start()
    return th, out


def test_a_stalled_connect_does_not_hold_up_other_nodes(loopback) -> None:
    """Node a's rdma_connect reaches the node and gets no answer (until the test says so); a read
    from node b, in another thread, completes meanwhile, connect to b included."""
    a, b = loopback.add_node("a"), loopback.add_node("b")
    data_a, data_b = _fill(a, 1), _fill(b, 2)
    stall = Stall()
    loopback.fabric.connect_hooks[a.device] = stall
    t = loopback.client(timeout=60.0)  # a's connect ends when the test opens it, not by timeout
    item_a, item_b = _read_item(a, 0, 4096), _read_item(b, 4096, 4096)
    th_a, rest_a = _in_thread(lambda: t.read([item_a]))
    try:
        assert stall.entered.wait(BOUND_S), "a's rdma_connect never reached node a"
        th_b, rest_b = _in_thread(lambda: t.read([item_b]))
        th_b.join(BOUND_S)
        b_done_while_a_connects = not th_b.is_alive() and th_a.is_alive()
    finally:
        stall.open()
        th_a.join(BOUND_S)
    assert b_done_while_a_connects, "the read from b waited for a's connect"
    assert rest_b == [[]] and bytes(item_b.dest) == data_b[4096:8192]  # over RDMA
    assert not th_a.is_alive() and rest_a == [[]] and bytes(item_a.dest) == data_a[:4096]
    assert stall.num_calls == 1 and t.serves("a") and t.serves("b")


def test_a_silent_node_times_out_and_falls_back_with_one_line(loopback, caplog) -> None:
    """Node a never answers rdma_connect: the connect ends at the client's timeout, a second
    reader of a waits for that one connect (no second one), both leave their items for TCP, one
    line says so, and node b's reads go on meanwhile."""
    rdma.devices._logged.clear()
    a, b = loopback.add_node("a"), loopback.add_node("b")
    data_b = _fill(b, 3)
    t = loopback.client(timeout=2.0)
    assert t.read([_read_item(b, 0, 8)]) == []  # b connected before a goes silent
    stall = Stall()
    loopback.fabric.connect_hooks[a.device] = stall
    b_done = threading.Event()
    b_done_at_fallback: list[bool] = []

    class Watch(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "RDMA off" in record.getMessage():
                b_done_at_fallback.append(b_done.is_set())

    watch = Watch()
    logging.getLogger("kvstore").addHandler(watch)
    first, second = _read_item(a, 0, 8), _read_item(a, 8, 8)
    try:
        with caplog.at_level(logging.INFO, logger="kvstore"):
            th1, rest1 = _in_thread(lambda: t.read([first]))
            assert stall.entered.wait(BOUND_S), "a's rdma_connect never reached node a"
            th2, rest2 = _in_thread(lambda: t.read([second]))
            item_b = _read_item(b, 64, 4096)
            assert t.read([item_b]) == [] and bytes(item_b.dest) == data_b[64 : 64 + 4096]
            b_done.set()
            th1.join(2.0 + BOUND_S)
            th2.join(2.0 + BOUND_S)
            assert not th1.is_alive() and not th2.is_alive(), "a's connect outlived its timeout"
    finally:
        logging.getLogger("kvstore").removeHandler(watch)
        stall.open()
    assert rest1 == [[first]] and rest2 == [[second]]  # left for TCP, no error
    assert first.result is None and second.result is None and not first.filled
    lines = [r.getMessage() for r in caplog.records if "RDMA off" in r.getMessage()]
    assert len(lines) == 1 and lines[0].startswith("client, node a: RDMA off (rdma_connect"), lines
    assert b_done_at_fallback == [True], "b's read waited for a's connect to time out"
    assert stall.num_calls == 1  # the second reader waited for the first one's connect
    assert not t.serves("a") and t.serves("b") and t.dropped == {"a"}


def test_a_stalled_completion_holds_up_neither_other_nodes_nor_its_timeout(loopback) -> None:
    """Operations towards node a do not complete (until the test says so): a read from node b
    completes meanwhile, and a second read from a gives up at its own timeout (its item left
    for TCP) while a's queue pair is still busy; a keeps RDMA."""
    a, b = loopback.add_node("a"), loopback.add_node("b")
    data_a, data_b = _fill(a, 4), _fill(b, 5)
    t = loopback.client(timeout=1.0)
    assert t.read([_read_item(a, 0, 8)]) == [] and t.read([_read_item(b, 0, 8)]) == []
    stall = Stall()
    loopback.fabric.run_hooks[a.device] = stall
    item_a, waiting_a, item_b = _read_item(a, 0, 4096), _read_item(a, 8, 8), _read_item(b, 8, 8)
    th_a, rest_a = _in_thread(lambda: t.read([item_a]))
    try:
        assert stall.entered.wait(BOUND_S), "the read from a never reached its queue pair"
        th_b, rest_b = _in_thread(lambda: t.read([item_b]))
        th_w, rest_w = _in_thread(lambda: t.read([waiting_a]))
        th_b.join(BOUND_S)
        th_w.join(1.0 + BOUND_S)
        done_while_a_runs = not th_b.is_alive() and not th_w.is_alive() and th_a.is_alive()
    finally:
        stall.open()
        th_a.join(BOUND_S)
    assert done_while_a_runs, "a read waited for a's queue pair past its timeout or across nodes"
    assert rest_b == [[]] and bytes(item_b.dest) == data_b[8:16]
    assert rest_w == [[waiting_a]] and waiting_a.result is None  # TCP this once
    assert rest_a == [[]] and bytes(item_a.dest) == data_a[:4096]
    assert t.serves("a") and t.serves("b") and not t.dropped


def test_many_threads_many_nodes_no_deadlock(loopback) -> None:
    """Eight threads read from two nodes, registering fresh buffers all the time (a cache of two
    registrations, so they are evicted while other threads' operations run). While node a's
    connect is held, node b's readers all finish and a's readers wait for that one connect;
    then everything finishes, all of it over RDMA. Every join is bounded."""
    a, b = loopback.add_node("a"), loopback.add_node("b")
    data = {"a": _fill(a, 6), "b": _fill(b, 7)}
    nodes = {"a": a, "b": b}
    stall = Stall()
    loopback.fabric.connect_hooks[a.device] = stall
    t = loopback.client(timeout=60.0)
    assert t.read([_read_item(b, 0, 8)]) == []  # opens the device: the cache now exists
    assert t._mrs is not None
    t._mrs.capacity = 2
    errors: list[str] = []

    def reader(i: int, names: str, rounds: int) -> None:
        for r in range(rounds):
            name = names[(i + r) % len(names)]
            offset, size = (i * 997 + r * 131) % 60_000, 1 + (i * 37 + r) % 4000
            item = _read_item(nodes[name], offset, size)
            rest = t.read([item])
            if rest or bytes(item.dest) != data[name][offset : offset + size]:
                errors.append(f"thread {i} round {r} node {name}: rest={rest}")

    def start(names: str, rounds: int, ids: range) -> list[threading.Thread]:
        threads = [
            threading.Thread(target=reader, args=(i, names, rounds), daemon=True) for i in ids
        ]
        for th in threads:
            th.start()
        return threads

    a_readers = start("a", 1, range(4))
    try:
        assert stall.entered.wait(BOUND_S), "a's rdma_connect never reached node a"
        b_readers = start("b", 20, range(4, 8))
        for th in b_readers:
            th.join(BOUND_S)
        b_done_while_a_connects = not any(th.is_alive() for th in b_readers) and all(
            th.is_alive() for th in a_readers
        )
    finally:
        stall.open()
        for th in a_readers:
            th.join(BOUND_S)
    assert b_done_while_a_connects, "b's readers waited for a's connect"
    assert not any(th.is_alive() for th in a_readers)
    mixed = start("ab", 20, range(8))
    for th in mixed:
        th.join(BOUND_S)
    assert not any(th.is_alive() for th in mixed), "deadlock: a reader never finished"
    assert errors == []
    assert stall.num_calls == 1 and len(a.service.book) == 1 and len(b.service.book) == 1
    assert t.serves("a") and t.serves("b") and not t.dropped


def test_an_idle_session_is_pinged_then_kept_or_replaced(loopback, monkeypatch) -> None:
    """A session idle past KEEPALIVE_S is pinged first (by one thread, with no lock held): kept
    if the node answers, replaced by a fresh connect if its connection is gone."""
    t = loopback.client()
    node_ctx = loopback.service.ctx

    def client_qps() -> list[LoopbackQp]:
        return [qp for qp in loopback.fabric.qps.values() if qp.ctx is not node_ctx]

    assert t.read([_read_item(loopback, 0, 8)]) == []
    monkeypatch.setattr(client_rdma, "KEEPALIVE_S", 0.0)  # every use now finds it idle
    assert t.read([_read_item(loopback, 8, 8)]) == []  # pinged: the same queue pair
    assert len(client_qps()) == 1 and len(loopback.service.book) == 1
    session = t._nodes["n0"].session
    assert session is not None
    session.conn.close()  # as if the node had closed the idle connection
    assert t.read([_read_item(loopback, 16, 8)]) == []  # the ping fails: connected afresh
    old, new = client_qps()
    assert old.closed and not new.closed and t.serves("n0") and not t.dropped
    wait_until(lambda: len(loopback.service.book) == 1, what="the node's old queue pair gone")


def test_a_batch_that_waited_out_its_timeout_still_connects_the_next_node(loopback) -> None:
    """One batch for nodes a and b: a's queue pair is busy past the batch's timeout (its item
    goes over TCP), and b, never connected yet, still gets a whole timeout for its connect."""
    a, b = loopback.add_node("a"), loopback.add_node("b")
    data_b = _fill(b, 8)
    t = loopback.client(timeout=1.0)
    assert t.read([_read_item(a, 0, 8)]) == []
    stall = Stall()
    loopback.fabric.run_hooks[a.device] = stall
    th_a, _ = _in_thread(lambda: t.read([_read_item(a, 0, 8)]))
    try:
        assert stall.entered.wait(BOUND_S), "the read from a never reached its queue pair"
        item_a, item_b = _read_item(a, 8, 8), _read_item(b, 64, 64)
        th, rest = _in_thread(lambda: t.read([item_a, item_b]))
        th.join(1.0 + BOUND_S)
        done_while_a_runs = not th.is_alive() and th_a.is_alive()
    finally:
        stall.open()
        th_a.join(BOUND_S)
    assert done_while_a_runs, "the batch waited for a's queue pair past its timeout"
    assert rest == [[item_a]] and bytes(item_b.dest) == data_b[64:128]  # b over RDMA
    assert t.serves("a") and t.serves("b") and not t.dropped
