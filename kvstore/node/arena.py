"""The DRAM tier: one shared-memory file, mapped once, addressed by offset.

The file lives in ``/dev/shm`` (tmpfs) with mode 0600, so only the node's user can map it
(same-host clients of that user may map it read/write for the shm transport).
"""

from __future__ import annotations

import contextlib
import mmap
import os
from pathlib import Path

from kvstore.errors import InvalidRequestError, NoSpaceError

SHM_DIR = Path("/dev/shm")


def default_arena_path(node_id: str, data_dir: Path) -> Path:
    base = SHM_DIR if SHM_DIR.is_dir() and os.access(SHM_DIR, os.W_OK) else data_dir
    return base / f"kvstore-{node_id}.dram"


class ShmArena:
    """A fixed-size byte arena backed by a shared-memory file.

    Args:
        path: the file to create (replaced if present).
        size: bytes; must be > 0.

    Raises:
        InvalidRequestError: a non-positive size.
        NoSpaceError: the file system cannot hold ``size`` bytes.
    """

    def __init__(self, path: Path, size: int) -> None:
        if size <= 0:
            raise InvalidRequestError(f"arena size must be > 0, got {size}")
        self.path = path
        self.size = size
        path.unlink(missing_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            try:
                os.posix_fallocate(fd, 0, size)
            except OSError as exc:
                path.unlink(missing_ok=True)
                raise NoSpaceError(
                    f"cannot reserve {size} bytes at {path}: {exc.strerror}"
                ) from None
            self._mmap = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        self.view = memoryview(self._mmap)

    def close(self, unlink: bool = True) -> None:
        self.view.release()
        with contextlib.suppress(BufferError):  # a thread still holds a slice: unmapped at exit
            self._mmap.close()
        if unlink:
            self.path.unlink(missing_ok=True)
