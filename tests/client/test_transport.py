"""The TCP data path (kvstore.client.transport): batched writes and reads with byte ranges over
real sockets, the checksum helpers, and the per-node connection pool.

A real data server (in this process) answers where the node must behave; a scripted node (a
listening socket and a thread in this test) answers where it must misbehave.
"""

from __future__ import annotations

import select
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import xxhash
from hypothesis import given
from hypothesis import strategies as st

from kvstore import auth, grants, protocol
from kvstore.client.buffers import Segments
from kvstore.client.transport import (
    STREAM_CHUNK,
    STREAM_HASH_MIN,
    NodePool,
    ReadItem,
    TcpTransport,
    WriteItem,
    checksum,
    digest,
    stream_groups,
    stream_hash_target,
)
from kvstore.errors import (
    ErrorCode,
    KVStoreError,
    KVTimeoutError,
    NodeUnavailableError,
    ProtocolError,
    UnauthenticatedError,
)
from kvstore.node.arena import ShmArena
from kvstore.node.server import DataServer
from kvstore.types import Location

ARENA = 4 << 20
TOKEN = "transport-test-token-0123456789"
WAIT_S = 10.0


# ---------------------------------------------------------------- a real node
class Node:
    """A data server with one DRAM segment, and grants signed with its secret."""

    def __init__(self, tmp: Path, name: str, token: auth.Token | None = None) -> None:
        self.name = name
        self.arena = ShmArena(tmp / f"{name}.arena", ARENA, prefault=False)
        self.server = DataServer({"dram": self.arena}, grants.new_secret(), token=token)
        self.server.start()

    def location(self, op: str, key: bytes, offset: int, size: int) -> Location:
        expires = int(time.time() * 1000) + 60_000
        grant = grants.sign(self.server.secret, op, key, "dram", offset, size, expires)
        return Location(self.name, self.server.host, self.server.port, grant)

    def forged(self, key: bytes, offset: int, size: int) -> Location:
        expires = int(time.time() * 1000) + 60_000
        grant = grants.sign(b"x" * 32, grants.OP_READ, key, "dram", offset, size, expires)
        return Location(self.name, self.server.host, self.server.port, grant)

    def close(self) -> None:
        self.server.stop()
        self.arena.close()


@pytest.fixture
def node(tmp_path: Path) -> Iterator[Node]:
    n = Node(tmp_path, "n1")
    yield n
    n.close()


@pytest.fixture
def transport() -> Iterator[TcpTransport]:
    t = TcpTransport(timeout=WAIT_S)
    yield t
    t.close()


def put(t: TcpTransport, node: Node, objects: list[tuple[bytes, int, bytes]]) -> None:
    """Write ``(key, offset, data)`` objects through ``t`` and assert they all landed."""
    items = [
        WriteItem(
            node.location(grants.OP_WRITE, key, off, len(data)),
            memoryview(data),
            checksum(memoryview(data)),
        )
        for key, off, data in objects
    ]
    t.write(items)
    assert [i.result for i in items] == [None] * len(items)


def reader(node: Node, key: bytes, offset: int, size: int, **kw: Any) -> ReadItem:
    return ReadItem(
        node.location(grants.OP_READ, key, offset, size), memoryview(bytearray(size)), **kw
    )


# ---------------------------------------------------------------- checksum helpers
@given(st.binary(max_size=4096))
def test_checksum_is_xxh3_64_of_the_bytes(data: bytes) -> None:
    assert checksum(memoryview(data)) == xxhash.xxh3_64_intdigest(data)


def test_digest_prefers_what_the_transport_hashed_in_flight() -> None:
    loc = Location("n", "h", 1, grants.Grant("r", b"k", "dram", 0, 3, 0, b""))
    item = ReadItem(loc, memoryview(bytearray(b"abc")))
    assert digest(item) == xxhash.xxh3_64_intdigest(b"abc")
    item.digest = 7
    assert digest(item) == 7


@pytest.mark.parametrize(
    ("size", "ranges", "streamed"),
    [
        (STREAM_HASH_MIN - 1, None, False),
        (STREAM_HASH_MIN, None, True),
        (STREAM_HASH_MIN * 2, None, True),
        (STREAM_HASH_MIN, [[0, STREAM_HASH_MIN]], False),  # a range read is checked otherwise
    ],
)
def test_only_large_whole_reads_are_hashed_in_flight(
    size: int, ranges: list[list[int]] | None, streamed: bool
) -> None:
    loc = Location("n", "h", 1, grants.Grant("r", b"k", "dram", 0, size, 0, b""))
    assert stream_hash_target(ReadItem(loc, memoryview(bytearray(size)), ranges)) is streamed


# ---------------------------------------------------------------- writes and reads
def test_a_batch_written_reads_back_whole(node: Node, transport: TcpTransport) -> None:
    objects = [(b"k%d" % i, i * 4096, bytes([i]) * (100 + i)) for i in range(5)]
    put(transport, node, objects)
    items = [reader(node, key, off, len(data)) for key, off, data in objects]
    transport.read(items)
    for item, (_, _, data) in zip(items, objects, strict=True):
        assert item.result is None
        assert bytes(item.dest) == data and item.filled == len(data)
        assert item.digest is None  # small objects: checksummed by the caller
    assert transport.pool.num_connects == 1, "one connection serves the writes and the reads"


@pytest.mark.parametrize(
    "ranges",
    [
        [[0, 4]],
        [[2, 3], [10, 6]],
        [[15, 1], [0, 1], [7, 2]],  # any order: the bytes come in the order asked
        [[0, 16]],
        [[5, 0]],  # an empty range carries no bytes
    ],
)
def test_ranges_fill_dest_with_those_bytes_in_order(
    node: Node, transport: TcpTransport, ranges: list[list[int]]
) -> None:
    data = bytes(range(16))
    put(transport, node, [(b"r", 0, data)])
    want = b"".join(data[s : s + n] for s, n in ranges)
    item = ReadItem(
        node.location(grants.OP_READ, b"r", 0, len(data)),
        memoryview(bytearray(len(want))),
        ranges,
    )
    transport.read([item])
    assert item.result is None and bytes(item.dest) == want and item.filled == len(want)


def test_a_large_object_is_hashed_while_it_moves(node: Node, transport: TcpTransport) -> None:
    data = bytes(range(256)) * (STREAM_HASH_MIN // 256 + 3)
    put(transport, node, [(b"big", 0, data)])
    item = reader(node, b"big", 0, len(data))
    transport.read([item])
    assert item.result is None and bytes(item.dest) == data
    assert item.digest == xxhash.xxh3_64_intdigest(data) == digest(item)


#: A large object given as pieces of every kind: many small ones (a KV block's per-layer planes),
#: one larger than a run, empty ones, uneven ones.
PIECE_SIZES = [24 << 10] * 30 + [0, STREAM_CHUNK + 5, 7, 0, 100_000, 24 << 10, 3]


def as_pieces(buf: bytearray) -> Segments:
    """The first ``sum(PIECE_SIZES)`` bytes of ``buf`` as consecutive pieces of those sizes."""
    pieces, at = [], 0
    for n in PIECE_SIZES:
        pieces.append(memoryview(buf)[at : at + n])
        at += n
    return Segments(tuple(pieces), at)


def test_stream_groups_cut_pieces_into_runs_of_at_most_a_chunk_in_order() -> None:
    data = bytearray(range(256)) * (sum(PIECE_SIZES) // 256 + 1)
    at = sum(PIECE_SIZES)
    groups = list(stream_groups(as_pieces(data)))
    assert all(sum(map(len, g)) <= STREAM_CHUNK for g in groups)
    assert b"".join(bytes(v) for g in groups for v in g) == bytes(data[:at])
    # Runs are full: a run and the first view of the next would not fit in one chunk.
    for g, after in zip(groups, groups[1:], strict=False):
        assert sum(map(len, g)) + len(after[0]) > STREAM_CHUNK
    assert len(groups) < len(PIECE_SIZES) // 3, "small pieces share a run (a syscall)"


def test_a_large_object_read_into_many_pieces_lands_in_order_and_is_hashed(
    node: Node, transport: TcpTransport
) -> None:
    total = sum(PIECE_SIZES)
    assert total >= STREAM_HASH_MIN
    data = bytes(range(251)) * (total // 251 + 1)
    data = data[:total]
    put(transport, node, [(b"pieces", 0, data)])
    dest = bytearray(total)
    item = ReadItem(node.location(grants.OP_READ, b"pieces", 0, total), as_pieces(dest))
    transport.read([item])
    assert item.result is None and item.filled == total
    assert bytes(dest) == data
    assert item.digest == xxhash.xxh3_64_intdigest(data)


def test_a_refused_item_leaves_its_neighbours_intact(node: Node, transport: TcpTransport) -> None:
    objects = [(b"a", 0, b"A" * 50), (b"b", 4096, b"B" * 70), (b"c", 8192, b"C" * 30)]
    put(transport, node, objects)
    items = [
        reader(node, b"a", 0, 50),
        ReadItem(node.forged(b"b", 4096, 70), memoryview(bytearray(70))),
        reader(node, b"b", 4096, 70, ranges=[[60, 20]]),  # past the object's end
        reader(node, b"c", 8192, 30),
    ]
    transport.read(items)
    codes = [None if i.result is None else i.result.code for i in items]
    assert codes == [None, ErrorCode.GRANT_INVALID, ErrorCode.OUT_OF_RANGE, None]
    assert bytes(items[0].dest) == b"A" * 50 and bytes(items[3].dest) == b"C" * 30
    assert items[1].filled == items[2].filled == 0
    # The connection stays in step: the next batch on it reads what it should.
    again = reader(node, b"b", 4096, 70)
    transport.read([again])
    assert again.result is None and bytes(again.dest) == b"B" * 70
    assert transport.pool.num_connects == 1


def test_a_refused_write_item_skips_only_its_bytes(node: Node, transport: TcpTransport) -> None:
    good = WriteItem(node.location(grants.OP_WRITE, b"g", 0, 4), memoryview(b"good"), 0)
    read_grant = WriteItem(node.location(grants.OP_READ, b"x", 4096, 4), memoryview(b"nope"), 0)
    last = WriteItem(node.location(grants.OP_WRITE, b"l", 8192, 4), memoryview(b"last"), 0)
    transport.write([good, read_grant, last])
    assert good.result is None and last.result is None
    assert read_grant.result is not None and read_grant.result.code == ErrorCode.GRANT_INVALID
    assert bytes(node.arena.view[0:4]) == b"good" and bytes(node.arena.view[8192:8196]) == b"last"
    assert bytes(node.arena.view[4096:4100]) == b"\0" * 4


def test_a_batch_over_two_nodes_fills_both(tmp_path: Path, transport: TcpTransport) -> None:
    a, b = Node(tmp_path, "a"), Node(tmp_path, "b")
    try:
        put(transport, a, [(b"x", 0, b"from a")])
        put(transport, b, [(b"y", 64, b"from b!")])
        items = [reader(b, b"y", 64, 7), reader(a, b"x", 0, 6)]
        transport.read(items)
        assert [bytes(i.dest) for i in items] == [b"from b!", b"from a"]
        assert [i.result for i in items] == [None, None]
        assert transport.pool.num_connects == 2
    finally:
        a.close()
        b.close()


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_an_unreachable_node_fails_only_its_items(node: Node, transport: TcpTransport) -> None:
    put(transport, node, [(b"k", 0, b"here")])
    gone = Location("gone", "127.0.0.1", _closed_port(), node.location("r", b"z", 0, 4).grant)
    items = [ReadItem(gone, memoryview(bytearray(4))), reader(node, b"k", 0, 4)]
    transport.read(items)
    assert isinstance(items[0].result, NodeUnavailableError)
    assert items[1].result is None and bytes(items[1].dest) == b"here"


# ---------------------------------------------------------------- a scripted node
Handler = Callable[[protocol.FramedSocket, protocol.Request], bool]


class ScriptedNode:
    """A listening socket whose connections answer each request with ``handler(conn, req)``;
    the connection closes when it returns False. ``closed`` counts connections closed here."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.closed = threading.Semaphore(0)
        self.requests: list[protocol.Request] = []
        self._threads: list[threading.Thread] = []
        self._accept = threading.Thread(target=self._run, daemon=True)
        self._accept.start()

    def _run(self) -> None:
        while True:
            try:
                sock, _ = self.listener.accept()
            except OSError:
                return
            t = threading.Thread(target=self._serve, args=(sock,), daemon=True)
            self._threads.append(t)
            t.start()

    def _serve(self, sock: socket.socket) -> None:
        fs = protocol.FramedSocket(sock)
        try:
            while True:
                header = fs.read_header()
                req = protocol.decode_request(fs.read_body(header))
                if header.payload_len:
                    fs.discard(header.payload_len, memoryview(bytearray(1 << 16)))
                self.requests.append(req)
                if not self.handler(fs, req):
                    return
        except (ConnectionError, OSError):
            pass
        finally:
            sock.close()
            self.closed.release()

    def location(self, size: int, key: bytes = b"k") -> Location:
        grant = grants.Grant("r", key, "dram", 0, size, 1 << 62, b"s" * 16)
        return Location("scripted", "127.0.0.1", self.port, grant)

    def close(self) -> None:
        self.listener.close()
        for t in self._threads:
            t.join(timeout=WAIT_S)


@pytest.fixture
def scripted() -> Iterator[Callable[[Handler], ScriptedNode]]:
    made: list[ScriptedNode] = []

    def make(handler: Handler) -> ScriptedNode:
        made.append(ScriptedNode(handler))
        return made[-1]

    yield make
    for n in made:
        n.close()


def ok_per_item(fs: protocol.FramedSocket, req: protocol.Request) -> None:
    fs.send_frame(protocol.encode_response(req.req_id, [[0, None]] * len(req.args["items"])))


def test_a_pooled_connection_the_node_closed_is_not_used(
    scripted: Callable[[Handler], ScriptedNode],
) -> None:
    """A node closes a connection that stays idle (its idle timeout, or a restart): the next
    call must not fail for it, but go over a fresh connection."""

    def one_request_per_connection(fs: protocol.FramedSocket, req: protocol.Request) -> bool:
        ok_per_item(fs, req)
        return False  # then hang up, like a node whose idle timeout fired

    node = scripted(one_request_per_connection)
    t = TcpTransport(timeout=WAIT_S)
    try:
        items = [WriteItem(node.location(4), memoryview(b"abcd"), 0)]
        t.call_per_node("commit", items, lambda i, refs: [refs.wire(i.location.grant)])
        assert items[0].result is None
        assert node.closed.acquire(timeout=WAIT_S), "the node did not hang up"
        for _ in range(3):
            t.call_per_node("commit", items, lambda i, refs: [refs.wire(i.location.grant)])
            assert items[0].result is None, items[0].result
            assert node.closed.acquire(timeout=WAIT_S)
        assert [r.verb for r in node.requests] == ["commit"] * 4
    finally:
        t.close()


def test_a_node_that_never_answers_times_out(
    scripted: Callable[[Handler], ScriptedNode],
) -> None:
    stop = threading.Event()

    def silent(fs: protocol.FramedSocket, req: protocol.Request) -> bool:
        stop.wait(WAIT_S)
        return False

    node = scripted(silent)
    t = TcpTransport(timeout=0.3)
    try:
        item = ReadItem(node.location(8), memoryview(bytearray(8)))
        started = time.monotonic()
        t.read([item])
        assert isinstance(item.result, KVTimeoutError)
        assert time.monotonic() - started < WAIT_S / 2
        assert item.filled == 0
    finally:
        stop.set()
        t.close()


def _reply(results: list[Any], payload: bytes = b"", req_id_delta: int = 0) -> Handler:
    def handler(fs: protocol.FramedSocket, req: protocol.Request) -> bool:
        frame = protocol.encode_response(req.req_id + req_id_delta, results, len(payload))
        fs.send_frame(frame, [payload] if payload else [])
        return True

    return handler


@pytest.mark.parametrize(
    ("handler", "error"),
    [
        (_reply([[0, 4]], b"abcd", req_id_delta=1), ProtocolError),  # answers another request
        (_reply([[0, 4], [0, 4]], b"abcdefgh"), ProtocolError),  # two results for one item
        (_reply("not a list"), ProtocolError),
        (_reply([[0, 4]], b"abcdef"), NodeUnavailableError),  # payload longer than announced
    ],
    ids=["other-request", "result-count", "not-a-list", "payload-mismatch"],
)
def test_a_reply_out_of_step_fails_the_items_and_drops_the_connection(
    scripted: Callable[[Handler], ScriptedNode], handler: Handler, error: type[KVStoreError]
) -> None:
    node = scripted(handler)
    t = TcpTransport(timeout=WAIT_S)
    try:
        item = ReadItem(node.location(4), memoryview(bytearray(4)))
        t.read([item])
        assert isinstance(item.result, error), item.result
        assert item.filled == 0
        assert node.closed.acquire(timeout=WAIT_S), "the connection was kept"
    finally:
        t.close()


@pytest.mark.parametrize("answers", [[2, 6, 3], [[0, 2], [0, 6], [0, 3]]], ids=["short", "in-full"])
def test_a_wrong_length_fails_that_item_and_keeps_the_framing(
    scripted: Callable[[Handler], ScriptedNode], answers: list[Any]
) -> None:
    # The node says 6 bytes for a 4-byte item: that item fails, its bytes are skipped, and the
    # items after it still get theirs. The client asks for short answers (lengths alone) and
    # also reads full ones (a node that predates them).
    node = scripted(_reply(answers, b"AAbbbbbbCCC"))
    t = TcpTransport(timeout=WAIT_S)
    try:
        items = [ReadItem(node.location(n), memoryview(bytearray(n))) for n in (2, 4, 3)]
        t.read(items)
        assert node.requests[0].args["short"] is True
        assert isinstance(items[1].result, ProtocolError)
        assert (items[0].result, bytes(items[0].dest)) == (None, b"AA")
        assert (items[2].result, bytes(items[2].dest)) == (None, b"CCC")
        assert t.pool.num_connects == 1
        # Still in step: the next batch on the same connection works.
        again = [ReadItem(node.location(n), memoryview(bytearray(n))) for n in (2, 4, 3)]
        t.read(again)
        assert bytes(again[2].dest) == b"CCC" and t.pool.num_connects == 1
    finally:
        t.close()


def test_a_node_that_hangs_up_mid_payload_fills_nothing_it_did_not_finish(
    scripted: Callable[[Handler], ScriptedNode],
) -> None:
    def half(fs: protocol.FramedSocket, req: protocol.Request) -> bool:
        fs.send_frame(protocol.encode_response(req.req_id, [[0, 4], [0, 4]], 8), [b"abcdef"])
        return False

    node = scripted(half)
    t = TcpTransport(timeout=WAIT_S)
    try:
        items = [ReadItem(node.location(4), memoryview(bytearray(4))) for _ in range(2)]
        t.read(items)
        # No item claims success without all its bytes.
        for item in items:
            assert item.result is not None or item.filled == 4
        assert isinstance(items[1].result, NodeUnavailableError)
    finally:
        t.close()


def test_a_per_item_call_answered_with_a_payload_is_refused(
    scripted: Callable[[Handler], ScriptedNode],
) -> None:
    node = scripted(_reply([[0, None]], b"junk"))
    t = TcpTransport(timeout=WAIT_S)
    try:
        items = [WriteItem(node.location(4), memoryview(b"abcd"), 0)]
        t.call_per_node("commit", items, lambda i, refs: [])
        assert isinstance(items[0].result, ProtocolError)
        assert node.closed.acquire(timeout=WAIT_S)
    finally:
        t.close()


def test_per_item_call_results_map_to_their_items(
    scripted: Callable[[Handler], ScriptedNode],
) -> None:
    node = scripted(_reply([[0, None], [int(ErrorCode.CHECKSUM_MISMATCH), "bad"]]))
    t = TcpTransport(timeout=WAIT_S)
    try:
        items = [WriteItem(node.location(4, b"k%d" % i), memoryview(b"abcd"), i) for i in range(2)]
        t.call_per_node("commit", items, lambda i, refs: [i.checksum])
        assert items[0].result is None
        assert items[1].result is not None and items[1].result.code == ErrorCode.CHECKSUM_MISMATCH
        assert node.requests[0].args == {"items": [[0], [1]]}
    finally:
        t.close()


@pytest.mark.parametrize(
    "answers",
    [
        [None, [int(ErrorCode.CHECKSUM_MISMATCH), "bad"]],
        [[0, None], [int(ErrorCode.CHECKSUM_MISMATCH), "bad"]],
    ],
    ids=["short", "in-full"],
)
def test_write_acknowledgements_short_or_in_full_map_to_their_items(
    scripted: Callable[[Handler], ScriptedNode], answers: list[Any]
) -> None:
    node = scripted(_reply(answers))
    t = TcpTransport(timeout=WAIT_S)
    try:
        items = [WriteItem(node.location(4, b"k%d" % i), memoryview(b"abcd"), i) for i in range(2)]
        t.write(items)
        assert node.requests[0].args["short"] is True
        assert items[0].result is None
        assert items[1].result is not None and items[1].result.code == ErrorCode.CHECKSUM_MISMATCH
    finally:
        t.close()


# ---------------------------------------------------------------- the pool
def test_pool_reuses_a_released_connection(node: Node) -> None:
    pool = NodePool(timeout=WAIT_S)
    ep = (node.server.host, node.server.port)
    try:
        conn, reused = pool.acquire(ep)
        assert not reused
        pool.release(ep, conn)
        again, reused = pool.acquire(ep)
        assert reused and again is conn and pool.num_connects == 1
        pool.release(ep, again)
    finally:
        pool.close()
    assert conn.sock.fileno() == -1, "close() closes idle connections"


def test_pool_keeps_as_many_idle_as_were_in_use_at_once(node: Node) -> None:
    pool = NodePool(timeout=WAIT_S, max_idle_per_node=1)
    ep = (node.server.host, node.server.port)
    try:
        held = [pool.acquire(ep)[0] for _ in range(3)]
        for c in held:
            pool.release(ep, c)
        assert all(c.sock.fileno() != -1 for c in held)
        again = [pool.acquire(ep) for _ in range(3)]
        assert all(reused for _, reused in again) and pool.num_connects == 3
        for c, _ in again:
            pool.release(ep, c)
    finally:
        pool.close()


def test_pool_closes_connections_past_what_it_keeps(node: Node) -> None:
    pool = NodePool(timeout=WAIT_S, max_idle_per_node=1)
    ep = (node.server.host, node.server.port)
    try:
        conn, _ = pool.acquire(ep)
        extra = protocol.FramedSocket.connect(*ep, timeout=WAIT_S)
        pool.release(ep, conn)
        pool.release(ep, extra)  # one opened through the pool: one kept
        assert conn.sock.fileno() != -1 and extra.sock.fileno() == -1
    finally:
        pool.close()


def test_pool_replaces_an_idle_connection_its_node_closed() -> None:
    with socket.create_server(("127.0.0.1", 0)) as listener:
        ep = ("127.0.0.1", listener.getsockname()[1])
        pool = NodePool(timeout=WAIT_S)
        try:
            conn, _ = pool.acquire(ep)
            peer, _ = listener.accept()
            peer.close()  # the node's idle timeout fired
            poller = select.poll()
            poller.register(conn.sock, select.POLLIN)
            assert poller.poll(WAIT_S * 1000), "the hang-up never arrived"
            pool.release(ep, conn)
            fresh, reused = pool.acquire(ep)
            assert not reused and fresh is not conn and pool.num_connects == 2
            assert conn.sock.fileno() == -1, "the dead one is closed, not kept"
            listener.accept()[0].close()
            fresh.close()
        finally:
            pool.close()


def test_pool_to_nothing_raises_node_unavailable() -> None:
    pool = NodePool(timeout=WAIT_S)
    with pytest.raises(NodeUnavailableError):
        pool.acquire(("127.0.0.1", _closed_port()))


def test_pool_presents_the_token(tmp_path: Path) -> None:
    token = auth.Token(TOKEN)
    n = Node(tmp_path, "secure", token=token)
    ep = (n.server.host, n.server.port)
    try:
        with pytest.raises(UnauthenticatedError):
            NodePool(WAIT_S, token=auth.Token(TOKEN[::-1])).acquire(ep)
        pool = NodePool(WAIT_S, token=token)
        conn, _ = pool.acquire(ep)
        assert conn.call("ping", {}) == {"role": "node"}
        conn.close()
    finally:
        n.close()


def test_transport_with_the_token_reads_from_a_secured_node(tmp_path: Path) -> None:
    token = auth.Token(TOKEN)
    n = Node(tmp_path, "secure", token=token)
    t = TcpTransport(WAIT_S, token=token)
    try:
        put(t, n, [(b"s", 0, b"secret bytes")])
        item = reader(n, b"s", 0, 12)
        t.read([item])
        assert item.result is None and bytes(item.dest) == b"secret bytes"
    finally:
        t.close()
        n.close()
