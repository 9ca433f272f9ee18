"""Follow the pool's KV events: what the master's prefix index stored, evicted, removed, moved.

A router (or any tool) keeps its view of which blocks are cached without polling::

    from kvstore.client.events import BlockView, EventStream

    view = BlockView()
    with EventStream("127.0.0.1:7700") as stream:   # or a Client, or "etcd://HOST:PORT"
        for item in stream:                         # blocks; long-polls the master
            view.apply(item)                        # Snapshot, BlockEvent or ResyncNotice

The stream remembers its position (epoch, seq) and resumes from it after a lost connection, a
master restart or an HA failover: it gets exactly the events after its position, or the master
says it must resync (another epoch, or events the ring no longer holds); the stream then yields
a :class:`ResyncNotice` and a fresh :class:`Snapshot`, and follows on from the snapshot's
position. Nothing is lost or applied twice. See ``master/event_ring.py`` for the master's side.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from kvstore.client.client import Client
from kvstore.errors import (
    InvalidRequestError,
    KVTimeoutError,
    MasterUnavailableError,
    NotLeaderError,
    OverloadedError,
    ProtocolError,
    StaleEpochError,
)

#: The master's bound on ``max`` per call (``kvstore.master.event_ring.MAX_EVENTS_PER_CALL``).
MAX_EVENTS_PER_CALL = 10_000
#: Failures worth retrying: the master (or the leader) is away or busy for now.
_TRANSIENT = (
    MasterUnavailableError,
    OverloadedError,
    KVTimeoutError,
    NotLeaderError,
    StaleEpochError,
    ProtocolError,
)


@dataclass(frozen=True, slots=True)
class BlockEvent:
    """One KV event: blocks of one namespace stored, evicted, removed, or moved between tiers.

    Attributes:
        epoch: the master term that numbered it.
        seq: its sequence number in that term.
        kind: ``stored``, ``evicted``, ``removed`` or ``moved``.
        namespace: the namespace digest (``Namespace.digest``).
        blocks: the block keys (``kvstore.keys.block_keys``) it is about.
        src_tier, dst_tier: for ``moved``, the tiers the replica moved from and to.
    """

    epoch: int
    seq: int
    kind: str
    namespace: bytes
    blocks: tuple[bytes, ...]
    src_tier: str = ""
    dst_tier: str = ""


@dataclass(frozen=True, slots=True)
class ResyncNotice:
    """The master could not serve the stream's position; a :class:`Snapshot` follows.

    Attributes:
        reason: ``epoch`` (another master term), ``gap`` (the ring dropped events this stream
            had not read) or ``ahead`` (a position this term never reached).
        message: the master's explanation.
        epoch: the master's epoch when it said so.
    """

    reason: str
    message: str
    epoch: int


@dataclass(frozen=True, slots=True)
class Snapshot:
    """Every block in the master's prefix index, per namespace, at ``(epoch, seq)``."""

    epoch: int
    seq: int
    blocks: dict[bytes, frozenset[bytes]]


StreamItem = BlockEvent | ResyncNotice | Snapshot


@dataclass(slots=True)
class BlockView:
    """A subscriber's copy of the prefix index: namespace digest -> block keys.

    Apply every item a stream yields, in order; the view then equals the master's index as of
    the stream's position. Events set state, so applying one a snapshot already shows is a
    no-op.
    """

    blocks: dict[bytes, set[bytes]] = field(default_factory=dict)
    #: The tier of blocks that moved since the last snapshot (others: where they were stored).
    tiers: dict[tuple[bytes, bytes], str] = field(default_factory=dict)

    def apply(self, item: StreamItem) -> None:
        """Fold one stream item into the view."""
        if isinstance(item, Snapshot):
            self.blocks = {ns: set(keys) for ns, keys in item.blocks.items()}
            self.tiers = {}
        elif isinstance(item, BlockEvent):
            keys = self.blocks.setdefault(item.namespace, set())
            if item.kind == "stored":
                keys.update(item.blocks)
            elif item.kind == "moved":
                for k in item.blocks:
                    if k in keys:
                        self.tiers[(item.namespace, k)] = item.dst_tier
            else:
                keys.difference_update(item.blocks)
                for k in item.blocks:
                    self.tiers.pop((item.namespace, k), None)
            if not keys:
                del self.blocks[item.namespace]

    def as_sets(self) -> dict[bytes, frozenset[bytes]]:
        """The view as comparable frozensets (empty namespaces left out)."""
        return {ns: frozenset(k) for ns, k in self.blocks.items() if k}


def _event_from_wire(epoch: int, raw: Any) -> BlockEvent:
    if not isinstance(raw, dict):
        raise ProtocolError("an event must be a map")
    try:
        return BlockEvent(
            epoch,
            int(raw["seq"]),
            str(raw["kind"]),
            bytes(raw["namespace"]),
            tuple(bytes(b) for b in raw["blocks"]),
            str(raw.get("src_tier", "")),
            str(raw.get("dst_tier", "")),
        )
    except (KeyError, TypeError, ValueError):
        raise ProtocolError("malformed event from the master") from None


def _snapshot_from_wire(raw: Any) -> Snapshot:
    if not isinstance(raw, dict) or not isinstance(raw.get("namespaces"), dict):
        raise ProtocolError("malformed snapshot from the master")
    blocks = {
        bytes(ns): frozenset(bytes(keys[i : i + 16]) for i in range(0, len(keys), 16))
        for ns, keys in raw["namespaces"].items()
    }
    return Snapshot(int(raw["epoch"]), int(raw["seq"]), blocks)


class EventStream:
    """An iterator over the master's KV events that follows, resumes and resyncs.

    Args:
        source: a connected :class:`Client` (not closed by the stream), or an address for
            ``Client.connect`` (``HOST:PORT`` or ``etcd://...``; closed with the stream).
        since_seq, since_epoch: where to resume (the ``position`` of an earlier stream);
            the default, no position, starts with a snapshot unless the master still holds
            its first event (then everything comes as events).
        namespaces: only events of these namespace digests (None: all).
        wait_s: how long one call long-polls the master (capped under the call timeout).
        max_events: most events per call.
        retry_s: how long a master may stay away (connection lost, no leader) before
            iteration raises; within it, the stream reconnects and resumes by itself.
        token: the cluster token, when ``source`` is an address.

    Raises:
        InvalidRequestError: bad arguments.
    """

    def __init__(
        self,
        source: Client | str,
        *,
        since_seq: int = 0,
        since_epoch: int | None = None,
        namespaces: Iterable[bytes] | None = None,
        wait_s: float = 5.0,
        max_events: int = 1000,
        retry_s: float = 30.0,
        token: str | bytes | None = None,
    ) -> None:
        if since_seq < 0 or (since_seq and since_epoch is None):
            raise InvalidRequestError("since_seq must be >= 0, and given with its since_epoch")
        if not 1 <= max_events <= MAX_EVENTS_PER_CALL or wait_s < 0 or retry_s < 0:
            raise InvalidRequestError(
                f"max_events must be in 1..{MAX_EVENTS_PER_CALL}; wait_s, retry_s >= 0"
            )
        self._owns = isinstance(source, str)
        self.client = Client.connect(source, token=token) if isinstance(source, str) else source
        self.seq = since_seq
        self.epoch = since_epoch
        self.namespaces = None if namespaces is None else sorted(set(namespaces))
        # NOTE: a long poll must end well inside the channel's own call timeout, or the channel
        # would call a quiet stream a dead master.
        self.wait_s = min(wait_s, self.client.call_timeout / 2)
        self.max_events = max_events
        self.retry_s = retry_s
        self.num_resyncs = 0
        self.num_reconnects = 0
        self._pending: list[StreamItem] = []
        self._closed = False

    @property
    def position(self) -> tuple[int | None, int]:
        """``(epoch, seq)`` of the last item yielded: resume a later stream from it."""
        return self.epoch, self.seq

    def __enter__(self) -> EventStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop following (iteration ends); closes the client if the stream opened it."""
        self._closed = True
        if self._owns:
            self.client.close()

    def __iter__(self) -> Iterator[StreamItem]:
        return self

    def __next__(self) -> StreamItem:
        while not self._pending:
            if self._closed:
                raise StopIteration
            self._pending = self.poll()
        return self._pending.pop(0)

    def poll(self, wait_s: float | None = None) -> list[StreamItem]:
        """One round: the events after the position (waiting up to ``wait_s`` for some), or a
        :class:`ResyncNotice` and a :class:`Snapshot`. Advances the position past them.

        Returns:
            The items, in order (empty when nothing happened in ``wait_s``).

        Raises:
            MasterUnavailableError, KVTimeoutError, NotLeaderError: the master stayed away
                longer than ``retry_s``.
            KVStoreError: the master refused the call (bad arguments).
        """
        wait = self.wait_s if wait_s is None else min(max(0.0, wait_s), self.wait_s)
        seq, epoch = self.seq, self.epoch
        reply = self._call(
            lambda: self.client.poll_events(
                seq, epoch, max_events=self.max_events, wait_s=wait, namespaces=self.namespaces
            )
        )
        if not isinstance(reply, dict) or not isinstance(reply.get("epoch"), int):
            raise ProtocolError("malformed events answer from the master")
        resync = reply.get("resync")
        if resync is not None:
            self.num_resyncs += 1
            notice = ResyncNotice(
                str(resync.get("reason", "")), str(resync.get("message", "")), reply["epoch"]
            )
            return [notice, self.snapshot()]
        epoch = reply["epoch"]
        items: list[StreamItem] = [_event_from_wire(epoch, e) for e in reply.get("events", [])]
        self.epoch, self.seq = epoch, int(reply["last_seq"])
        return items

    def snapshot(self) -> Snapshot:
        """Read the master's index now and move the position to the snapshot's.

        Raises:
            As :meth:`poll`.
        """
        snap = _snapshot_from_wire(self._call(lambda: self.client.events_snapshot(self.namespaces)))
        self.epoch, self.seq = snap.epoch, snap.seq
        return snap

    def _call(self, call: Callable[[], Any]) -> Any:
        """One call, retried while the master is away (bounded by ``retry_s``); the position
        only moves once an answer is in, so a retry asks for exactly the same events."""
        deadline = time.monotonic() + self.retry_s
        backoff = 0.05
        while True:
            try:
                return call()
            except _TRANSIENT:
                if self._closed or time.monotonic() >= deadline:
                    raise
            self.num_reconnects += 1
            time.sleep(min(backoff, max(0.0, deadline - time.monotonic())))
            backoff = min(backoff * 2, 1.0)
