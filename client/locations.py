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

Who gives a lease back (see :mod:`kvstore.client.releases`): without lease reads, the read that
asked for an answer, once it is done (the cache keeps the answer only as a guess, and a guess
needs no lease). With lease reads, an answer the cache keeps takes its lease along: the cache
gives it back when the entry ends (a newer answer for the key replaces it, this client's own
put or remove or a failed read forgets it, or the cache starts over when full), so rereads
within the lease stay safe; an answer it does not keep is given back by its read.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable

from kvstore.grants import Grant
from kvstore.types import Location, ObjectInfo

#: Entries kept before the cache starts over (an entry is a few hundred bytes).
MAX_ENTRIES = 65536

#: A cached answer, as put: flat, ``(size, checksum, lease, lease_until)`` then per replica
#: ``node_id, host, port, op, key, segment, offset, size, expires_ms, signature, batch, index``
#: (the grant's fields: see kvstore.grants; a batch grant's wire form is a tuple). One tuple of
#: plain values and not the answer's own records: the garbage collector stops tracking such a
#: tuple the first time it sees it, whereas tens of thousands of kept records (an ObjectInfo,
#: its list, its Locations, their Grants) are traversed by every full collection, a large share
#: of the CPU a key of a client reading distinct keys (``.venv/bin/python bench/bench_small.py
#: --keys 1000 --size 16``). (Flat: a tuple holding tuples made after it is not untracked at
#: once.) Once an answer is used from the cache it is kept as ``(ObjectInfo, lease_until)``
#: instead: a hot key's reread then costs no rebuilding of the records, a share of a leased batch
#: read worth saving (``.venv/bin/python bench/bench_store.py --small``, the lease-read client's
#: batch of 16 x 4 KiB), nor does a newer answer for it (a speculative reread's); only reread
#: keys are kept so.
_Entry = tuple[object, ...]
_HEAD = 4  # size, checksum, lease, lease_until
_REPLICA = 12  # fields of one replica
_USED = 2  # the length of a used entry, (ObjectInfo, lease_until); a flat one is longer


def _entry(info: ObjectInfo, lease_until: float) -> _Entry:
    out: list[object] = [info.size, info.checksum, info.lease, lease_until]
    for loc in info.locations:
        g = loc.grant
        out += (loc.node_id, loc.host, loc.port, g.op, g.key, g.segment, g.offset, g.size)
        out += (g.expires_ms, g.signature, g.batch, g.index)
    return tuple(out)


def _info(e: _Entry) -> ObjectInfo:
    if len(e) == _USED:
        return e[0]  # type: ignore[return-value]
    locations = [
        Location(e[i], e[i + 1], e[i + 2], Grant(*e[i + 3 : i + _REPLICA]))  # type: ignore[arg-type]
        for i in range(_HEAD, len(e), _REPLICA)
    ]
    return ObjectInfo(e[0], e[1], locations, e[2])  # type: ignore[arg-type]


def _lease(e: _Entry) -> int:
    return e[0].lease if len(e) == _USED else e[2]  # type: ignore[attr-defined,return-value]


def _until(e: _Entry) -> float:
    return e[1] if len(e) == _USED else e[3]  # type: ignore[return-value]


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

    Args:
        max_entries: entries kept before the cache starts over.
        give_back: where leases go that this cache owned and no longer needs; None: the cache
            owns no leases (without lease reads: its answers are guesses, their reads give the
            leases back).
    """

    def __init__(
        self,
        max_entries: int = MAX_ENTRIES,
        give_back: Callable[[Iterable[int]], None] | None = None,
    ) -> None:
        self.max_entries = max_entries
        self._give_back = give_back
        self._infos: dict[bytes, _Entry] = {}
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
        out: list[ObjectInfo | None] = []
        used: list[tuple[bytes, _Entry, ObjectInfo]] = []
        for k, e in zip(keys, got, strict=True):
            if e is None or _until(e) <= now:
                out.append(None)
                continue
            info = _info(e)
            out.append(info)
            if len(e) != _USED:
                used.append((k, e, info))
        if used:
            with self._lock:
                for k, e, info in used:
                    if self._infos.get(k) is e:  # not replaced or forgotten meanwhile
                        self._infos[k] = (info, _until(e))
        return out

    def put_many(
        self,
        keys: list[bytes],
        infos: list[object],
        lease_until: float = 0.0,
        generation: int | None = None,
    ) -> list[int]:
        """Remember every ObjectInfo in ``infos``; forget keys whose answer was an error.

        Args:
            lease_until: monotonic time until which the master's read lease on these answers
                holds, as seen from here (0: no lease to rely on).
            generation: :attr:`generation` when the answers were asked for; if a forget came
                since (this client wrote or removed something), the answers are not kept.

        Returns:
            The lease tokens of ``infos`` the cache did not take over: the caller gives them
            back once its read is done.
        """
        owns = self._give_back is not None
        taken: set[int] = set()
        dropped: list[int] = []
        with self._lock:
            if generation is not None and generation != self.generation:
                for k in keys:
                    old = self._infos.pop(k, None)
                    if old is not None:
                        dropped.append(_lease(old))
            else:
                if len(self._infos) + len(keys) > self.max_entries:
                    dropped.extend(map(_lease, self._infos.values()))
                    self._infos.clear()
                for k, info in zip(keys, infos, strict=True):
                    if isinstance(info, ObjectInfo) and info.locations:
                        old = self._infos.get(k)
                        if old is None and len(self._infos) >= self.max_entries:
                            continue  # a batch larger than the bound: used once, not kept
                        # A key used from the cache before is reread: keep its records.
                        hot = old is not None and len(old) == _USED
                        self._infos[k] = (info, lease_until) if hot else _entry(info, lease_until)
                        if owns:
                            taken.add(info.lease)
                    else:
                        old = self._infos.pop(k, None)
                    if old is not None:
                        dropped.append(_lease(old))
        if owns and dropped:
            self._give_back(dropped)  # type: ignore[misc]
        return [
            info.lease
            for info in infos
            if isinstance(info, ObjectInfo) and info.lease and info.lease not in taken
        ]

    def forget(self, keys: list[bytes]) -> None:
        dropped: list[int] = []
        with self._lock:
            self.generation += 1
            for k in keys:
                old = self._infos.pop(k, None)
                if old is not None:
                    dropped.append(_lease(old))
        if self._give_back is not None and dropped:
            self._give_back(dropped)

    def clear(self) -> None:
        """Forget everything (giving owned leases back)."""
        with self._lock:
            self.generation += 1
            dropped = list(map(_lease, self._infos.values()))
            self._infos.clear()
        if self._give_back is not None and dropped:
            self._give_back(dropped)

    def __len__(self) -> int:
        return len(self._infos)
