"""Zero-copy reads of same-host objects: located objects read in place, in the node's shared
memory, instead of copied into a buffer first.

Why: an engine that copies pool blocks into its own paged KV cache (the vLLM connector: a
transpose per layer into vLLM's block layout) would otherwise move every byte twice, node arena
to a staging buffer, then staging to the cache. Read in place, the bytes move once, from the
arena straight into the cache; for a 2K-token prompt of SmolLM2 that is 46 MB less to copy.

What makes a view safe to read is the read lease of its answer: while the lease (and so its
grant) holds, the master neither frees nor reuses the object's space, so the bytes under the
view cannot change. Hence the three steps:

1. :meth:`InPlaceReads.view` checks an object's bytes against its checksum (xxh3_64, as every
   read does) just before handing them out: the caller copies them right away, while they are
   still in the CPU's cache from the check (one pass over memory, not two). A replica that
   fails is not served (None) and is reported to the master when the reads close, as any
   read reports one (the master drops it and copies a good replica back);
2. the caller copies what it needs out of the views;
3. then asks :meth:`InPlaceReads.intact`: True when every grant still holds *now*, so it held
   for the whole copy; False means a copy may have raced a reuse of the space: the caller treats
   those objects as failed (reads them again, or recomputes).

The caller owns the leases (``Client.batch_locate`` took them): it gives them back with
``Client.release_leases`` after step 3. Only objects with a replica in an arena this process has
mapped (node started with ``--shm``, same host) get a view; the rest get None, to be read the
usual way (``Client.batch_read_located``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from kvstore.client.reads import corrupt_report
from kvstore.client.transport import checksum
from kvstore.types import Location, ObjectInfo


class InPlaceReads:
    """Read-only views of located objects in shared memory (see the module docstring).

    Args:
        infos: the located objects (answers of ``Client.batch_locate``, leases held).
        views_of: the data path's views of locations (``DataPath.views``).
        report_corrupt: tells the master of replicas that failed their checksum (called once,
            at :meth:`close`, with ``report_corrupt`` items of :mod:`kvstore.client.reads`).
        clock_ms: wall-clock milliseconds, the clock grants expire on.

    Use as a context manager: the views are released on exit and must not be kept.
    """

    def __init__(
        self,
        infos: Sequence[ObjectInfo],
        views_of: Callable[[Sequence[Location]], list[memoryview | None]],
        report_corrupt: Callable[[list[list[Any]]], None] | None = None,
        clock_ms: Callable[[], float] = lambda: time.time() * 1000,
    ) -> None:
        self._clock_ms = clock_ms
        self._report = report_corrupt
        self._corrupt: list[list[Any]] = []
        flat = [loc for info in infos for loc in info.locations]
        found = views_of(flat)
        self._picks: list[tuple[ObjectInfo, Location, memoryview] | None] = []
        self._until_ms = float("inf")
        pos = 0
        for info in infos:
            pick = None
            for loc, view in zip(
                info.locations, found[pos : pos + len(info.locations)], strict=True
            ):
                if view is None:
                    continue
                if pick is None and len(view) == info.size:
                    pick = (info, loc, view)
                    self._until_ms = min(self._until_ms, loc.grant.expires_ms)
                else:
                    view.release()
            pos += len(info.locations)
            self._picks.append(pick)

    def __len__(self) -> int:
        return len(self._picks)

    def mapped(self, i: int) -> bool:
        """Whether object ``i`` is in memory this process has mapped (its bytes not checked
        yet): the others are to be read the usual way."""
        return self._picks[i] is not None

    def view(self, i: int) -> memoryview | None:
        """Object ``i``'s bytes in place, checked against its checksum now (copy them right
        away: they are in cache from the check), or None: not mapped here, or corrupt."""
        pick = self._picks[i]
        if pick is None:
            return None
        info, loc, view = pick
        if checksum(view) == info.checksum:
            return view
        self._corrupt.append(corrupt_report(loc, info.checksum))
        view.release()
        self._picks[i] = None
        return None

    def intact(self) -> bool:
        """Whether every view's grant still holds now: called after the copies out of the
        views, True means no byte under them can have changed during those copies."""
        return self._clock_ms() < self._until_ms

    def close(self) -> None:
        """Release the views (a mapping cannot be unmapped while one is held) and report the
        replicas that failed their check (best effort, one master call)."""
        for pick in self._picks:
            if pick is not None:
                pick[2].release()
        self._picks = [None] * len(self._picks)
        corrupt, self._corrupt = self._corrupt, []
        if corrupt and self._report is not None:
            self._report(corrupt)

    def __enter__(self) -> InPlaceReads:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
