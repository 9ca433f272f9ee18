"""The long poll of the ``events`` verb (``master/rpc_events.py``) on a real event loop, without
sockets: it answers at once when the caller is behind, wakes on the event it waits for (and
only on one it wants), and ends at its timeout, a new term, or the server stopping. The verbs'
answers and argument checks are tested through ``dispatch`` in ``test_events.py``."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Coroutine
from typing import Any

import pytest

from kvstore import protocol
from kvstore.errors import InvalidRequestError
from kvstore.master.event_ring import EVENT_STORED
from kvstore.master.rpc_events import EVENTS_MAX_WAIT_S, await_events, events_query
from kvstore.master.service import MasterService, ServiceSlot

A, B = b"a" * 16, b"b" * 16


def _request(**args: Any) -> protocol.Request:
    return protocol.Request(1, "events", args)


def _never() -> bool:
    return False


def _timed(coro: Coroutine[Any, Any, None]) -> float:
    """Seconds ``coro`` took to return, on a fresh event loop."""

    async def run() -> float:
        started = time.monotonic()
        await asyncio.wait_for(coro, 10)
        return time.monotonic() - started

    return asyncio.run(run())


def test_a_caller_behind_the_log_is_answered_at_once() -> None:
    slot = ServiceSlot(MasterService())
    slot.service.events.append(EVENT_STORED, A, [b"k" * 16])
    assert _timed(await_events(slot, _request(since_seq=0, wait_s=5), _never)) < 1


def test_the_poll_ends_at_its_timeout_when_nothing_comes() -> None:
    slot = ServiceSlot(MasterService())
    took = _timed(await_events(slot, _request(since_seq=0, wait_s=0.2), _never))
    assert 0.15 < took < 2


@pytest.mark.parametrize(
    "args", [{"wait_s": -1}, {"wait_s": EVENTS_MAX_WAIT_S + 1}, {"since_seq": "x", "wait_s": 5}]
)
def test_bad_arguments_return_at_once_for_the_verb_to_refuse(args: dict[str, Any]) -> None:
    slot = ServiceSlot(MasterService())
    assert _timed(await_events(slot, _request(**args), _never)) < 1
    with pytest.raises(InvalidRequestError):
        events_query(args)


def _after(delay: float, action: Callable[[], None]) -> Callable[[], Coroutine[Any, Any, None]]:
    async def later() -> None:
        await asyncio.sleep(delay)
        action()

    return later


def _poll_with(
    slot: ServiceSlot, request: protocol.Request, stopping: Callable[[], bool], action: Any
) -> float:
    """Seconds the long poll of ``request`` took while ``action`` runs after 0.1 s."""

    async def both() -> None:
        side = asyncio.create_task(_after(0.1, action)())
        await await_events(slot, request, stopping)
        await side

    return _timed(both())


def test_an_event_it_wants_wakes_it_and_one_it_does_not_want_leaves_it_waiting() -> None:
    slot = ServiceSlot(MasterService())
    log_ = slot.service.events
    wanted = _request(since_seq=0, wait_s=5, namespaces=[A])
    assert _poll_with(slot, wanted, _never, lambda: log_.append(EVENT_STORED, A, [])) < 2
    # Only B's event: the caller of A's waits to its timeout.
    later = _request(since_seq=log_.last_seq, since_epoch=log_.epoch, wait_s=0.4, namespaces=[A])
    assert _poll_with(slot, later, _never, lambda: log_.append(EVENT_STORED, B, [])) > 0.35


def test_a_new_term_or_the_server_stopping_ends_the_poll() -> None:
    slot = ServiceSlot(MasterService())
    # The next term wakes the old log's waiters (MasterService.next_term): they see a new log.
    assert _poll_with(slot, _request(wait_s=5), _never, lambda: slot.next_term()) < 2
    stopped = False

    def stop() -> None:
        nonlocal stopped
        stopped = True
        slot.service.events.wake()  # as ControlServer.stop does

    assert _poll_with(slot, _request(wait_s=5), lambda: stopped, stop) < 2
