"""The data plane with real processes: shm transport (opt-in per node), reads that overlap the
master's answer, and misbehaving peers (a stall mid-stream, a reset during a batch)."""

from __future__ import annotations

import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator

import numpy as np
import pytest

from kvstore import grants, protocol
from kvstore.client import Client
from kvstore.client.transport import ReadItem, TcpTransport
from kvstore.errors import (
    KeyNotFoundError,
    KVTimeoutError,
    NodeUnavailableError,
    UnauthenticatedError,
)
from kvstore.types import Location
from tests.support import wait_until


def node_stats(cluster, i: int | None = None) -> dict:
    """Node ``i``'s stats, or (None) the cluster's: counters summed, flags true on every node."""
    if i is None:
        each = [node_stats(cluster, j) for j in range(len(cluster.nodes))]
        merged = dict(each[0])
        for key, value in merged.items():
            if type(value) is bool:
                merged[key] = all(s[key] for s in each)
            elif type(value) in (int, float):
                merged[key] = sum(s[key] for s in each)
        return merged
    host, port = cluster.nodes[i].field("data").split(":")
    conn = protocol.FramedSocket.connect(host, int(port), timeout=5)
    try:
        return conn.call("stats", {})
    finally:
        conn.close()


def test_shm_round_trips_without_node_reads(cluster_factory) -> None:
    cluster = cluster_factory(node_args=("--shm",))
    rng = np.random.default_rng(1)
    values = {
        f"k{i}": rng.integers(0, 256, n, dtype=np.uint8) for i, n in enumerate([1, 4096, 1 << 20])
    }
    with Client.connect(cluster.address) as c:
        assert all(e is None for e in c.batch_put(list(values), list(values.values())))
        for k, v in values.items():
            assert c.get(k) == v.tobytes()
            buf = np.empty_like(v)
            assert c.get_into(k, buf) == v.nbytes and np.array_equal(buf, v)
        got = c.batch_get(["k0", "missing", "k2"])
        assert got[0] == values["k0"].tobytes() and isinstance(got[1], KeyNotFoundError)
        stats = node_stats(cluster)
        assert stats["num_reads"] == 0  # every byte came through shared memory
        assert stats["num_writes"] == len(values)  # each committed by shm_commit
        assert c._data.shm is not None and c._data.shm.mapping(
            next(iter(c._control.call("node_transports", {}))), "dram"
        )


def test_shm_is_opt_in_per_node_and_per_client(cluster_factory) -> None:
    plain = cluster_factory()
    with Client.connect(plain.address) as c:
        offers = c._control.call("node_transports", {})
        assert len(offers) == 2 and all(t == {} for t in offers.values())
        c.put("a", b"x" * 1000)
        assert c.get("a") == b"x" * 1000
    assert node_stats(plain)["num_reads"] == 1
    shm = cluster_factory(node_args=("--shm",))
    with Client.connect(shm.address, shm=False) as c:
        c.put("a", b"y" * 1000)
        assert c.get("a") == b"y" * 1000
    assert node_stats(shm)["num_reads"] == 1


@pytest.mark.parametrize("node_args", [(), ("--shm",)], ids=["tcp", "shm"])
def test_cached_locations_never_return_stale_bytes(cluster_factory, node_args) -> None:
    cluster = cluster_factory(node_args=node_args)
    with Client.connect(cluster.address) as reader, Client.connect(cluster.address) as writer:
        writer.put("k", b"one" * 1000)
        assert reader.get_into("k", buf := bytearray(3000)) == 3000 and buf == b"one" * 1000
        assert reader.get_into("k", buf) == 3000  # served from the cached location
        writer.put("k", b"two" * 1000)  # another client overwrites: new place, new checksum
        assert reader.get_into("k", buf) == 3000 and buf == b"two" * 1000
        writer.put("k", b"six" * 500)  # smaller
        assert reader.batch_get_into(["k"], [buf])[0] == 1500 and buf[:1500] == b"six" * 500
        writer.remove("k")
        with pytest.raises(KeyNotFoundError):
            reader.get_into("k", buf)


def test_node_restart_drops_the_old_mapping(cluster_factory) -> None:
    cluster = cluster_factory(num_nodes=1, node_args=("--shm",))  # the node restarted holds "k"
    with Client.connect(cluster.address) as c:
        c.put("k", b"before" * 100)
        assert c.get("k") == b"before" * 100
        cluster.nodes[0].stop()  # unlinks its arena file: our mapping is now of a dead file
        cluster.nodes.pop()
        cluster.add_node(name="node0")  # same id, new arena file (node_args has --shm)
        wait_until(lambda: c.stats()["num_nodes"] == 1, what="node back")
        with pytest.raises((KeyNotFoundError, NodeUnavailableError)):
            c.get("k")  # the old incarnation's objects are gone
        c.put("k", b"after" * 100)
        assert c.get("k") == b"after" * 100

        def served_by_shm() -> bool:
            before = node_stats(cluster)["num_reads"]
            assert c.get("k") == b"after" * 100
            return node_stats(cluster)["num_reads"] == before

        wait_until(served_by_shm, what="shm remapped")


# ---------------------------------------------------------------- misbehaving peers
class FakeNode:
    """A data server that reads one request per connection, then does what ``behave`` says."""

    def __init__(self, behave: Callable[[socket.socket, protocol.Request], None]) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.behave = behave
        self.conns: list[socket.socket] = []
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            self.conns.append(conn)
            fs = protocol.FramedSocket(conn)
            try:
                header = fs.read_header()
                request = protocol.decode_request(fs.read_body(header))
                self.behave(conn, request)
            except OSError:
                pass

    def close(self) -> None:
        self.listener.close()
        for c in self.conns:
            c.close()


def reply_with(conn: socket.socket, req: protocol.Request, payload: bytes, send: int) -> None:
    lengths = [[0, len(payload) // len(req.args["items"])] for _ in req.args["items"]]
    conn.sendall(protocol.encode_response(req.req_id, lengths, len(payload)) + payload[:send])


@pytest.fixture
def fake_nodes() -> Iterator[list[FakeNode]]:
    made: list[FakeNode] = []
    yield made
    for f in made:
        f.close()


def location(port: int, size: int) -> Location:
    g = grants.sign(b"s" * 32, "r", b"k", "dram", 0, size, int(time.time() * 1000) + 60_000)
    return Location(f"fake-{port}", "127.0.0.1", port, g)


def test_peer_that_stalls_mid_stream_times_out(fake_nodes) -> None:
    stall = FakeNode(lambda conn, req: reply_with(conn, req, b"z" * 2000, send=700))
    fake_nodes.append(stall)
    t = TcpTransport(timeout=0.5)
    items = [ReadItem(location(stall.port, 1000), memoryview(bytearray(1000))) for _ in range(2)]
    t.read(items)
    assert all(isinstance(i.result, KVTimeoutError) for i in items)
    assert not t.pool._idle  # the broken connection never goes back to the pool
    t.close()


def test_connection_reset_during_a_batch_is_reported_per_key(fake_nodes) -> None:
    def reset(conn: socket.socket, req: protocol.Request) -> None:
        reply_with(conn, req, b"r" * 2000, send=1200)  # first item whole, second cut
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        conn.close()  # RST

    good = FakeNode(lambda conn, req: reply_with(conn, req, b"g" * 1000, send=1000))
    bad = FakeNode(reset)
    fake_nodes.extend([good, bad])
    t = TcpTransport(timeout=5)
    ok = ReadItem(location(good.port, 1000), memoryview(bytearray(1000)))
    cut = [ReadItem(location(bad.port, 1000), memoryview(bytearray(1000))) for _ in range(2)]
    t.read([cut[0], ok, cut[1]])
    assert ok.result is None and bytes(ok.dest) == b"g" * 1000
    # A reset may discard bytes the kernel had already received: the first item either arrived
    # whole or is reported; the cut one is always reported. Never wrong bytes without an error.
    assert (cut[0].result is None and bytes(cut[0].dest) == b"r" * 1000) or isinstance(
        cut[0].result, NodeUnavailableError
    )
    assert isinstance(cut[1].result, NodeUnavailableError)
    t.close()


def test_reset_mid_batch_leaves_stored_objects_intact(cluster_factory) -> None:
    cluster = cluster_factory(num_nodes=2)
    with Client.connect(cluster.address) as c:
        keys = [f"k{i}" for i in range(16)]
        values = [bytes([i]) * 50_000 for i in range(16)]
        assert all(e is None for e in c.batch_put(keys, values))
        cluster.nodes[1].kill()
        got = c.batch_get(keys)
        survivors = [i for i, g in enumerate(got) if isinstance(g, bytes)]
        assert survivors and len(survivors) < 16
        assert all(got[i] == values[i] for i in survivors)
        assert all(
            isinstance(g, (NodeUnavailableError, KeyNotFoundError))
            for g in got
            if not isinstance(g, bytes)
        )
        assert [c.get(keys[i]) for i in survivors] == [values[i] for i in survivors]


def test_shm_with_a_cluster_token(cluster_factory, tmp_path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("data-plane-secret-0123456789\n")
    flags = ("--token-file", str(token_file))
    cluster = cluster_factory(master_args=flags, node_args=(*flags, "--shm"))
    with Client.connect(cluster.address, token="data-plane-secret-0123456789") as c:
        c.put("k", b"guarded" * 100)
        assert c.get("k") == b"guarded" * 100
    assert node_stats_with_token(cluster, "data-plane-secret-0123456789")["num_reads"] == 0
    with pytest.raises(UnauthenticatedError):
        Client.connect(cluster.address, token="wrong-token-0123456789abcdef")


def node_stats_with_token(cluster, token: str) -> dict:
    from kvstore import auth

    host, port = cluster.nodes[0].field("data").split(":")
    conn = protocol.FramedSocket.connect(host, int(port), timeout=5)
    try:
        auth.hello(conn, auth.Token(token))
        return conn.call("stats", {})
    finally:
        conn.close()


def test_node_reports_when_its_arena_is_warm(cluster_factory) -> None:
    cluster = cluster_factory()
    wait_until(lambda: node_stats(cluster)["arenas_warm"], timeout=30, what="arena pre-fault")
