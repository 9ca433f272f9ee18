"""Polling before sleeping (kvstore.polling): the window from the environment, and an event loop
kept turning for a window after a request (:class:`LoopAwake`), with the backoff when nobody
came back. The loop's turns are counted by a selector of our own: a turning loop asks it to
select with a zero timeout."""

from __future__ import annotations

import asyncio
import selectors

import pytest

from kvstore.polling import POLL_BACKOFF, REQUEST_WINDOWS, LoopAwake, extend_poll, poll_window

WINDOW_S = 0.02


@pytest.mark.parametrize(("raw", "seconds"), [("", 200e-6), ("0", 0.0), ("250", 250e-6)])
def test_the_window_comes_from_the_environment_in_microseconds(
    monkeypatch: pytest.MonkeyPatch, raw: str, seconds: float
) -> None:
    monkeypatch.setenv("KVSTORE_POLL_US", raw)
    assert poll_window() == pytest.approx(seconds)
    assert LoopAwake().window == pytest.approx(seconds)


class CountingSelector(selectors.DefaultSelector):  # type: ignore[misc,valid-type]
    """Records the timeout of every select the event loop makes."""

    def __init__(self) -> None:
        super().__init__()
        self.timeouts: list[float | None] = []

    def select(self, timeout: float | None = None) -> list:  # type: ignore[type-arg]
        self.timeouts.append(timeout)
        return super().select(timeout)


def turns_per_round(window: float, rounds: int, again_after: float | None = None) -> list[int]:
    """Per round: one request served, then an idle wait a window longer than the longest poll
    (``REQUEST_WINDOWS``); how many times the loop turned without sleeping meanwhile. ``again_after``: a second request that long after the
    first, in the first round only (a busy client)."""
    selector = CountingSelector()
    loop = asyncio.SelectorEventLoop(selector)
    awake = LoopAwake(window)

    async def main() -> list[int]:
        out = []
        for r in range(rounds):
            selector.timeouts.clear()
            awake.served()
            if r == 0 and again_after is not None:
                await asyncio.sleep(again_after)
                awake.served()
            await asyncio.sleep((REQUEST_WINDOWS + 1) * window + 0.01)
            out.append(sum(1 for t in selector.timeouts if t == 0))
        return out

    try:
        return loop.run_until_complete(main())
    finally:
        loop.close()


def test_no_window_never_keeps_the_loop_awake() -> None:
    assert max(turns_per_round(0.0, 3)) <= 2


def test_a_request_keeps_the_loop_turning_then_it_backs_off() -> None:
    turns = turns_per_round(WINDOW_S, POLL_BACKOFF + 2)
    assert turns[0] >= 3, "awake for a window after the request"
    # Nobody came back within it: the next POLL_BACKOFF requests sleep at once.
    assert max(turns[1 : POLL_BACKOFF + 1]) <= 2, turns
    assert turns[POLL_BACKOFF + 1] >= 3, "then it polls again"


def test_a_client_that_comes_back_keeps_it_polling() -> None:
    turns = turns_per_round(WINDOW_S, 2, again_after=WINDOW_S / 3)
    assert turns[0] >= 3 and turns[1] >= 3, turns


@pytest.mark.parametrize(
    ("cpu_s", "wall_s", "extends"),
    [
        (WINDOW_S, WINDOW_S, True),  # busy the whole window: alone on its CPU, it may poll on
        (0.6 * WINDOW_S, WINDOW_S, True),  # ran for most of it
        (0.1 * WINDOW_S, WINDOW_S, False),  # others took its CPU for most of it: stop
        (0.0, WINDOW_S, False),
    ],
)
def test_a_poller_that_ran_polls_on_and_one_that_waited_for_its_cpu_does_not(
    cpu_s: float, wall_s: float, extends: bool
) -> None:
    # The thread's CPU clock is injected: the test holds whatever CPU the machine gives it.
    assert extend_poll(10.0, 3.0, 10.0 + wall_s, thread_time=lambda: 3.0 + cpu_s) is extends
