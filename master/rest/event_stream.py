"""KV events on the admin API: ``GET /api/v1/events`` (server-sent events) and its snapshot.

The stream is self-healing: it always gives the subscriber a complete view. A subscriber with
no position (or one the master cannot serve: another epoch, events the ring dropped) first gets
a ``resync`` event when it had a position, then a ``snapshot`` event (every indexed block per
namespace), then every event after the snapshot's sequence number. Each data event's ``id:`` is
``EPOCH.SEQ``, so a browser's ``EventSource`` (or ``curl -N`` with ``Last-Event-ID``) that
reconnects resumes exactly after the last event it saw.

Why the epoch is in the id (not the bare sequence number): a restarted or failed-over master
numbers its events from 1 again; a bare number would resume at the wrong place without notice.
A bare number is still accepted (with the ``epoch`` query parameter, or it resyncs).

The stream obeys the leadership fence: it starts only on a leader (``NOT_LEADER``, 503
otherwise, see ``fence.py``) and ends with an ``error`` event when this master stops leading.

Memory per subscriber is bounded: at most ``MAX_STREAMS`` streams are open at once (the next
gets ``OVERLOADED``, 503); the snapshot is written a few thousand block keys at a time (as
``data:`` lines of one event, which a reader joins into one JSON document), each piece only
once the subscriber took the one before; a subscriber that takes nothing for
``WRITE_TIMEOUT_S`` is dropped. The events name blocks of every tenant's prompts: they need the
token (when one is set) even where other reads are public (``security.py``).

A tenant's token gets its own view (:func:`tenant_events_stream`, :func:`tenant_events_snapshot`),
as its connection's ``events`` verb does on the RPC edge (``rpc_tenants.py``): only the events
and blocks of its own prompt trees, each under its namespace's own digest (the one it knows),
and of the shared namespaces; its ``namespace`` parameters name its own digests. Its trees are
looked up again at every read, so a namespace it starts using while subscribed shows up.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from kvstore.errors import InvalidRequestError, KVStoreError, OverloadedError
from kvstore.master.event_ring import (
    MAX_EVENTS_PER_CALL,
    EventBatch,
    Resync,
    event_to_json,
)
from kvstore.master.prefix import scoped_digest
from kvstore.master.rest.fence import FENCE_KEY
from kvstore.master.rest.state import SERVICE_KEY, open_to_tenants
from kvstore.master.service import MasterService

#: A comment line this often keeps proxies from closing an idle stream (and finds gone peers).
KEEPALIVE_S = 15.0
#: What a browser waits before it reconnects (the SSE ``retry:`` field), in milliseconds.
RETRY_MS = 1000
MAX_DURATION_S = 86_400.0
#: Event streams open at once, across subscribers.
MAX_STREAMS = 64
#: Seconds a subscriber has to take each piece written to it before it is dropped.
WRITE_TIMEOUT_S = 30.0
#: Block keys per piece of a streamed snapshot (~140 KB of JSON).
SNAPSHOT_PIECE_KEYS = 4096
_MAX_INT = (1 << 53) - 1  # exact in JSON numbers


@dataclass(slots=True)
class StreamState:
    """Open event streams of one app: the app's shutdown ends them (else it waits for them)."""

    stopping: bool = False
    num_open: int = 0
    max_open: int = MAX_STREAMS


STREAMS_KEY = web.AppKey("event_streams", StreamState)


def _uint(raw: str, name: str) -> int:
    if not raw.isascii() or not raw.isdigit() or len(raw) > 16:
        raise InvalidRequestError(f"{name} must be a non-negative integer")
    value = int(raw)
    if value > _MAX_INT:
        raise InvalidRequestError(f"{name} must be at most {_MAX_INT}")
    return value


def parse_position(request: web.Request) -> tuple[int, int | None] | None:
    """The subscriber's ``(seq, epoch)``: from ``Last-Event-ID`` (``EPOCH.SEQ`` or ``SEQ``), else
    from the ``since`` and ``epoch`` query parameters; None for a subscriber with none.

    Raises:
        InvalidRequestError: a malformed header or parameter.
    """
    epoch_q = request.query.get("epoch")
    epoch = _uint(epoch_q, "epoch") if epoch_q is not None else None
    last_id = request.headers.get("Last-Event-ID")
    if last_id:
        text = last_id.strip()
        if "." in text:
            e, _, s = text.partition(".")
            return _uint(s, "Last-Event-ID's seq"), _uint(e, "Last-Event-ID's epoch")
        return _uint(text, "Last-Event-ID"), epoch
    since = request.query.get("since")
    if since is None:
        return None  # (an epoch alone names no position)
    return _uint(since, "since"), epoch


def _only_params(request: web.Request, allowed: frozenset[str]) -> None:
    """Raises InvalidRequestError for a query parameter the route does not take."""
    unknown = set(request.query) - allowed
    if unknown:
        raise InvalidRequestError(f"unknown query parameter {sorted(unknown)[0][:64]!r}")


def parse_namespaces(request: web.Request) -> frozenset[bytes] | None:
    """The ``namespace`` query parameters (hex digests, repeatable); None: every namespace.

    Raises:
        InvalidRequestError: not 32 hex digits, or too many.
    """
    raw = request.query.getall("namespace", [])
    if not raw:
        return None
    if len(raw) > 64:
        raise InvalidRequestError("at most 64 namespace parameters")
    out = set()
    for text in raw:
        try:
            digest = bytes.fromhex(text) if len(text) == 32 else b""
        except ValueError:
            digest = b""
        if len(digest) != 16:
            raise InvalidRequestError("namespace must be a digest of 32 hex digits")
        out.add(digest)
    return frozenset(out)


def _duration(request: web.Request) -> float:
    raw = request.query.get("duration_s")
    if raw is None:
        return MAX_DURATION_S
    try:
        value = float(raw)
    except ValueError:
        raise InvalidRequestError("duration_s must be a number") from None
    if not 0.0 < value <= MAX_DURATION_S:
        raise InvalidRequestError(f"duration_s must be in (0, {MAX_DURATION_S:g}]")
    return value


def _trees(
    svc: MasterService, tenant: str, asked: frozenset[bytes] | None
) -> tuple[frozenset[bytes], dict[bytes, bytes]]:
    """The prompt trees ``tenant`` may follow (those of ``asked``, its own namespace digests;
    None: all of them), and each of its own trees' digest -> the namespace's digest it knows.
    A shared namespace's tree is the namespace's own (not mapped)."""
    shared = svc.tenants
    if asked is None:
        back = {
            tree: d
            for tree, (owner, d) in svc.prefix.scopes.items()
            if owner == tenant and not shared.is_shared(d)
        }
        return frozenset(back) | shared.shared, back
    back = {scoped_digest(tenant, d): d for d in asked if not shared.is_shared(d)}
    return frozenset(back) | frozenset(d for d in asked if shared.is_shared(d)), back


def _snapshot(
    svc: MasterService, namespaces: frozenset[bytes] | None, tenant: str | None
) -> tuple[int, int, list[tuple[bytes, bytes]]]:
    """(epoch, seq, [(namespace digest, block keys)]): the operator's of every tree, a tenant's
    of its own trees and the shared ones, under the digests it knows; only ``namespaces``'."""
    if tenant is None:
        epoch, seq, keys = svc.prefix.snapshot()
    else:
        epoch, seq, keys = svc.prefix.tenant_snapshot(tenant, svc.tenants.shared)
    wanted = [(d, raw) for d, raw in keys.items() if namespaces is None or d in namespaces]
    return epoch, seq, wanted


def snapshot_json(
    svc: MasterService, namespaces: frozenset[bytes] | None, tenant: str | None = None
) -> dict[str, Any]:
    """The snapshot as JSON: ``{epoch, seq, namespaces: {digest hex: [block key hex]}}``
    (``tenant``: that tenant's view, see the module's docstring)."""
    epoch, seq, wanted = _snapshot(svc, namespaces, tenant)
    out = {d.hex(): [raw[i : i + 16].hex() for i in range(0, len(raw), 16)] for d, raw in wanted}
    return {"epoch": epoch, "seq": seq, "namespaces": out}


def _frame(kind: str, data: dict[str, Any], event_id: str | None = None) -> bytes:
    head = f"event: {kind}\n" + (f"id: {event_id}\n" if event_id is not None else "")
    return (head + "data: " + json.dumps(data, separators=(",", ":")) + "\n\n").encode()


async def events_snapshot(request: web.Request) -> web.Response:
    """``GET /api/v1/events/snapshot``: every indexed block and the position it reflects."""
    return await tenant_events_snapshot(request, None)


async def tenant_events_snapshot(request: web.Request, tenant: str | None) -> web.Response:
    """``GET /api/v1/events/snapshot`` for ``tenant`` (None: the operator's, every block)."""
    _only_params(request, frozenset({"namespace"}))
    namespaces = parse_namespaces(request)
    svc = request.app[SERVICE_KEY].service
    return web.json_response(snapshot_json(svc, namespaces, tenant))


async def events_stream(request: web.Request) -> web.StreamResponse:
    """``GET /api/v1/events``: server-sent KV events (see the module's docstring).

    Raises:
        OverloadedError: ``MAX_STREAMS`` streams are open already.
    """
    return await tenant_events_stream(request, None)


async def tenant_events_stream(request: web.Request, tenant: str | None) -> web.StreamResponse:
    """``GET /api/v1/events`` for ``tenant`` (None: the operator's, every event).

    Raises:
        OverloadedError: ``MAX_STREAMS`` streams are open already (the operator's and the
            tenants' together).
    """
    _only_params(request, frozenset({"since", "epoch", "namespace", "duration_s"}))
    position = parse_position(request)
    namespaces = parse_namespaces(request)
    duration = _duration(request)
    state = request.app[STREAMS_KEY]
    if state.num_open >= state.max_open:
        raise OverloadedError(f"{state.max_open} event streams are open: try again later")
    state.num_open += 1
    try:
        return await _stream(request, position, namespaces, duration, tenant)
    finally:
        state.num_open -= 1


async def _stream(
    request: web.Request,
    position: tuple[int, int | None] | None,
    namespaces: frozenset[bytes] | None,
    duration: float,
    tenant: str | None,
) -> web.StreamResponse:
    app = request.app
    slot = app[SERVICE_KEY]
    fence = app.get(FENCE_KEY)
    state = app[STREAMS_KEY]
    response = web.StreamResponse(
        headers={
            "Content-Type": "text/event-stream",
            "Cache-Control": "no-cache",
            "X-Accel-Buffering": "no",
        }
    )
    await response.prepare(request)
    await _write(response, f"retry: {RETRY_MS}\n\n".encode())
    loop = asyncio.get_running_loop()
    deadline = loop.time() + duration
    try:
        while not state.stopping and loop.time() < deadline:
            err: KVStoreError | None = fence.admin_check() if fence is not None else None
            if err is not None:
                await _write(
                    response,
                    _frame(
                        "error",
                        {"code": int(err.code), "name": err.code.name, "message": err.message},
                    ),
                )
                break
            svc = slot.service  # a new term's service is a new instance: read it each turn
            log_ = svc.events
            if position is None:
                position = await _write_snapshot(response, svc, namespaces, tenant)
                continue
            trees, back = (namespaces, {}) if tenant is None else _trees(svc, tenant, namespaces)
            got = log_.read(position[0], position[1], MAX_EVENTS_PER_CALL, trees)
            if isinstance(got, Resync):
                await _write(
                    response,
                    _frame(
                        "resync",
                        {
                            "reason": got.reason,
                            "message": got.message,
                            "epoch": log_.epoch,
                            "last_seq": log_.last_seq,
                        },
                    ),
                )
                position = None
                continue
            await _write_batch(response, got, back)
            position = (got.last_seq, got.epoch)
            if got.events or got.last_seq < log_.last_seq:
                continue
            await _wait(loop, log_, min(KEEPALIVE_S, deadline - loop.time()), response)
    except (ConnectionResetError, ConnectionError, TimeoutError):
        pass  # the subscriber went away, or took nothing for WRITE_TIMEOUT_S
    return response


async def _write(response: web.StreamResponse, data: bytes) -> None:
    """Write and wait until the subscriber took it (its buffers drained).

    Raises:
        TimeoutError: it took nothing for ``WRITE_TIMEOUT_S``.
    """
    await asyncio.wait_for(response.write(data), WRITE_TIMEOUT_S)


async def _write_snapshot(
    response: web.StreamResponse,
    svc: MasterService,
    namespaces: frozenset[bytes] | None,
    tenant: str | None,
) -> tuple[int, int]:
    """Write the snapshot event a piece at a time (see the module docstring).

    Returns:
        The position it reflects: ``(seq, epoch)``.
    """
    epoch, seq, wanted = _snapshot(svc, namespaces, tenant)
    head = f"event: snapshot\nid: {epoch}.{seq}\n"
    await _write(response, f'{head}data: {{"epoch":{epoch},"seq":{seq},"namespaces":{{'.encode())
    step = SNAPSHOT_PIECE_KEYS * 16
    for n, (digest, raw) in enumerate(wanted):
        await _write(response, f'\ndata: {"," if n else ""}"{digest.hex()}":['.encode())
        for at in range(0, len(raw), step):
            piece = ",".join(
                f'"{raw[i : i + 16].hex()}"' for i in range(at, min(len(raw), at + step), 16)
            )
            await _write(response, f"\ndata: {',' if at else ''}{piece}".encode())
        await _write(response, b"\ndata: ]")
    await _write(response, b"\ndata: }}\n\n")
    return seq, epoch


async def _write_batch(
    response: web.StreamResponse, batch: EventBatch, back: dict[bytes, bytes]
) -> None:
    """Write a batch's events; ``back`` maps a tenant's tree digests to its namespaces'."""
    if not batch.events:
        return
    events = batch.events
    if back:
        events = [(ev[0], ev[1], back.get(ev[2], ev[2]), *ev[3:]) for ev in events]
    parts = [_frame(ev[1], event_to_json(ev), f"{batch.epoch}.{ev[0]}") for ev in events]
    await _write(response, b"".join(parts))


async def _wait(
    loop: asyncio.AbstractEventLoop, log_: Any, timeout: float, response: web.StreamResponse
) -> None:
    """Until the next event (or a new term, or shutdown); a keep-alive comment on timeout."""
    if timeout <= 0:
        return
    woken: asyncio.Future[None] = loop.create_future()

    def wake() -> None:
        if not woken.done():
            woken.set_result(None)

    log_.add_waiter(wake)
    try:
        done, _ = await asyncio.wait({woken}, timeout=timeout)
    finally:
        log_.remove_waiter(wake)
    if not done:
        await _write(response, b": keep-alive\n\n")


async def _stop_streams(app: web.Application) -> None:
    app[STREAMS_KEY].stopping = True
    app[SERVICE_KEY].service.events.wake()


def add_routes(app: web.Application) -> None:
    """Register the event routes on ``app`` (and end open streams at its shutdown)."""
    app[STREAMS_KEY] = StreamState()
    app.on_shutdown.append(_stop_streams)
    app.router.add_get("/api/v1/events", events_stream)
    app.router.add_get("/api/v1/events/snapshot", events_snapshot)
    open_to_tenants(app, "GET", "/api/v1/events", tenant_events_stream)
    open_to_tenants(app, "GET", "/api/v1/events/snapshot", tenant_events_snapshot)
