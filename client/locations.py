"""A client-side cache of where objects live, for reads that overlap the master round trip.

A read needs the master (where is the key, and a grant) and then the node (the bytes): two round
trips in sequence. With a cached :class:`ObjectInfo` from an earlier read, the client sends
``get_locations`` to the master *and* reads the cached replica (shm copy, or a TCP request to the
node) before it waits for the master's answer; latency becomes the longer of the two instead of
their sum.

The cached answer is only a guess. The read is accepted only when the master's fresh answer names
the same object: same size and checksum, with a replica at the same node, segment and offset that
was read, and the bytes read match that checksum. Anything else (overwritten, removed, moved,
node restarted, grant expired) and the read is redone from the fresh answer. So a speculative
read returns exactly what a plain read at the moment of the master's answer would have returned;
on failure the caller's buffer may hold stale bytes before it is refilled or the error returned.
"""

from __future__ import annotations

import threading

from kvstore.types import Location, ObjectInfo

#: Entries kept before the cache starts over (an ObjectInfo is a few hundred bytes).
MAX_ENTRIES = 65536


def same_replica(fresh: ObjectInfo, cached: ObjectInfo, read_from: Location) -> bool:
    """Whether ``fresh`` confirms a read of ``cached`` at ``read_from``."""
    if fresh.size != cached.size or fresh.checksum != cached.checksum:
        return False
    g = read_from.grant
    return any(
        loc.node_id == read_from.node_id
        and loc.grant.segment == g.segment
        and loc.grant.offset == g.offset
        and loc.grant.size == g.size
        for loc in fresh.locations
    )


class LocationCache:
    """key -> last ObjectInfo the master returned. Thread-safe; bounded."""

    def __init__(self, max_entries: int = MAX_ENTRIES) -> None:
        self.max_entries = max_entries
        self._infos: dict[bytes, ObjectInfo] = {}
        self._lock = threading.Lock()

    def get_many(self, keys: list[bytes]) -> list[ObjectInfo | None]:
        with self._lock:
            return [self._infos.get(k) for k in keys]

    def put_many(self, keys: list[bytes], infos: list[object]) -> None:
        """Remember every ObjectInfo in ``infos``; forget keys whose answer was an error."""
        with self._lock:
            if len(self._infos) + len(keys) > self.max_entries:
                self._infos.clear()
            for k, info in zip(keys, infos, strict=True):
                if isinstance(info, ObjectInfo) and info.locations:
                    self._infos[k] = info
                else:
                    self._infos.pop(k, None)

    def forget(self, keys: list[bytes]) -> None:
        with self._lock:
            for k in keys:
                self._infos.pop(k, None)

    def __len__(self) -> int:
        return len(self._infos)
