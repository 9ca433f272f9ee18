"""Stopping a child process we started, by PID: SIGTERM, then SIGKILL if it lingers."""

from __future__ import annotations

import subprocess


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
