"""Real vLLM OpenAI servers for the engine tests and the vLLM benchmark.

A server runs in the vLLM virtualenv (``<repo>/.venv-vllm``, or ``$KVSTORE_VLLM_PYTHON``) with
the real model (``~/.cache/kvstore/models/smollm2-135m-instruct`` or ``$KVSTORE_MODEL_DIR``).
One vLLM engine is three processes (API server, engine core, worker): each server gets its own
session, and stopping it signals that whole process group, by the leader's PID.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]
CONNECTOR = {
    "kv_connector": "KVStoreConnector",
    "kv_connector_module_path": "kvstore.client.adapters.vllm",
}
START_TIMEOUT_S = 240.0
REQUEST_TIMEOUT_S = 180.0


def vllm_python() -> Path:
    """The vLLM virtualenv's interpreter (may not exist)."""
    env = os.environ.get("KVSTORE_VLLM_PYTHON")
    return Path(env) if env else REPO_ROOT / ".venv-vllm" / "bin" / "python"


def model_dir() -> Path:
    """The converted SmolLM2-135M-Instruct folder (may not exist)."""
    env = os.environ.get("KVSTORE_MODEL_DIR")
    return (
        Path(env)
        if env
        else Path.home() / ".cache" / "kvstore" / "models" / "smollm2-135m-instruct"
    )


def missing_engine() -> str | None:
    """Why the engine tests cannot run here, or None when they can."""
    py = vllm_python()
    if not py.exists():
        return f"no vLLM virtualenv at {py} (make it, or set KVSTORE_VLLM_PYTHON)"
    if not (model_dir() / "config.json").exists():
        return (
            f"no converted model at {model_dir()} (run `kvstore model fetch smollm2`, or set "
            "KVSTORE_MODEL_DIR)"
        )
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def kv_config(role: str, master: str, **extra: Any) -> dict[str, Any]:
    """A ``--kv-transfer-config`` for the kvstore connector."""
    return {**CONNECTOR, "kv_role": role, "kv_connector_extra_config": {"master": master, **extra}}


class VLLMServer:
    """``python -m vllm.entrypoints.openai.api_server`` on a free port, logging to a file.

    Args:
        log_path: where its stdout and stderr go.
        kv_transfer: the ``--kv-transfer-config`` dict, or None for no connector.
        cpu: the core its compute threads are pinned to (``VLLM_CPU_OMP_THREADS_BIND``).
        block_size: vLLM's ``--block-size``.
        prefix_caching: vLLM's own prefix cache.
        env: more environment variables.
    """

    def __init__(
        self,
        log_path: Path,
        kv_transfer: dict[str, Any] | None = None,
        *,
        cpu: int = 0,
        block_size: int = 32,
        prefix_caching: bool = True,
        max_model_len: int = 4096,
        env: dict[str, str] | None = None,
    ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        args = [
            str(vllm_python()),
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(model_dir()),
            "--served-model-name",
            "smollm2",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--dtype",
            "bfloat16",
            "--block-size",
            str(block_size),
            "--max-model-len",
            str(max_model_len),
            "--enforce-eager",
            "--max-num-seqs",
            "4",
            "--enable-prefix-caching" if prefix_caching else "--no-enable-prefix-caching",
        ]
        if kv_transfer is not None:
            args += ["--kv-transfer-config", json.dumps(kv_transfer)]
        self._log = open(log_path, "ab")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            args,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: stop() signals all three processes
            env={
                **os.environ,
                "VLLM_CPU_KVCACHE_SPACE": "1",
                "VLLM_CPU_OMP_THREADS_BIND": str(cpu),
                "VLLM_LOGGING_LEVEL": "INFO",
                "TOKENIZERS_PARALLELISM": "false",
                "HF_HUB_OFFLINE": "1",
                "TRANSFORMERS_OFFLINE": "1",
                **(env or {}),
            },
        )

    def wait_ready(self, timeout: float = START_TIMEOUT_S) -> VLLMServer:
        """Poll ``/health`` until it answers (bounded).

        Raises:
            RuntimeError: the server exited, or was not up within ``timeout``.
        """
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return self
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.25)
        raise RuntimeError(f"vLLM not up in {timeout}s:\n{self.log_tail()}")

    def log_tail(self, n: int = 60) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def post(self, path: str, body: dict[str, Any], timeout: float = REQUEST_TIMEOUT_S) -> Any:
        req = urllib.request.Request(
            self.url + path,
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read())

    def complete(self, prompt: list[int], max_tokens: int = 16) -> list[int]:
        """Greedy completion of a token-id prompt; returns the generated token ids."""
        out = self.post(
            "/v1/completions",
            {
                "model": "smollm2",
                "prompt": prompt,
                "max_tokens": max_tokens,
                "temperature": 0,
                "return_token_ids": True,
                "ignore_eos": True,
            },
        )
        return list(out["choices"][0]["token_ids"])

    def ttft(self, prompt: list[int]) -> float:
        """Seconds to the first token of a one-token completion (the whole prefill)."""
        t0 = time.perf_counter()
        self.complete(prompt, max_tokens=1)
        return time.perf_counter() - t0

    def tokenize(self, text: str) -> list[int]:
        return list(self.post("/tokenize", {"model": "smollm2", "prompt": text})["tokens"])

    def metrics(self) -> dict[str, float]:
        """``vllm:kvstore_*`` counters from ``/metrics`` (summed over labels)."""
        with urllib.request.urlopen(self.url + "/metrics", timeout=10) as r:
            text = r.read().decode()
        out: dict[str, float] = {}
        for m in re.finditer(
            r"^(vllm:[a-z_]+?)(?:_total)?(?:\{[^}]*\})? ([0-9.e+-]+)$", text, re.M
        ):
            out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(2))
        return out

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM the server's process group, then SIGKILL what lingers (by the leader's PID)."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=timeout)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # the engine core and worker too
        self.proc.wait(timeout=10)
        self._log.close()
