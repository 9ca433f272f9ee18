"""Read leases a client is done with, on their way back to the master.

Every ``get_locations`` answer carries a lease token per object (``ObjectInfo.lease``); until the
lease is given back (or runs out, ``lease_s``) the master neither evicts the object nor reuses
space freed under it. A finished read gives its leases back so that the master can do both at
once: :meth:`LeaseReturns.give_back` queues the tokens, and they travel

- **piggybacked** on the client's next request to the master, whatever its verb (the
  ``release`` argument; the master gives them back before it serves the verb), or
- in a ``release_leases`` request of their own, when no other request went within
  ``FLUSH_DELAY_S`` (a background thread, started on first use; while tokens keep coming it
  looks for them every ``FLUSH_DELAY_S`` on its own, and only once it has seen none for
  ``BUSY_FOR_S`` does it sleep until the next token wakes it: a read does not wake a thread).

Ownership (every lease given back once): a read owns the leases of the answers it asked for and
gives them back when it is done; with lease reads (``Client.connect(..., lease_reads=True)``) an
answer kept in the location cache hands its lease to the cache, which gives it back when the
entry ends (see :mod:`kvstore.client.locations`). A token given back twice or late changes
nothing on the master; one lost on the way (a failed request, a client that closes or crashes)
only costs the space until its lease runs out.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from kvstore.errors import KVStoreError

log = logging.getLogger(__name__)

#: Lease tokens one request carries back at most (the rest wait for the next one).
MAX_PIGGYBACK = 4096
#: How long finished reads' leases wait for another request to carry them before a
#: ``release_leases`` of their own goes.
FLUSH_DELAY_S = 0.02
#: The flusher re-checks for work at least this often (no unbounded waits).
IDLE_WAIT_S = 1.0
#: After this long without a token, the flusher stops looking every ``delay_s`` and sleeps until
#: a token wakes it (or ``IDLE_WAIT_S``).
BUSY_FOR_S = 1.0


class LeaseReturns:
    """A queue of lease tokens to give back. Thread-safe.

    NOTE: the lock guards only the queue; ``send`` (a round trip) runs without it.

    Args:
        send: sends one ``release_leases`` request with the given tokens (may raise
            KVStoreError: the tokens are then dropped, their leases run out on their own).
        delay_s: how long tokens wait for a piggyback before ``send`` carries them.
    """

    def __init__(self, send: Callable[[list[int]], Any], delay_s: float = FLUSH_DELAY_S) -> None:
        self._send = send
        self.delay_s = delay_s
        self._tokens: list[int] = []
        self._since = 0.0  # when the oldest queued token was queued (the last, once none are)
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closed = False
        # Whether the flusher sleeps until woken (idle a while); otherwise it looks for tokens
        # every ``delay_s`` on its own. NOTE: waking a thread for every read costs a single
        # small get a large share of its latency (a futex wake, and a fight for the GIL while
        # the caller waits for the master's answer: ``.venv/bin/python bench/bench_store.py
        # --small``); a busy client wakes it no more.
        self._sleeping = False
        self.num_piggybacked = 0
        self.num_sent = 0

    def give_back(self, tokens: Iterable[int]) -> None:
        """Queue leases whose reads are done (0: no lease, skipped)."""
        new = [t for t in tokens if t]
        if not new:
            return
        with self._cond:
            if self._closed:
                return
            if not self._tokens:
                self._since = time.monotonic()
            self._tokens.extend(new)
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="kvstore-lease-returns", daemon=True
                )
                self._thread.start()
            elif self._sleeping:
                self._cond.notify()

    def attach(self, args: dict[str, Any]) -> dict[str, Any]:
        """``args`` with queued tokens (up to ``MAX_PIGGYBACK``) added under ``release``.

        Returns:
            ``args`` itself when nothing is queued, else a new dict.
        """
        if not self._tokens:  # (a racy peek: a token queued just now goes with the next one)
            return args
        with self._cond:
            tokens = self._take()
        if not tokens:
            return args
        self.num_piggybacked += len(tokens)
        return {**args, "release": [*args.get("release", ()), *tokens]}

    def _take(self) -> list[int]:
        out = self._tokens[:MAX_PIGGYBACK]
        del self._tokens[:MAX_PIGGYBACK]
        if self._tokens:
            self._since = time.monotonic()
        return out

    def sleeping(self) -> bool:
        """Whether the flusher sleeps until a token wakes it (no token for ``BUSY_FOR_S``)."""
        with self._cond:
            return self._sleeping

    def pending(self) -> int:
        """Tokens queued and not yet sent."""
        with self._cond:
            return len(self._tokens)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._closed:
                    now = time.monotonic()
                    if self._tokens:
                        left = self._since + self.delay_s - now
                        if left <= 0:
                            break
                        self._cond.wait(left)
                    elif now - self._since < BUSY_FOR_S:
                        self._cond.wait(self.delay_s)  # (tokens queued meanwhile wake no one)
                    else:
                        self._sleeping = True
                        self._cond.wait(IDLE_WAIT_S)
                        self._sleeping = False
                if self._closed:
                    return
                tokens = self._take()
            try:
                self._send(tokens)
                self.num_sent += len(tokens)
            except KVStoreError as err:
                log.debug("could not give %d read lease(s) back: %s", len(tokens), err.message)

    def close(self, timeout: float = 1.0) -> None:
        """Stop the flusher. Queued tokens are dropped: their leases run out on the master."""
        with self._cond:
            self._closed = True
            self._tokens.clear()
            self._cond.notify_all()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
