"""Pre-faulting a shared mapping in the background.

A fresh ``mmap`` has no page-table entries: the first access to each 4 KiB page traps into the
kernel. On a storage node's arena that made the first writes to a new node twice as slow as
later ones (16 MiB puts: 8.7 ms, then 4.5 ms), and the same holds for a client's shm mapping of
that arena. :class:`Prefaulter` asks the kernel to fill the page tables of a whole mapping
(``madvise(MADV_POPULATE_WRITE)``, Linux 5.14+, ~0.26 s per GiB here) from a background thread,
chunk by chunk, at the lowest CPU priority, with the GIL released, so the mapping is usable at
once and warm soon after. It changes no byte; a range the kernel cannot populate (a truncated
file) just stops it. ``KVSTORE_PREFAULT=0`` turns it off (measured with
``bench/bench_warmup.py``).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import mmap
import os
import threading

from kvstore.env import Env

log = logging.getLogger(__name__)

MADV_POPULATE_WRITE = 23
CHUNK = 16 << 20


def enabled() -> bool:
    """Whether to pre-fault (``$KVSTORE_PREFAULT``, on unless ``0``)."""
    return Env.read().prefault


class Prefaulter:
    """Populates the page tables of ``mapping`` (``size`` bytes) in a daemon thread.

    Call :meth:`stop` before closing the mapping.
    """

    def __init__(self, mapping: mmap.mmap, size: int, name: str = "prefault") -> None:
        self._mapping = mapping
        self._size = size
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop (after the chunk in progress) and wait for the thread."""
        self._stop.set()
        self._thread.join()

    def done(self) -> bool:
        return not self._thread.is_alive()

    def _run(self) -> None:
        # Lowest CPU priority (Linux: per thread): warming up must not slow the work itself.
        with contextlib.suppress(OSError, AttributeError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        try:
            madvise = ctypes.CDLL(None, use_errno=True).madvise
            madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
            anchor = ctypes.c_char.from_buffer(self._mapping)
            base = ctypes.addressof(anchor)
            del anchor  # the address stays valid until the mapping closes, after stop()
        except (OSError, AttributeError, TypeError, ValueError) as exc:
            log.debug("prefault unavailable: %s", exc)
            return
        # NOTE: a foreign call through ctypes releases the GIL: everything else goes on.
        for start in range(0, self._size, CHUNK):
            if self._stop.is_set():
                return
            if madvise(base + start, min(CHUNK, self._size - start), MADV_POPULATE_WRITE):
                err = ctypes.get_errno()
                if err != errno.EINTR:
                    log.debug("prefault stopped at %d: %s", start, os.strerror(err))
                    return
