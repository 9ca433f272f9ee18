"""Start and stop an embedded cluster (``kvstore up``) as a child process, for the demo and the
benchmarks: one place that knows its command line; its ready record is read with
:func:`kvstore.processes.parse_ready`."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from kvstore import protocol
from kvstore.errors import MasterUnavailableError
from kvstore.processes import parse_ready, terminate


class EmbeddedCluster:
    """``kvstore up`` in a child process; a context manager that stops it by PID.

    Args:
        data_dir: where the node keeps its files.
        dram: the node's DRAM size, e.g. ``"1GiB"``.
        extra: more ``kvstore up`` flags (e.g. ``["--shm"]``).
        env: environment variables to set for it (e.g. ``{"KVSTORE_POLL_US": "0"}``).

    Raises:
        MasterUnavailableError: the cluster exited before printing its ready line.
    """

    def __init__(
        self,
        data_dir: str,
        dram: str,
        extra: list[str] | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "kvstore",
                "--log-level",
                "warning",
                "up",
                "--port",
                "0",
                "--dram",
                dram,
                "--data-dir",
                data_dir,
                *(extra or []),
            ],
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, **(env or {})},
        )
        assert self.proc.stdout is not None
        self.address = ""
        self.data = ""  # the storage node's data address
        self.admin = ""  # the master's admin URL
        # `kvstore up` prints its ready line, or exits, within its own start timeout.
        for line in self.proc.stdout:
            ready = parse_ready(line, "up")
            if ready is not None:
                self.address = ready["control"]
                self.data = ready["data"]
                self.admin = ready["admin"]
                break
        if not self.address:
            self.stop()
            raise MasterUnavailableError("the embedded cluster failed to start")

    def wait_warm(self, timeout: float = 120.0) -> None:
        """Wait until the node's arena is pre-faulted (it warms up in the background after
        start, see kvstore.pages), so that measurements see the store, not its warm-up.

        Raises:
            TimeoutError: not warm within ``timeout`` seconds.
        """
        host, port = self.data.rsplit(":", 1)
        conn = protocol.FramedSocket.connect(host, int(port), timeout=10)
        try:
            deadline = time.monotonic() + timeout
            while not conn.call("stats", {}).get("arenas_warm", True):
                if time.monotonic() > deadline:
                    raise TimeoutError("the embedded node did not warm up in time")
                time.sleep(0.05)  # polling a state, bounded by the deadline
        finally:
            conn.close()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stop(self, timeout: float = 30.0) -> None:
        terminate(self.proc, timeout)

    def __enter__(self) -> EmbeddedCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
