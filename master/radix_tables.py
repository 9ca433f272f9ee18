"""Open-addressing hash tables of int32 ids for the radix index (:mod:`kvstore.master.radix`).

Why not dicts: with 1M blocks a dict entry per block or per tree node costs ~100-150 B, most
of the index's per-block budget. These tables store only int32 ids (4 B per entry, ~8 B at
the kept load factor) and read the entries' keys from the tree's own arrays.
"""

from __future__ import annotations

import numpy as np

#: Up to this many keys a batch probes or places them one by one: a vectorised round costs
#: ~15 numpy calls, more than a few keys by themselves, and a prompt adds only a few new blocks
#: (``.venv/bin/python bench/bench_radix.py`` prints the insert rate).
SMALL_BATCH = 16


class KeyTable:
    """Block key -> slot: open addressing with linear probing over an int32 array.

    Why not a dict: a dict of 16-byte ``bytes`` to ``int`` costs ~150 B per entry; this costs
    ~8-13 B (4 B per entry, load factor kept in (0.3, 0.6]). Keys are uniform hashes, so their
    first 8 bytes are the bucket hash; the full 16 bytes are compared on every probe hit.
    """

    __slots__ = ("table", "mask", "count")

    def __init__(self, size: int = 1 << 11) -> None:
        self.table = np.full(size, -1, dtype=np.int32)
        self.mask = size - 1
        self.count = 0

    @staticmethod
    def _bucket(key: bytes) -> int:
        return int.from_bytes(key[:8], "little")

    def find(self, key: bytes, keys: np.ndarray) -> int:
        table, mask = self.table, self.mask
        i = self._bucket(key) & mask
        for _ in range(len(table)):
            s = int(table[i])
            if s < 0:
                return -1
            if keys[s].tobytes() == key:
                return s
            i = (i + 1) & mask
        return -1

    def find_many(self, rows: np.ndarray, keys: np.ndarray) -> np.ndarray:
        """Slots of ``rows`` (``[n, 16]`` uint8 keys), -1 where absent; probes all rows at once
        (a few rows, e.g. a prompt's new blocks: one by one, cheaper than a vectorised round)."""
        if len(rows) <= SMALL_BATCH:
            return np.array([self.find(row.tobytes(), keys) for row in rows], dtype=np.int32)
        result = np.full(len(rows), -1, dtype=np.int32)
        pos = (_buckets(rows) & np.uint64(self.mask)).astype(np.int64)
        active = np.arange(len(rows))
        for _ in range(len(self.table)):  # bounded: each round advances every active probe
            if not len(active):
                break
            s = self.table[pos[active]]
            occupied = s >= 0
            hit = np.zeros(len(active), dtype=bool)
            hit[occupied] = (keys[s[occupied]] == rows[active[occupied]]).all(axis=1)
            result[active[hit]] = s[hit]
            active = active[occupied & ~hit]
            pos[active] = (pos[active] + 1) & self.mask
        return result

    def add_many(self, rows: np.ndarray, slots: np.ndarray, keys: np.ndarray) -> None:
        """Add absent, distinct keys ``rows`` mapping to ``slots``, all at once.

        Each key still lands on the first free bucket of its probe sequence (ties within the
        batch go to the first claimant, the others probe on), so lookups stay correct.
        """
        if (self.count + len(rows)) * 5 > len(self.table) * 3:
            size = len(self.table)
            while (self.count + len(rows)) * 5 > size * 3:
                size *= 2
            self._rehash(size, keys)
        _place(self.table, _buckets(rows), slots)
        self.count += len(rows)

    def discard(self, key: bytes, keys: np.ndarray) -> None:
        """Remove ``key`` (backward-shift deletion: no tombstones, probes stay short)."""
        table, mask = self.table, self.mask
        i = self._bucket(key) & mask
        for _ in range(len(table)):
            s = int(table[i])
            if s < 0:
                return
            if keys[s].tobytes() == key:
                break
            i = (i + 1) & mask
        else:
            return
        j = i
        for _ in range(len(table)):
            j = (j + 1) & mask
            s = int(table[j])
            if s < 0:
                break
            home = self._bucket(keys[s].tobytes()) & mask
            # Move entry j into the hole at i unless its home lies cyclically in (i, j].
            if (j > i and (home <= i or home > j)) or (j < i and home <= i and home > j):
                table[i] = s
                i = j
        table[i] = -1
        self.count -= 1
        if len(self.table) > (1 << 11) and self.count * 10 < len(self.table) * 3 // 2:
            self._rehash(len(self.table) // 2, keys)

    def _rehash(self, size: int, keys: np.ndarray) -> None:
        live = self.table[self.table >= 0]
        self.table = np.full(size, -1, dtype=np.int32)
        self.mask = size - 1
        self.count = 0
        self.add_many(keys[live], live, keys)

    def nbytes(self) -> int:
        return self.table.nbytes


class ChildTable:
    """(parent node, first token of the child's first block) -> child node ids.

    Open addressing with linear probing over an int32 array of child ids, the way
    :class:`KeyTable` maps keys: the (parent, first token) of an entry is read from the tree's
    node arrays, so an entry costs 4 B (~8 B at the kept load factor) instead of a dict per
    node. Siblings that share a first token (they differ later in the block) are separate
    entries under the same (parent, token); :meth:`find` returns all of them.
    """

    __slots__ = ("table", "mask", "count")

    def __init__(self, size: int = 1 << 10) -> None:
        self.table = np.full(size, -1, dtype=np.int32)
        self.mask = size - 1
        self.count = 0

    @staticmethod
    def _home(parent: int, token: int) -> int:
        h = (parent * 0x9E3779B97F4A7C15 + token * 0xC2B2AE3D27D4EB4F) & 0xFFFFFFFFFFFFFFFF
        return h ^ (h >> 29)

    @staticmethod
    def _homes(parents: np.ndarray, tokens: np.ndarray) -> np.ndarray:
        p = parents.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)
        h = p + tokens.astype(np.uint64) * np.uint64(0xC2B2AE3D27D4EB4F)
        return h ^ (h >> np.uint64(29))

    def find(self, parent: int, token: int, n_parent: np.ndarray, n_first: np.ndarray) -> list[int]:
        table, mask = self.table, self.mask
        i = self._home(parent, token) & mask
        out: list[int] = []
        for _ in range(len(table)):  # bounded: the table always has a free bucket
            c = int(table[i])
            if c < 0:
                break
            if n_first[c] == token and n_parent[c] == parent:
                out.append(c)
            i = (i + 1) & mask
        return out

    def add(self, child: int, n_parent: np.ndarray, n_first: np.ndarray) -> None:
        if (self.count + 1) * 5 > len(self.table) * 3:
            self._rehash(len(self.table) * 2, n_parent, n_first)
        table, mask = self.table, self.mask
        i = self._home(int(n_parent[child]), int(n_first[child])) & mask
        for _ in range(len(table)):
            if table[i] < 0:
                table[i] = child
                self.count += 1
                return
            i = (i + 1) & mask
        raise AssertionError("child table full")

    def discard(self, child: int, n_parent: np.ndarray, n_first: np.ndarray) -> None:
        """Remove ``child``, filed under its current parent and first token (backward shift)."""
        table, mask = self.table, self.mask
        i = self._home(int(n_parent[child]), int(n_first[child])) & mask
        for _ in range(len(table)):
            c = int(table[i])
            assert c >= 0, "child not in the child table"
            if c == child:
                break
            i = (i + 1) & mask
        j = i
        for _ in range(len(table)):
            j = (j + 1) & mask
            c = int(table[j])
            if c < 0:
                break
            home = self._home(int(n_parent[c]), int(n_first[c])) & mask
            # Move entry j into the hole at i unless its home lies cyclically in (i, j].
            if (j > i and (home <= i or home > j)) or (j < i and home <= i and home > j):
                table[i] = c
                i = j
        table[i] = -1
        self.count -= 1
        if len(table) > (1 << 10) and self.count * 10 < len(table) * 3 // 2:
            self._rehash(len(table) // 2, n_parent, n_first)

    def _rehash(self, size: int, n_parent: np.ndarray, n_first: np.ndarray) -> None:
        live = self.table[self.table >= 0]
        table = np.full(size, -1, dtype=np.int32)
        _place(table, self._homes(n_parent[live], n_first[live]), live)
        self.table, self.mask = table, size - 1

    def nbytes(self) -> int:
        return self.table.nbytes


def _place(table: np.ndarray, homes: np.ndarray, values: np.ndarray) -> None:
    """Put each of ``values`` into the first free bucket of its linear probe sequence from its
    home hash, all at once (``table``'s size is a power of two with room for them all).

    Ties within the batch go to the first claimant; the others probe on, so every value lands
    exactly where one-by-one insertion would have put it relative to what was there before.
    """
    mask = len(table) - 1
    if len(values) <= SMALL_BATCH:  # one by one: each takes the first free bucket from home
        for home, value in zip(homes.tolist(), values.tolist(), strict=True):
            i = home & mask
            while table[i] >= 0:  # bounded: the table has room for them all
                i = (i + 1) & mask
            table[i] = value
        return
    pos = (homes & np.uint64(mask)).astype(np.int64)
    active = np.arange(len(values))
    for _ in range(len(table)):  # bounded: every round places or advances each value
        if not len(active):
            break
        p = pos[active]
        free = table[p] < 0
        claim_pos, first = np.unique(p[free], return_index=True)
        winners = active[free][first]
        table[claim_pos] = values[winners]
        placed = np.zeros(len(values), dtype=bool)
        placed[winners] = True
        active = active[~placed[active]]
        pos[active] = (pos[active] + 1) & mask


def _buckets(rows: np.ndarray) -> np.ndarray:
    """Bucket hash of ``[n, 16]`` uint8 keys: their first 8 bytes as little-endian uint64."""
    return np.ascontiguousarray(rows[:, :8]).view("<u8").reshape(-1)
