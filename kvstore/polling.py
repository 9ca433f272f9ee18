"""Polling before sleeping: how long a waiting reader stays awake for the next frame.

Waking a sleeping thread on a virtual machine takes a trip through the hypervisor (the vCPU
halts), which costs more than a whole small request does otherwise (``.venv/bin/python
bench/bench_hops.py`` prints a round trip to a sleeping peer and to a spinning one). A
reader that expects its peer to answer soon therefore polls for a short window before it sleeps
in the kernel:

- a :class:`~kvstore.protocol.FramedSocket` looks for bytes without blocking (``poll(2)`` with
  a zero timeout, then ``sched_yield`` so that a runnable thread on this CPU, perhaps the peer,
  goes first) for up to the window before each wait for a frame (a server waiting for a
  request: up to ``REQUEST_WINDOWS`` windows while it has its CPU to itself); after a poll
  that found nothing, the next waits sleep straight away: ``POLL_BACKOFF`` of them for a node waiting for
  a client's next request, ``REPLY_BACKOFF`` for a client waiting for a reply;
- of the threads of one process that wait for replies, one at a time polls (the others sleep
  in the kernel at once): eight threads of one shared client polling side by side fought over
  the GIL and the CPU the master and node needed (``.venv/bin/python bench/bench_concurrency.py
  --threads 8``);
- neither side polls around a large payload (over ``POLL_MAX_BYTES``) moving: a vCPU polling
  slows a copy on its sibling vCPU (they share a physical core), and the peer is busy with the
  payload anyway (``.venv/bin/python bench/bench_poll_cost.py`` shows what polling takes from a
  busy neighbour); nor does a client for the answer to a data request of
  many items (over ``POLL_MAX_ITEMS``), which keeps the node busy longer than the window;
- the master's event loop keeps turning (polling its sockets with a zero timeout) for up to
  ``MASTER_WINDOWS`` windows after each request it answered (:class:`LoopAwake`), with the same
  extension and backoff: a client comes back to the master after a round trip to a node.

So idle connections and peers slower than the window cost nothing, and a busy client's next
request (or reply) is read as soon as it lands. ``$KVSTORE_POLL_US`` sets the window in
microseconds (200 by default; 0 never polls). The window should outlast a client's turn
elsewhere between two requests to one server (a put's write to the node between its put_start
and put_end at the master), or the master sleeps by the put_end: what each window gives one
client and takes from four shows in ``.venv/bin/python bench/bench_polling.py``.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable

from kvstore.env import read_poll_us

#: Waits that sleep at once after a poll that found nothing: for requests, for replies. With
#: more busy processes than cores, polling for every reply (no backoff, no yield) takes the CPU
#: the other clients, the master and the node need, and their aggregate gets per second drop
#: (``.venv/bin/python bench/bench_concurrency.py``).
POLL_BACKOFF = 15
REPLY_BACKOFF = 3
#: After sending a payload larger than this (or asking for one), a side sleeps through its next
#: wait.
POLL_MAX_BYTES = 256 << 10
#: Likewise after sending a data request of more items than this: the node's work grows with the
#: items, so the answer comes well after the window, and a client polling for it only takes a
#: core the node and the master need (a chunk of 256 tiny reads or writes; the node's CPU per
#: key: ``.venv/bin/python bench/bench_small.py``).
POLL_MAX_ITEMS = 32


#: A server waiting for a client's next request polls up to this many windows, as long as it ran
#: for most of the first (``SHARE_TO_EXTEND``): that request comes after the client's turn
#: elsewhere (the master, another node) and its own work, not one round trip after the answer.
#: With one window, a client alternating between master and node (every get) finds both asleep:
#: each poll ends before the client comes back, the backoff follows, and every hop pays a
#: wake-up (``.venv/bin/python bench/bench_hops.py --reads-only``). Unconditional, three windows
#: take CPU from busy clients sharing the cores (``.venv/bin/python bench/bench_concurrency.py``,
#: its lease reads): a poller that had to share its CPU stops after one.
REQUEST_WINDOWS = 3
#: The master's window is this many of a connection's (and its extension, REQUEST_WINDOWS of
#: those). A client's next request to the master comes after its round trip to a node (a get
#: reads what the master located; a put writes what it allocated), often longer than one window:
#: the loop is asleep by then, its backoff follows, and each such request pays for waking the
#: master; two windows keep a lone client's gets off that cliff for some of the master's CPU
#: (``.venv/bin/python bench/bench_hops.py --reads-only --repeat 2 --ops 300`` with one window
#: and with two; without ``--reads-only`` it also prints the cliff, a locate after an idle gap).
MASTER_WINDOWS = 2
#: The least share of the first window's wall time a poller must have run (its thread's CPU
#: time) to poll on: a server that a lone client alternates with runs for nearly all of its
#: window, one that shares its cores with busy clients for well under half of it
#: (``.venv/bin/python bench/bench_concurrency.py`` is that second case).
SHARE_TO_EXTEND = 0.5


def extend_poll(
    started: float,
    cpu_started: float,
    now: float,
    thread_time: Callable[[], float] = time.thread_time,
) -> bool:
    """Whether a poll that began at ``started`` (``time.perf_counter()``; the thread's CPU time
    then: ``cpu_started``, ``thread_time()``) and found nothing by ``now`` may poll on: its
    thread ran for most of that time (nobody else waited for its CPU)."""
    return thread_time() - cpu_started >= SHARE_TO_EXTEND * (now - started)


def poll_window() -> float:
    """The window in seconds, from ``$KVSTORE_POLL_US`` (a bad value means the default; at most
    ``MAX_POLL_US``), read when a server or a connection starts (:func:`kvstore.env.read_poll_us`:
    that variable alone, a connection does not parse the whole environment)."""
    return read_poll_us() / 1e6


class LoopAwake:
    """Keeps an asyncio event loop turning for a window after each request it served.

    While a callback is pending the loop polls its sockets with a zero timeout instead of
    sleeping, so the next request of a busy client is read as soon as it lands. Works on any
    event loop (uvloop included). Call :meth:`served` from the loop's thread.
    """

    def __init__(self, window: float | None = None) -> None:
        self.window = poll_window() if window is None else window
        self._deadline = 0.0
        self._started = 0.0  # when the current window began, and the loop thread's CPU time
        self._cpu_started = 0.0
        self._extended = False
        self._running = False
        self._count = 0
        self._count_at_start = 0
        self._skip = 0

    def served(self) -> None:
        """One request was answered: stay awake for another window."""
        self._count += 1
        if not self.window:
            return
        self._started = time.perf_counter()
        self._cpu_started = time.thread_time()
        self._deadline = self._started + self.window
        self._extended = False
        if self._running:
            return
        if self._skip:
            self._skip -= 1
            return
        self._running = True
        self._count_at_start = self._count
        asyncio.get_running_loop().call_soon(self._turn)

    def _turn(self) -> None:
        now = time.perf_counter()
        if now >= self._deadline and not self._extended:
            self._extended = True  # (a request served meanwhile starts a window of its own)
            if extend_poll(self._started, self._cpu_started, now):
                self._deadline += self.window * (REQUEST_WINDOWS - 1)
        if now < self._deadline:
            os.sched_yield()  # a runnable thread on this CPU goes first
            asyncio.get_running_loop().call_soon(self._turn)
            return
        self._running = False
        if self._count == self._count_at_start:  # nobody came back within the window
            self._skip = POLL_BACKOFF
