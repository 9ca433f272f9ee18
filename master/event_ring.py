"""KV events: what happened to the prefix index, sequence-numbered, in a bounded ring.

A router (``kvstore router``) follows the pool without polling: it reads a snapshot of the
indexed blocks once, then the events after it. Four kinds, each about blocks of one namespace:

* ``stored``: blocks of a prompt entered the prefix index (``kv_commit``, or a new leader
  rebuilding the index from the nodes' prompt metas);
* ``evicted``: blocks left it because the tier manager deleted their last replica;
* ``removed``: blocks left it for any other reason (``remove``, the admin API, a dead node, a
  corrupt last replica, a stale entry found by a lookup). Removing a block drops the blocks
  stored after it too (the index is prefix-closed); the event names all of them;
* ``moved``: a block's replica moved between tiers (demote / promote), ``src_tier`` ->
  ``dst_tier``.

Every event carries a sequence number, 1, 2, ... per **epoch**. The epoch names the master's
term: with HA masters the leader's etcd epoch, otherwise a random id drawn when the process
(or, for a new term, the service) starts, so a restarted master is a new epoch and a subscriber
learns that its sequence numbers mean nothing any more.

Resuming: a subscriber names the last ``(epoch, seq)`` it applied. It gets exactly the events
after it, or a **resync** with a reason (the epoch changed; the ring no longer holds what it
missed; it claims a sequence number this epoch never reached), after which it reads a snapshot
(:meth:`EventLog.snapshot_seq` names the sequence number it reflects) and follows from there.

Events set state (present / absent / in tier X); they never add or subtract. So applying an
event whose effect a snapshot already shows changes nothing, which is what makes "snapshot,
then every event after its sequence number" exact.

Cost: the log always records, whether anyone listens or not (resuming must work for a
subscriber that was away). One event per prompt commit / removal / move, not per block: a
tuple of six fields in a preallocated list used as a ring (``buf[seq % capacity]``), no
per-event allocation beyond the tuple and the list of block keys the index produced anyway.

NOTE: pure: no clock, no I/O, no asyncio. Single-threaded like the service that owns it;
long-polling waiters register plain callbacks (:meth:`EventLog.add_waiter`).
"""

from __future__ import annotations

import contextlib
import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvstore.errors import InvalidRequestError

EVENT_STORED = "stored"
EVENT_EVICTED = "evicted"
EVENT_REMOVED = "removed"
EVENT_MOVED = "moved"

#: Why a subscriber must resync.
RESYNC_EPOCH = "epoch"  # another master term: its sequence numbers mean nothing here
RESYNC_GAP = "gap"  # the ring dropped events it has not seen
RESYNC_AHEAD = "ahead"  # it names a sequence number this epoch never reached

#: Most events one ``events`` answer carries.
MAX_EVENTS_PER_CALL = 10_000
DEFAULT_RING_EVENTS = 65_536
#: Block keys all events in the ring may name together (memory bound: ~70 B per key).
DEFAULT_RING_BLOCKS = 1 << 21

#: One event: (seq, kind, namespace digest, block keys, src tier, dst tier). A plain tuple:
#: the cheapest record Python has (no per-event object with a ``__dict__``).
Event = tuple[int, str, bytes, Sequence[bytes], str, str]


def new_epoch() -> int:
    """A fresh epoch for a master without etcd: random, 52 bits (exact in JSON numbers)."""
    return secrets.randbits(52) | 1 << 51  # never 0, never a small etcd revision


@dataclass(frozen=True, slots=True)
class Resync:
    """The subscriber must read a snapshot: ``reason`` is one of ``RESYNC_*``."""

    reason: str
    message: str


@dataclass(frozen=True, slots=True)
class EventBatch:
    """The events after a subscriber's position.

    Attributes:
        epoch: the log's epoch.
        events: the events, in sequence order.
        last_seq: the position to resume from next time (the last event scanned, even one a
            namespace filter left out; the caller's own position when nothing is new).
    """

    epoch: int
    events: list[Event]
    last_seq: int


class EventLog:
    """The bounded ring of recent events of one master term.

    Args:
        capacity: most events held; the oldest go first.
        max_blocks: most block keys the held events may name together (a ring of large
            prompts drops its oldest events sooner); at least the newest event stays.
        epoch: this term's epoch (None: a random one, see :func:`new_epoch`).

    Raises:
        InvalidRequestError: a capacity or block bound below 1.
    """

    __slots__ = (
        "capacity",
        "max_blocks",
        "epoch",
        "next_seq",
        "first_seq",
        "num_blocks",
        "num_dropped",
        "_buf",
        "_waiters",
    )

    def __init__(
        self,
        capacity: int = DEFAULT_RING_EVENTS,
        max_blocks: int = DEFAULT_RING_BLOCKS,
        epoch: int | None = None,
    ) -> None:
        if capacity < 1 or max_blocks < 1:
            raise InvalidRequestError("the event ring needs room for at least one event")
        self.capacity = capacity
        self.max_blocks = max_blocks
        self.epoch = new_epoch() if epoch is None else epoch
        self.next_seq = 1  # the sequence number of the next event
        self.first_seq = 1  # the oldest sequence number still held
        self.num_blocks = 0  # block keys named by the held events
        self.num_dropped = 0
        # Why a list used as a ring and not a deque: reading "the events after seq S" must
        # index straight to S (a deque indexes in O(n) in the middle).
        self._buf: list[Event | None] = [None] * capacity
        self._waiters: list[Callable[[], None]] = []

    @property
    def last_seq(self) -> int:
        """The newest event's sequence number (0 before the first)."""
        return self.next_seq - 1

    def restart(self, epoch: int) -> None:
        """Begin a new term: forget every event, number from 1 again under ``epoch``."""
        self._buf = [None] * self.capacity
        self.epoch = epoch
        self.next_seq = self.first_seq = 1
        self.num_blocks = 0
        self.wake()

    # ------------------------------------------------------------------ recording
    def append(
        self,
        kind: str,
        ns_digest: bytes,
        block_keys: Sequence[bytes],
        src_tier: str = "",
        dst_tier: str = "",
    ) -> None:
        """Record one event (O(1) amortised; wakes any long-polling subscriber)."""
        seq = self.next_seq
        if seq - self.first_seq >= self.capacity:
            self._drop_oldest()
        self._buf[seq % self.capacity] = (seq, kind, ns_digest, block_keys, src_tier, dst_tier)
        self.next_seq = seq + 1
        self.num_blocks += len(block_keys)
        while self.num_blocks > self.max_blocks and self.first_seq < seq:
            self._drop_oldest()
        if self._waiters:
            self.wake()

    def _drop_oldest(self) -> None:
        i = self.first_seq % self.capacity
        old = self._buf[i]
        assert old is not None and old[0] == self.first_seq, "ring slot out of step"
        self.num_blocks -= len(old[3])
        self._buf[i] = None
        self.first_seq += 1
        self.num_dropped += 1

    # ------------------------------------------------------------------ reading
    def read(
        self,
        since_seq: int,
        since_epoch: int | None,
        max_events: int,
        namespaces: frozenset[bytes] | None = None,
    ) -> EventBatch | Resync:
        """The events after ``since_seq`` of ``since_epoch``, or why the caller must resync.

        Args:
            since_seq: the last sequence number the caller applied (0: none).
            since_epoch: the epoch of that number; None for a caller that has seen nothing
                (it follows from the start when the ring still holds event 1).
            max_events: at most this many events (1..MAX_EVENTS_PER_CALL).
            namespaces: only events of these namespace digests (None: all).

        Returns:
            An :class:`EventBatch` (perhaps empty), or a :class:`Resync`.

        Raises:
            InvalidRequestError: a negative ``since_seq`` or ``max_events`` out of range.
        """
        if since_seq < 0:
            raise InvalidRequestError("since_seq must be >= 0")
        if not 1 <= max_events <= MAX_EVENTS_PER_CALL:
            raise InvalidRequestError(f"max must be in 1..{MAX_EVENTS_PER_CALL}")
        if since_epoch is None:
            if since_seq:
                return Resync(RESYNC_EPOCH, "a position without its epoch; read a snapshot")
        elif since_epoch != self.epoch:
            return Resync(
                RESYNC_EPOCH, f"epoch {since_epoch} ended; the master's is now {self.epoch}"
            )
        if since_seq > self.last_seq:
            return Resync(
                RESYNC_AHEAD,
                f"seq {since_seq} is past the last event {self.last_seq} of this epoch",
            )
        if since_seq + 1 < self.first_seq:
            return Resync(
                RESYNC_GAP,
                f"events {since_seq + 1}..{self.first_seq - 1} are no longer held "
                f"(ring of {self.capacity} events)",
            )
        out: list[Event] = []
        seq = since_seq
        end = self.last_seq
        buf, cap = self._buf, self.capacity
        while seq < end and len(out) < max_events:
            seq += 1
            ev = buf[seq % cap]
            assert ev is not None and ev[0] == seq, "ring slot out of step"
            if namespaces is None or ev[2] in namespaces:
                out.append(ev)
        return EventBatch(self.epoch, out, seq)

    # ------------------------------------------------------------------ long polling
    def add_waiter(self, wake: Callable[[], None]) -> None:
        """Call ``wake()`` once, at the next event (or restart, or :meth:`wake`)."""
        self._waiters.append(wake)

    def remove_waiter(self, wake: Callable[[], None]) -> None:
        """Forget a waiter that stopped waiting (timed out)."""
        with contextlib.suppress(ValueError):
            self._waiters.remove(wake)

    def wake(self) -> None:
        """Wake every waiter (each is called once and forgotten)."""
        waiters, self._waiters = self._waiters, []
        for w in waiters:
            w()

    def stats(self) -> dict[str, Any]:
        """Figures for ``stats`` and the admin API."""
        return {
            "epoch": self.epoch,
            "last_seq": self.last_seq,
            "first_seq": self.first_seq,
            "capacity": self.capacity,
            "num_held": self.next_seq - self.first_seq,
            "num_blocks_held": self.num_blocks,
            "num_dropped": self.num_dropped,
            "num_waiters": len(self._waiters),
        }


def event_to_wire(ev: Event) -> dict[str, Any]:
    """An event for msgpack: digest and block keys as raw bytes."""
    seq, kind, digest, keys, src, dst = ev
    out: dict[str, Any] = {"seq": seq, "kind": kind, "namespace": digest, "blocks": list(keys)}
    if kind == EVENT_MOVED:
        out["src_tier"], out["dst_tier"] = src, dst
    return out


def event_to_json(ev: Event) -> dict[str, Any]:
    """An event for JSON (SSE): digest and block keys as lowercase hex."""
    seq, kind, digest, keys, src, dst = ev
    out: dict[str, Any] = {
        "seq": seq,
        "kind": kind,
        "namespace": digest.hex(),
        "blocks": [k.hex() for k in keys],
    }
    if kind == EVENT_MOVED:
        out["src_tier"], out["dst_tier"] = src, dst
    return out
