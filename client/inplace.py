"""Zero-copy reads of same-host objects: located objects read in place, in the node's shared
memory, instead of copied into a buffer first.

Why: an engine that copies pool blocks into its own paged KV cache (the vLLM connector: a
transpose per layer into vLLM's block layout) would otherwise move every byte twice, node arena
to a staging buffer, then staging to the cache. Read in place, the bytes move once, from the
arena straight into the cache; for a 2K-token prompt of SmolLM2 that is 46 MB less to copy.

What makes a view safe to read is the read lease of its answer: while the lease (and so its
grant) holds, the master neither frees nor reuses the object's space, so the bytes under the
view cannot change. Hence the three steps:

1. each view is checked against the object's checksum when it is made (xxh3_64, as every read
   is): a replica that fails it is not served in place; the usual read of that object finds the
   same fault, reports it to the master and falls back to another replica;
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

from kvstore.client.transport import checksum
from kvstore.types import Location, ObjectInfo


class InPlaceReads:
    """Read-only views of located objects in shared memory (see the module docstring).

    Args:
        infos: the located objects (answers of ``Client.batch_locate``, leases held).
        views_of: the data path's views of locations (``DataPath.views``).
        clock_ms: wall-clock milliseconds, the clock grants expire on.

    Use as a context manager: the views are released on exit and must not be kept.
    """

    def __init__(
        self,
        infos: Sequence[ObjectInfo],
        views_of: Callable[[Sequence[Location]], list[memoryview | None]],
        clock_ms: Callable[[], float] = lambda: time.time() * 1000,
    ) -> None:
        self._clock_ms = clock_ms
        flat = [loc for info in infos for loc in info.locations]
        found = views_of(flat)
        #: Per object: a read-only view of its bytes, or None (read it the usual way).
        self.views: list[memoryview | None] = []
        self._until_ms = float("inf")
        pos = 0
        for info in infos:
            chosen: memoryview | None = None
            for loc, view in zip(
                info.locations, found[pos : pos + len(info.locations)], strict=True
            ):
                if view is None:
                    continue
                if chosen is None and len(view) == info.size and checksum(view) == info.checksum:
                    chosen = view
                    self._until_ms = min(self._until_ms, loc.grant.expires_ms)
                else:
                    view.release()
            pos += len(info.locations)
            self.views.append(chosen)

    def intact(self) -> bool:
        """Whether every view's grant still holds now: called after the copies out of the
        views, True means no byte under them can have changed during those copies."""
        return self._clock_ms() < self._until_ms

    def close(self) -> None:
        """Release the views (a mapping cannot be unmapped while one is held)."""
        for view in self.views:
            if view is not None:
                view.release()
        self.views = [None] * len(self.views)

    def __enter__(self) -> InPlaceReads:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
