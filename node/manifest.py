"""The node's manifest: every object this node holds whole, by where it lies.

The manifest is what the node can claim to a master that does not know it (a new leader after
a failover, a restart with durable tiers; see ``kvstore.stored_object``). An object enters it only
once all its bytes arrived (a whole-object write verb, an shm/RDMA commit, a task's copy), and
leaves it when the master frees it (the heartbeat's ``forget``) or a registration starts over.

The manifest also finds a record by its key (the newest version a place holds): what a one-hop
read asks for (``read_keys``, :mod:`kvstore.node.verbs`; the safety rule is in
:mod:`kvstore.placement`).

It is its own module because three writers share it: the data server's verbs (one thread per
connection), the tasks the master hands out, and the agent that registers the node; each goes
through :class:`Manifest`'s lock and nothing else. The records are the core
:class:`~kvstore.stored_object.StoredObject`, the same the tiers store and the master admits; the
manifest keeps each as a plain tuple of its fields, which the garbage collector stops tracking
at its first pass (a tuple of strings, bytes and ints cannot be part of a cycle). Kept as
objects, a node's records were walked by every full collection, which held the data threads
longer the more the node stored, against nothing once they are tuples (``.venv/bin/python
bench/bench_node_gc.py`` prints the node's collections under a steady write load).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import Any

from kvstore.stored_object import StoredObject


class Manifest:
    """What this node holds: ``(segment, offset)`` → its :class:`StoredObject`.

    Written by data threads, read by the agent; thread-safe. One record per place: a newer
    write to the same place replaces the older record.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        #: (segment, offset) -> (segment, offset, key, size, checksum, stamp): a
        #: StoredObject's fields (see the module docstring).
        self._entries: dict[tuple[str, int], tuple[str, int, bytes, int, int, int]] = {}
        #: key -> the place of its newest record (by stamp); kept with ``_entries``.
        self._by_key: dict[bytes, tuple[str, int]] = {}

    def record(self, obj: StoredObject) -> None:
        self.record_many((obj,))

    def record_many(self, objs: Iterable[StoredObject]) -> None:
        """Record every object under one lock."""
        rows = [(o.segment, o.offset, o.key, o.size, o.checksum, o.stamp) for o in objs]
        with self._lock:
            entries, by_key = self._entries, self._by_key
            for row in rows:
                pos = row[:2]
                old = entries.get(pos)
                if old is not None and by_key.get(old[2]) == pos:
                    del by_key[old[2]]
                entries[pos] = row
                held = by_key.get(row[2])
                if held is None or held == pos or entries[held][5] <= row[5]:
                    by_key[row[2]] = pos

    def forget(self, items: list[tuple[Any, ...]]) -> None:
        """Drop ``(segment, offset[, stamp])`` entries; with a stamp, only that version."""
        with self._lock:
            for item in items:
                pos = (item[0], item[1])
                entry = self._entries.get(pos)
                if entry is None:
                    continue
                if len(item) > 2 and item[2] and entry[5] != item[2]:
                    continue  # the extent was reused by a newer write since
                del self._entries[pos]
                if self._by_key.get(entry[2]) == pos:
                    del self._by_key[entry[2]]

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._by_key.clear()

    def clear_volatile(self, durable_segments: set[str]) -> None:
        """Forget every entry except those of tiers that survive a restart (NVMe)."""
        with self._lock:
            self._entries = {p: e for p, e in self._entries.items() if p[0] in durable_segments}
            self._by_key = {k: p for k, p in self._by_key.items() if p[0] in durable_segments}

    def find(self, key: bytes) -> StoredObject | None:
        """The newest record of ``key`` this node holds whole, or None."""
        with self._lock:
            pos = self._by_key.get(key)
            row = self._entries[pos] if pos is not None else None
        return StoredObject(*row) if row is not None else None

    def objects(self) -> list[StoredObject]:
        """Every record, as of now."""
        with self._lock:
            rows = list(self._entries.values())
        return [StoredObject(*row) for row in rows]

    def snapshot(self) -> list[list[Any]]:
        """Every record in its wire form (the ``manifest`` verb's answer)."""
        with self._lock:
            rows = list(self._entries.values())
        return [list(row) for row in rows]

    def __len__(self) -> int:
        return len(self._entries)
