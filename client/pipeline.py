"""One control connection carrying the requests of many threads at once, replies matched by id.

A :class:`~kvstore.client.Client` shared by the worker threads of an engine sends every control
request (``get_locations``, ``put_start``, ``put_end``, ...) on one :class:`Pipeline`: a thread
writes its frame (a short send lock: the frame only, never a wait for the answer) and waits on
a slot of its own; one reader thread per connection reads the replies and hands each to the slot
of the request id it answers. The master serves a connection's requests one after another and
answers them in order, so requests of many threads travel together (one ``recv`` of the master
may take several) without a connection, an accept and a hello per thread.

Failure rules:

- a call waits at most until its own deadline; its reply, if it comes later, is dropped. The
  connection stays up for the other calls (a slow answer is not a broken connection);
- a call that timed out on a connection that has answered nothing since the call was sent
  retires the connection: new calls open a fresh one, the old one closes once its last waiter
  has its answer or its timeout (a master that is gone without a word cannot hold the client);
- a broken connection (the master closed it, a send failed, a reply that is no frame) fails every
  waiter on it at once with one typed error (:class:`MasterUnavailableError`, or the
  :class:`ProtocolError`); the next call opens a new connection.
"""

from __future__ import annotations

import contextlib
import itertools
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any

from kvstore import protocol
from kvstore.errors import (
    KVStoreError,
    KVTimeoutError,
    MasterUnavailableError,
    ProtocolError,
)

#: How long a caller whose reply was just taken by the reader waits for the hand-over (the
#: reader releases the slot right after it took it: this bound is never reached in practice).
HANDOVER_S = 1.0


#: Verbs served on a connection of their own, never on a pipeline: a long poll, or answers that
#: may be large.
EXCLUSIVE_VERBS = frozenset({"events", "events_snapshot", "list_keys"})
#: A batch with more items than this goes on a connection of its own too. The master serves
#: a connection's requests one after another but a large batch in chunks, with other
#: connections' requests between two chunks (master/server.py, CHUNK_ITEMS): on a connection of
#: its own a large batch holds up nobody else's small calls.
PIPELINE_MAX_ITEMS = 256
#: Likewise a request with a bytes argument longer than this (a long prompt's tokens).
PIPELINE_MAX_BYTES = 4 * PIPELINE_MAX_ITEMS


def pipelined(verb: str, args: dict[str, Any]) -> bool:
    """Whether a request goes on the shared pipeline (else on a connection of its own)."""
    if verb in EXCLUSIVE_VERBS:
        return False
    for value in args.values():
        if isinstance(value, list) and len(value) > PIPELINE_MAX_ITEMS:
            return False
        if isinstance(value, bytes) and len(value) > PIPELINE_MAX_BYTES:
            return False
    return True


#: A connection with nothing to read for this long is closed (the next call opens a new one).
READER_IDLE_S = 3600.0


def fresh_copy(err: KVStoreError) -> KVStoreError:
    """A new instance of ``err`` (same class, code and message): one error is raised in many
    threads, each with a traceback of its own."""
    return KVStoreError.from_wire(err.to_wire())


@dataclass(slots=True)
class _Slot:
    """Where the reply to one request lands. ``ready`` is held until it does."""

    ready: threading.Lock
    sent_at: float = 0.0
    response: protocol.Response | None = None
    error: KVStoreError | None = None


class Pipeline:
    """A connection to the master shared by many threads. Thread-safe.

    NOTE: lock order: ``_send_lock`` before ``_lock``; the reader takes ``_lock`` only. Neither
    is held across a wait for a reply: ``_send_lock`` covers writing one frame (bounded by the
    caller's deadline), ``_lock`` the table of waiting slots.

    Args:
        conn: a connected, authenticated connection (its hello done); the pipeline owns it.
        address: the master's address, for error messages.
    """

    def __init__(self, conn: protocol.FramedSocket, address: object) -> None:
        self.address = address
        # The reader reads through ``conn`` (its read-ahead buffer), waiting up to
        # READER_IDLE_S (close() wakes it); senders write through a duplicate of the socket,
        # whose timeout they set per frame without touching the reader's. (Both keep a
        # timeout: the two share the file's non-blocking flag, which a timeout sets.)
        self._conn = conn
        conn.sock.settimeout(READER_IDLE_S)
        self._send_sock = conn.sock.dup()
        self._send_lock = threading.Lock()
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._slots: dict[int, _Slot] = {}
        self._error: KVStoreError | None = None
        self._retired = False
        self._closed = False
        # The master's own last word on a frame it could not tie to a request (req_id 0),
        # before it hung up: the cause given to the waiters.
        self._last_word: KVStoreError | None = None
        self.last_reply = time.monotonic()
        self._reader = threading.Thread(
            target=self._read_loop, name="kvstore-control-reader", daemon=True
        )
        self._reader.start()

    @property
    def usable(self) -> bool:
        """Whether new calls may go on this connection (not broken, retired or closed)."""
        return self._error is None and not self._retired and not self._closed

    @property
    def num_waiting(self) -> int:
        """Requests sent and not yet answered, failed or timed out."""
        return len(self._slots)

    # ------------------------------------------------------------------ calls
    def send(self, verb: str, args: dict[str, Any], deadline: float) -> tuple[int, _Slot]:
        """Send one request; returns its id and the slot its reply will land in.

        Raises:
            KVTimeoutError: the frame could not be sent by ``deadline`` (the connection is then
                broken: a half-sent frame ends it).
            MasterUnavailableError: the connection is broken (the request was not sent whole).
        """
        req_id = next(self._ids)  # (itertools.count: atomic under the GIL)
        frame = protocol.encode_request(req_id, verb, args)
        slot = _Slot(threading.Lock())
        slot.ready.acquire()
        if not self._send_lock.acquire(timeout=_left(deadline)):
            raise KVTimeoutError(f"master {self.address}: could not send {verb} in time")
        try:
            with self._lock:
                if self._error is not None:
                    raise fresh_copy(self._error)
                slot.sent_at = time.monotonic()
                self._slots[req_id] = slot
            try:
                self._send_sock.settimeout(_left(deadline))
                self._send_sock.sendall(frame)
            except OSError as exc:
                timed_out = isinstance(exc, TimeoutError)
                self._fail(
                    MasterUnavailableError(
                        f"master {self.address}: connection lost while sending {verb}: "
                        + ("send timed out" if timed_out else str(exc))
                    )
                )
                with self._lock:
                    self._slots.pop(req_id, None)
                if timed_out:
                    raise KVTimeoutError(
                        f"master {self.address} did not take {verb} in time"
                    ) from None
                raise fresh_copy(slot.error or self._error) from None  # type: ignore[arg-type]
        finally:
            self._send_lock.release()
        return req_id, slot

    def wait(self, req_id: int, slot: _Slot, deadline: float, verb: str) -> Any:
        """The result of request ``req_id``, by ``deadline``.

        Raises:
            KVTimeoutError: no reply by ``deadline`` (this call alone; others go on).
            MasterUnavailableError, ProtocolError: the connection broke first.
            KVStoreError: whatever the master answered.
        """
        if not slot.ready.acquire(timeout=_left(deadline)):
            with self._lock:
                mine = self._slots.pop(req_id, None)
                # Silent since this call was sent: the connection may be dead without a word.
                if mine is not None and self.last_reply < mine.sent_at:
                    self._retired = True
                close_now = self._retired and not self._slots
            if mine is not None:
                if close_now:
                    self.close()
                raise KVTimeoutError(f"master {self.address} did not answer {verb} in time")
            # The reader took the reply (or failed the slot) just now: it is being handed over.
            if not slot.ready.acquire(timeout=HANDOVER_S):
                raise KVTimeoutError(f"master {self.address} did not answer {verb} in time")
        if slot.error is not None:
            raise fresh_copy(slot.error)
        assert slot.response is not None
        return slot.response.unwrap()

    def call(self, verb: str, args: dict[str, Any], deadline: float) -> Any:
        """:meth:`send` then :meth:`wait`."""
        req_id, slot = self.send(verb, args, deadline)
        return self.wait(req_id, slot, deadline, verb)

    # ------------------------------------------------------------------ the reader
    def _read_loop(self) -> None:
        err: KVStoreError
        try:
            while True:
                response, payload_len = self._conn.read_response()
                if payload_len:
                    raise ProtocolError(f"reply {response.req_id} carries an unexpected payload")
                with self._lock:
                    self.last_reply = time.monotonic()
                    slot = self._slots.pop(response.req_id, None)
                    close_now = self._retired and not self._slots
                if slot is not None:
                    slot.response = response
                    slot.ready.release()
                elif response.code:
                    self._last_word = KVStoreError.from_wire([response.code, response.result])
                if close_now:
                    self.close()
                    return
        except ProtocolError as exc:
            err = exc
        except (OSError, ConnectionError) as exc:
            err = self._last_word or MasterUnavailableError(
                f"master {self.address}: connection lost: {exc}"
            )
        except BaseException as exc:  # noqa: BLE001 - no waiter may hang on a dead reader
            err = MasterUnavailableError(f"master {self.address}: reader failed: {exc!r}")
        self._fail(err)

    def _fail(self, err: KVStoreError) -> None:
        """Break the connection: every waiter gets ``err`` now, later calls at once."""
        with self._lock:
            if self._error is None:
                self._error = err
            slots, self._slots = self._slots, {}
        for slot in slots.values():
            slot.error = err
            slot.ready.release()
        self.close()

    def close(self) -> None:
        """Hang up. Waiters still waiting get MasterUnavailableError (through the reader)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self._error is None:
                self._error = MasterUnavailableError(f"master {self.address}: connection closed")
        with contextlib.suppress(OSError):  # (already gone)
            self._send_sock.shutdown(socket.SHUT_RDWR)  # wakes the reader out of its recv
        self._send_sock.close()
        self._conn.close()


def close_released(idle: list[protocol.FramedSocket], pipe: Pipeline | None) -> None:
    """Close the idle connections and the pipeline a control channel just let go of.

    The channel swaps them out under its lock and calls this after releasing it: closing a
    socket may block, and no lock is held across I/O.
    """
    for conn in idle:
        conn.close()
    if pipe is not None:
        pipe.close()


def _left(deadline: float) -> float:
    """Seconds until ``deadline`` (monotonic), at least a sliver (a socket timeout of 0 would
    make the socket non-blocking; a lock wait of 0 would not wait)."""
    return max(0.001, deadline - time.monotonic())
