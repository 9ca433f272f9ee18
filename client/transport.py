"""TCP data transport: a connection pool per storage node and batched, pipelined reads/writes.

A batch touching several nodes sends one request to every node before reading any reply, so
the nodes work in parallel; each reply's payload is ``recv_into`` its destination buffers.
"""

from __future__ import annotations

import socket
import threading
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import xxhash

from kvstore import auth, grants, protocol
from kvstore.client.buffers import Segments
from kvstore.errors import (
    KVStoreError,
    KVTimeoutError,
    NodeUnavailableError,
    ProtocolError,
)
from kvstore.polling import POLL_MAX_BYTES, POLL_MAX_ITEMS
from kvstore.types import Location, result_from_wire

Endpoint = tuple[str, int]


@dataclass(slots=True)
class WriteItem:
    location: Location
    data: memoryview | Segments
    checksum: int
    result: KVStoreError | None = None


@dataclass(slots=True)
class ReadItem:
    location: Location
    # exactly the bytes to fill; given as pieces (a scatter list, whole-object reads only), the
    # object lands piece after piece (TCP: one ``recvmsg_into``; shm: a copy each; no RDMA)
    dest: memoryview | Segments
    ranges: list[list[int]] | None = None
    result: KVStoreError | None = None
    filled: int = 0
    # xxh3_64 of ``dest``, where the transport hashed the bytes while moving them (large
    # objects: chunk by chunk, each chunk while it is still in cache); None: not computed.
    digest: int | None = None


@dataclass(slots=True)
class KeyRead:
    """One one-hop read: ``key`` asked of its home node at ``endpoint`` (``read_keys``), into
    ``dest`` (room for the object; after a hit, exactly its bytes). After the read: ``result``
    (None: found, with ``size`` and the ``checksum`` stored at write time, for the caller to
    check against ``digest``), or the error (a miss is ``KeyNotFoundError``)."""

    key: bytes
    endpoint: tuple[str, int]
    dest: memoryview
    result: KVStoreError | None = None
    size: int = 0
    checksum: int = 0
    filled: int = 0
    digest: int | None = None
    ranges: None = None  # (whole objects only: what the transport's payload readers ask)
    node_id: str = ""
    #: Whether ``dest`` is only room for an object of a size not known yet (a read into new
    #: bytes): the client then waits for the answer as for a small one.
    room_only: bool = False
    #: Where the object lies on its node, for a client that copies it itself (``where``).
    segment: str = ""
    offset: int = 0


def checksum(view: memoryview | Segments) -> int:
    """xxh3_64 of an object's bytes (the checksum stored with every object); of
    :class:`Segments`, that of their concatenation (streamed, nothing joined)."""
    if type(view) is not Segments:
        return xxhash.xxh3_64_intdigest(view)
    h = xxhash.xxh3_64()
    for part in view.parts:
        h.update(part)
    return h.intdigest()


def payload_parts(data: memoryview | Segments) -> tuple[memoryview, ...]:
    """The buffers that hold an object's bytes (that send it, or that it lands in)."""
    return data.parts if type(data) is Segments else (data,)


def digest(item: ReadItem) -> int:
    """The checksum of what ``item`` read: from the transport if it hashed while moving bytes."""
    return item.digest if item.digest is not None else checksum(item.dest)


#: Objects at least this large are hashed while they move, chunk by chunk.
STREAM_HASH_MIN = 512 << 10
STREAM_CHUNK = 256 << 10


def stream_hash_target(item: ReadItem) -> bool:
    return item.ranges is None and len(item.dest) >= STREAM_HASH_MIN


def stream_chunks(data: memoryview | Segments) -> list[memoryview]:
    """An object's bytes as consecutive views of at most ``STREAM_CHUNK`` bytes (a chunk never
    spans two pieces): what a transport moves and hashes while it is still in cache. A piece
    that fits a chunk is taken as it is, not sliced (a plain loop: this runs for every piece of
    every large object moved, e.g. the 60 planes of each SmolLM2 block)."""
    chunks: list[memoryview] = []
    for part in payload_parts(data):
        if len(part) <= STREAM_CHUNK:
            chunks.append(part)
        else:
            chunks += [part[pos : pos + STREAM_CHUNK] for pos in range(0, len(part), STREAM_CHUNK)]
    return chunks


def stream_groups(data: memoryview | Segments) -> list[list[memoryview]]:
    """:func:`stream_chunks` gathered into runs of at most ``STREAM_CHUNK`` bytes: one scatter
    read fills a run, then each of its views is hashed while still in cache. An object given
    as many small pieces (a KV block's per-layer planes) costs a syscall a run, not a piece."""
    groups: list[list[memoryview]] = []
    group: list[memoryview] = []
    size = 0
    for chunk in stream_chunks(data):
        n = len(chunk)
        if size + n > STREAM_CHUNK and group:
            groups.append(group)
            group, size = [], 0
        group.append(chunk)
        size += n
    if group:
        groups.append(group)
    return groups


@dataclass(slots=True)
class _Exchange:
    endpoint: Endpoint
    conn: protocol.FramedSocket | None = None
    req_id: int = 0
    error: KVStoreError | None = None
    payload_len: int = 0
    items: list[Any] = field(default_factory=list)


#: Reads or writes whose requests are sent and whose replies are not yet taken (what
#: :meth:`TcpTransport.read_begin` and ``write_begin`` return, for ``read_end``/``write_end``).
InFlight = list[_Exchange]


def _by_node(items: Sequence[Any]) -> dict[Endpoint, _Exchange]:
    """One exchange per node, holding that node's items in order."""
    exchanges: dict[Endpoint, _Exchange] = {}
    for item in items:
        loc = item.location
        ep = (loc.host, loc.port)
        ex = exchanges.get(ep)
        if ex is None:  # (not setdefault: that would build an exchange per item)
            ex = exchanges[ep] = _Exchange(ep)
        ex.items.append(item)
    return exchanges


#: Most idle connections a pool keeps per node, however many threads share it.
MAX_POOL_PER_NODE = 64


class NodePool:
    """Idle connections per node. Thread-safe; a connection is used by one thread at a time.

    Sized to the threads that share it: per node it keeps as many idle connections as it ever
    had to open (at least ``max_idle_per_node``, at most ``MAX_POOL_PER_NODE``): a call that
    finds none idle opens one because that many threads use the node at once. So each of them
    finds a connection waiting next time, instead of a connection (and a hello) per call
    beyond a fixed size.

    NOTE: ``_lock`` guards the idle lists and their sizes only; connecting (and the hello)
    happens without it.
    """

    def __init__(
        self, timeout: float, max_idle_per_node: int = 8, token: auth.Token | None = None
    ) -> None:
        self.timeout = timeout
        self.token = token
        self.max_idle_per_node = max_idle_per_node
        self._idle: dict[Endpoint, list[protocol.FramedSocket]] = defaultdict(list)
        #: Connections opened per node (each because none was idle): how many to keep idle.
        self._opened: dict[Endpoint, int] = defaultdict(int)
        self.num_connects = 0
        self._lock = threading.Lock()

    def acquire(self, endpoint: Endpoint) -> tuple[protocol.FramedSocket, bool]:
        """A connection to ``endpoint`` and whether it was reused from the pool.

        Raises:
            NodeUnavailableError, KVTimeoutError: no connection (or hello) within the timeout.
        """
        replacing = False
        while True:
            with self._lock:
                idle = self._idle.get(endpoint)
                conn = idle.pop() if idle else None
                if conn is None:
                    if not replacing:  # (a replacement is no new thread using the node)
                        self._opened[endpoint] += 1
                    self.num_connects += 1
            if conn is None:
                break
            # An idle connection has nothing to read: anything readable is its end (the node
            # closed it while it sat here: its idle timeout, a restart), a reset or bytes out
            # of step. A request sent on it would be lost, not refused, so it is not tried.
            if not conn.readable_now():
                return conn, True
            conn.close()
            replacing = True
        conn = protocol.FramedSocket.connect(endpoint[0], endpoint[1], timeout=self.timeout)
        try:
            auth.hello(conn, self.token)
        except (OSError, ConnectionError) as exc:
            conn.close()
            raise _io_error(endpoint, exc) from None
        except BaseException:
            conn.close()
            raise
        return conn, False

    def _keep(self, endpoint: Endpoint) -> int:
        """How many idle connections to keep for ``endpoint`` (call under ``_lock``)."""
        return max(self.max_idle_per_node, min(self._opened[endpoint], MAX_POOL_PER_NODE))

    def release(self, endpoint: Endpoint, conn: protocol.FramedSocket) -> None:
        with self._lock:
            idle = self._idle[endpoint]
            if len(idle) < self._keep(endpoint):
                idle.append(conn)
                return
        conn.close()

    def close(self) -> None:
        with self._lock:
            for conns in self._idle.values():
                for c in conns:
                    c.close()
            self._idle.clear()


def _io_error(endpoint: Endpoint, exc: BaseException) -> KVStoreError:
    if isinstance(exc, KVStoreError):
        return exc
    if isinstance(exc, socket.timeout | TimeoutError):
        return KVTimeoutError(f"node {endpoint[0]}:{endpoint[1]} did not answer in time")
    return NodeUnavailableError(f"node {endpoint[0]}:{endpoint[1]} failed: {exc}")


class TcpTransport:
    """Moves object bytes between this process and storage nodes over TCP."""

    def __init__(self, timeout: float, token: auth.Token | None = None) -> None:
        self.pool = NodePool(timeout, token=token)

    def close(self) -> None:
        self.pool.close()

    # -------------------------------------------------------------- one request per node
    def _send(
        self, ex: _Exchange, verb: str, args: dict[str, Any], payload: Sequence[memoryview]
    ) -> None:
        """Send, retrying once on a fresh connection if a pooled one turns out to be dead."""
        for attempt in range(2):
            try:
                conn, reused = self.pool.acquire(ex.endpoint)
            except KVStoreError as err:
                ex.error = err
                return
            try:
                ex.req_id = conn.send_request(verb, args, payload)
                ex.conn = conn
                return
            except (OSError, ConnectionError) as exc:
                conn.close()
                if not reused or attempt:
                    ex.error = _io_error(ex.endpoint, exc)
                    return

    def _receive(self, ex: _Exchange) -> list[Any] | None:
        """Read the reply's body; returns per-item results, leaving the payload unread. On a
        failure (here or when sending) every item of the exchange gets the error: None."""
        if ex.error is None:
            assert ex.conn is not None
            try:
                response, payload_len = ex.conn.read_response()
                if response.req_id != ex.req_id:
                    raise ProtocolError(
                        f"reply {response.req_id} does not answer request {ex.req_id}"
                    )
                result = response.unwrap()
                if not isinstance(result, list) or len(result) != len(ex.items):
                    raise ProtocolError("reply does not carry one result per item")
                ex.payload_len = payload_len
                return result
            except KVStoreError as err:
                ex.error = err
            except (OSError, ConnectionError) as exc:
                ex.error = _io_error(ex.endpoint, exc)
            ex.conn.close()
            ex.conn = None
        for item in ex.items:
            item.result = ex.error
        return None

    def _finish(self, ex: _Exchange) -> None:
        if ex.conn is not None:
            self.pool.release(ex.endpoint, ex.conn)
            ex.conn = None

    # -------------------------------------------------------------- writes
    def write(self, items: Sequence[WriteItem]) -> None:
        """Write each item's bytes to its location; sets ``item.result`` on failure."""
        self.write_end(self.write_begin(items))

    def write_begin(self, items: Sequence[WriteItem]) -> InFlight:
        """The first half of :meth:`write`: send each node its request (bytes and all) and
        return without waiting for the acknowledgements. Every call must be followed by
        :meth:`write_end` of what it returns, errors or not."""
        exchanges = _by_node(items)
        for ex in exchanges.values():
            refs = grants.GrantRefs()  # a batch grant travels once per request
            args = {
                "items": [
                    [refs.wire(i.location.grant), 0, len(i.data), i.checksum] for i in ex.items
                ],
                "short": True,  # a success acknowledged by None alone
            }
            self._send(ex, "write", args, [p for i in ex.items for p in payload_parts(i.data)])
            if ex.conn is not None and len(ex.items) > POLL_MAX_ITEMS:
                ex.conn.sleep_through_next_wait()
        return list(exchanges.values())

    def write_end(self, exchanges: InFlight) -> None:
        """The second half of :meth:`write`: take each node's acknowledgement into its items."""
        for ex in exchanges:
            results = self._receive(ex)
            if results is None:
                continue
            for item, r in zip(ex.items, results, strict=True):
                if r is not None:  # (None: written, as asked; else the node's full answer)
                    item.result, _ = result_from_wire(r)
            self._finish(ex)

    # -------------------------------------------------------------- small per-item calls
    def call_per_node(
        self,
        verb: str,
        items: Sequence[WriteItem],
        item_args: Callable[[WriteItem, grants.GrantRefs], Any],
    ) -> None:
        """One ``verb`` request per node carrying ``item_args(item, refs)`` per item, no
        payload (``refs``: the request's writer of grants, :class:`~kvstore.grants.GrantRefs`);
        sets each ``item.result`` (None on success), all nodes in flight together."""
        exchanges = _by_node(items)
        for ex in exchanges.values():
            refs = grants.GrantRefs()
            self._send(ex, verb, {"items": [item_args(i, refs) for i in ex.items]}, ())
        for ex in exchanges.values():
            results = self._receive(ex)
            if results is None:
                continue
            if ex.payload_len:
                assert ex.conn is not None
                ex.conn.close()
                ex.conn = None
                for item in ex.items:
                    item.result = ProtocolError(f"{verb} reply carries an unexpected payload")
                continue
            for item, r in zip(ex.items, results, strict=True):
                item.result, _ = result_from_wire(r)
            self._finish(ex)

    # -------------------------------------------------------------- reads
    def read(self, items: Sequence[ReadItem]) -> None:
        """Fill each item's ``dest`` from its location; sets ``item.result`` on failure."""
        self.read_end(self.read_begin(items))

    def read_begin(self, items: Sequence[ReadItem]) -> InFlight:
        """The first half of :meth:`read`: send each node its request and return without
        waiting, so the caller works while the nodes do. Every call must be followed by
        :meth:`read_end` of what it returns (which fills the items), errors or not."""
        exchanges = _by_node(items)
        for ex in exchanges.values():
            refs = grants.GrantRefs()  # a batch grant travels once per request
            args = {
                "items": [[refs.wire(i.location.grant), i.ranges] for i in ex.items],
                "short": True,  # a success answered by its length alone
            }
            self._send(ex, "read", args, ())
            if ex.conn is not None and (
                len(ex.items) > POLL_MAX_ITEMS
                or sum(len(i.dest) for i in ex.items) > POLL_MAX_BYTES
            ):
                ex.conn.sleep_through_next_wait()
        return list(exchanges.values())

    def read_end(self, exchanges: InFlight) -> None:
        """The second half of :meth:`read`: take each node's reply into its items."""
        for ex in exchanges:
            self._take_reply(ex, self._read_payload)

    def read_keys(self, items: Sequence[KeyRead], where: bool = False) -> None:
        """Read each item's object by key from its node (one ``read_keys`` request per node,
        all in flight together); sets each item's result, size and checksum. With ``where``
        the nodes say where each object lies instead (``segment``, ``offset``) and send no
        bytes: the caller copies them from its own mapping of the node's arena."""
        exchanges: dict[Endpoint, _Exchange] = {}
        for item in items:
            ex = exchanges.get(item.endpoint)
            if ex is None:
                ex = exchanges[item.endpoint] = _Exchange(item.endpoint)
            ex.items.append(item)
        for ex in exchanges.values():
            args: dict[str, Any] = {"items": [[i.key, len(i.dest)] for i in ex.items]}
            if where:
                args["where"] = True
            self._send(ex, "read_keys", args, ())
            if (
                ex.conn is not None
                and not where
                and (
                    len(ex.items) > POLL_MAX_ITEMS
                    or sum(len(i.dest) for i in ex.items if not i.room_only) > POLL_MAX_BYTES
                )
            ):
                ex.conn.sleep_through_next_wait()
        for ex in exchanges.values():
            self._take_reply(ex, self._key_payload)

    def _take_reply(self, ex: _Exchange, take: Callable[[_Exchange, list[Any]], None]) -> None:
        """Receive a node's reply and ``take`` its payload into the exchange's items; a
        connection that fails in the payload fails the items still unfilled and is closed."""
        results = self._receive(ex)
        if results is None:
            return
        try:
            take(ex, results)
        except (OSError, ConnectionError) as exc:
            err = _io_error(ex.endpoint, exc)
            for item in ex.items:
                if item.result is None and item.filled < len(item.dest):
                    item.result = err
            assert ex.conn is not None
            ex.conn.close()
            ex.conn = None
            return
        self._finish(ex)

    def _key_payload(self, ex: _Exchange, results: list[Any]) -> None:
        """Take a ``read_keys`` reply: per item ``[size, checksum]`` (its bytes follow, in
        order) or an error."""
        found: list[KeyRead] = []
        for item, r in zip(ex.items, results, strict=True):
            if type(r) is list and len(r) == 4 and type(r[2]) is str and type(r[3]) is int:
                item.size, item.checksum, item.segment, item.offset = r  # (``where``: no bytes)
                continue
            if type(r) is list and len(r) == 2 and type(r[0]) is int and type(r[1]) is int:
                size, item.checksum = r
                if not 0 <= size <= len(item.dest):
                    raise ConnectionError(
                        f"node sent an object of {size} bytes for {len(item.dest)}"
                    )
                item.size = size
                item.dest = item.dest[:size]
                found.append(item)
                continue
            err, _ = result_from_wire(r)
            item.result = err or ProtocolError("read_keys answered neither bytes nor an error")
        if sum(i.size for i in found) != ex.payload_len:
            raise ConnectionError("reply payload does not match its item sizes")
        self._fill(ex, found)  # type: ignore[arg-type]

    def _read_payload(self, ex: _Exchange, results: list[Any]) -> None:
        assert ex.conn is not None
        expected = 0
        lengths: list[int | None] = []  # None: an error result, no bytes follow
        for item, r in zip(ex.items, results, strict=True):
            # A length alone: a success, as asked (else the node's full answer)
            err, length = (None, r) if type(r) is int else result_from_wire(r)
            if err is not None:
                item.result = err
                lengths.append(None)
                continue
            if type(length) is not int or length != len(item.dest):
                item.result = ProtocolError(
                    f"node sent {length!r} bytes, expected {len(item.dest)}"
                )
                # The bytes still follow in the payload: they must be consumed below.
                length = length if type(length) is int and length >= 0 else 0
            expected += length
            lengths.append(length)
        if expected != ex.payload_len:
            raise ConnectionError("reply payload does not match its item lengths")
        scratch: memoryview | None = None
        run: list[ReadItem] = []  # consecutive good items: one scatter read for all of them
        for item, length in zip(ex.items, lengths, strict=True):
            if length is None:
                continue
            if item.result is None:
                run.append(item)
                continue
            self._fill(ex, run)
            scratch = scratch or memoryview(bytearray(1 << 16))
            ex.conn.discard(length, scratch)
        self._fill(ex, run)

    @staticmethod
    def _fill(ex: _Exchange, run: list[ReadItem]) -> None:
        assert ex.conn is not None
        small: list[memoryview] = []  # consecutive small objects: one scatter read for all
        for item in run:
            if not stream_hash_target(item):
                dest = item.dest
                if type(dest) is Segments:
                    small.extend(dest.parts)
                else:
                    small.append(dest)
                continue
            if small:
                ex.conn.recv_scatter(small)
                small = []
            # A large object: hash each run of chunks as it lands, while the node sends the next.
            h = xxhash.xxh3_64()
            for group in stream_groups(item.dest):
                ex.conn.recv_scatter(group)
                for chunk in group:
                    h.update(chunk)
            item.digest = h.intdigest()
        if small:
            ex.conn.recv_scatter(small)
        for item in run:
            item.filled = len(item.dest)
        run.clear()
