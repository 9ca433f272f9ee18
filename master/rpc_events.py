"""The KV event verbs of the master's RPC edge: ``events`` (with its long poll) and
``events_snapshot``.

The event log itself (sequence numbers, epochs, resyncs) is ``master/event_ring.py``; the REST
stream of the same events is ``master/rest/event_stream.py``. Here: the checks of the arguments,
the answers, and :func:`await_events`, the wait the frame loop runs before ``events`` answers.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvstore import protocol
from kvstore.errors import InvalidRequestError, KVStoreError
from kvstore.master.event_ring import (
    MAX_EVENTS_PER_CALL,
    EventBatch,
    EventLog,
    Resync,
    event_to_wire,
)
from kvstore.master.rpc_args import arg, list_arg, optional_arg
from kvstore.master.service import MasterService, ServiceSlot

#: Longest long poll of one ``events`` call (a subscriber's call timeout must exceed it).
EVENTS_MAX_WAIT_S = 30.0
EVENTS_DEFAULT_MAX = 1000
#: Most namespaces one ``events`` or ``events_snapshot`` call may name.
EVENTS_MAX_NAMESPACES = 1024
#: Most block keys one snapshot answer carries (16 bytes each: 24 MiB, under the frame limit).
SNAPSHOT_MAX_BLOCKS = 1_500_000


@dataclass(frozen=True, slots=True)
class EventsQuery:
    """The checked arguments of an ``events`` call."""

    since_seq: int
    since_epoch: int | None
    max_events: int
    wait_s: float
    namespaces: frozenset[bytes] | None


def namespaces_arg(args: dict[str, Any]) -> frozenset[bytes] | None:
    """The namespace digests an ``events`` or ``events_snapshot`` call is limited to (None:
    every namespace).

    Raises:
        InvalidRequestError: not a list of at most :data:`EVENTS_MAX_NAMESPACES` 16-byte digests.
    """
    if "namespaces" not in args or args["namespaces"] is None:
        return None
    digests = list_arg(args, "namespaces", bytes)
    if len(digests) > EVENTS_MAX_NAMESPACES or any(len(d) != 16 for d in digests):
        raise InvalidRequestError(
            f"namespaces must be at most {EVENTS_MAX_NAMESPACES} digests of 16 bytes"
        )
    return frozenset(digests)


def events_query(args: dict[str, Any]) -> EventsQuery:
    """Check the arguments of ``events``.

    NOTE: the caller's epoch travels as ``since_epoch``, never ``epoch``: ``epoch`` is the HA
    fence's (the leader the caller believes in), and an event epoch there would be refused as
    stale, or even make a leader step down.

    Raises:
        InvalidRequestError: a wrong type or a value out of range.
    """
    since_seq = optional_arg(args, "since_seq", int, 0)
    if since_seq < 0:
        raise InvalidRequestError("since_seq must be >= 0")
    raw_epoch = args.get("since_epoch")
    since_epoch = None if raw_epoch is None else arg(args, "since_epoch", int)
    max_events = optional_arg(args, "max", int, EVENTS_DEFAULT_MAX)
    if not 1 <= max_events <= MAX_EVENTS_PER_CALL:
        raise InvalidRequestError(f"max must be in 1..{MAX_EVENTS_PER_CALL}")
    wait_s = float(optional_arg(args, "wait_s", (int, float), 0.0))
    if not 0.0 <= wait_s <= EVENTS_MAX_WAIT_S:  # (NaN fails too)
        raise InvalidRequestError(f"wait_s must be in 0..{EVENTS_MAX_WAIT_S:g}")
    return EventsQuery(since_seq, since_epoch, max_events, wait_s, namespaces_arg(args))


def read_events(log_: EventLog, q: EventsQuery) -> EventBatch | Resync:
    """The events of ``log_`` that ``q`` asks for (no waiting)."""
    return log_.read(q.since_seq, q.since_epoch, q.max_events, q.namespaces)


def events(svc: MasterService, args: dict[str, Any]) -> Any:
    """``events``: the KV events after the caller's position, or a resync (see
    ``master/event_ring.py``).

    The long poll (``wait_s``) happens in :func:`await_events`, before this.
    """
    log_ = svc.events
    got = read_events(log_, events_query(args))
    if isinstance(got, Resync):
        return {
            "epoch": log_.epoch,
            "last_seq": log_.last_seq,
            "events": [],
            "resync": {"reason": got.reason, "message": got.message},
        }
    return {
        "epoch": got.epoch,
        "last_seq": got.last_seq,
        "events": [event_to_wire(ev) for ev in got.events],
        "resync": None,
    }


def events_snapshot(svc: MasterService, args: dict[str, Any]) -> Any:
    """``events_snapshot``: every indexed block per namespace, and the ``(epoch, seq)`` to
    follow events from."""
    return snapshot_answer(args, *svc.prefix.snapshot())


def snapshot_answer(
    args: dict[str, Any], epoch: int, seq: int, keys: dict[bytes, bytes]
) -> dict[str, Any]:
    """An ``events_snapshot`` answer: the namespaces asked for (all without ``namespaces``),
    refused when it would exceed :data:`SNAPSHOT_MAX_BLOCKS`.

    Raises:
        InvalidRequestError: a bad ``namespaces`` argument, or too many blocks to answer.
    """
    wanted = namespaces_arg(args)
    if wanted is not None:
        keys = {d: k for d, k in keys.items() if d in wanted}
    num_blocks = sum(len(k) for k in keys.values()) // 16
    if num_blocks > SNAPSHOT_MAX_BLOCKS:
        raise InvalidRequestError(
            f"a snapshot of {num_blocks} blocks exceeds {SNAPSHOT_MAX_BLOCKS} per answer: "
            "ask for fewer namespaces at a time"
        )
    return {"epoch": epoch, "seq": seq, "namespaces": keys, "num_blocks": num_blocks}


async def await_events(
    slot: ServiceSlot, request: protocol.Request, stopping: Callable[[], bool]
) -> None:
    """The long poll of ``events``: wait until an event the caller wants is recorded, or
    ``wait_s`` passes, or the log is replaced (a new term) or ``stopping()`` turns true.

    Holds nothing while it waits (a callback on the log, a future): other connections are
    served meanwhile. Bad arguments return at once; the handler then refuses them.
    """
    try:
        q = events_query(request.args)
    except KVStoreError:
        return
    loop = asyncio.get_running_loop()
    deadline = loop.time() + q.wait_s
    log_ = slot.service.events
    while not stopping() and slot.service.events is log_:
        got = read_events(log_, q)
        if not isinstance(got, EventBatch) or got.events:
            return
        left = deadline - loop.time()
        if left <= 0:
            return
        q = EventsQuery(got.last_seq, q.since_epoch, q.max_events, 0.0, q.namespaces)
        await _woken_or_timeout(log_, left)


async def _woken_or_timeout(log_: EventLog, timeout: float) -> None:
    """Wait until ``log_`` records an event (or is woken) or ``timeout`` seconds pass."""
    woken: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def wake() -> None:
        if not woken.done():
            woken.set_result(None)

    log_.add_waiter(wake)
    try:
        await asyncio.wait({woken}, timeout=timeout)
    finally:
        log_.remove_waiter(wake)
