"""The client's two-phase put: allocate at the master, write to the nodes, commit.

A batch of puts is one :class:`PutBatch` record, the state every step reads and updates (keys,
bytes, checksums, per-key results, nodes found dead), and :class:`Putter` runs it:

1. ``put_start`` (one master call for the batch) allocates room and returns a write grant
   per replica; the client hashes the values while the master answers.
2. The bytes go straight to the nodes, one data call per node, all nodes at once.
3. ``put_end`` commits what was written (``kv_commit`` for the KV-cache layer, which indexes the
   prompt in the same call: :class:`PromptCommit`); ``put_revoke`` gives back what was not. Both
   are pinned to the epoch of the ``put_start`` (a put id means nothing to another HA leader).

A plain batch of more than ``PUT_CHUNK`` keys runs these steps a chunk at a time, every process
busy at once: the master allocates the next chunk, and commits the one before last, while the
nodes take this one and the client sends it and takes the acknowledgements of the one before.

A single small put whose size this client put before skips step 1: it writes into a blank, a
put the master started ahead (:mod:`kvstore.client.blanks`), and names its key in ``put_end``;
each commit asks for the blanks that run low, in the same call. A put that finds no blank, or
whose blank was lost (its node failed the write, the master took it back) or is older than the
key's stored version (versions are ordered by their put's start), goes the usual way.

A write that failed because its node died is tried once more, elsewhere (the dead nodes are
excluded from the second ``put_start``). The location cache forgets every key of the batch
before the first write and after the commit (see :meth:`Putter.run`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvstore import grants
from kvstore.client.blanks import Blank, Blanks
from kvstore.client.buffers import Segments
from kvstore.client.control import ControlChannel
from kvstore.client.datapath import DataPath
from kvstore.client.locations import LocationCache
from kvstore.client.pipeline import PIPELINE_MAX_ITEMS, one_chunk_ahead
from kvstore.client.transport import InFlight, WriteItem, checksum
from kvstore.errors import (
    BlankTooOldError,
    KVStoreError,
    NodeUnavailableError,
    NoSpaceError,
    PutNotFoundError,
    StaleEpochError,
)
from kvstore.gc_policy import PausedCollector
from kvstore.keys import Namespace
from kvstore.kvblocks import tokens_to_wire
from kvstore.types import Location, PutTicket, result_from_wire

#: put_start rounds per batch: the second retries, elsewhere, keys whose node died.
MAX_ROUNDS = 2
#: A plain batch of more keys than this is put a chunk at a time, the next chunk's put_start in
#: flight while a chunk is written and committed (each chunk stays on the shared pipeline).
PUT_CHUNK = PIPELINE_MAX_ITEMS


@dataclass(frozen=True, slots=True)
class PromptCommit:
    """The prompt a KV-cache put indexes in the master's prefix index, in the same call as its
    commit (``kv_commit``): the put's keys are its block objects (``kv/`` keys, which only such
    a put may write) and its meta object.

    Attributes:
        namespace: the model/layout the blocks belong to.
        tokens: the prompt's token ids (its full blocks are indexed).
    """

    namespace: Namespace
    tokens: np.ndarray

    def to_wire(self) -> dict[str, Any]:
        return {"namespace": self.namespace.to_dict(), "tokens": tokens_to_wire(self.tokens)}


def _seal(view: memoryview | Segments) -> int:
    """The checksum of a value about to be written: its seal's, where it has one (which also
    completes its bytes: see :attr:`Segments.seal`), else the hash of its bytes."""
    if type(view) is Segments and view.seal is not None:
        return view.seal()
    return checksum(view)


@dataclass(slots=True)
class PutBatch:
    """One batch of puts in flight: what every step of :class:`Putter` reads and updates.

    Attributes:
        keys: the wire keys (all valid; the caller maps bad keys to errors itself).
        views: the bytes of each key.
        replicas: copies of each object on distinct nodes.
        prompt: for a KV-cache put, the prompt its commit indexes (None: a plain put).
        results: per key, None (stored) or its error, once the batch has run.
        sums: per key, the checksum of its bytes (filled while the first put_start is answered).
        excluded: nodes found dead during this batch: later rounds allocate elsewhere.
    """

    keys: list[bytes]
    views: list[memoryview | Segments]
    replicas: int = 1
    prompt: PromptCommit | None = None
    results: list[KVStoreError | None] = field(init=False)
    sums: list[int] = field(default_factory=list)
    excluded: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        assert len(self.keys) == len(self.views), "one value per key"
        self.results = [None] * len(self.keys)


def _plain(batch: PutBatch) -> bool:
    """Whether ``batch`` may use blanks: one copy of each object, no prompt to index."""
    return batch.replicas == 1 and batch.prompt is None


@dataclass(slots=True)
class _Writes:
    """A chunk's writes sent (:meth:`Putter._write_begin`): the tickets they write, in order,
    their items, the epoch of their put_start and what the data path has in flight."""

    tickets: list[tuple[int, PutTicket]]
    items: list[WriteItem]
    epoch: int | None
    in_flight: InFlight


class Putter:
    """Runs put batches for one client. Thread-safe (no state of its own beyond its parts).

    Args:
        control: the channel to the master.
        data: the data path to the nodes.
        cache: the client's location cache (forgotten for every key put).
    """

    def __init__(self, control: ControlChannel, data: DataPath, cache: LocationCache) -> None:
        self._control = control
        self._data = data
        self._cache = cache
        #: ``{"at": this client's site}`` (``kvstore.topology``), sent with every put_start:
        #: the master places the objects near this client.
        self.site_args: dict[str, Any] = {}
        #: Told the keys about to be committed and where each one's first replica is
        #: (``ReadPipeline.changed``: keys away from home are held from one-hop reads).
        self.changed: Callable[[list[bytes], list[str | None]], None] | None = None
        #: This client's blanks (None: every put starts at the master).
        self.blanks: Blanks | None = None
        #: A key's home node as one-hop reads see it (None: not known; the blanks' own view).
        self.home: Callable[[bytes], str | None] = lambda key: None
        #: Puts committed through a blank (a counter for tests and benches; racy under threads).
        self.num_into_blanks = 0

    def run(self, batch: PutBatch) -> None:
        """Store the batch; sets ``batch.results``."""
        # Forgotten before (no read may use the old place once the write starts) and after
        # (an answer looked up meanwhile may name the old object; see LocationCache.put_many).
        self._cache.forget(batch.keys)
        todo = list(range(len(batch.keys)))
        with PausedCollector():
            try:
                if self.blanks is not None and len(todo) == 1 and _plain(batch):
                    todo = self._into_blank(batch, self.blanks)
                for round_ in range(MAX_ROUNDS):
                    if not todo:
                        break
                    lost = {j: batch.results[j] for j in todo} if round_ else {}
                    todo = self._round(batch, todo)
                    for j, err in lost.items():
                        # The retry found no other node: the truth is still that the node died.
                        if isinstance(batch.results[j], NoSpaceError):
                            batch.results[j] = err
            finally:
                self._cache.forget(batch.keys)

    def _into_blank(self, batch: PutBatch, blanks: Blanks) -> list[int]:
        """Put the batch's one key into a blank, if there is one for it: write, then commit
        naming the key (see the module docstring).

        Returns:
            ``[0]``: put it the usual way (no blank, or the blank was lost); ``[]``: done (its
            result is set).
        """
        key, view = batch.keys[0], batch.views[0]
        blank = blanks.take(len(view), key, self.home(key))
        if blank is None:
            return [0]
        if not batch.sums:
            batch.sums.append(_seal(view))
        loc = blank.location
        node = loc.node_id
        item = WriteItem(
            Location(node, loc.host, loc.port, loc.grant.for_key(key)), view, batch.sums[0]
        )
        self._data.refresh_offers({node})
        self._data.write_end(self._data.write_begin([item]))
        if item.result is not None:
            self._give_back([blank])
            if isinstance(item.result, NodeUnavailableError):
                blanks.forget_node(node)
                batch.excluded.append(node)
            return [0]
        if self.changed is not None:
            self.changed([key], [node])
        args: dict[str, Any] = {
            "put_ids": [blank.put_id],
            "checksums": batch.sums,
            "keys": [key],
        }
        asked = self._ask_blanks(blanks, len(view), args)
        try:
            reply = self._control.call("put_end", args, pin_epoch=blank.epoch)
        except StaleEpochError:
            blanks.take_all()  # (another leader: none of them is pending there)
            return [0]
        err, _ = result_from_wire((reply["results"] if asked is not None else reply)[0])
        if isinstance(err, PutNotFoundError):
            # The master took the blank back (it timed out, or the master restarted): so it
            # did, or will, the others held from before.
            blanks.take_all()
        if asked is not None:
            self._add_blanks(blanks, len(view), asked, reply["blanks"], blank.epoch)
        if isinstance(err, PutNotFoundError):
            return [0]
        if err is not None:
            self._give_back([blank])
            if isinstance(err, BlankTooOldError):
                return [0]  # (the key's stored version is newer: a put started now is not)
        else:
            self.num_into_blanks += 1
        batch.results[0] = err
        return []

    def _ask_blanks(self, blanks: Blanks, size: int, args: dict[str, Any]) -> dict[str, Any] | None:
        """Ask, in the ``put_end`` of ``args``, for the blanks of ``size`` that run low; what
        was asked (for :meth:`_add_blanks`), or None."""
        asked = blanks.wanted(size)
        if asked is not None:
            args["blanks"] = {**asked, **self.site_args}  # (placed near this client too)
        return asked

    def _add_blanks(
        self, blanks: Blanks, size: int, asked: dict[str, Any], answer: Any, epoch: int | None
    ) -> None:
        """Keep the blanks a commit brought, and give back those of a size no longer kept."""
        blanks.add(size, asked, answer, epoch)
        dropped = blanks.take_dropped()
        if dropped:
            self._give_back(dropped)

    def _give_back(self, given: list[Blank]) -> None:
        """Revoke blanks not committed (their space is the master's again at once); a master
        that does not answer takes them back at its put timeout anyway."""
        by_epoch: dict[int | None, list[int]] = {}
        for b in given:
            by_epoch.setdefault(b.epoch, []).append(b.put_id)
        for epoch, ids in by_epoch.items():
            with contextlib.suppress(KVStoreError):
                self._control.call("put_revoke", {"put_ids": ids}, pin_epoch=epoch)

    def close(self) -> None:
        """Give back every blank held."""
        if self.blanks is not None:
            self._give_back(self.blanks.take_all())

    def _round(self, batch: PutBatch, todo: list[int]) -> list[int]:
        """One put_start, the writes, and the commit of keys ``todo`` (of a large plain batch:
        a chunk at a time, see :meth:`_round_in_chunks`).

        Returns:
            The keys to try again elsewhere (their node died); the dead nodes are added to
            ``batch.excluded``.
        """
        if batch.prompt is None and len(todo) > PUT_CHUNK:
            return self._round_in_chunks(batch, todo)
        reply, epoch = self._start(batch, todo, self._hasher(batch))
        written, retry = self._write(batch, todo, reply, epoch)
        if written or batch.prompt is not None:
            self._commit(batch, written, epoch)
        return retry

    def _round_in_chunks(self, batch: PutBatch, todo: list[int]) -> list[int]:
        """:meth:`_round` ``PUT_CHUNK`` keys at a time, three steps in flight: each chunk's
        ``put_start`` is sent before the chunk ahead of it is written; that chunk's writes are
        sent before the acknowledgements of the chunk before it are taken, and the commit of
        the one before that is sent first. So the master allocates and commits while the nodes
        take a chunk and the client sends the next; nobody waits for a whole step. A chunk is
        committed only once its writes are acknowledged. (A KV-cache put is never cut: its
        ``kv_commit`` indexes the whole prompt at once.)"""
        retry: list[int] = []
        # The chunk whose writes are in flight, and the chunk acknowledged last whose commit
        # is not sent yet (its written keys and its epoch).
        writing: _Writes | None = None
        unsent: tuple[list[tuple[int, PutTicket]], int | None] | None = None

        def acknowledged(writes: _Writes) -> None:
            nonlocal unsent
            written, again = self._write_end(batch, writes)
            retry.extend(again)
            unsent = (written, writes.epoch) if written else None

        def finish(chunk: slice, answer: tuple[Any, int | None]) -> None:
            nonlocal writing, unsent
            last, unsent = unsent, None

            def write() -> None:
                nonlocal writing
                sent = self._write_begin(batch, todo[chunk], *answer)
                before, writing = writing, sent  # (whatever raises, writing is in flight)
                if before is not None:
                    acknowledged(before)

            if last is None:
                write()
            else:
                self._commit(batch, *last, work=write)

        try:
            one_chunk_ahead(
                len(todo),
                PUT_CHUNK,
                lambda chunk, work: self._start(batch, todo[chunk], work or self._hasher(batch)),
                finish,
            )
        except BaseException:
            if writing is not None:  # (not committed: the master takes the space back)
                self._data.write_end(writing.in_flight)
            raise
        if writing is not None:
            writes, last = writing, unsent
            if last is None:
                acknowledged(writes)
            else:
                self._commit(batch, *last, work=lambda: acknowledged(writes))
        if unsent is not None:
            self._commit(batch, *unsent)
        return retry

    @staticmethod
    def _hasher(batch: PutBatch) -> Callable[[], None] | None:
        """What hashes (or seals) every value of the batch, run while the master answers the
        first put_start; None once they are hashed (a later round)."""
        if batch.sums:
            return None
        return lambda: batch.sums.extend(map(_seal, batch.views))

    def _start(
        self, batch: PutBatch, todo: list[int], work: Callable[[], None] | None
    ) -> tuple[Any, int | None]:
        """``put_start`` of keys ``todo``, with ``work()`` run while the master answers.

        Returns:
            The answer, and the epoch its commit is pinned to.
        """
        start: dict[str, Any] = {
            "keys": [batch.keys[j] for j in todo],
            "sizes": [len(batch.views[j]) for j in todo],
            "exclude": batch.excluded,
            "batch_grants": True,  # one write grant per node (kvstore.grants)
            **self.site_args,
        }
        if batch.replicas != 1:
            start["replicas"] = batch.replicas
        if batch.prompt is not None:
            start["kv"] = True  # the KV-cache layer writes kv/ keys (see MasterService.put_start)
        if work is None:
            return self._control.call_epoch("put_start", start)
        return self._control.call_overlapped("put_start", start, work)

    def _write(
        self, batch: PutBatch, todo: list[int], reply: Any, epoch: int | None
    ) -> tuple[list[tuple[int, PutTicket]], list[int]]:
        """The writes of keys ``todo``, whose put_start answered ``reply``; what failed is
        revoked (and its error set).

        Returns:
            The keys written, with their tickets (to commit), and the keys to try again
            elsewhere (as :meth:`_round`).
        """
        return self._write_end(batch, self._write_begin(batch, todo, reply, epoch))

    def _write_begin(
        self, batch: PutBatch, todo: list[int], reply: Any, epoch: int | None
    ) -> _Writes:
        """:meth:`_write` up to the nodes' acknowledgements (see :meth:`DataPath.write_begin`):
        for :meth:`_write_end`, which must follow."""
        tickets: list[tuple[int, PutTicket]] = []
        writes: list[WriteItem] = []
        reader = grants.GrantReader(grants.open_batch_unverified, check=True)
        for j, r in zip(todo, reply, strict=True):
            if type(r) is list and len(r) == 2 and type(r[0]) is int and r[0] == 0:
                payload = r[1]  # (the common case: result_from_wire's first test)
            else:
                err, payload = result_from_wire(r)
                if err is not None:
                    batch.results[j] = err
                    continue
            ticket = PutTicket.from_wire(payload, reader)
            tickets.append((j, ticket))
            for loc in ticket.locations:
                writes.append(WriteItem(loc, batch.views[j], batch.sums[j]))
        self._data.refresh_offers({w.location.node_id for w in writes})
        return _Writes(tickets, writes, epoch, self._data.write_begin(writes))

    def _write_end(
        self, batch: PutBatch, sent: _Writes
    ) -> tuple[list[tuple[int, PutTicket]], list[int]]:
        """:meth:`_write`'s second half: take the acknowledgements, revoke what failed."""
        self._data.write_end(sent.in_flight)
        tickets, epoch = sent.tickets, sent.epoch
        failed: dict[int, KVStoreError] = {}
        dead_nodes: set[str] = set()
        w = iter(sent.items)
        for j, ticket in tickets:
            for _loc in ticket.locations:
                item = next(w)
                if item.result is not None:
                    failed.setdefault(j, item.result)
                    if isinstance(item.result, NodeUnavailableError):
                        dead_nodes.add(item.location.node_id)
        commit = [(j, t) for j, t in tickets if j not in failed]
        revoke = [(j, t) for j, t in tickets if j in failed]
        if revoke:
            self._control.call(
                "put_revoke", {"put_ids": [t.put_id for _, t in revoke]}, pin_epoch=epoch
            )
        for j, _ in revoke:
            batch.results[j] = failed[j]
        batch.excluded.extend(sorted(dead_nodes.difference(batch.excluded)))
        return commit, [j for j, _ in revoke if isinstance(failed[j], NodeUnavailableError)]

    def _commit(
        self,
        batch: PutBatch,
        commit: list[tuple[int, PutTicket]],
        epoch: int | None,
        work: Callable[[], None] | None = None,
    ) -> None:
        """``put_end`` (or ``kv_commit``, indexing the batch's prompt) of the written keys;
        ``work`` (a plain put's next writes) runs while the master answers."""
        if self.changed is not None and commit:
            self.changed(
                [batch.keys[j] for j, _ in commit],
                [t.locations[0].node_id if t.locations else None for _, t in commit],
            )
        args: dict[str, Any] = {
            "put_ids": [t.put_id for _, t in commit],
            "checksums": [batch.sums[j] for j, _ in commit],
        }
        # A single small put asks for blanks for its next ones of its size (see _into_blank).
        asked = None
        if self.blanks is not None and len(batch.keys) == 1 and len(commit) == 1 and _plain(batch):
            asked = self._ask_blanks(self.blanks, len(batch.views[0]), args)
        # NOTE: pinned: a put id means nothing to another leader.
        if work is not None:
            assert batch.prompt is None, "a KV-cache put commits once"
            reply, _ = self._control.call_overlapped("put_end", args, work, pin_epoch=epoch)
        elif batch.prompt is None:
            reply = self._control.call("put_end", args, pin_epoch=epoch)
            if asked is not None and self.blanks is not None:
                self._add_blanks(self.blanks, len(batch.views[0]), asked, reply["blanks"], epoch)
                reply = reply["results"]
        else:
            reply = self._control.call(
                "kv_commit", {**args, **batch.prompt.to_wire()}, pin_epoch=epoch
            )["results"]
        for (j, _), r in zip(commit, reply, strict=True):
            batch.results[j], _ = result_from_wire(r)
