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

With lease reads (``Client.connect(..., lease_reads=True)``) a cached answer is also used *without*
asking the master, while the read lease the master took for it still holds: until then the master
neither evicts the object nor reuses its space (an overwrite or remove frees the old space only
after the lease ends), so the bytes at the cached location are exactly the object the master
named, and their checksum is still checked. The price is staleness: another client's overwrite or
remove is seen up to one lease (``lease_s``, 5 s by default) late. Content-addressed keys (KV
blocks: the same key always holds the same bytes) never see the difference.
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
    """key -> last ObjectInfo the master returned, and until when its read lease holds.

    Thread-safe; bounded.
    """

    def __init__(self, max_entries: int = MAX_ENTRIES) -> None:
        self.max_entries = max_entries
        self._infos: dict[bytes, tuple[ObjectInfo, float]] = {}
        self._lock = threading.Lock()
        # Bumped by every forget: an answer asked for before a forget may predate the write
        # that caused it, so it is not remembered (see put_many).
        self.generation = 0

    def get_many(self, keys: list[bytes]) -> list[ObjectInfo | None]:
        """The cached answers (leased or not), None where there is none."""
        return self.leased_many(keys, float("-inf"))

    def leased_many(self, keys: list[bytes], now: float) -> list[ObjectInfo | None]:
        """The cached answers whose lease holds at ``now`` (monotonic), None elsewhere."""
        with self._lock:
            got = [self._infos.get(k) for k in keys]
        return [g[0] if g is not None and g[1] > now else None for g in got]

    def put_many(
        self,
        keys: list[bytes],
        infos: list[object],
        lease_until: float = 0.0,
        generation: int | None = None,
    ) -> None:
        """Remember every ObjectInfo in ``infos``; forget keys whose answer was an error.

        Args:
            lease_until: monotonic time until which the master's read lease on these answers
                holds, as seen from here (0: no lease to rely on).
            generation: :attr:`generation` when the answers were asked for; if a forget came
                since (this client wrote or removed something), the answers are not kept.
        """
        with self._lock:
            if generation is not None and generation != self.generation:
                for k in keys:
                    self._infos.pop(k, None)
                return
            if len(self._infos) + len(keys) > self.max_entries:
                self._infos.clear()
            for k, info in zip(keys, infos, strict=True):
                if isinstance(info, ObjectInfo) and info.locations:
                    self._infos[k] = (info, lease_until)
                else:
                    self._infos.pop(k, None)

    def forget(self, keys: list[bytes]) -> None:
        with self._lock:
            self.generation += 1
            for k in keys:
                self._infos.pop(k, None)

    def __len__(self) -> int:
        return len(self._infos)
