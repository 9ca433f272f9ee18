"""The object table: key -> committed object, most objects stored as one packed record.

Why not one record object per key: the master holds millions of objects, and CPython's cyclic
garbage collector walks every container object it tracks on each full collection. With a
record, a list and a replica object per key that walk grows with the table until it outlasts
the heartbeats (the master declares a live node dead), and the objects cost several times one
record's memory (``.venv/bin/python bench/bench_master_memory.py`` prints bytes per object and a
full collection's time). A
``bytes`` is not a container: the collector never tracks it, so a table of such records costs
the collector one dict, whatever its size.

So :class:`ObjectTable` keeps each object in one of two forms, in one dict:

- **cold**: its fields (:data:`RECORD_FIELDS`) packed into one ``bytes`` of fixed layout
  (:data:`_PACK`): an object with exactly one replica, no reader, no pin, no task in flight.
  Every ``put_end`` commits this form; most objects stay in it all their life.
- **hot**: an :class:`ObjectMeta`, made from the record the first time code asks the table for the
  object (``table[key]``, ``table.get(key)``): reads, pins, moves and copies work on it as on any
  record, and it keeps its identity for as long as anything refers to it (a read lease, a held
  free, a task). :meth:`ObjectTable.cool` turns hot objects that nothing else refers to and that
  are back in the cold case into records again (the service calls it from ``tick``, a bounded
  number per call).

Why packed bytes and not a tuple of the fields: the cold record is most of the master's memory
per object. A 12-field tuple costs 136 bytes, plus an int object for each field that no other
record shares (the checksum and the offset: ~64 bytes more); one ``bytes`` of the same fields
costs 94, and ``struct`` unpacks it in one call when the object turns hot. The replica's node,
segment and tier (strings every record of a segment shares) become one small *place id* into
the table's own list of places, which only grows with the segments ever registered.

Code that scans the whole table (node death, stats, metrics) uses the table's own scans
(:meth:`ObjectTable.keys_on`, :meth:`ObjectTable.total_bytes`, ...), which read records in place
instead of making an ObjectMeta of each.
"""

from __future__ import annotations

import itertools
import struct
import sys
from collections.abc import Iterable, Iterator, MutableMapping
from typing import NamedTuple

from kvstore.master.leases import PIN_NONE
from kvstore.types import TIER_DRAM


class Replica(NamedTuple):
    """One copy of an object: where it lives and which version of it the node holds.

    A named tuple, not a dataclass: the object table keeps each replica as a plain tuple of
    these fields (see :class:`ObjectMeta`), and turning one back into a ``Replica`` is one
    ``tuple.__new__``.
    """

    node_id: str
    segment: str
    offset: int
    size: int
    stamp: int = 0  # the write grant's expiry (wall ms): which version the node holds there
    tier: str = TIER_DRAM
    # The stamp the node's write claim on these bytes carries, when not ``stamp``: a move or
    # copy keeps the object's version stamp but claims its new bytes as a new allocation.
    claim: int = 0


_as_replica = Replica._make


class ObjectMeta:
    """One committed object of the table.

    Why replicas are stored as plain tuples, not ``Replica`` records in a list: the master
    holds millions of objects, and CPython's cyclic collector walks every container it tracks
    on each full collection (at millions of objects, long enough to miss heartbeats). A
    tuple that holds only strings and ints is untracked by the collector after its first
    young collection, and a list and a record per object cost ~180 bytes more than one tuple.
    So each object is one tracked record: ``_reps`` holds the fields of its only replica (the
    common case), or a tuple of such field tuples when it has none or several. ``replicas``
    builds ``Replica`` values on demand and is a tuple: change them with ``replicas = ...``,
    :meth:`add_replica`, :meth:`remove_replica` or :meth:`swap_replica`, never in place.
    """

    __slots__ = (
        "key",
        "size",
        "checksum",
        "_reps",
        "replicas_wanted",
        "last_access",
        "hits",
        "hits_since_move",
        "lease_until",
        "readers",
        "pin",
        "pin_until",
        "busy",
    )

    def __init__(
        self,
        key: bytes,
        size: int,
        checksum: int,
        replicas: Iterable[Replica],
        replicas_wanted: int = 1,
        last_access: float = 0.0,
        hits: int = 0,
        hits_since_move: int = 0,
        lease_until: float = 0.0,
        readers: int = 0,
        pin: int = PIN_NONE,
        pin_until: float = 0.0,
        busy: int = 0,
    ) -> None:
        self.key = key
        self.size = size
        self.checksum = checksum
        self.replicas = replicas
        self.replicas_wanted = replicas_wanted
        self.last_access = last_access
        self.hits = hits
        self.hits_since_move = hits_since_move
        # monotonic; readers hold grants until then (0: all given back)
        self.lease_until = lease_until
        self.readers = readers  # leases outstanding (see leases.ReadLeases): leased while > 0
        self.pin = pin
        self.pin_until = pin_until
        self.busy = busy  # id of the move/copy task in flight, 0 when none

    @property
    def replicas(self) -> tuple[Replica, ...]:
        """The object's replicas, first the one readers try first."""
        reps = self._reps
        if not reps:
            return ()
        if type(reps[0]) is str:
            return (_as_replica(reps),)
        return tuple(map(_as_replica, reps))

    @replicas.setter
    def replicas(self, replicas: Iterable[Replica]) -> None:
        reps = tuple(tuple(r) for r in replicas)
        self._reps = reps[0] if len(reps) == 1 else reps

    @property
    def num_replicas(self) -> int:
        """``len(self.replicas)``, without building them."""
        reps = self._reps
        return 1 if reps and type(reps[0]) is str else len(reps)

    def add_replica(self, replica: Replica) -> None:
        """Append ``replica`` (a copy made by re-replication or admitted from a manifest)."""
        self.replicas = (*self.replicas, replica)

    def remove_replica(self, replica: Replica) -> None:
        """Drop ``replica``.

        Raises:
            ValueError: the object has no such replica.
        """
        reps = list(self.replicas)
        reps.remove(replica)
        self.replicas = reps

    def swap_replica(self, old: Replica, new: Replica) -> bool:
        """Put ``new`` where ``old`` is (a move or a drain finished). Returns False, changing
        nothing, when the object has no replica ``old``."""
        reps = list(self.replicas)
        if old not in reps:
            return False
        reps[reps.index(old)] = new
        self.replicas = reps
        return True

    def held_by(self, node_id: str) -> bool:
        """Whether a replica lives on ``node_id`` (no ``Replica`` is built)."""
        reps = self._reps
        if reps and type(reps[0]) is str:
            return reps[0] == node_id
        return any(r[0] == node_id for r in reps)

    def __repr__(self) -> str:
        return (
            f"ObjectMeta(key={self.key[:64]!r}, size={self.size}, checksum={self.checksum}, "
            f"replicas={list(self.replicas)!r}, replicas_wanted={self.replicas_wanted}, "
            f"readers={self.readers}, pin={self.pin}, busy={self.busy})"
        )


#: The fields of a cold object's record, in order (the replica's size is the object's; its
#: node, segment and tier are one place id: see :meth:`ObjectTable.place_id`).
RECORD_FIELDS = (
    "size",
    "checksum",
    "replicas_wanted",
    "last_access",
    "hits",
    "hits_since_move",
    "place",
    "offset",
    "stamp",
    "claim",
)
#: The layout of a cold record (little-endian, no padding): 61 bytes, a 94-byte ``bytes``.
_PACK = struct.Struct("<QQBdIIIQqq")
#: Where the place id sits in a cold record, and the size (scans read them in place).
_PLACE_AT = struct.calcsize("<QQBdII")
_pack = _PACK.pack
_read_place = struct.Struct("<I").unpack_from
_read_size = struct.Struct("<Q").unpack_from
_MISSING = object()
#: References to a hot ObjectMeta while :meth:`ObjectTable.cool` looks at it when nothing else
#: refers to it: the table's dict, the loop variable and ``sys.getrefcount``'s argument.
_UNREFERENCED = 3
#: A place: the (node_id, segment, tier) of a replica.
_Place = tuple[str, str, str]


class ObjectTable(MutableMapping[bytes, ObjectMeta]):
    """Committed objects by key: a mapping of ``ObjectMeta`` whose idle entries are packed records.

    Reading an entry (``[]``, ``get``, ``pop``, ``values``, ``items``) hands out its
    ``ObjectMeta`` (made hot on first use); ``in``, ``len`` and iteration over keys never make
    one. See the module docstring for why.
    """

    def __init__(self) -> None:
        self._d: dict[bytes, ObjectMeta | bytes] = {}
        # Keys whose entry is an ObjectMeta, oldest first (cool() looks at them in turn).
        self._hot: dict[bytes, None] = {}
        # The places cold records name by index (see place_id); never shrinks, so an id stays
        # valid for as long as a record may hold it.
        self._places: list[_Place] = []
        self._place_ids: dict[_Place, int] = {}
        self._last_place: tuple[str, str, str, int] = ("", "", "", -1)

    def place_id(self, node_id: str, segment: str, tier: str) -> int:
        """The small id cold records store for a replica's (node, segment, tier)."""
        place = (node_id, segment, tier)
        pid = self._place_ids.get(place)
        if pid is None:
            pid = self._place_ids[place] = len(self._places)
            self._places.append(place)
        return pid

    def _warm(self, key: bytes, rec: bytes) -> ObjectMeta:
        """The ObjectMeta of a cold record (not stored anywhere)."""
        size, checksum, wanted, last_access, hits, hsm, place, offset, stamp, claim = _PACK.unpack(
            rec
        )
        node_id, segment, tier = self._places[place]
        meta = ObjectMeta.__new__(ObjectMeta)
        meta.key = key
        meta.size = size
        meta.checksum = checksum
        meta._reps = (node_id, segment, offset, size, stamp, tier, claim)
        meta.replicas_wanted = wanted
        meta.last_access = last_access
        meta.hits = hits
        meta.hits_since_move = hsm
        meta.lease_until = 0.0
        meta.readers = 0
        meta.pin = PIN_NONE
        meta.pin_until = 0.0
        meta.busy = 0
        return meta

    def _pack(
        self,
        size: int,
        checksum: int,
        wanted: int,
        last_access: float,
        hits: int,
        hsm: int,
        reps: tuple,
    ) -> bytes | None:
        """The cold record of these fields, or None when one does not fit its layout (the
        object then stays an ObjectMeta: nothing is lost, it only costs more)."""
        node_id, segment, offset, _, stamp, tier, claim = reps
        try:
            return _PACK.pack(
                size,
                checksum,
                wanted,
                last_access,
                hits,
                hsm,
                self.place_id(node_id, segment, tier),
                offset,
                stamp,
                claim,
            )
        except struct.error:
            return None

    def _cold(self, meta: ObjectMeta, now: float) -> bytes | None:
        """The cold record of ``meta`` when it is in the cold case now, else None."""
        reps = meta._reps
        if (
            not reps
            or type(reps[0]) is not str
            or meta.readers
            or meta.busy
            or meta.lease_until > now
            or (meta.pin != PIN_NONE and meta.pin_until > now)
            or reps[3] != meta.size
        ):
            return None
        return self._pack(
            meta.size,
            meta.checksum,
            meta.replicas_wanted,
            meta.last_access,
            meta.hits,
            meta.hits_since_move,
            reps,
        )

    # ------------------------------------------------------------ mapping
    def __getitem__(self, key: bytes) -> ObjectMeta:
        v = self._d[key]
        if type(v) is bytes:
            v = self._d[key] = self._warm(key, v)
            self._hot[key] = None
        return v  # type: ignore[return-value]

    def get(self, key: bytes, default: ObjectMeta | None = None) -> ObjectMeta | None:  # type: ignore[override]
        """The object of ``key`` (made hot), or ``default``."""
        v = self._d.get(key)
        if v is None:
            return default
        if type(v) is bytes:
            v = self._d[key] = self._warm(key, v)
            self._hot[key] = None
        return v  # type: ignore[return-value]

    def __setitem__(self, key: bytes, meta: ObjectMeta) -> None:
        self._d[key] = meta
        self._hot[key] = None

    def __delitem__(self, key: bytes) -> None:
        del self._d[key]
        self._hot.pop(key, None)

    def pop(self, key: bytes, default: object = _MISSING) -> ObjectMeta:  # type: ignore[override]
        """Remove ``key`` and return its object (``default`` when missing).

        Raises:
            KeyError: no such key and no default.
        """
        v = self._d.pop(key, _MISSING)
        if v is _MISSING:
            if default is _MISSING:
                raise KeyError(key)
            return default  # type: ignore[return-value]
        self._hot.pop(key, None)
        return self._warm(key, v) if type(v) is bytes else v  # type: ignore[arg-type,return-value]

    def __contains__(self, key: object) -> bool:
        return key in self._d

    def __iter__(self) -> Iterator[bytes]:
        return iter(self._d)

    def __len__(self) -> int:
        return len(self._d)

    def __repr__(self) -> str:
        return f"ObjectTable({len(self._d)} objects, {len(self._hot)} hot)"

    # ------------------------------------------------------------ the service's own verbs
    def commit(
        self,
        key: bytes,
        size: int,
        checksum: int,
        replicas: list[Replica],
        replicas_wanted: int,
        now: float,
    ) -> None:
        """Store a newly committed object (cold when it has one replica), replacing ``key``'s."""
        self._hot.pop(key, None)
        if len(replicas) == 1:
            # NOTE: _pack inlined: this runs once per key of every put_end.
            node_id, segment, offset, rsize, stamp, tier, claim = replicas[0]
            if rsize == size:
                last = self._last_place
                if node_id is last[0] and segment is last[1] and tier is last[2]:
                    place = last[3]  # a batch's puts name the same strings: no lookup
                else:
                    place = self.place_id(node_id, segment, tier)
                    self._last_place = (node_id, segment, tier, place)
                try:
                    self._d[key] = _pack(
                        size, checksum, replicas_wanted, now, 0, 0, place, offset, stamp, claim
                    )
                    return
                except struct.error:
                    pass  # a field beyond the layout: the object stays hot
        self[key] = ObjectMeta(
            key, size, checksum, replicas, replicas_wanted=replicas_wanted, last_access=now
        )

    def peek(self, key: bytes) -> ObjectMeta | None:
        """The object of ``key`` to *look at* (rank, count): a cold one is not made hot, and
        what this returns for it is a copy that changes nothing when changed."""
        v = self._d.get(key)
        if v is None or type(v) is not bytes:
            return v  # type: ignore[return-value]
        return self._warm(key, v)

    def keys_on(self, node_id: str) -> list[bytes]:
        """Keys with a replica on ``node_id`` (no record is made)."""
        out = []
        places = {i for i, p in enumerate(self._places) if p[0] == node_id}
        for key, v in self._d.items():
            if type(v) is bytes:
                if _read_place(v, _PLACE_AT)[0] in places:
                    out.append(key)
            elif v.held_by(node_id):  # type: ignore[union-attr]
                out.append(key)
        return out

    def total_bytes(self) -> int:
        """Bytes of every committed object."""
        return sum(_read_size(v)[0] if type(v) is bytes else v.size for v in self._d.values())  # type: ignore[union-attr,misc]

    def hot_values(self) -> list[ObjectMeta]:
        """The objects in ``ObjectMeta`` form: the only ones that can be leased, pinned or
        moving (a cold object is none of these)."""
        d = self._d
        return [d[k] for k in self._hot]  # type: ignore[misc]

    @property
    def num_hot(self) -> int:
        """Objects in ``ObjectMeta`` form now."""
        return len(self._hot)

    def cool(self, now: float, limit: int) -> int:
        """Turn up to ``limit`` hot objects back into records, oldest first.

        One is turned only when nothing but the table refers to it (so no holder of the
        ``ObjectMeta`` can tell) and it is in the cold case (see :meth:`_cold`); the others
        go to the back of the queue.

        Returns:
            How many were turned.
        """
        d, hot = self._d, self._hot
        done = 0
        for key in list(itertools.islice(hot, limit)):
            meta = d[key]
            rec = self._cold(meta, now) if sys.getrefcount(meta) <= _UNREFERENCED else None  # type: ignore[arg-type]
            del hot[key]
            if rec is None:
                hot[key] = None  # still hot: to the back
            else:
                d[key] = rec
                done += 1
        return done
