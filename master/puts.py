"""Two-phase puts: ``put_start`` allocates and says where to write, ``put_end`` commits.

Life of a put::

    put_start ──► PENDING ──put_end──► COMMITTED (in the object table)
                     └──put_revoke / timeout / node death──► gone (space freed)

A key has at most one PENDING put at a time (a second ``put_start`` gets ``ObjectBusyError``).

A **blank** is a put started before its key is known (``put_blanks``: room for one object of a
given size on a given node, with a write grant signed for no key, :data:`grants.BLANK_KEY`). A
client keeps a few per node and size it writes often, writes an object into one with its key
(the node records the key written), and names the key in ``put_end``: so a small put costs it
two round trips, the write and the commit, instead of three. Until then a blank is a pending put
like any other (its key the empty one, which is in no ``pending_by_key``): its space is neither
evicted nor reused, it is reclaimed when its writer does not commit it in time, and it is lost
with its node or its master's term. It is committed only over an older version of its key: a
version's stamp (its write grant's expiry) orders a key's versions on a node and among the
claims a new leader admits (``recovery.py``), and a blank's was given before its key was known.
Only the operator's connections take blanks (a tenant's puts are placed apart, against its
quotas).

A ``put_end`` over a committed key replaces it: the new bytes become visible atomically and the
old replicas' space is freed (last committed writer wins). Readers of the old version that are
still in flight either finish before the space is reused or fail the checksum: never wrong bytes.

Where the bytes go is not decided here: the caller passes a :data:`Place` (the tier manager's
placement for this batch), so this module sits below tiering, which reads the pending puts
(space being written is neither evictable nor drained).

Why a pending put is kept as one plain tuple (:data:`PendingRecord`), not a record object: a
client's maximum-size batch leaves 65,536 puts pending for as long as its writes take (seconds),
long enough for the collector to promote them to the old generation. A record, its replica list
and a ``Replica`` (a named tuple: never untracked) per key were three tracked objects a key, and
each full collection walked them all while the master served no one (``.venv/bin/python
bench/bench_fairness.py`` prints the master's collections and loop lag around such batches). A
flat tuple of bytes, strings and numbers is untracked by the collector at its first young
collection, so pending puts cost a full collection nothing, as committed objects do
(``table.py``). Flat, not a tuple of replica tuples: a collection may look at the outer tuple
before it untracks the inner ones, and then the outer one stays tracked into the old generation.
:class:`PendingPut` is the view of one, made on demand for the few callers that look at a put
as a whole (a node's death).
"""

from __future__ import annotations

import functools
import itertools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvstore import grants
from kvstore.errors import (
    BlankTooOldError,
    InvalidRequestError,
    KVStoreError,
    ObjectBusyError,
    ObjectExistsError,
    PutNotFoundError,
)
from kvstore.kvblocks import is_kv_key
from kvstore.master.config import MasterConfig
from kvstore.master.leases import PIN_NONE
from kvstore.master.membership import Membership, Node, Segment
from kvstore.master.quotas import TENANT_END
from kvstore.master.space import Space
from kvstore.master.table import ObjectTable, Replica
from kvstore.tenants import owner_of
from kvstore.types import PutTicket

log = logging.getLogger(__name__)

#: Placement of a batch's objects of one size: ``place(size, num_replicas, count)`` -> a
#: segment on each of as many distinct nodes, with room, and how many of the ``count`` objects
#: of that size still to place (at least one) go there, allocated together
#: (``tiering.TierManager.placer``). Objects of a tenant are placed with the tenant as a fourth
#: argument, ``place(size, num_replicas, count, tenant)``: the count may shrink to what the
#: tenant's quota takes.
Place = Callable[..., tuple[list[tuple[Segment, Node]], int]]


#: A pending put as :attr:`Puts.pending` keeps it: ``(key, size, deadline, replicas_wanted,
#: *fields of each replica)``, one flat tuple (see the module docstring for why): replica ``i``'s
#: fields start at ``_REPLICAS + i * _REPLICA_FIELDS``.
PendingRecord = tuple[Any, ...]
#: The most blanks one ``put_blanks`` starts on a node, and the most nodes it names.
MAX_BLANKS = 64
MAX_BLANK_NODES = 1024
_REPLICAS = 4
_REPLICA_FIELDS = len(Replica._fields)
_STAMP = Replica._fields.index("stamp")


def _replicas_of(record: PendingRecord) -> list[Replica]:
    if len(record) == _REPLICAS + _REPLICA_FIELDS:  # (most puts: one replica, no comprehension)
        return [Replica._make(record[_REPLICAS:])]
    return [
        Replica._make(record[i : i + _REPLICA_FIELDS])
        for i in range(_REPLICAS, len(record), _REPLICA_FIELDS)
    ]


def _node_ids_of(record: PendingRecord) -> tuple[str, ...]:
    return record[_REPLICAS::_REPLICA_FIELDS]


@dataclass(frozen=True, slots=True)
class PendingPut:
    """One pending put, made from its record on demand (changing it changes nothing)."""

    put_id: int
    key: bytes
    size: int
    replicas: tuple[Replica, ...]
    deadline: float
    replicas_wanted: int = 1

    @staticmethod
    def of(put_id: int, record: PendingRecord) -> PendingPut:
        """The view of ``record``, the pending put ``put_id``."""
        key, size, deadline, wanted = record[:_REPLICAS]
        return PendingPut(put_id, key, size, tuple(_replicas_of(record)), deadline, wanted)


class Puts:
    """The pending puts of one master term, and the verbs that start, commit and end them.

    Args:
        config: the put timeout and the batch and object limits.
        membership: nodes (write grants are signed with their secrets).
        objects: the object table commits go to.
        space: frees the space of revoked puts and of replaced versions.
        clock: monotonic seconds (put deadlines).
        first_put_id: the first put id handed out (an HA term starts above every earlier
            term's, so ids of different terms never collide).
    """

    def __init__(
        self,
        config: MasterConfig,
        membership: Membership,
        objects: ObjectTable,
        space: Space,
        clock: Callable[[], float],
        first_put_id: int = 1,
    ) -> None:
        self.config = config
        self.membership = membership
        self.objects = objects
        self.space = space
        self.clock = clock
        #: put id -> its record (plain tuples only: see the module docstring).
        self.pending: dict[int, PendingRecord] = {}
        self.pending_by_key: dict[bytes, int] = {}
        self._put_ids = itertools.count(first_put_id)
        self.num_reclaimed = 0
        #: Blanks pending (among ``pending``: see the module docstring).
        self.num_blanks = 0

    # ================================================================ verbs
    def start(
        self,
        keys: Sequence[bytes],
        sizes: Sequence[int],
        place: Place,
        replicas: int = 1,
        kv_blocks: bool = False,
        batcher: grants.GrantBatcher | None = None,
    ) -> list[PutTicket | list[Any] | KVStoreError]:
        """Allocate room for each key; the client then writes the bytes straight to the node.

        Args:
            place: where each object goes (computed once per batch by the caller).
            replicas: copies of each object, on distinct nodes (the client writes every one).
            kv_blocks: the KV-cache layer is writing: keys under ``kv/`` and ``kvmeta/`` are
                allowed, and one that is already stored gets ``ObjectExistsError`` (blocks are
                immutable: the prefix index may be serving it).
            batcher: a write :class:`~kvstore.grants.GrantBatcher`: each ticket comes in its
                wire form, its grants references to the batch grants (signed here, at the end).

        Returns:
            Per key, a ticket (put id and where to write; a wire form with ``batcher``) or the
            error for that key.

        Raises:
            InvalidRequestError: a malformed batch or replica count.
        """
        self.config.check_batch(keys)
        if len(sizes) != len(keys):
            raise InvalidRequestError("keys and sizes differ in length")
        if not isinstance(replicas, int) or isinstance(replicas, bool) or not 1 <= replicas <= 16:
            raise InvalidRequestError(f"replicas must be an integer in 1..16, got {replicas!r}")
        results: list[PutTicket | list[Any] | KVStoreError | None] = [None] * len(keys)
        # (size, home node) -> positions of the keys to place (kvstore.placement)
        by_size: dict[tuple[int, str | None], list[int]] = {}
        homes = getattr(place, "homes", None)
        home_of = homes.home if homes is not None else None
        # A tenant's keys are placed apart, each tenant's run checked against its quotas.
        by_tenant: dict[tuple[int, str], list[int]] = {}
        taken: set[bytes] = set()  # (a key twice in one batch: the second is busy)
        for i, (key, size) in enumerate(zip(keys, sizes, strict=True)):
            try:
                self._check_start(key, size, kv_blocks, taken)
            except KVStoreError as err:
                results[i] = err
                continue
            taken.add(key)
            if key < TENANT_END and (tenant := owner_of(key)) is not None:
                by_tenant.setdefault((size, tenant), []).append(i)
            else:
                by_size.setdefault((size, home_of(key) if home_of else None), []).append(i)
        # Once per batch: the grants' expiry base (each allocation's claim stamp is still
        # ordered after every claim on its bytes, see Segment.claim_stamp) and the deadline.
        base = self.space.claim_base()
        deadline = self.clock() + self.config.put_timeout_s
        groups: list[tuple[int, str | None, str | None, list[int]]] = [
            (s, None, h, p) for (s, h), p in by_size.items()
        ]
        groups += [(s, t, None, p) for (s, t), p in by_tenant.items()]
        for size, owner, home, positions in groups:
            done = 0
            while done < len(positions):
                try:
                    if home is not None:
                        picks, k = place(size, replicas, len(positions) - done, home=home)
                    elif owner is None:
                        picks, k = place(size, replicas, len(positions) - done)
                    else:
                        picks, k = place(size, replicas, len(positions) - done, owner)
                except KVStoreError as err:
                    results[positions[done]] = err
                    done += 1
                    continue
                run = positions[done : done + k]
                self._start_run(keys, run, size, picks, base, deadline, batcher, results)
                if owner is not None:
                    self.space.quotas.pend(owner, [seg.tier for seg, _ in picks], size * len(run))
                done += k
        if batcher is not None:
            batcher.sign()
        return results  # type: ignore[return-value]

    def _check_start(self, key: bytes, size: int, kv_blocks: bool, taken: set[bytes]) -> None:
        """Raises the error a put of ``key`` gets before any placement (``taken``: keys
        earlier in its batch)."""
        if is_kv_key(key):
            if not kv_blocks:
                raise InvalidRequestError("keys under kv/ and kvmeta/ are written by KVCache only")
            if key in self.objects:
                raise ObjectExistsError("this KV block is already stored")
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise InvalidRequestError(f"size must be a non-negative integer, got {size!r}")
        if size > self.config.max_object_bytes:
            raise InvalidRequestError(
                f"object of {size} bytes exceeds the limit of {self.config.max_object_bytes}"
            )
        if key in self.pending_by_key or key in taken:
            raise ObjectBusyError("another put of this key is in flight")

    def _start_run(
        self,
        keys: Sequence[bytes],
        run: list[int],
        size: int,
        picks: list[tuple[Segment, Node]],
        base: int,
        deadline: float,
        batcher: grants.GrantBatcher | None,
        results: list[Any],
    ) -> None:
        """Start the puts of ``keys[i]`` for ``i`` in ``run`` (objects of ``size``), each
        replica in the segment of its pick, allocated together; sets their ``results``."""
        if len(picks) == 1:
            expires = picks[0][0].claim_stamp(base)
        else:
            expires = max(segment.claim_stamp(base) for segment, _ in picks)
        offsets = [segment.allocator.allocate_many(size, len(run)) for segment, _ in picks]
        assert all(len(o) == len(run) for o in offsets), "placement chose a run without room"
        head = (size, deadline, len(picks))
        if batcher is not None:
            location = functools.partial(self.membership.location_ref, batcher)
        else:
            location = self.membership.location
        (segment, node), op = picks[0], grants.OP_WRITE
        for n, i in enumerate(run):
            key = keys[i]
            put_id = next(self._put_ids)
            if batcher is not None:  # (keys are placed size by size, not in answer order)
                batcher.position = i
            if len(picks) == 1:  # (most puts: one replica, no comprehensions)
                r = Replica(node.node_id, segment.name, offsets[0][n], size, expires, segment.tier)
                self.pending[put_id] = (key, *head, *r)
                locations = [location(r, key, op, expires)]
            else:
                placed = [
                    Replica(node.node_id, segment.name, offs[n], size, expires, segment.tier)
                    for (segment, node), offs in zip(picks, offsets, strict=True)
                ]
                self.pending[put_id] = sum(placed, (key, *head))
                locations = [location(r, key, op, expires) for r in placed]
            self.pending_by_key[key] = put_id
            results[i] = (
                [put_id, locations] if batcher is not None else PutTicket(put_id, locations)
            )

    def blanks(self, size: int, wanted: Sequence[tuple[str, int]], place: Place) -> list[list[Any]]:
        """Start blanks (see the module docstring): up to ``count`` objects of ``size`` bytes on
        each ``(node_id, count)`` of ``wanted``, one replica each, placed on that node when its
        fastest tier has room (elsewhere otherwise, as a put of a key at home there would be).

        Returns:
            ``[put_id, location]`` per blank started (a location's wire form, its grant one
            for :data:`grants.BLANK_KEY`); fewer than asked where there was no room.

        Raises:
            InvalidRequestError: a size outside ``1..max_object_bytes`` or a count outside
                ``1..MAX_BLANKS``.
        """
        if type(size) is not int or not 0 < size <= self.config.max_object_bytes:
            raise InvalidRequestError(
                f"a blank's size must be an integer in 1..{self.config.max_object_bytes}"
            )
        if len(wanted) > MAX_BLANK_NODES or not all(
            type(n) is int and 0 < n <= MAX_BLANKS for _, n in wanted
        ):
            raise InvalidRequestError(f"blanks are asked for {MAX_BLANKS} at most a node")
        base = self.space.claim_base()
        deadline = self.clock() + self.config.put_timeout_s
        out: list[list[Any]] = []
        key, op, location = grants.BLANK_KEY, grants.OP_WRITE, self.membership.location_wire
        for node_id, count in wanted:
            done = 0
            while done < count:
                try:
                    picks, k = place(size, 1, count - done, home=node_id)
                except KVStoreError:
                    break  # (no room: fewer blanks, and the client puts the usual way)
                (segment, node), expires = picks[0], picks[0][0].claim_stamp(base)
                for offset in segment.allocator.allocate_many(size, k):
                    r = Replica(node.node_id, segment.name, offset, size, expires, segment.tier)
                    put_id = next(self._put_ids)
                    self.pending[put_id] = (key, size, deadline, 1, *r)
                    out.append([put_id, location(r, key, op, expires)])
                self.num_blanks += k
                done += k
        return out

    def end(
        self,
        put_ids: Sequence[int],
        checksums: Sequence[int],
        keys: Sequence[bytes | KVStoreError | None] | None = None,
    ) -> list[KVStoreError | None]:
        """Commit puts: each object becomes visible now, replacing any earlier version.

        Args:
            keys: per put, the key a blank is committed under (None for a put started with its
                key; an error: a malformed key, answered as it is). A blank refused here (no
                key, a key a blank may not hold, a key with a put in flight, a key whose
                stored version is newer than the blank) stays pending, for its writer to
                revoke.
        """
        self.config.check_batch(put_ids)
        if len(checksums) != len(put_ids) or (keys is not None and len(keys) != len(put_ids)):
            raise InvalidRequestError("put_ids, checksums and keys differ in length")
        results: list[KVStoreError | None] = []
        space, objects, pending = self.space, self.objects, self.pending
        now = self.clock()  # (once per batch: its objects are committed together)
        for i, (put_id, checksum) in enumerate(zip(put_ids, checksums, strict=True)):
            record = pending.get(put_id) if isinstance(put_id, int) else None
            if record is None:
                results.append(
                    PutNotFoundError(f"put {put_id!r} is not pending (timed out or revoked?)")
                )
                continue
            if not isinstance(checksum, int) or not 0 <= checksum < 1 << 64:
                results.append(InvalidRequestError("checksum must be an unsigned 64-bit integer"))
                continue
            named = keys[i] if keys is not None else None
            blank = not record[0]
            if named is not None or blank:
                try:
                    record = self._name_blank(put_id, record, named)
                except KVStoreError as err:
                    results.append(err)
                    continue
            del pending[put_id]
            key, size, _, replicas_wanted = record[:_REPLICAS]
            if blank:
                self.num_blanks -= 1
            else:
                del self.pending_by_key[key]
            replicas = _replicas_of(record)
            if key < TENANT_END:  # a tenant's put: its bytes count as committed from here
                self.space.quotas.unpend(key, [r.tier for r in replicas], size)
            old = objects.get(key)
            if old is not None:
                space.release_all(old.replicas, hold_until=space.hold_until(old, now), lease_of=old)
            objects.commit(key, size, checksum, replicas, replicas_wanted, now)
            if old is not None and old.pin != PIN_NONE:
                # A pin belongs to the key: it holds the new version too.
                new = objects[key]
                new.pin, new.pin_until = old.pin, old.pin_until
            for r in replicas:
                space.attach(key, r)
            results.append(None)
        return results

    def _name_blank(
        self, put_id: int, record: PendingRecord, key: bytes | KVStoreError | None
    ) -> PendingRecord:
        """The record of blank ``put_id`` under ``key``, about to be committed.

        Raises:
            InvalidRequestError: the put is no blank, no key was given, or the key is one a
                blank may not hold (a KV-cache layer's, a tenant's).
            ObjectBusyError: another put of the key is in flight.
            BlankTooOldError: the key's stored version was started after the blank.
        """
        if isinstance(key, KVStoreError):
            raise key
        if record[0]:
            raise InvalidRequestError(f"put {put_id} was started with its key: name none")
        if key is None:
            raise InvalidRequestError(f"put {put_id} is a blank: commit it with its key")
        if is_kv_key(key) or key < TENANT_END:
            raise InvalidRequestError("a blank holds a plain key of the operator's")
        if key in self.pending_by_key:
            raise ObjectBusyError("another put of this key is in flight")
        old = self.objects.get(key)
        if old is not None and max(r.stamp for r in old.replicas) >= record[_REPLICAS + _STAMP]:
            # Versions are ordered by their stamps (a node's newest record of a key, a new
            # leader choosing among claims): a blank older than the stored version is no newer.
            raise BlankTooOldError("the stored version is newer than this blank: put it anew")
        return (key, *record[1:])

    def revoke(self, put_ids: Sequence[int]) -> list[KVStoreError | None]:
        """Abandon puts: their space is freed and nothing becomes visible."""
        self.config.check_batch(put_ids)
        results: list[KVStoreError | None] = []
        for put_id in put_ids:
            record = self.pending.get(put_id) if isinstance(put_id, int) else None
            if record is None:
                results.append(PutNotFoundError(f"put {put_id!r} is not pending"))
            else:
                self._discard(put_id, record)
                results.append(None)
        return results

    def reclaim_expired(self) -> int:
        """Free PENDING puts whose writer never committed within ``put_timeout_s``."""
        now = self.clock()
        expired = [(i, rec) for i, rec in self.pending.items() if rec[2] <= now]
        for put_id, record in expired:
            log.info("reclaiming put %d of %r: not committed in time", put_id, record[0][:64])
            self._discard(put_id, record)
        self.num_reclaimed += len(expired)
        return len(expired)

    # ================================================================ bookkeeping
    def discard(self, put: PendingPut) -> None:
        """Forget a pending put and free its space."""
        self._discard(put.put_id, self.pending[put.put_id])

    def _discard(self, put_id: int, record: PendingRecord) -> None:
        del self.pending[put_id]
        key = record[0]
        if not key:  # a blank (see the module docstring)
            self.num_blanks -= 1
            self.space.release_all(_replicas_of(record))
            return
        del self.pending_by_key[key]
        replicas = _replicas_of(record)
        if key < TENANT_END:
            self.space.quotas.unpend(key, [r.tier for r in replicas], record[1])
        self.space.release_all(replicas)

    def on_node(self, node_id: str) -> list[PendingPut]:
        """Pending puts writing a replica on ``node_id``."""
        return [
            PendingPut.of(put_id, rec)
            for put_id, rec in self.pending.items()
            if node_id in _node_ids_of(rec)
        ]

    def num_writing_on(self, node_ids: set[str]) -> int:
        """Pending puts writing a replica on any of ``node_ids``."""
        return sum(1 for rec in self.pending.values() if not node_ids.isdisjoint(_node_ids_of(rec)))

    def writing_on(self, node_id: str) -> bool:
        """Whether a pending put writes on ``node_id`` (a drained node waits for it)."""
        return any(node_id in _node_ids_of(rec) for rec in self.pending.values())
