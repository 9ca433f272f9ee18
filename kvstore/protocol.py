"""The wire protocol: length-prefixed msgpack frames, optionally followed by raw payload bytes.

Every frame, request or response, on the control plane (client/node <-> master) and on the data
plane (client <-> node) has the same shape::

    offset  size  field
    0       2     magic  b"KV"
    2       1     version (PROTOCOL_VERSION)
    3       1     kind   (0 = request, 1 = response)
    4       4     body_len     big-endian u32, msgpack body, at most max_body bytes
    8       8     payload_len  big-endian u64, raw bytes that follow the body (data plane)

    request body:   [req_id: int, verb: str, args: map]
    response body:  [req_id: int, code: int, result]   (code != 0: result is the error message)

Request ids let a connection carry many requests in flight; responses name the id they answer.
Payload bytes never pass through msgpack: the sender hands memoryviews to ``sendmsg`` and the
receiver ``recv_into``s them straight into their destination (an arena, a caller's buffer).

This module owns the format and its blocking-socket reader/writer (:class:`FramedSocket`);
what a server does with the frames it reads (deadlines, refusals, the token handshake) is
``kvstore.serving``'s, shared by the master's and the nodes' servers.
"""

from __future__ import annotations

import contextlib
import os
import select
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import msgpack

from kvstore.errors import ErrorCode, KVStoreError, NodeUnavailableError, ProtocolError
from kvstore.polling import (
    POLL_BACKOFF,
    POLL_MAX_BYTES,
    REPLY_BACKOFF,
    REQUEST_WINDOWS,
    extend_poll,
    poll_window,
)

MAGIC = b"KV"
PROTOCOL_VERSION = 1
KIND_REQUEST = 0
KIND_RESPONSE = 1
HEADER = struct.Struct("!2sBBIQ")
HEADER_SIZE = HEADER.size  # 16
#: Default ceiling on a msgpack body. Batches of 10k keys with locations stay far below this.
DEFAULT_MAX_BODY = 32 << 20
#: Default ceiling on the raw payload of one frame.
DEFAULT_MAX_PAYLOAD = 1 << 40
#: Seconds a frame's header and body have, once its first byte arrived, to arrive whole
#: (plus :data:`MIN_FRAME_RATE` for a large body): a half-sent frame cannot hold a server.
#: The default: each server takes its own from ``kvstore.serving.WireDeadlines``.
FRAME_TIMEOUT_S = 10.0
#: Bytes per second a large frame body must at least arrive at.
MIN_FRAME_RATE = 1 << 20


def frame_deadline_s(body_len: int) -> float:
    """Seconds the rest of a frame (header and a body of ``body_len`` bytes) may take, at
    the default deadlines (a server's own: ``kvstore.serving.WireDeadlines``)."""
    return FRAME_TIMEOUT_S + body_len / MIN_FRAME_RATE


@dataclass(frozen=True, slots=True)
class FrameHeader:
    version: int
    kind: int
    body_len: int
    payload_len: int


def encode_header(kind: int, body_len: int, payload_len: int = 0) -> bytes:
    return HEADER.pack(MAGIC, PROTOCOL_VERSION, kind, body_len, payload_len)


def decode_header(
    data: bytes | memoryview,
    *,
    max_body: int = DEFAULT_MAX_BODY,
    max_payload: int = DEFAULT_MAX_PAYLOAD,
) -> FrameHeader:
    """Check and split a 16-byte header.

    Raises:
        ProtocolError: bad magic, other version, unknown kind, or a length over the limits.
    """
    if len(data) != HEADER_SIZE:
        raise ProtocolError(f"truncated header ({len(data)} of {HEADER_SIZE} bytes)")
    magic, version, kind, body_len, payload_len = HEADER.unpack(data)
    if magic != MAGIC:
        raise ProtocolError("bad magic: not a kvstore frame")
    if version != PROTOCOL_VERSION:
        raise ProtocolError(
            f"protocol version {version} not supported (this side speaks {PROTOCOL_VERSION})",
            code=ErrorCode.VERSION_MISMATCH,
        )
    if kind not in (KIND_REQUEST, KIND_RESPONSE):
        raise ProtocolError(f"unknown frame kind {kind}")
    if body_len > max_body:
        raise ProtocolError(
            f"frame body of {body_len} bytes exceeds the limit of {max_body}",
            code=ErrorCode.FRAME_TOO_LARGE,
        )
    if payload_len > max_payload:
        raise ProtocolError(
            f"frame payload of {payload_len} bytes exceeds the limit of {max_payload}",
            code=ErrorCode.FRAME_TOO_LARGE,
        )
    return FrameHeader(version, kind, body_len, payload_len)


def _pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def _unpack(body: bytes | memoryview) -> Any:
    try:
        return msgpack.unpackb(body, raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises a zoo of types for bad input
        raise ProtocolError(f"undecodable msgpack body: {type(exc).__name__}") from None


def encode_request(req_id: int, verb: str, args: dict[str, Any], payload_len: int = 0) -> bytes:
    body = _pack([req_id, verb, args])
    return encode_header(KIND_REQUEST, len(body), payload_len) + body


def encode_response(req_id: int, result: Any, payload_len: int = 0) -> bytes:
    body = _pack([req_id, 0, result])
    return encode_header(KIND_RESPONSE, len(body), payload_len) + body


def encode_error(req_id: int, err: KVStoreError) -> bytes:
    body = _pack([req_id, int(err.code), err.message])
    return encode_header(KIND_RESPONSE, len(body), 0) + body


@dataclass(frozen=True, slots=True)
class Request:
    req_id: int
    verb: str
    args: dict[str, Any]


@dataclass(frozen=True, slots=True)
class Response:
    req_id: int
    code: int
    result: Any

    def unwrap(self) -> Any:
        if self.code != 0:
            raise KVStoreError.from_wire([self.code, self.result])
        return self.result


def decode_request(body: bytes | memoryview) -> Request:
    """Decode a request body.

    Raises:
        ProtocolError: not msgpack, or not ``[int, str, map]``.
    """
    obj = _unpack(body)
    if (
        not isinstance(obj, list)
        or len(obj) != 3
        or not isinstance(obj[0], int)
        or isinstance(obj[0], bool)
        or not isinstance(obj[1], str)
        or not isinstance(obj[2], dict)
    ):
        raise ProtocolError("request body must be [req_id: int, verb: str, args: map]")
    return Request(obj[0], obj[1], obj[2])


def decode_response(body: bytes | memoryview) -> Response:
    obj = _unpack(body)
    if (
        not isinstance(obj, list)
        or len(obj) != 3
        or not isinstance(obj[0], int)
        or not isinstance(obj[1], int)
    ):
        raise ProtocolError("response body must be [req_id: int, code: int, result]")
    return Response(obj[0], obj[1], obj[2])


def request_id_of(body: bytes | memoryview) -> int:
    """Best-effort request id of an undecodable body, so the error can name it (0 if unknown)."""
    try:
        obj = msgpack.unpackb(body, raw=False, strict_map_key=False)
        if (
            isinstance(obj, list)
            and obj
            and isinstance(obj[0], int)
            and not isinstance(obj[0], bool)
        ):
            return obj[0]
    except Exception:  # noqa: BLE001 - any failure means "unknown"
        pass
    return 0


# --------------------------------------------------------------------------- blocking sockets


def recv_exact_into(sock: socket.socket, view: memoryview) -> None:
    """Fill ``view`` from ``sock`` completely (``recv_into``, no intermediate copies).

    Raises:
        ConnectionError: the peer closed before ``view`` was full.
    """
    received = 0
    total = len(view)
    while received < total:
        n = sock.recv_into(view[received:])
        if n == 0:
            raise ConnectionError(f"peer closed after {received} of {total} bytes")
        received += n


def recv_exact_scatter(sock: socket.socket, views: Sequence[memoryview]) -> None:
    """Fill every view in order, several per syscall (``recvmsg_into``, scatter I/O).

    Raises:
        ConnectionError: the peer closed before every view was full.
    """
    pending = [v for v in views if len(v)]
    while pending:
        n = sock.recvmsg_into(pending[:_IOV_MAX])[0]
        if n == 0:
            raise ConnectionError("peer closed in the middle of a payload")
        pending = _advance(pending, n)


def _advance(views: list[memoryview], n: int) -> list[memoryview]:
    """``views`` less their first ``n`` bytes: whole views dropped, the next one trimmed."""
    i = 0
    while i < len(views) and n >= len(views[i]):
        n -= len(views[i])
        i += 1
    views = views[i:]
    if views and n:
        views[0] = views[0][n:]
    return views


def discard(sock: socket.socket, size: int, scratch: memoryview) -> None:
    """Read and drop ``size`` bytes (a payload we refuse but must skip to keep the framing)."""
    while size > 0:
        chunk = scratch[: min(size, len(scratch))]
        recv_exact_into(sock, chunk)
        size -= len(chunk)


@contextlib.contextmanager
def _until(sock: socket.socket, deadline: float) -> Iterator[None]:
    """Reads under ``deadline`` (see :func:`_set_timeout_until`); the socket's own timeout is
    restored after."""
    saved = sock.gettimeout()
    try:
        yield
    finally:
        sock.settimeout(saved)


def _set_timeout_until(sock: socket.socket, deadline: float) -> None:
    """The next blocking call on ``sock`` times out at ``deadline`` (``time.monotonic()``).

    Raises:
        TimeoutError: ``deadline`` has passed.
    """
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("the frame did not arrive in time")
    sock.settimeout(left)


_IOV_MAX = 512
#: Held by the one thread of this process that polls for a reply (see kvstore.polling): the
#: others sleep in the kernel. Threads that polled side by side (a client shared by an
#: engine's workers) took the GIL from each other, and the CPU from the peers they waited for.
_REPLY_POLLER = threading.Lock()
#: Bytes a FramedSocket reads ahead in one ``recv``: a small frame and its payload in one syscall.
READ_AHEAD = 32 << 10


#: Up to this many bytes in all, many buffers are joined and sent with one ``sendall``: copying
#: them costs less than a memoryview (and an iovec) per buffer.
JOIN_MAX_BYTES = 256 << 10


def send_all(sock: socket.socket, buffers: Sequence[bytes | memoryview]) -> None:
    """Send every buffer: small ones joined in one ``sendall``, larger ones with ``sendmsg``
    (gather I/O: a large payload is never joined or copied)."""
    if len(buffers) == 1 and type(buffers[0]) is bytes:
        sock.sendall(buffers[0])  # a frame without payload: one syscall, no views
        return
    if len(buffers) > 2 and sum(map(len, buffers)) <= JOIN_MAX_BYTES:
        sock.sendall(b"".join(buffers))
        return
    views = [memoryview(b).cast("B") for b in buffers if len(b)]
    while views:
        views = _advance(views, sock.sendmsg(views[:_IOV_MAX]))


class FramedSocket:
    """A blocking socket speaking the frame format; used by clients and by threaded servers.

    Not thread-safe: one user at a time (callers keep a pool of these).
    """

    def __init__(
        self,
        sock: socket.socket,
        *,
        max_body: int = DEFAULT_MAX_BODY,
        max_payload: int = DEFAULT_MAX_PAYLOAD,
    ) -> None:
        self.sock = sock
        self.max_body = max_body
        self.max_payload = max_payload
        # Read-ahead: one ``recv`` takes the header, the body and (for small replies) the
        # payload together; bytes past the frame wait here for the next read. Every read of
        # this connection must go through this object's methods, never ``sock`` directly.
        self._rview = memoryview(bytearray(READ_AHEAD))
        self._rpos = 0
        self._rend = 0
        # Polling before sleeping (see kvstore.polling): a connection this side opened waits for
        # replies, which come soon (short backoff); an accepted one waits for requests.
        self.awaits_replies = False
        self.poll_window = poll_window()
        self._poll_skip = 0
        self._poller: select.poll | None = None
        self._next_id = 1

    @classmethod
    def connect(cls, host: str, port: int, *, timeout: float | None, **kwargs: Any) -> FramedSocket:
        """Open a TCP connection (TCP_NODELAY).

        Raises:
            NodeUnavailableError: nothing answers at ``host:port`` within ``timeout``.
        """
        try:
            sock = socket.create_connection((host, port), timeout=timeout)
        except OSError as exc:
            raise NodeUnavailableError(
                f"cannot connect to {host}:{port}: {exc.strerror or exc}"
            ) from None
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn = cls(sock, **kwargs)
        conn.awaits_replies = True
        return conn

    def next_id(self) -> int:
        req_id = self._next_id
        self._next_id += 1
        return req_id

    def send_request(
        self,
        verb: str,
        args: dict[str, Any],
        payload: Sequence[bytes | memoryview] = (),
    ) -> int:
        req_id = self.next_id()
        if not payload:
            self.sock.sendall(encode_request(req_id, verb, args))
            return req_id
        payload_len = sum(len(memoryview(b).cast("B")) for b in payload)
        send_all(self.sock, [encode_request(req_id, verb, args, payload_len), *payload])
        if payload_len > POLL_MAX_BYTES:
            self.sleep_through_next_wait()
        return req_id

    def send_frame(self, frame: bytes, payload: Sequence[bytes | memoryview] = ()) -> None:
        if not payload:
            self.sock.sendall(frame)
            return
        send_all(self.sock, [frame, *payload])
        if sum(map(len, payload)) > POLL_MAX_BYTES:
            self.sleep_through_next_wait()

    def sleep_through_next_wait(self) -> None:
        """Do not poll before the next wait: a large payload is moving (the peer is busy with
        it, and a poll would only slow its copy down on a shared core)."""
        self._poll_skip = max(self._poll_skip, 1)

    def _fill(self, need: int, poll: bool = False, deadline: float | None = None) -> None:
        """Have at least ``need`` (at most READ_AHEAD) bytes read ahead; ``poll``: this is the
        wait for a frame (see kvstore.polling), not for the rest of one; ``deadline``: a
        ``time.monotonic()`` by which they must all have arrived (else TimeoutError)."""
        have = self._rend - self._rpos
        if have >= need:
            return
        if self._rpos:  # move what is left to the front
            self._rview[:have] = self._rview[self._rpos : self._rend]
            self._rpos, self._rend = 0, have
        if poll and self.poll_window:
            if self._poll_skip:
                self._poll_skip -= 1
            elif self.awaits_replies and not _REPLY_POLLER.acquire(blocking=False):
                pass  # another thread of this process polls for its reply: sleep in the kernel
            else:
                try:
                    found = self._poll()
                finally:
                    if self.awaits_replies:
                        _REPLY_POLLER.release()
                if not found:
                    self._poll_skip = REPLY_BACKOFF if self.awaits_replies else POLL_BACKOFF
        if deadline is not None:
            with _until(self.sock, deadline):
                self._fill_blocking(need, deadline)
            return
        self._fill_blocking(need, None)

    def _fill_blocking(self, need: int, deadline: float | None) -> None:
        while self._rend < need:
            if deadline is not None:
                _set_timeout_until(self.sock, deadline)
            n = self.sock.recv_into(self._rview[self._rend :])
            if n == 0:
                raise ConnectionError(
                    f"peer closed after {self._rend} of {need} bytes"
                    if self._rend
                    else "peer closed"
                )
            self._rend += n

    def wait_frame(self) -> None:
        """Wait (under the socket's own timeout) until the next frame's first byte is here."""
        self._fill(1, poll=True)

    def readable_now(self) -> bool:
        """Whether anything is waiting to be read (bytes, the peer's end or a reset): one
        ``poll(2)`` with a zero timeout on the socket's own poller, no wait."""
        if self._rend > self._rpos:
            return True
        return bool(self._ready()(0))

    def _ready(self) -> Callable[[int], list[tuple[int, int]]]:
        """``poll`` of this socket's own poller (made on first use, kept)."""
        if self._poller is None:
            self._poller = select.poll()
            self._poller.register(self.sock.fileno(), select.POLLIN)
        return self._poller.poll

    def _poll(self) -> bool:
        """Wait without sleeping until bytes arrive (True) or the poll window is over (False)."""
        # poll(2) with a zero timeout looks at the socket without taking its lock; reading in a
        # loop instead would take the lock each time and slow the peer's delivery of a stream.
        ready = self._ready()
        started = time.perf_counter()
        deadline = started + self.poll_window
        # A reply comes within one window or late; a request may come a little later (see
        # kvstore.polling.REQUEST_WINDOWS): a server polls on while it had its CPU to itself.
        extended = self.awaits_replies
        cpu_started = 0.0 if extended else time.thread_time()
        while not ready(0):
            now = time.perf_counter()
            if now >= deadline:
                if extended or not extend_poll(started, cpu_started, now):
                    return False
                extended = True
                deadline = started + self.poll_window * REQUEST_WINDOWS
            os.sched_yield()  # a runnable thread on this CPU (perhaps the peer) goes first
        return True

    def _take(self, view: memoryview) -> int:
        """Copy read-ahead bytes into the front of ``view``; returns how many."""
        n = min(self._rend - self._rpos, len(view))
        if n:
            view[:n] = self._rview[self._rpos : self._rpos + n]
            self._rpos += n
        return n

    def read_header(self, deadline: float | None = None) -> FrameHeader:
        """The next frame's header; ``deadline``: a ``time.monotonic()`` it must arrive by.

        Raises:
            ProtocolError: see :func:`decode_header`. TimeoutError: past ``deadline``.
        """
        self._fill(HEADER_SIZE, poll=True, deadline=deadline)
        start = self._rpos
        self._rpos += HEADER_SIZE
        return decode_header(
            self._rview[start : start + HEADER_SIZE],
            max_body=self.max_body,
            max_payload=self.max_payload,
        )

    def read_body(self, header: FrameHeader, deadline: float | None = None) -> bytes:
        return self.recv_exact(header.body_len, deadline)

    def recv_exact(self, size: int, deadline: float | None = None) -> bytes:
        """The next ``size`` bytes of the stream (by ``deadline``, a ``time.monotonic()``).

        Raises:
            ConnectionError: the peer closed first. TimeoutError: past ``deadline``.
        """
        if size <= READ_AHEAD:
            self._fill(size, deadline=deadline)
            start = self._rpos
            self._rpos += size
            return bytes(self._rview[start : start + size])
        buf = bytearray(size)
        view = memoryview(buf)
        n = self._take(view)
        if deadline is None:
            recv_exact_into(self.sock, view[n:])
        else:
            with _until(self.sock, deadline):
                while n < size:
                    _set_timeout_until(self.sock, deadline)
                    got = self.sock.recv_into(view[n:])
                    if got == 0:
                        raise ConnectionError(f"peer closed after {n} of {size} bytes")
                    n += got
        return bytes(buf)

    def recv_into(self, view: memoryview) -> None:
        """Fill ``view`` from the stream: read-ahead bytes first, then straight from the socket.

        Raises:
            ConnectionError: the peer closed before ``view`` was full.
        """
        n = self._take(view)
        if n < len(view):
            recv_exact_into(self.sock, view[n:])

    def recv_into_before(
        self, view: memoryview, deadline: float, cancelled: Callable[[], bool]
    ) -> None:
        """:meth:`recv_into` that starts no socket read at or after ``deadline`` (monotonic) or
        once ``cancelled()``: each read waits at most until the deadline. So bytes land in
        ``view`` only while the sender's permission (a write grant) holds.

        Raises:
            TimeoutError: the deadline passed, or the read was cancelled, before ``view`` was
                full; ConnectionError: the peer closed first.
        """
        n = self._take(view)
        total = len(view)
        if n == total:  # all read ahead already: no socket read
            return
        # A small view reads ahead: one recv brings the bytes of the items after it too (a
        # batch of tiny objects took a recv per object). Its own bytes are copied in from the
        # read-ahead buffer at once; the others wait there for their own call.
        ahead = total - n <= READ_AHEAD // 2
        if ahead:
            self._rpos = self._rend = 0  # (all taken: the whole buffer is free)
        sock = self.sock
        before = sock.gettimeout()
        try:
            while n < total:
                left = deadline - time.monotonic()
                if left <= 0 or cancelled():
                    raise TimeoutError(f"payload stopped after {n} of {total} bytes")
                sock.settimeout(left if before is None else min(left, before))
                got = sock.recv_into(self._rview[self._rend :] if ahead else view[n:])
                if got == 0:
                    raise ConnectionError(f"peer closed after {n} of {total} bytes")
                if ahead:
                    self._rend += got
                    n += self._take(view[n:])
                else:
                    n += got
        finally:
            sock.settimeout(before)

    def recv_scatter(self, views: Sequence[memoryview]) -> None:
        """Fill every view in order (read-ahead bytes first, then scatter I/O from the socket).

        Raises:
            ConnectionError: the peer closed before every view was full.
        """
        rest = list(views)
        while rest and self._rend > self._rpos:
            n = self._take(rest[0])
            if n < len(rest[0]):
                rest[0] = rest[0][n:]
            else:
                rest.pop(0)
        if rest:
            recv_exact_scatter(self.sock, rest)

    def discard(self, size: int, scratch: memoryview) -> None:
        """Read and drop the next ``size`` bytes (a payload refused but skipped for framing)."""
        n = min(self._rend - self._rpos, size)
        self._rpos += n
        discard(self.sock, size - n, scratch)

    def read_response(self) -> tuple[Response, int]:
        """Read one response; returns it and the number of payload bytes that follow it."""
        header = self.read_header()
        if header.kind != KIND_RESPONSE:
            raise ProtocolError("expected a response frame")
        return decode_response(self.read_body(header)), header.payload_len

    def call(self, verb: str, args: dict[str, Any]) -> Any:
        """One request, one response without payload. Raises the error the server sent."""
        req_id = self.send_request(verb, args)
        response, payload_len = self.read_response()
        if response.req_id != req_id or payload_len:
            raise ProtocolError(f"response {response.req_id} does not answer request {req_id}")
        return response.unwrap()

    def close(self) -> None:
        self.sock.close()
