"""Child processes: stopping one we started, by PID (SIGTERM, then SIGKILL if it lingers), and
making one die with its parent."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import threading
import time


def terminate(proc: subprocess.Popen, timeout: float = 10.0) -> int:
    """Stop ``proc``: SIGTERM, wait up to ``timeout`` seconds, then SIGKILL and wait.

    Returns:
        Its exit status (negative: the signal that ended it).
    """
    if proc.poll() is None:
        proc.terminate()
        try:
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
    return proc.wait(timeout=timeout)


#: ``prctl`` option: the signal this process gets when its parent dies (linux/prctl.h).
PR_SET_PDEATHSIG = 1
#: Seconds a process whose parent died has to stop by itself before it exits hard.
ORPHAN_GRACE_S = 15.0


def die_with_parent(pipe_fd: int | None) -> None:
    """Make this process stop when the process that started it dies, even by SIGKILL.

    Two mechanisms, because each alone has a gap: ``PR_SET_PDEATHSIG`` (Linux) sends us
    SIGTERM when the parent dies, but not if it died before this call; and ``pipe_fd`` is the
    read end of a pipe whose write end only the parent holds, so EOF on it means the parent is
    gone whenever that happened. Either way we get SIGTERM (a clean stop: locks released, files
    closed), then a hard exit if the clean stop takes longer than :data:`ORPHAN_GRACE_S`.

    Args:
        pipe_fd: the read end of the parent's pipe, or None (prctl only).
    """
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    if pipe_fd is None:
        return

    def watch() -> None:
        with contextlib.suppress(OSError):
            while os.read(pipe_fd, 64):
                pass  # the parent never writes; anything read is ignored
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(ORPHAN_GRACE_S)  # not synchronisation: a deadline for the clean stop
        os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()
