"""Records that cross the wire between master, nodes and clients, with their wire forms.

Per-key results of batch verbs travel as ``[code, payload]``: code 0 carries the value, any
other code carries the error message (see :mod:`kvstore.errors`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvstore.errors import ErrorCode, KVStoreError, ProtocolError
from kvstore.grants import Grant, GrantReader


# NOTE: the records made per key per operation (Location, PutTicket, ObjectInfo, and
# kvstore.grants.Grant) are not ``frozen``: a frozen dataclass's __init__ sets each field through
# object.__setattr__, a few times the cost of a plain assignment, paid per key in master, node and
# client alike (their CPU per key: ``.venv/bin/python bench/bench_small.py``). They are still
# never changed after construction (a Grant's fields are covered by its signature).
@dataclass(slots=True, unsafe_hash=True)
class Location:
    """Where a client reads or writes one replica, with the node's grant."""

    node_id: str
    host: str
    port: int
    grant: Grant

    def to_wire(self) -> list[Any]:
        return [self.node_id, self.host, self.port, self.grant.to_wire()]

    @staticmethod
    def from_wire(obj: Any, reader: GrantReader | None = None) -> Location:
        """``reader``: the message's reader of batch grant references (None: one-key grants).

        Raises ProtocolError (GrantInvalidError for the grant) when ``obj`` is malformed."""
        if type(obj) is not list or len(obj) != 4:
            raise ProtocolError("location must be [node_id, host, port, grant]")
        node_id, host, port, grant = obj
        if type(node_id) is not str or type(host) is not str or type(port) is not int:
            raise ProtocolError("location must be [node_id: str, host: str, port: int, grant]")
        g = reader.resolve(grant) if reader is not None else None
        return Location(node_id, host, port, g if g is not None else Grant.from_wire(grant))


def _locations_to_wire(locations: list[Location]) -> list[Any]:
    """``[loc.to_wire() for loc in locations]``, inlined: it runs per key of every batch."""
    return [
        [
            loc.node_id,
            loc.host,
            loc.port,
            [g.op, g.key, g.segment, g.offset, g.size, g.expires_ms, g.signature],
        ]
        for loc in locations
        for g in (loc.grant,)
    ]


@dataclass(slots=True)
class PutTicket:
    """The master's answer to ``put_start`` for one key: the put id and where to write."""

    put_id: int
    locations: list[Location]

    def to_wire(self) -> list[Any]:
        return [self.put_id, _locations_to_wire(self.locations)]

    @staticmethod
    def from_wire(obj: Any, reader: GrantReader | None = None) -> PutTicket:
        """``reader``: as :meth:`Location.from_wire`.

        Raises ProtocolError (GrantInvalidError for a grant) when ``obj`` is malformed."""
        if type(obj) is not list or len(obj) != 2 or type(obj[0]) is not int:
            raise ProtocolError("put ticket must be [put_id: int, locations]")
        locations = obj[1]
        if type(locations) is not list:
            raise ProtocolError("a put ticket's locations must be a list")
        if len(locations) == 1:  # (most puts: no comprehension's frame for one replica)
            return PutTicket(obj[0], [Location.from_wire(locations[0], reader)])
        return PutTicket(obj[0], [Location.from_wire(x, reader) for x in locations])


@dataclass(slots=True)
class ObjectInfo:
    """A committed object: its size, checksum (xxh3_64) and replicas.

    ``lease`` names the read lease the master took for this answer (0: none): the reader gives
    it back (``release_leases``) once it is done reading, so the master need not wait for the
    lease to run out before it evicts the object or reuses space freed under it.
    """

    size: int
    checksum: int
    locations: list[Location]
    lease: int = 0

    def to_wire(self) -> list[Any]:
        out = [self.size, self.checksum, _locations_to_wire(self.locations)]
        if self.lease:
            out.append(self.lease)
        return out

    @staticmethod
    def from_wire(obj: Any, reader: GrantReader | None = None) -> ObjectInfo:
        """``reader``: as :meth:`Location.from_wire`.

        Raises ProtocolError (GrantInvalidError for a grant) when ``obj`` is malformed."""
        if type(obj) is not list or len(obj) not in (3, 4):
            raise ProtocolError("object info must be [size, checksum, locations(, lease)]")
        size, checksum, locations = obj[0], obj[1], obj[2]
        if type(size) is not int or type(checksum) is not int or size < 0 or checksum < 0:
            raise ProtocolError("an object's size and checksum must be unsigned integers")
        if type(locations) is not list:
            raise ProtocolError("an object's locations must be a list")
        lease = obj[3] if len(obj) == 4 else 0
        if type(lease) is not int or lease < 0:
            raise ProtocolError("an object's lease token must be an unsigned integer")
        if len(locations) == 1:  # (most objects: no comprehension's frame for one replica)
            return ObjectInfo(size, checksum, [Location.from_wire(locations[0], reader)], lease)
        return ObjectInfo(size, checksum, [Location.from_wire(x, reader) for x in locations], lease)


#: A storage node's state, one vocabulary for every report of it (``/api/v1/nodes``,
#: ``/api/v1/cluster``, ``stats``, a drain's progress, ``kvstore nodes``): ``active`` (serves
#: and takes new data), ``draining`` (serves, takes no new data, its objects move elsewhere),
#: ``retired`` (drained; told to stop).
NODE_STATES = ("active", "draining", "retired")

#: The tiers, one vocabulary for master, node, client and operator: fastest first. A replica lives
#: in one; a node registers a segment in each it has; demotion moves one step right, promotion
#: one step left.
TIER_HBM = "hbm"
TIER_DRAM = "dram"
TIER_NVME = "nvme"
#: Files on a shared file system path (``kvstore.node.shared``): outlives every node.
TIER_SHARED = "shared"
TIER_ORDER = (TIER_HBM, TIER_DRAM, TIER_NVME, TIER_SHARED)
TIER_RANK = {t: i for i, t in enumerate(TIER_ORDER)}
#: Tiers whose replica offsets are ids the master never reuses for the segment (the node stores
#: whole objects under them), not byte positions: nothing to fence or claim by byte range.
TIERS_BY_ID = frozenset((TIER_NVME, TIER_SHARED))


def node_state(draining: bool, retired: bool) -> str:
    """The state word (:data:`NODE_STATES`) of a node with these flags."""
    return "retired" if retired else "draining" if draining else "active"


@dataclass(frozen=True, slots=True)
class SegmentSpec:
    """A segment a node offers at registration."""

    name: str
    tier: str
    capacity: int
    shm_path: str = ""

    def to_wire(self) -> list[Any]:
        return [self.name, self.tier, self.capacity, self.shm_path]

    @staticmethod
    def from_wire(obj: Any) -> SegmentSpec:
        if (
            not isinstance(obj, list)
            or len(obj) != 4
            or not isinstance(obj[0], str)
            or not isinstance(obj[1], str)
            or not isinstance(obj[2], int)
            or not isinstance(obj[3], str)
        ):
            raise ProtocolError("segment must be [name, tier, capacity, shm_path]")
        return SegmentSpec(obj[0], obj[1], obj[2], obj[3])


def result_to_wire(result: Any) -> list[Any]:
    """One per-key result of a batch verb: a value, None, or a KVStoreError."""
    if isinstance(result, KVStoreError):
        return result.to_wire()
    if hasattr(result, "to_wire"):
        return [0, result.to_wire()]
    return [0, result]


def result_from_wire(obj: Any) -> tuple[KVStoreError | None, Any]:
    """Split a per-key ``[code, payload]`` into (error or None, payload)."""
    if type(obj) is list and len(obj) == 2 and type(obj[0]) is int and obj[0] == ErrorCode.OK:
        return None, obj[1]  # the common case, in one test
    if not isinstance(obj, list) or len(obj) != 2 or not isinstance(obj[0], int):
        return ProtocolError(f"bad per-key result {obj!r:.100}"), None
    if obj[0] == ErrorCode.OK:
        return None, obj[1]
    return KVStoreError.from_wire(obj), None
