"""Child processes: the ``ready`` record a daemon prints when it serves, stopping one we
started, by PID (SIGTERM, then SIGKILL if it lingers), and making one die with its parent.

Why a ready *record*: whoever starts a daemon (``kvstore up`` its node, the demo and the
benchmarks ``kvstore up``, the tests every daemon) waits for one stdout line that says it
serves and where. Each reader used to cut that line with its own regex; now the line carries
one JSON object after a fixed human prefix, written by :func:`ready_line` and read by
:func:`parse_ready` only::

    kvstore master ready: {"role": "master", "pid": 4242, "control": "127.0.0.1:7700", ...}

The prefixes (:data:`READY_PREFIXES`) are the old lines' words, so a person (or a wait on the
prefix) still reads them as before.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import subprocess
import threading
import time
from typing import Any

#: The human prefix of each role's ready line.
READY_PREFIXES = {
    "master": "kvstore master ready:",
    "node": "kvstore node ready:",
    "up": "kvstore up: ready",
    "router": "kvstore router: ready",
    "proxy": "kvstore proxy: ready",
    "engine": "kvstore engine: registered",
}


def ready_line(role: str, **fields: Any) -> str:
    """The line a daemon prints once it serves: its role's prefix, then one JSON object.

    Args:
        role: a key of :data:`READY_PREFIXES`.
        fields: what a starter needs (addresses, ids, sizes); JSON values only. ``role`` and
            ``pid`` (this process) are added.

    Returns:
        One line, without the newline.
    """
    record = {"role": role, "pid": os.getpid(), **fields}
    return f"{READY_PREFIXES[role]} {json.dumps(record, separators=(', ', ': '))}"


def parse_ready(line: str, role: str | None = None) -> dict[str, Any] | None:
    """The record of a ready line (:func:`ready_line`), or None when ``line`` is not one.

    Args:
        line: one line of a daemon's stdout (a trailing newline is fine).
        role: accept only this role's ready line (None: any role's).

    Returns:
        The JSON object: at least ``role`` and ``pid``, then the role's own fields.
    """
    line = line.strip()
    for name, prefix in READY_PREFIXES.items():
        if (role is None or role == name) and line.startswith(prefix + " {"):
            try:
                record = json.loads(line[len(prefix) + 1 :])
            except ValueError:
                return None
            if isinstance(record, dict) and record.get("role") == name:
                return record
    return None


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
