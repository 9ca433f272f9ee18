"""The tiers of a storage node behind one small interface.

A node owns up to three tiers, fastest first: HBM (GPU memory), DRAM (the shared-memory arena)
and NVMe (an lmdb environment). The master addresses every replica as ``(segment, offset)``; for
DRAM and HBM the offset is a byte position, for NVMe it is an id that names lmdb records.

The data server keeps its zero-copy path for the DRAM arena (``recv_into`` the arena); every
other tier goes through :class:`Tier`: whole-object reads and batched whole-object writes.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass

import xxhash

from kvstore.errors import ChecksumMismatchError, KVStoreError, OutOfRangeError
from kvstore.node.arena import ShmArena

TIER_HBM = "hbm"
TIER_DRAM = "dram"
TIER_NVME = "nvme"
#: Fastest first. Demotion moves one step right, promotion one step left.
TIER_ORDER = (TIER_HBM, TIER_DRAM, TIER_NVME)


@dataclass(frozen=True, slots=True)
class StoredObject:
    """One object a tier holds (what a manifest entry says)."""

    offset: int
    key: bytes
    size: int
    checksum: int
    stamp: int = 0  # the version (the write grant's expiry, kept across moves)


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


class ArenaTier(Tier):
    """The DRAM arena seen through the tier interface (used by moves between tiers)."""

    def __init__(self, segment: str, arena: ShmArena, tier: str = TIER_DRAM) -> None:
        self.segment = segment
        self.tier = tier
        self.arena = arena
        self.capacity = arena.size

    def read(self, offset: int, size: int) -> memoryview:
        if offset < 0 or size < 0 or offset + size > self.arena.size:
            raise OutOfRangeError("range lies outside the segment")
        return self.arena.view[offset : offset + size]

    def write(self, items: list[tuple[StoredObject, memoryview]]) -> list[KVStoreError | None]:
        results: list[KVStoreError | None] = []
        for obj, data in items:
            if obj.offset < 0 or obj.offset + len(data) > self.arena.size:
                results.append(OutOfRangeError("range lies outside the segment"))
                continue
            self.arena.view[obj.offset : obj.offset + len(data)] = data
            results.append(None)
        return results
