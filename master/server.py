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
#: Bytes a connection's stream reader buffers before it pauses reading the socket (x2).
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
        self._writers: set[asyncio.StreamWriter] = set()
        #: Connections with a frame (or the hello) on the way -> the loop time it must be in by.
        self._deadlines: dict[asyncio.StreamWriter, float] = {}
        self._sweeper: asyncio.Task[None] | None = None
        # Clients come back after a round trip to a node: see kvstore.polling.MASTER_WINDOWS.
        self._awake = LoopAwake(poll_window() * MASTER_WINDOWS)
        #: Connections that have not sent their hello yet (bounded; see auth.PendingConnections).
        self.pending = auth.PendingConnections()
        self._stopping = False
        #: ``events_snapshot`` answers being built or written now (see SNAPSHOTS_IN_FLIGHT).
        self._snapshots = 0

    async def start(self) -> None:
        # A small stream limit: a connection buffers at most ~2x this before we read it, so a
        # flood of peers that are never authenticated holds little memory (readexactly of a
        # larger body still works: it resumes reading as it goes).
        self._server = await asyncio.start_server(
            self._serve, self.host, self.port, limit=STREAM_LIMIT
        )
        self.port = self._server.sockets[0].getsockname()[1]
        self._sweeper = asyncio.create_task(self._sweep())

    async def stop(self) -> None:
        self._stopping = True
        self.slot.service.events.wake()  # long polls answer now, not at their timeout
        if self._sweeper is not None:
            self._sweeper.cancel()
        if self._server is not None:
            self._server.close()
            for w in list(self._writers):
                w.close()
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
            late = [w for w, by in self._deadlines.items() if by < now]
            for w in late:
                self._deadlines.pop(w, None)
                w.close()  # its reader sees EOF: the serving coroutine returns

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One connection's frame loop (its rules: :class:`kvstore.serving.FrameSession`)."""
        self._writers.add(writer)
        loop = asyncio.get_running_loop()
        session = serving.FrameSession(
            self.token, loop.time(), deadlines=self.deadlines, tenants=self.tenants
        )
        after: list[Callable[[], None]] = []  # a request's work left until its answer is out
        if not session.authenticated:  # the whole hello must arrive, small, by this time
            self._deadlines[writer] = session.hello_by
            self.pending.add(writer, writer.close)
        try:
            while True:
                frame = await self._read_frame(reader, writer, session)
                if frame is None or not await self._answer_frame(writer, session, *frame, after):
                    return
                self._awake.served()
        except ConnectionError:
            return
        finally:
            self._deadlines.pop(writer, None)
            self.pending.discard(writer)
            self._writers.discard(writer)
            writer.close()

    async def _read_frame(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        session: serving.FrameSession,
    ) -> tuple[protocol.FrameHeader, bytes] | None:
        """The connection's next whole frame, or None once the connection is over (closed,
        or its header refused: answered here once)."""
        loop = asyncio.get_running_loop()
        deadlines = self._deadlines
        try:
            if session.authenticated:
                # Idle between frames as long as it likes; once a frame starts, it must
                # arrive whole within its deadline (no half-sent frame holds us).
                first = await reader.readexactly(1)
                started = loop.time()
                deadlines[writer] = session.header_deadline(started)
                raw = first + await reader.readexactly(protocol.HEADER_SIZE - 1)
            else:
                raw = await reader.readexactly(protocol.HEADER_SIZE)
        except (asyncio.IncompleteReadError, ConnectionError):
            return None
        try:
            header = protocol.decode_header(raw, max_body=self.max_body, max_payload=0)
            session.check_header(header)
        except KVStoreError as err:
            # The framing is lost (or the peer is not authenticated): answer once, then hang up.
            writer.write(protocol.encode_error(0, err))
            await writer.drain()
            return None
        if session.authenticated and header.body_len > protocol.READ_AHEAD:
            deadlines[writer] = session.body_deadline(started, header)
        try:
            body = await reader.readexactly(header.body_len)
        except (asyncio.IncompleteReadError, ConnectionError):
            return None
        if session.authenticated:
            deadlines.pop(writer, None)
        return header, body

    async def _answer_frame(
        self,
        writer: asyncio.StreamWriter,
        session: serving.FrameSession,
        header: protocol.FrameHeader,
        body: bytes,
        after: list[Callable[[], None]],
    ) -> bool:
        """Answer one frame: the session's refusal, or the request's answer. Returns False
        when the connection is to be closed."""
        step = session.open_request(header, body)
        if not isinstance(step, serving.Refusal):
            return await self._answer_request(writer, step, after, session.tenant)
        # (No payload to skip: the header's limit refused every payload.)
        if session.authenticated:
            self._deadlines.pop(writer, None)
            self.pending.discard(writer)
        writer.write(step.frame)
        await writer.drain()
        return not step.hang_up

    async def _answer_request(
        self,
        writer: asyncio.StreamWriter,
        request: protocol.Request,
        after: list[Callable[[], None]],
        tenant: str | None = None,
    ) -> bool:
        """Fence, long-poll (``events``) and serve one request, and write its answer. Returns
        False when the connection is to be closed (a snapshot its reader did not take).

        ``tenant``: the connection's (None: the operator's); a tenant's request is taken into
        its part of the key space first (``rpc_tenants.py``)."""
        refusal = self._fence_check(request)
        own: Answer | None = None  # a tenant's request answered by rpc_tenants
        if tenant is not None and refusal is None:
            try:
                own = scope_request(self.slot.service, request, tenant)
            except KVStoreError as err:
                refusal = err
        holds_snapshot = False  # this request holds one of the snapshot slots
        if refusal is None and request.verb == "events_snapshot":
            refusal = self._take_snapshot_slot()
            holds_snapshot = refusal is None
        try:
            if refusal is None and request.verb == "events":
                await await_events(self.slot, request, lambda: self._stopping)
                refusal = self._fence_check(request)  # it may have lost the lead while it waited
            if refusal is not None:
                writer.write(protocol.encode_error(request.req_id, refusal))
            elif own is not None and tenant is not None:
                writer.write(self._answer_tenant(request, own, tenant))
            else:
                reply = await dispatch_bounded(
                    self.slot.service, request, self.observer, self.chunk_items, after
                )
                writer.write(reply)
                if after:  # (no await between: see rpc_verbs.AFTER_REPLY)
                    run_after_reply(after)
            if not holds_snapshot:
                await writer.drain()
                return True
            return await self._drain_snapshot(writer)
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
    async def _drain_snapshot(writer: asyncio.StreamWriter) -> bool:
        """Wait until a snapshot answer is read, at most :data:`SNAPSHOT_WRITE_TIMEOUT_S`;
        False (the connection aborted) if its reader does not take it in time."""
        try:
            await asyncio.wait_for(writer.drain(), SNAPSHOT_WRITE_TIMEOUT_S)
        except TimeoutError:
            log.warning("a subscriber did not read its event snapshot; closing")
            writer.transport.abort()  # close() would keep the buffer to send
            return False
        return True
