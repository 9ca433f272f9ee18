"""The tiers of a storage node behind one small interface.

A node owns up to three tiers, fastest first: HBM (GPU memory, ``kvstore.node.hbm``), DRAM
(the shared-memory arena, ``kvstore.node.arena``) and NVMe (an lmdb environment,
``kvstore.node.nvme``). The master addresses every replica as ``(segment, offset)``; for DRAM
and HBM the offset is a byte position, for NVMe it is an id that names lmdb records.

Every segment the data server serves is a :class:`Tier`, the DRAM arena included, so moves,
copies, reads and the manifest treat all tiers alike. What sets DRAM apart is one method,
:meth:`Tier.in_place`: memory of this process that a client's write can stream straight into
(``recv_into``) and a read can send from without a copy. The other tiers answer None there, and
their writes carry whole objects, stored in one batch per tier (one lmdb transaction for NVMe).

The objects a tier stores are the core :class:`~kvstore.stored_object.StoredObject` records, the
same the node's manifest keeps and the master admits.
"""

from __future__ import annotations

import abc

import xxhash

from kvstore.errors import ChecksumMismatchError, KVStoreError
from kvstore.stored_object import StoredObject

__all__ = [
    "StoredObject",
    "Tier",
    "checksum_of",
    "verify_checksum",
]


def checksum_of(view: memoryview | bytes) -> int:
    return xxhash.xxh3_64_intdigest(view)


class Tier(abc.ABC):
    """One tier of one node: a named segment of ``capacity`` bytes."""

    segment: str
    tier: str
    capacity: int
    #: Whether what this tier holds survives a node restart (reported at registration).
    durable: bool = False

    @abc.abstractmethod
    def read(self, offset: int, size: int) -> memoryview:
        """The whole object at ``offset`` (``size`` bytes), valid until the next call.

        Raises:
            KeyNotFoundError: nothing is stored there (NVMe).
            OutOfRangeError: the range lies outside the segment (DRAM, HBM).
        """

    @abc.abstractmethod
    def write(self, items: list[tuple[StoredObject, memoryview]]) -> list[KVStoreError | None]:
        """Store whole objects, in one batch (one transaction where the tier has them).

        Returns:
            Per item, None or the error that kept it out (nothing stored for it).
        """

    def in_place(self, offset: int, size: int) -> memoryview | None:
        """The live bytes of ``[offset, offset + size)``, for a ranged write to stream straight
        into and a read to send from without a copy; None where the tier keeps no such memory
        (its writes then carry whole objects, through :meth:`write`).

        Raises:
            OutOfRangeError: the range lies outside the segment.
        """
        return None

    def forget(self, offsets: list[int]) -> None:
        """The master freed these objects: drop what the tier keeps for them."""
        return None

    def stored(self) -> list[StoredObject]:
        """What a durable tier holds now (empty for volatile tiers)."""
        return []

    def close(self) -> None:
        return None


def verify_checksum(obj: StoredObject, data: memoryview | bytes) -> None:
    """Raises ChecksumMismatchError unless ``data`` is the object's bytes."""
    if checksum_of(data) != obj.checksum:
        raise ChecksumMismatchError(f"bytes of {obj.key[:64]!r} do not match their checksum")
