"""One vLLM OpenAI-compatible server as a child process, for the demo, the proxy's tests and the
benchmarks: the command line that works on the CPU (see ENGINES.md), readiness by polling
``/health``, and a stop that ends the whole process group (one engine is three processes).

Nothing here imports vLLM: the server runs in the interpreter given (``.venv-vllm``'s python by
default when this one has no vLLM).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import IO, Any

from kvstore.errors import InternalError, KVTimeoutError

START_TIMEOUT_S = 600.0  # start-up is ~20-35 s alone, minutes on a loaded 2-core machine


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago (the server binds it right after)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def kv_transfer_config(master: str, role: str, **extra: Any) -> str:
    """The ``--kv-transfer-config`` JSON that loads kvstore's connector.

    Args:
        master: the pool's control address (``HOST:PORT`` or ``etcd://...``).
        role: ``kv_producer``, ``kv_consumer`` or ``kv_both``.
        extra: more ``kv_connector_extra_config`` fields.
    """
    return json.dumps(
        {
            "kv_connector": "KVStoreConnector",
            "kv_connector_module_path": "kvstore.client.adapters.vllm",
            "kv_role": role,
            "kv_connector_extra_config": {"master": master, **extra},
        }
    )


def engine_python() -> str:
    """The interpreter that has vLLM: this one if it does, else the repo's ``.venv-vllm``."""
    import importlib.util

    if importlib.util.find_spec("vllm") is not None:
        return sys.executable
    repo = Path(__file__).resolve().parents[2]
    return str(repo / ".venv-vllm" / "bin" / "python")


class VLLMServer:
    """``python -m vllm.entrypoints.openai.api_server`` in its own session (process group).

    Args:
        model: the model folder.
        name: a label for logs and messages (``prefill``, ``decode``, ``reference``).
        log_path: where the server's stdout and stderr go.
        kv_config: a ``--kv-transfer-config`` JSON, or None for a plain server.
        prefix_caching: vLLM's own prefix cache (off makes every prompt computed or loaded).
        cpu_core: the core to pin its threads to (``VLLM_CPU_OMP_THREADS_BIND``).
        python: the interpreter (default :func:`engine_python`).
        block_size: vLLM's block size (a multiple of 32 on the CPU).
        max_model_len: the longest prompt plus answer.
        env: more environment variables.
        port: the port (default: a free one).
        extra_args: more ``api_server`` arguments (e.g. ``["--max-num-seqs", "4"]``).
        host: the address it listens on (and is reached at).
        launcher: a command the server's is run under (e.g. ``ip netns exec NS``, another
            host of the test bed: ``kvstore.cli.testbed.Testbed.command``).
        reach: the address clients reach it at (default ``host``; e.g. a test bed console).
    """

    def __init__(
        self,
        model: str | os.PathLike[str],
        name: str,
        log_path: str | os.PathLike[str],
        *,
        kv_config: str | None = None,
        prefix_caching: bool = True,
        cpu_core: int | None = None,
        python: str | None = None,
        block_size: int = 32,
        max_model_len: int = 4096,
        env: dict[str, str] | None = None,
        port: int | None = None,
        extra_args: list[str] | None = None,
        host: str = "127.0.0.1",
        launcher: list[str] | None = None,
        reach: str | None = None,
    ) -> None:
        self.name = name
        self.port = port or free_port()
        self.url = f"http://{reach or host}:{self.port}"
        self.log_path = Path(log_path)
        cmd = [
            python or engine_python(),
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(model),
            "--served-model-name",
            "smollm2",
            "--host",
            host,
            "--port",
            str(self.port),
            "--dtype",
            "bfloat16",
            "--block-size",
            str(block_size),
            "--max-model-len",
            str(max_model_len),
            "--enforce-eager",
            "--enable-prefix-caching" if prefix_caching else "--no-enable-prefix-caching",
        ]
        cmd += extra_args or []
        if kv_config is not None:
            cmd += ["--kv-transfer-config", kv_config]
        child_env = {
            **os.environ,
            "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB; the default (92% of RAM) refuses to start
            "VLLM_CPU_OMP_THREADS_BIND": "auto" if cpu_core is None else str(cpu_core),
            "TQDM_DISABLE": "1",
            "HF_HUB_OFFLINE": "1",  # the model is a local folder: never a hub
            "TRANSFORMERS_OFFLINE": "1",
            **(env or {}),
        }
        # Appended: a server restarted on the same log keeps its earlier life's lines.
        self._log: IO[bytes] = open(self.log_path, "ab")  # noqa: SIM115 (closed in stop)
        self.proc = subprocess.Popen(
            [*(launcher or []), *cmd],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=child_env,
            start_new_session=True,  # its own group: we stop all three processes at once
        )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log_tail(self, num_lines: int = 20) -> str:
        """The last lines of the server's log (for error messages)."""
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-num_lines:])

    def wait_ready(self, timeout: float = START_TIMEOUT_S) -> None:
        """Poll ``/health`` until it answers 200.

        Raises:
            InternalError: the server exited first (the message has its log's tail).
            KVTimeoutError: not ready within ``timeout`` seconds.
        """
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise InternalError(
                    f"vLLM {self.name} exited with {self.proc.returncode} before it was ready "
                    f"(log {self.log_path}):\n{self.log_tail()}"
                )
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=5) as resp:
                    if resp.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > deadline:
                raise KVTimeoutError(
                    f"vLLM {self.name} not ready after {timeout:.0f} s (log {self.log_path})"
                )
            time.sleep(0.5)  # polling a state, bounded by the deadline

    def signal_group(self, sig: int) -> None:
        """Send ``sig`` to the server's process group (no-op once it has been reaped)."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, sig)

    def stop(self, timeout: float = 20.0) -> None:
        """SIGTERM to the group, SIGKILL to the group if it lingers; reap; close the log."""
        self.signal_group(signal.SIGTERM)
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.signal_group(signal.SIGKILL)
            self.proc.wait(timeout=timeout)
        # The engine's own children share the group; make sure none outlives its parent.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self._log.close()

    def __enter__(self) -> VLLMServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
