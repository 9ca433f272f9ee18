"""The master's RPC edge: read a frame, call the verb's handler, map the error, write the answer.

It owns the connections and their frame loop (:class:`ControlServer`: deadlines, the hello,
the HA fence, the cap on event snapshots in flight), :func:`dispatch` (one request to one
response frame, every failure an error frame) and :func:`dispatch_bounded` (which requests are
served in chunks). Nothing else; the rest of the edge lives beside it:

* ``rpc_verbs.py``: one handler per verb (:data:`HANDLERS`), with ``rpc_args.py``'s checks of
  its arguments, so a wrong type is an ``InvalidRequestError`` for the caller;
* ``rpc_chunks.py``: large batches and long prompts served a chunk a turn of the loop;
* ``rpc_events.py``: the KV event verbs and the long poll of ``events``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any, Protocol

from kvstore import auth, protocol, serving
from kvstore.errors import (
    InternalError,
    InvalidRequestError,
    KVStoreError,
    OverloadedError,
    UnknownVerbError,
)
from kvstore.master.rpc_chunks import (
    CHUNK_ITEMS,
    PACK,
    chunk_count,
    is_large_kv_match,
    release_in_chunks,
    serve_chunks,
    serve_kv_match,
)
from kvstore.master.rpc_events import await_events
from kvstore.master.rpc_tenants import Answer, scope_request
from kvstore.master.rpc_verbs import (
    AFTER_REPLY,
    HANDLERS,
    pop_releases,
    run_after_reply,
    take_releases,
)
from kvstore.master.service import MasterService, ServiceSlot
from kvstore.polling import MASTER_WINDOWS, LoopAwake, poll_window
from kvstore.tenants import TenantDirectory

log = logging.getLogger(__name__)

#: Most ``events_snapshot`` answers built or being written at once: each may hold up to
#: ``rpc_events.SNAPSHOT_MAX_BLOCKS`` keys until its reader takes it, so many subscribers asking
#: together must not each hold one (the rest are refused OVERLOADED; the client's event stream
#: retries).
SNAPSHOTS_IN_FLIGHT = 4
#: How long a subscriber may take to read its snapshot before its connection is closed (so a
#: reader that never reads cannot hold a slot).
SNAPSHOT_WRITE_TIMEOUT_S = 30.0
#: While a connection's answers wait (a task answering one of its requests, or a peer not taking
#: them), it buffers at most about twice this of its next frames before the socket is not read
#: (so a peer that floods requests without reading holds little memory).
STREAM_LIMIT = 64 << 10
#: How often the server looks for connections past their frame or hello deadline.
SWEEP_INTERVAL_S = 0.5

__all__ = [
    "CHUNK_ITEMS",
    "HANDLERS",
    "ControlServer",
    "Fence",
    "RpcObserver",
    "dispatch",
    "dispatch_bounded",
]


#: A request :meth:`ControlServer.answer` left for the loop: the request, a tenant's answer
#: (``rpc_tenants``) or None, and the connection's tenant.
Deferred = tuple[protocol.Request, Answer | None, str | None]


class _Connection(asyncio.Protocol):
    """One client connection of a :class:`ControlServer`: its frame loop as protocol callbacks.

    A frame is answered in the callback that completes it, with no coroutine, future or task
    (the usual small request; an asyncio stream reader costs a few of each per frame:
    ``.venv/bin/python bench/bench_hops.py`` prints the master's round trip). A request that
    needs the loop (a long poll, a snapshot, a batch served in chunks) is answered by a task;
    until it is, the connection's next frames wait, in order, and past ``2 * STREAM_LIMIT``
    buffered bytes the socket is not read. While the peer does not take our answers (the
    transport's buffer over its high-water mark) no frame is answered either.

    The rules of a frame (deadlines, the hello, the header's checks) are the session's
    (:class:`kvstore.serving.FrameSession`), as in the node's blocking servers.
    """

    def __init__(self, server: ControlServer) -> None:
        self.server = server
        self.loop = asyncio.get_running_loop()
        self.session = serving.FrameSession(
            server.token, self.loop.time(), deadlines=server.deadlines, tenants=server.tenants
        )
        #: A request's work left until its answer is out (rpc_verbs.AFTER_REPLY).
        self.after: list[Callable[[], None]] = []
        self._transport: asyncio.Transport | None = None
        self._buf = bytearray()
        self._started: float | None = None  # when the first byte of the frame in _buf came
        self._task: asyncio.Task[None] | None = None  # answering a deferred request
        self._writing_paused = False
        self._reading_paused = False
        self._drained: asyncio.Future[None] | None = None
        self._closed = False

    # ------------------------------------------------------------------ transport callbacks
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]  # (uvloop's is no subclass)
        server = self.server
        server._conns.add(self)
        if not self.session.authenticated:  # the whole hello must arrive, small, by this time
            server._deadlines[self] = self.session.hello_by
            server.pending.add(self, self.close)

    def data_received(self, data: bytes) -> None:
        self._buf += data
        if self._task is None and not self._writing_paused:
            self._frames()
        elif len(self._buf) > 2 * STREAM_LIMIT and not self._reading_paused:
            self._reading_paused = True  # (resumed once the frames are taken)
            if self._transport is not None:
                self._transport.pause_reading()

    def eof_received(self) -> bool:
        return False  # close: a half-open connection sends no more requests

    def connection_lost(self, exc: Exception | None) -> None:
        self._closed = True
        server = self.server
        server._deadlines.pop(self, None)
        server.pending.discard(self)
        server._conns.discard(self)
        self._wake_drain(ConnectionResetError("connection lost"))

    def pause_writing(self) -> None:
        self._writing_paused = True

    def resume_writing(self) -> None:
        self._writing_paused = False
        self._wake_drain(None)
        if self._task is None:
            self._frames()

    # ------------------------------------------------------------------ what the server uses
    def write(self, frame: bytes) -> None:
        if self._transport is not None:
            self._transport.write(frame)

    def reply(self, frame: bytes) -> None:
        """Write a request's answer, then the work its verb left until the answer is out
        (:data:`~kvstore.master.rpc_verbs.AFTER_REPLY`; nothing may come between the two)."""
        self.write(frame)
        if self.after:
            run_after_reply(self.after)

    async def drain(self) -> None:
        """Until the transport's buffer is under its high-water mark.

        Raises:
            ConnectionResetError: the connection is lost.
        """
        if self._closed:
            raise ConnectionResetError("connection lost")
        if not self._writing_paused:
            return
        if self._drained is None:
            self._drained = self.loop.create_future()
        await self._drained

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()

    def abort(self) -> None:
        if self._transport is not None:
            self._transport.abort()

    # ------------------------------------------------------------------ the frame loop
    def _wake_drain(self, exc: Exception | None) -> None:
        waiter, self._drained = self._drained, None
        if waiter is not None and not waiter.done():
            if exc is None:
                waiter.set_result(None)
            else:
                waiter.set_exception(exc)
                waiter.exception()  # (retrieved: nobody may wait for it any more)

    def _frames(self) -> None:
        """Answer every whole frame buffered, in order, until one needs the loop, the peer
        stops taking answers, or the connection is to close; note the deadline of a frame on
        the way."""
        server, session = self.server, self.session
        deadlines = server._deadlines
        while not self._closed and not self._writing_paused:
            buf = self._buf
            if not buf:
                break
            if self._started is None:
                self._started = self.loop.time()
                if session.authenticated:
                    deadlines[self] = session.header_deadline(self._started)
            if len(buf) < protocol.HEADER_SIZE:
                break
            try:
                header = protocol.decode_header(
                    bytes(buf[: protocol.HEADER_SIZE]), max_body=server.max_body, max_payload=0
                )
                session.check_header(header)
            except KVStoreError as err:
                # The framing is lost (or the peer is not authenticated): answer once, then hang up.
                self.write(protocol.encode_error(0, err))
                self._hang_up()
                return
            end = protocol.HEADER_SIZE + header.body_len
            if len(buf) < end:
                if session.authenticated and header.body_len > protocol.READ_AHEAD:
                    deadlines[self] = session.body_deadline(self._started, header)
                break
            body = bytes(buf[protocol.HEADER_SIZE : end])
            del buf[:end]
            self._started = None
            if session.authenticated:
                deadlines.pop(self, None)
            if not self._answer(header, body):
                return  # (a task answers it, or the connection is closing)
        else:
            return  # (the peer is not taking our answers: resume_writing goes on)
        self._resume_reading()  # waiting for more bytes

    def _resume_reading(self) -> None:
        if self._reading_paused and not self._closed and self._transport is not None:
            self._reading_paused = False
            self._transport.resume_reading()

    def _answer(self, header: protocol.FrameHeader, body: bytes) -> bool:
        """Answer one frame: the session's refusal, or the request's answer (at once, or by a
        task). Returns whether the next frame may be answered now."""
        server, session = self.server, self.session
        step = session.open_request(header, body)
        if isinstance(step, serving.Refusal):
            # (No payload to skip: the header's limit refused every payload.)
            if session.authenticated:
                server._deadlines.pop(self, None)
                server.pending.discard(self)
            self.write(step.frame)
            if step.hang_up:
                self._hang_up()
                return False
            server._awake.served()
            return True
        later = server.answer(self, step, session.tenant)
        server._awake.served()
        if later is None:
            return True
        self._task = self.loop.create_task(self._answer_later(later))
        return False

    async def _answer_later(self, later: Deferred) -> None:
        try:
            keep = await self.server.answer_later(self, later)
        except ConnectionError:
            keep = False
        except Exception:  # noqa: BLE001 - logged; the connection is closed, the server goes on
            log.exception("internal error while serving %r", later[0].verb[:64])
            keep = False
        self._task = None
        self.server._awake.served()
        if not keep:
            self._hang_up()
            return
        self._frames()

    def _hang_up(self) -> None:
        """Close after what is written is sent; read nothing more."""
        self._closed = True
        self.server._deadlines.pop(self, None)
        self.close()


class RpcObserver(Protocol):
    """Records each served request (metrics). ``result`` is the handler's return value or None."""

    def observe(self, request: protocol.Request, code: int, result: Any, seconds: float) -> None:
        """Args: the request, its error code (0 = ok), the handler's result, the time it took."""


class Fence(Protocol):
    """Decides, before any handler runs, whether this master may serve a request (HA mode)."""

    def check(self, request: protocol.Request) -> KVStoreError | None: ...


def dispatch(
    svc: MasterService,
    request: protocol.Request,
    observer: RpcObserver | None = None,
    after: list[Callable[[], None]] | None = None,
) -> bytes:
    """Run one request and return the encoded response frame.

    Args:
        after: where a verb of :data:`~kvstore.master.rpc_verbs.AFTER_REPLY` leaves its
            remaining work, for the caller to run (:func:`~kvstore.master.rpc_verbs.run_after_reply`)
            once the frame is written; None: it is done here.
    """
    handler = HANDLERS.get(request.verb)
    started, code, result = time.perf_counter(), 0, None
    try:
        if handler is None:
            raise UnknownVerbError(f"unknown verb {request.verb[:64]!r}")
        take_releases(svc, request.args)
        deferring = AFTER_REPLY.get(request.verb) if after is not None else None
        if deferring is not None:
            result = deferring(svc, request.args, after)
        else:
            result = handler(svc, request.args)
        return protocol.encode_response(request.req_id, result)
    except Exception as exc:  # noqa: BLE001 - every failure is an error frame, never a hang-up
        code, frame = _error_frame(request, exc)
        return frame
    finally:
        if observer is not None:
            observer.observe(request, code, result, time.perf_counter() - started)


def _error_frame(request: protocol.Request, exc: Exception) -> tuple[int, bytes]:
    """The error code and response frame for a failed request: a typed error travels as it
    is; anything else is logged and answered as an internal error (its message never leaves)."""
    if isinstance(exc, KVStoreError):
        return int(exc.code), protocol.encode_error(request.req_id, exc)
    log.exception("internal error while serving %r", request.verb[:64])
    return int(InternalError.code), protocol.encode_error(
        request.req_id, InternalError("internal error")
    )


async def _give_back_releases(
    svc: MasterService, request: protocol.Request, chunk_items: int
) -> None:
    """As :func:`~kvstore.master.rpc_verbs.take_releases`, bounded: a short list, the usual
    case, is given back at once, without a coroutine; a long one a chunk a turn."""
    if request.verb not in HANDLERS or "release" not in request.args:
        return
    tokens = pop_releases(svc, request.args)
    if len(tokens) <= chunk_items:
        svc.release_leases(tokens)
    else:
        await release_in_chunks(svc, tokens, chunk_items)


def dispatch_now(
    svc: MasterService,
    request: protocol.Request,
    observer: RpcObserver | None = None,
    chunk_items: int = CHUNK_ITEMS,
    after: list[Callable[[], None]] | None = None,
) -> bytes | None:
    """:func:`dispatch_bounded`'s answer to a request it serves in one go (the usual small one),
    without a coroutine; None, with nothing done, for one it serves in chunks (or whose
    arguments it must look at more closely: :func:`dispatch_bounded` answers those)."""
    release = request.args.get("release") if request.verb in HANDLERS else None
    try:
        if (
            (type(release) is list and len(release) > chunk_items)
            or is_large_kv_match(request, chunk_items)
            or chunk_count(svc, request, chunk_items)
        ):
            return None
    except KVStoreError:
        return None  # (dispatch_bounded refuses it)
    return dispatch(svc, request, observer, after)


async def dispatch_bounded(
    svc: MasterService,
    request: protocol.Request,
    observer: RpcObserver | None = None,
    chunk_items: int = CHUNK_ITEMS,
    after: list[Callable[[], None]] | None = None,
) -> bytes:
    """:func:`dispatch`, but a large batch is served in chunks of ``chunk_items`` with the loop
    free between two (bounded work per turn: one client's 65,536-key batch does not stall the
    others). ``after``: as :func:`dispatch` (a request served in one go may leave work there)."""
    started, code, delegated = time.perf_counter(), 0, False
    try:
        await _give_back_releases(svc, request, chunk_items)
        if is_large_kv_match(request, chunk_items):
            packed = await serve_kv_match(svc, request, chunk_items)
        else:
            n = chunk_count(svc, request, chunk_items)
            if not n:
                delegated = True  # small: in one go (dispatch observes it)
                return dispatch(svc, request, observer, after)
            packed = await serve_chunks(svc, request, n, chunk_items)
        body = PACK.pack_array_header(3) + PACK.pack(request.req_id) + PACK.pack(0) + packed
        return protocol.encode_header(protocol.KIND_RESPONSE, len(body)) + body
    except Exception as exc:  # noqa: BLE001 - as in dispatch
        code, frame = _error_frame(request, exc)
        return frame
    finally:
        if observer is not None and not delegated:
            observer.observe(request, code, None, time.perf_counter() - started)


class ControlServer:
    """Serves the msgpack control protocol on an asyncio loop, each request by the service of
    the current term (read from ``slot`` per request: an HA term swaps in a fresh one)."""

    def __init__(
        self,
        slot: ServiceSlot,
        host: str,
        port: int,
        *,
        max_body: int = protocol.DEFAULT_MAX_BODY,
        fence: Fence | None = None,
        observer: RpcObserver | None = None,
        token: auth.Token | None = None,
        chunk_items: int = CHUNK_ITEMS,
        deadlines: serving.WireDeadlines = serving.DEFAULT_DEADLINES,
        tenants: TenantDirectory | None = None,
    ) -> None:
        if chunk_items < 1:
            raise InvalidRequestError("chunk_items must be >= 1")
        self.slot = slot
        self.chunk_items = chunk_items
        self.fence = fence
        self.observer = observer
        self.token = token
        #: The tenants' token digests a hello may prove (the master's book keeps it current).
        self.tenants = tenants
        #: How long a frame (and, before the token is proved, the hello) may take to arrive.
        self.deadlines = deadlines
        self.host = host
        self.port = port
        self.max_body = max_body
        self._server: asyncio.Server | None = None
        self._conns: set[_Connection] = set()
        #: Connections with a frame (or the hello) on the way -> the loop time it must be in by.
        self._deadlines: dict[_Connection, float] = {}
        self._sweeper: asyncio.Task[None] | None = None
        # Clients come back after a round trip to a node: see kvstore.polling.MASTER_WINDOWS.
        self._awake = LoopAwake(poll_window() * MASTER_WINDOWS)
        #: Connections that have not sent their hello yet (bounded; see auth.PendingConnections).
        self.pending = auth.PendingConnections()
        self._stopping = False
        #: ``events_snapshot`` answers being built or written now (see SNAPSHOTS_IN_FLIGHT).
        self._snapshots = 0

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: _Connection(self), self.host, self.port)
        self.port = self._server.sockets[0].getsockname()[1]
        self._sweeper = asyncio.create_task(self._sweep())

    async def stop(self) -> None:
        self._stopping = True
        self.slot.service.events.wake()  # long polls answer now, not at their timeout
        if self._sweeper is not None:
            self._sweeper.cancel()
        if self._server is not None:
            self._server.close()
            for conn in list(self._conns):
                conn.close()
            await self._server.wait_closed()

    def _take_snapshot_slot(self) -> KVStoreError | None:
        """Count one more snapshot answer in flight, or the refusal when
        :data:`SNAPSHOTS_IN_FLIGHT` are already."""
        if self._snapshots >= SNAPSHOTS_IN_FLIGHT:
            return OverloadedError(
                f"{SNAPSHOTS_IN_FLIGHT} event snapshots are being sent already; try again shortly"
            )
        self._snapshots += 1
        return None

    def _fence_check(self, request: protocol.Request) -> KVStoreError | None:
        return self.fence.check(request) if self.fence is not None else None

    async def _sweep(self) -> None:
        """Close every connection whose frame (or hello) is past its deadline.

        One timer for the whole server instead of one per request: a request only records its
        deadline in ``_deadlines`` while its frame is on the way (a dict write, no timer).
        """
        loop = asyncio.get_running_loop()
        last = loop.time()
        while True:
            await asyncio.sleep(SWEEP_INTERVAL_S)
            now = loop.time()
            stalled = now - last - SWEEP_INTERVAL_S
            last = now
            if stalled > SWEEP_INTERVAL_S:
                # This loop did not run (a long batch, a GC pause): the peers' bytes may be
                # waiting unread. Their time did not run out, ours did: push every deadline back.
                for w in self._deadlines:
                    self._deadlines[w] += stalled
                continue
            late = [conn for conn, by in self._deadlines.items() if by < now]
            for conn in late:
                self._deadlines.pop(conn, None)
                conn.close()

    def answer(
        self, conn: _Connection, request: protocol.Request, tenant: str | None
    ) -> Deferred | None:
        """Answer a request at once if it can be (the usual small request: fenced or not, a
        tenant's or the operator's, served in one go), without a coroutine; else (``events``
        long polls, ``events_snapshot``, a batch served in chunks) return what
        :meth:`answer_later` needs to answer it, which it must before the connection's next
        frame.

        ``tenant``: the connection's (None: the operator's); a tenant's request is taken into
        its part of the key space first (``rpc_tenants.py``)."""
        refusal = self._fence_check(request)
        own: Answer | None = None  # a tenant's request answered by rpc_tenants
        if tenant is not None and refusal is None:
            try:
                own = scope_request(self.slot.service, request, tenant)
            except KVStoreError as err:
                refusal = err
        if refusal is not None:
            conn.write(protocol.encode_error(request.req_id, refusal))
            return None
        if request.verb in ("events", "events_snapshot"):
            return request, own, tenant
        if own is not None and tenant is not None:
            conn.write(self._answer_tenant(request, own, tenant))
            return None
        reply = dispatch_now(
            self.slot.service, request, self.observer, self.chunk_items, conn.after
        )
        if reply is None:
            return request, None, tenant
        conn.reply(reply)
        return None

    async def answer_later(self, conn: _Connection, later: Deferred) -> bool:
        """Answer a request :meth:`answer` left (screened already: not fenced; ``own``, a
        tenant's answer from ``rpc_tenants``, or None): long-poll ``events``, take a snapshot
        slot, or serve a batch in chunks. Returns False when the connection is to be closed (a
        snapshot its reader did not take)."""
        request, own, tenant = later
        refusal: KVStoreError | None = None
        holds_snapshot = False  # this request holds one of the snapshot slots
        if request.verb == "events_snapshot":
            refusal = self._take_snapshot_slot()
            holds_snapshot = refusal is None
        try:
            if refusal is None and request.verb == "events":
                await await_events(self.slot, request, lambda: self._stopping)
                refusal = self._fence_check(request)  # it may have lost the lead while it waited
            if refusal is not None:
                conn.write(protocol.encode_error(request.req_id, refusal))
            elif own is not None and tenant is not None:
                conn.write(self._answer_tenant(request, own, tenant))
            else:
                reply = await dispatch_bounded(
                    self.slot.service, request, self.observer, self.chunk_items, conn.after
                )
                conn.reply(reply)
            if not holds_snapshot:
                await conn.drain()
                return True
            return await self._drain_snapshot(conn)
        finally:
            if holds_snapshot:
                self._snapshots -= 1

    def _answer_tenant(self, request: protocol.Request, own: Answer, tenant: str) -> bytes:
        """The response frame of a tenant's request whose answer ``rpc_tenants`` builds (as
        :func:`dispatch`: piggybacked leases given back first, every failure an error frame)."""
        svc = self.slot.service
        started, code = time.perf_counter(), 0
        try:
            take_releases(svc, request.args)
            return protocol.encode_response(request.req_id, own(svc, request.args, tenant))
        except Exception as exc:  # noqa: BLE001 - as in dispatch
            code, frame = _error_frame(request, exc)
            return frame
        finally:
            if self.observer is not None:
                self.observer.observe(request, code, None, time.perf_counter() - started)

    @staticmethod
    async def _drain_snapshot(conn: _Connection) -> bool:
        """Wait until a snapshot answer is read, at most :data:`SNAPSHOT_WRITE_TIMEOUT_S`;
        False (the connection aborted) if its reader does not take it in time."""
        try:
            await asyncio.wait_for(conn.drain(), SNAPSHOT_WRITE_TIMEOUT_S)
        except TimeoutError:
            log.warning("a subscriber did not read its event snapshot; closing")
            conn.abort()  # close() would keep the buffer to send
            return False
        return True
