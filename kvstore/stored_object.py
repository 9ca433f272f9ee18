"""The stored-object record: what a storage node holds, as its tiers, its manifest and a master
see it.

One record, :class:`StoredObject`, names one object's bytes on one node: where they lie
(``segment``, ``offset``), what they are (``key``, ``size``, ``checksum``) and which version
(``stamp``). The node's tiers store and list objects as these records, its manifest
(``kvstore.node.manifest``) keeps one per object it received completely, and it claims them,
as these same records, to a master. It lives in the core layer, not under ``kvstore.node``,
because the master decodes and admits the claims too (``ManifestClaim`` is its name there).
Before, the three had three shapes (a tier object without its segment, a manifest entry
without its place, a claim with both) and the node converted between them on every write.

When a node registers with a master that does not know it yet (a new leader after a failover,
or a restart with persistent tiers), it sends its manifest's records as claims; the master rebuilds its object table from them
(``MasterService.admit_manifest``).

``stamp`` orders versions of one key: it is the expiry of the write grant the master issued at
``put_start`` (wall-clock ms), so a later put of a key has a larger stamp.

The node checks every claim against its bytes before it sends it (:func:`verify_claims`): an
extent that was freed and partly rewritten no longer matches its checksum and is dropped, so
nothing half-written can become visible.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import xxhash

from kvstore.errors import InvalidRequestError, KVStoreError
from kvstore.limits import check_wire_key

if TYPE_CHECKING:
    from kvstore.grants import Grant


# NOTE: not ``frozen`` (never changed all the same): a node makes one per object of every write,
# and a frozen dataclass's __init__ costs more per object (see the NOTE in kvstore.types).
@dataclass(slots=True, unsafe_hash=True)
class StoredObject:
    """One object a node holds: where (segment, offset), what (key, size, checksum), when.

    ``offset`` is a byte position in DRAM and HBM segments and an object id in NVMe ones;
    ``stamp`` is the version (the write grant's expiry, kept across moves between tiers).
    """

    segment: str
    offset: int
    key: bytes
    size: int
    checksum: int
    stamp: int = 0

    def to_wire(self) -> list[Any]:
        return [self.segment, self.offset, self.key, self.size, self.checksum, self.stamp]

    @staticmethod
    def written(grant: Grant, checksum: int) -> StoredObject:
        """The object a completed write of ``grant`` stored: its version is the grant's expiry."""
        return StoredObject(
            grant.segment, grant.offset, grant.key, grant.size, checksum, grant.expires_ms
        )

    @staticmethod
    def from_wire(obj: Any) -> StoredObject:
        """Raises InvalidRequestError for anything but a well-formed claim."""
        if not isinstance(obj, list | tuple) or len(obj) not in (5, 6):
            raise InvalidRequestError(
                "a manifest claim is [segment, offset, key, size, checksum, stamp]"
            )
        segment, offset, key, size, checksum = obj[:5]
        stamp = obj[5] if len(obj) == 6 else 0
        ints = (offset, size, checksum, stamp)
        if not isinstance(segment, str) or not all(
            isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in ints
        ):
            raise InvalidRequestError("malformed manifest claim")
        if checksum >= 1 << 64:
            raise InvalidRequestError("claim checksum must be an unsigned 64-bit integer")
        return StoredObject(segment, offset, check_wire_key(key), size, checksum, stamp)


#: What the master calls a stored object a node claims at registration (the same record).
ManifestClaim = StoredObject


def verify_claims(
    claims: Iterable[StoredObject], segments: Mapping[str, memoryview]
) -> tuple[list[StoredObject], list[tuple[StoredObject, str]]]:
    """Keep the claims whose bytes are in place and match their checksum.

    Args:
        claims: what the manifest says.
        segments: the node's segment bytes by name.

    Returns:
        (claims that hold, [(claim, why it was dropped)]).
    """
    good: list[StoredObject] = []
    bad: list[tuple[StoredObject, str]] = []
    for c in claims:
        view = segments.get(c.segment)
        if view is None:
            bad.append((c, f"no segment {c.segment!r}"))
        elif c.offset + c.size > len(view):
            bad.append((c, "extent outside its segment"))
        elif xxhash.xxh3_64_intdigest(view[c.offset : c.offset + c.size]) != c.checksum:
            bad.append((c, "bytes do not match the checksum (overwritten or never completed)"))
        else:
            good.append(c)
    return good, bad


def claims_from_wire(raw: Any) -> list[StoredObject | KVStoreError]:
    """Decode a wire list of claims; each bad one becomes its error in place.

    Raises:
        InvalidRequestError: ``raw`` is not a list.
    """
    if not isinstance(raw, list):
        raise InvalidRequestError("manifest must be a list of claims")
    out: list[StoredObject | KVStoreError] = []
    for item in raw:
        try:
            out.append(StoredObject.from_wire(item))
        except KVStoreError as err:
            out.append(err)
    return out
