"""Polling before sleeping: how long a waiting reader stays awake for the next frame.

Waking a sleeping thread costs tens of microseconds on virtual machines (the vCPU halts, and
waking it takes the hypervisor), which is more than a whole small request costs otherwise. A
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
  the GIL and the CPU the master and node needed (``bench/bench_concurrency.py --threads 8``);
- neither side polls around a large payload (over ``POLL_MAX_BYTES``) moving: measured here, a
  vCPU polling slows a copy on the other vCPU by a quarter (they share a physical core), and the
  peer is busy with the payload anyway; nor does a client for the answer to a data request of
  many items (over ``POLL_MAX_ITEMS``), which keeps the node busy longer than the window;
- the master's event loop keeps turning (polling its sockets with a zero timeout) for up to
  ``MASTER_WINDOWS`` windows after each request it answered (:class:`LoopAwake`), with the same
  extension and backoff: a client comes back to the master after a round trip to a node.

So idle connections and peers slower than the window cost nothing, and a busy client's next
request (or reply) is read as soon as it lands. ``$KVSTORE_POLL_US`` sets the window in
microseconds (100 by default; 0 never polls). Measured with ``bench/bench_store.py --small``
(``KVSTORE_POLL_US=0`` against the default).
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable

from kvstore.env import read_poll_us

#: Waits that sleep at once after a poll that found nothing: for requests, for replies. With
#: more busy processes than cores, polling for every reply (no backoff, no yield) cut four
#: clients' aggregate gets from 10.2K to 7.5K per second here; with both, 10.6K
#: (bench/bench_concurrency.py).
POLL_BACKOFF = 15
REPLY_BACKOFF = 3
#: After sending a payload larger than this (or asking for one), a side sleeps through its next
#: wait.
POLL_MAX_BYTES = 256 << 10
#: Likewise after sending a data request of more items than this: a node takes ~5 us an item, so
#: the answer comes well after the window, and a client polling for it only took a core the node
#: and the master needed (a chunk of 256 tiny reads or writes).
POLL_MAX_ITEMS = 32


#: A server waiting for a client's next request polls up to this many windows, as long as it ran
#: for most of the first (``SHARE_TO_EXTEND``): that request comes after the client's turn
#: elsewhere (the master, another node) and its own work, not one round trip after the answer.
#: With one window, a client alternating between master and node (every get) found both asleep:
#: each poll ended before the client came back, the backoff followed, and every hop paid a
#: wake-up (get of 4 KiB, p50: 290 us; with up to three windows 170-240 us). Unconditional,
#: three windows cost four busy clients on two cores ~10% of their lease reads
#: (bench/bench_concurrency.py): a poller that had to share its CPU stops after one.
REQUEST_WINDOWS = 3
#: The master's window is this many of a connection's (and its extension, REQUEST_WINDOWS of
#: those). A client's next request to the master comes after its round trip to a node (a get
#: reads what the master located; a put writes what it allocated): 100-250 µs here. With one
#: window the loop was asleep by then more often than not, its backoff followed, and each such
#: request paid for waking the master. Measured here (``bench/bench_hops.py --reads-only
#: --repeat 2 --ops 300``, one window and two alternating, three pairs): a lone client's
#: get_into of distinct 4 KiB keys p50 228-359 → 231-284 µs (medians 323 → 248), batch_get_into
#: of 16 such 622-803 → 535-764 µs (725 → 548); the master's CPU a 16-key read 210 → 540 µs,
#: most of it polling. Four busy clients' gets/s (bench/bench_concurrency.py) and batches of
#: 1,000 tiny keys (bench/bench_small.py) within noise; ``bench/bench_hops.py`` shows the
#: cliff: a 16-key locate after the client spent 0-1,000 µs elsewhere.
MASTER_WINDOWS = 2
#: The least share of the first window's wall time a poller must have run (its thread's CPU
#: time) to poll on. Measured here: a median of 0.97 for a server that a lone client alternates
#: with, 0.24-0.35 with four busy clients on two cores.
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
