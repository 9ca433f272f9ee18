"""The DRAM tier: one shared-memory file, mapped once, addressed by offset.

:class:`ShmArena` owns the file and its mapping (creation, locking, pre-faulting, removal);
:class:`DramTier` serves it through the tier interface like NVMe and HBM, and is the one tier
whose bytes a write can land in place (:meth:`DramTier.in_place`).

The file lives in ``/dev/shm`` (tmpfs) with mode 0600, so only the node's user can map it
(same-host clients of that user may map it read/write for the shm transport).

A node holds an exclusive ``flock`` on its arena file for as long as it lives. A node killed with
SIGKILL cannot remove its file, and tmpfs keeps it in memory forever; the kernel does drop the
lock, though, so the next node to start on the host removes every arena file nobody holds
(:func:`reclaim_stale_arenas`).

The arena is pre-faulted in the background after start (:mod:`kvstore.pages`): without it the
first writes to a new node pay a page fault for every page they touch and run slower than later
ones (``.venv/bin/python bench/bench_warmup.py``).
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import mmap
import os
import time
from pathlib import Path

from kvstore import pages
from kvstore.errors import InvalidRequestError, KVStoreError, NoSpaceError, OutOfRangeError
from kvstore.node.tiers import StoredObject, Tier
from kvstore.pages import Prefaulter
from kvstore.types import TIER_DRAM

log = logging.getLogger(__name__)

SHM_DIR = Path("/dev/shm")
#: Arena files of nodes that lock them (older ones, named ``*.dram``, are never touched).
ARENA_GLOB = "kvstore-*.arena"
CREATING_GLOB = ARENA_GLOB + ".*.creating"
#: A file still being created (locked right after it appears) is left alone this long.
CREATING_GRACE_S = 60.0


def default_arena_path(node_id: str, data_dir: Path) -> Path:
    base = SHM_DIR if SHM_DIR.is_dir() and os.access(SHM_DIR, os.W_OK) else data_dir
    return base / f"kvstore-{node_id}.arena"


class ShmArena:
    """A fixed-size byte arena backed by a shared-memory file.

    Args:
        path: the file to create (replaced if present and no live node holds it).
        size: bytes; must be > 0.
        prefault: map every page in the background (see the module docstring); None:
            unless ``KVSTORE_PREFAULT=0``.

    Raises:
        InvalidRequestError: a non-positive size, or a live node holds ``path`` (two nodes
            with one node id, i.e. one data directory).
        NoSpaceError: the file system cannot hold ``size`` bytes.
    """

    def __init__(self, path: Path, size: int, prefault: bool | None = None) -> None:
        if size <= 0:
            raise InvalidRequestError(f"arena size must be > 0, got {size}")
        self.path = path
        self.size = size
        _remove_unless_held(path)
        # Created under another name, locked, then renamed: a file matching ARENA_GLOB is
        # always locked while its node lives (the lock follows the open file, not the name).
        creating = path.with_name(f"{path.name}.{os.getpid()}.creating")
        creating.unlink(missing_ok=True)
        fd = os.open(creating, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            try:
                os.posix_fallocate(fd, 0, size)
            except OSError as exc:
                raise NoSpaceError(
                    f"cannot reserve {size} bytes at {path}: {exc.strerror}"
                ) from None
            self._mmap = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            os.rename(creating, path)
        except BaseException:
            os.close(fd)
            creating.unlink(missing_ok=True)
            raise
        self._lock_fd = fd  # held (with its lock) until close
        self.view = memoryview(self._mmap)
        if prefault is None:
            prefault = pages.enabled()
        self._prefault = Prefaulter(self._mmap, size, "arena-prefault") if prefault else None

    def warm(self) -> bool:
        """Whether the background pre-fault is over (or was never asked for)."""
        return self._prefault is None or self._prefault.done()

    def close(self, unlink: bool = True) -> None:
        if self._prefault is not None:
            self._prefault.stop()
        self.view.release()
        with contextlib.suppress(BufferError):  # a thread still holds a slice: unmapped at exit
            self._mmap.close()
        if unlink:
            self.path.unlink(missing_ok=True)
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1


class DramTier(Tier):
    """The DRAM arena as a tier: reads are views of the arena, writes copy into it.

    Args:
        segment: the segment's name (the master addresses it by this).
        arena: the mapped arena (owned by the caller, which closes it).
    """

    tier = TIER_DRAM

    def __init__(self, segment: str, arena: ShmArena) -> None:
        self.segment = segment
        self.arena = arena
        self.capacity = arena.size

    def in_place(self, offset: int, size: int) -> memoryview:
        # Every read of a DRAM object comes through here: one call, the check inline.
        arena = self.arena
        if offset < 0 or size < 0 or offset + size > arena.size:
            raise OutOfRangeError("range lies outside the segment")
        return arena.view[offset : offset + size]

    def read(self, offset: int, size: int) -> memoryview:
        return self.in_place(offset, size)

    def write(self, items: list[tuple[StoredObject, memoryview]]) -> list[KVStoreError | None]:
        results: list[KVStoreError | None] = []
        for obj, data in items:
            if obj.offset < 0 or obj.offset + len(data) > self.arena.size:
                results.append(OutOfRangeError("range lies outside the segment"))
                continue
            self.arena.view[obj.offset : obj.offset + len(data)] = data
            results.append(None)
        return results


def _remove_unless_held(path: Path) -> None:
    """Remove ``path`` (an earlier run's arena) unless a live node holds its lock.

    Raises:
        InvalidRequestError: a live node holds it.
    """
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
    except FileNotFoundError:
        return
    except OSError:
        path.unlink(missing_ok=True)  # not ours to open: replaced as before
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            raise InvalidRequestError(
                f"a live node holds {path}: is another node running with this data directory?"
            ) from None
        path.unlink(missing_ok=True)
    finally:
        os.close(fd)


def reclaim_stale_arenas(directory: Path = SHM_DIR) -> list[Path]:
    """Remove the arena files in ``directory`` that no live node holds.

    A file is stale when its exclusive lock can be taken (the node that held it is gone). Only
    this user's files of the locking scheme (``ARENA_GLOB``) are looked at, and files still
    being created are left alone for a while.

    Returns:
        The files removed.
    """
    removed: list[Path] = []
    now = time.time()
    uid = os.getuid()
    for path in [*directory.glob(ARENA_GLOB), *directory.glob(CREATING_GLOB)]:
        try:
            st = path.stat()
            if st.st_uid != uid:
                continue  # another user's node (root can open it, but it is not ours)
            if path.name.endswith(".creating") and now - st.st_mtime < CREATING_GRACE_S:
                continue
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
        except OSError:
            continue  # gone already, or not openable
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                continue  # a live node holds it
            # Still the same file under that name (not replaced since we opened it)?
            with contextlib.suppress(OSError):
                if os.stat(path).st_ino == os.fstat(fd).st_ino:
                    path.unlink()
                    removed.append(path)
        finally:
            os.close(fd)
    if removed:
        log.info("removed %d arena file(s) left by nodes that died", len(removed))
    return removed
