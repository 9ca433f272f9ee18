"""One control connection carrying the requests of many threads at once, replies matched by id.

A :class:`~kvstore.client.Client` shared by the worker threads of an engine sends every control
request (``get_locations``, ``put_start``, ``put_end``, ...) on one :class:`Pipeline`: a thread
writes its frame (a short send lock: the frame only, never a wait for the answer) and waits on
a slot of its own. One of the waiting threads at a time reads the connection (leader and
followers): it hands each reply to the slot of the request id it answers until its own reply
comes, then passes the reading on to another waiting thread, if any. The master serves a
connection's requests one after another and answers them in order, so requests of many threads
travel together (one ``recv`` of the master may take several) without a connection, an accept
and a hello per thread; and a lone caller reads its own reply, with no thread in between (a
reader thread that handed every reply on costs a thread wake-up per call, a large share of a
small call's latency when the client had paused: ``.venv/bin/python bench/bench_store.py
--small``, its 4 KiB get_into asking the master).

Failure rules:

- a call waits at most until its own deadline; its reply, if it comes later, is dropped. The
  connection stays up for the other calls (a slow answer is not a broken connection);
- a call that timed out on a connection that has answered nothing since the call was sent
  retires the connection: new calls open a fresh one, the old one closes once its last waiter
  has its answer or its timeout (a master that is gone without a word cannot hold the client);
- a broken connection (the master closed it, a send failed, a reply that is no frame, a reply
  that stopped halfway) fails every waiter on it at once with one typed error
  (:class:`MasterUnavailableError`, or the :class:`ProtocolError`); the next call opens a new
  connection. With no call waiting nobody reads, so before a call goes on a connection,
  :meth:`Pipeline.check_idle` reads what came meanwhile (a late reply, the master's hang-up).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from kvstore import protocol
from kvstore.errors import (
    KVStoreError,
    KVTimeoutError,
    MasterUnavailableError,
    ProtocolError,
)

#: Once a reply's header is here, its body must follow within this long (past the caller's own
#: deadline if need be: a reply cut off halfway leaves the connection unreadable, so it breaks).
BODY_GRACE_S = 1.0
#: How long :meth:`Pipeline.check_idle` waits for the rest of a frame that began to arrive.
IDLE_READ_S = 0.1


#: Verbs served on a connection of their own, never on a pipeline: a long poll, or answers that
#: may be large.
EXCLUSIVE_VERBS = frozenset({"events", "events_snapshot", "list_keys"})
#: A batch with more items than this goes on a connection of its own too. The master serves
#: a connection's requests one after another but a large batch in chunks, with other
#: connections' requests between two chunks (master/rpc_chunks.py, CHUNK_ITEMS): on a connection of
#: its own a large batch holds up nobody else's small calls.
PIPELINE_MAX_ITEMS = 256
#: Likewise a request with a bytes argument longer than this (a long prompt's tokens).
PIPELINE_MAX_BYTES = 4 * PIPELINE_MAX_ITEMS


_Answer = TypeVar("_Answer")


def one_chunk_ahead(
    count: int,
    size: int,
    start: Callable[[slice, Callable[[], None] | None], _Answer],
    finish: Callable[[slice, _Answer], None],
) -> None:
    """Run a batch of ``count`` items ``size`` at a time, one chunk ahead: ``start(chunk,
    work)`` sends the master the request of ``chunk`` (a slice of the batch) and runs ``work``
    while it is answered, then returns the answer; ``work`` is the ``finish(chunk, answer)`` of
    the chunk before (None for the first). So the master works on a chunk while the caller
    (and the nodes) work on the one before; the last chunk is finished here."""
    ahead: Callable[[], None] | None = None
    for lo in range(0, count, size):
        chunk = slice(lo, lo + size)
        ahead = functools.partial(finish, chunk, start(chunk, ahead))
    if ahead is not None:
        ahead()


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


def fresh_copy(err: KVStoreError) -> KVStoreError:
    """A new instance of ``err`` (same class, code and message): one error is raised in many
    threads, each with a traceback of its own."""
    return KVStoreError.from_wire(err.to_wire())


@dataclass(slots=True)
class _Slot:
    """Where the reply to one request lands. ``ready`` is set when it does, when the
    connection breaks, or when the waiter is asked to take over the reading (``read_turn``).
    ``waiting``: its thread waits on ``ready`` now (a call whose thread is busy elsewhere, e.g.
    overlapping work with the answer, is never asked to read)."""

    ready: threading.Event
    sent_at: float = 0.0
    response: protocol.Response | None = None
    error: KVStoreError | None = None
    waiting: bool = False
    read_turn: bool = False

    @property
    def done(self) -> bool:
        return self.response is not None or self.error is not None


class Pipeline:
    """A connection to the master shared by many threads. Thread-safe.

    NOTE: lock order: ``_send_lock`` before ``_lock``. Neither is held across a wait for a
    reply: ``_send_lock`` covers writing one frame (bounded by the caller's deadline), ``_lock``
    the table of waiting slots and who reads (``_reading``: a thread reads, or has been asked
    to). Whenever a call waits for its reply, some thread reads (or is about to): the reader
    passes the reading on before it leaves.

    Args:
        conn: a connected, authenticated connection (its hello done); the pipeline owns it.
        address: the master's address, for error messages.
    """

    def __init__(self, conn: protocol.FramedSocket, address: object) -> None:
        self.address = address
        # Readers read through ``conn`` (its read-ahead buffer), each up to its own deadline;
        # senders write through a duplicate of the socket, whose timeout they set per frame
        # without touching the reader's. (Both keep a timeout: the two share the file's
        # non-blocking flag, which a timeout sets.)
        self._conn = conn
        self._send_sock = conn.sock.dup()
        self._send_lock = threading.Lock()
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._slots: dict[int, _Slot] = {}
        self._reading = False
        self._error: KVStoreError | None = None
        self._retired = False
        self._closed = False
        # The master's own last word on a frame it could not tie to a request (req_id 0),
        # before it hung up: the cause given to the waiters.
        self._last_word: KVStoreError | None = None
        self.last_reply = time.monotonic()

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
        slot = _Slot(threading.Event())
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
        """The result of request ``req_id``, by ``deadline``. Reads the connection itself
        when no other thread does.

        Raises:
            KVTimeoutError: no reply by ``deadline`` (this call alone; others go on).
            MasterUnavailableError, ProtocolError: the connection broke first.
            KVStoreError: whatever the master answered.
        """
        while not slot.done and time.monotonic() < deadline:
            with self._lock:
                if slot.done:
                    break
                # Handed the reading, or nobody reads: read (else wait to be woken).
                lead = slot.read_turn or not self._reading
                slot.read_turn = False
                if lead:
                    self._reading = True
                else:
                    slot.waiting = True
                    slot.ready.clear()  # (under the lock: a wake-up after this is not lost)
            if lead:
                self._read_for(slot, deadline)
                continue
            slot.ready.wait(_left(deadline))
            with self._lock:
                slot.waiting = False
        if not slot.done:
            with self._lock:
                done = slot.done  # (landed just now)
                mine = self._slots.pop(req_id, None) if not done else None
                # Silent since this call was sent: the connection may be dead without a word.
                if mine is not None and self.last_reply < mine.sent_at:
                    self._retired = True
                if slot.read_turn:  # asked to read as it gave up: pass it on
                    slot.read_turn = False
                    self._pass_reading_locked()
                close_now = self._retired and not self._slots
            if not done:
                if close_now:
                    self.close()
                raise KVTimeoutError(f"master {self.address} did not answer {verb} in time")
        if slot.error is not None:
            raise fresh_copy(slot.error)
        assert slot.response is not None
        return slot.response.unwrap()

    def call(self, verb: str, args: dict[str, Any], deadline: float) -> Any:
        """:meth:`send` then :meth:`wait`."""
        req_id, slot = self.send(verb, args, deadline)
        return self.wait(req_id, slot, deadline, verb)

    def check_idle(self) -> None:
        """With nobody reading, read what arrived meanwhile: replies to calls that timed out
        (dropped), the master's last word, its hang-up (the connection is then broken, and the
        caller opens a new one instead of sending on it). One ``poll(2)`` when nothing came."""
        if self._reading or self._error is not None:
            return
        with self._lock:
            if self._reading:
                return
            self._reading = True  # (the poll below is the reader's: one poller per socket)
        self._read_for(None, time.monotonic() + IDLE_READ_S)

    # ------------------------------------------------------------------ reading
    def _read_for(self, slot: _Slot | None, deadline: float) -> None:
        """Read replies, each to its slot, until ``slot`` has its own or ``deadline`` passes
        (``slot`` None: only what is there already); then pass the reading on. The caller
        took the reading (``_reading``)."""
        err: KVStoreError | None = None
        try:
            while slot is None or not slot.done:
                if slot is None and not self._conn.readable_now():
                    return
                try:
                    header = self._conn.read_header(deadline)
                except TimeoutError:
                    # Nothing more by this deadline (what came of a header stays read). The
                    # next reader does not poll first: the master is slow, and a poll would
                    # hold up this thread's way out (the GIL) for nothing.
                    self._conn.sleep_through_next_wait()
                    return
                if header.kind != protocol.KIND_RESPONSE:
                    raise ProtocolError("expected a response frame")
                if header.payload_len:
                    raise ProtocolError("a reply carries an unexpected payload")
                try:
                    body = self._conn.read_body(
                        header, max(deadline, time.monotonic() + BODY_GRACE_S)
                    )
                except TimeoutError:
                    raise ConnectionError("reply stopped halfway") from None
                self._deliver(protocol.decode_response(body))
        except ProtocolError as exc:
            err = exc
        except (OSError, ConnectionError) as exc:
            err = self._last_word or MasterUnavailableError(
                f"master {self.address}: connection lost: {exc}"
            )
        except BaseException as exc:  # noqa: BLE001 - no waiter may hang on a dead reader
            err = MasterUnavailableError(f"master {self.address}: reader failed: {exc!r}")
            raise
        finally:
            if err is not None:
                self._fail(err)
            with self._lock:
                self._pass_reading_locked()

    def _deliver(self, response: protocol.Response) -> None:
        """Hand ``response`` to the slot of the request it answers (dropped when that call gave
        up waiting; kept as the master's last word when it names no request)."""
        with self._lock:
            self.last_reply = time.monotonic()
            slot = self._slots.pop(response.req_id, None)
            if slot is not None:
                slot.response = response
            close_now = self._retired and not self._slots
        if slot is not None:
            slot.ready.set()
        elif response.code:
            self._last_word = KVStoreError.from_wire([response.code, response.result])
        if close_now:
            self.close()

    def _pass_reading_locked(self) -> None:
        """The reader leaves: ask a waiting call to read in its place (none waiting: nobody
        reads until the next call). Holding ``_lock``."""
        for waiter in self._slots.values():
            if waiter.waiting and not waiter.done and not waiter.read_turn:
                waiter.read_turn = True
                waiter.ready.set()
                return
        self._reading = False

    def _fail(self, err: KVStoreError) -> None:
        """Break the connection: every waiter gets ``err`` now, later calls at once."""
        with self._lock:
            if self._error is None:
                self._error = err
            slots, self._slots = self._slots, {}
            for slot in slots.values():
                slot.error = err
        for slot in slots.values():
            slot.ready.set()
        self.close()

    def close(self) -> None:
        """Hang up. Calls still waiting get MasterUnavailableError."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self._error is None:
                self._error = MasterUnavailableError(f"master {self.address}: connection closed")
        with contextlib.suppress(OSError):  # (already gone)
            self._send_sock.shutdown(socket.SHUT_RDWR)  # wakes a reader out of its recv
        self._send_sock.close()
        self._conn.close()
        self._fail(self._error)


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
