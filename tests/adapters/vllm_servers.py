"""Real vLLM OpenAI servers for the engine tests and the vLLM benchmark.

A server runs in the vLLM virtualenv (``<repo>/.venv-vllm``, or ``$KVSTORE_VLLM_PYTHON``) with
the real model (``~/.cache/kvstore/models/smollm2-135m-instruct`` or ``$KVSTORE_MODEL_DIR``).
One vLLM engine is three processes (API server, engine core, worker): each server gets its own
session, and stopping it signals that whole process group, by the leader's PID.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from kvstore.demo import realmodel, vllm_server
from kvstore.errors import KVStoreError

REPO_ROOT = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 240.0
REQUEST_TIMEOUT_S = 180.0
#: Top tokens per position compared at the first difference of two greedy completions.
TOP_K = 5


def vllm_python() -> Path:
    """The vLLM virtualenv's interpreter (may not exist)."""
    env = os.environ.get("KVSTORE_VLLM_PYTHON")
    return Path(env) if env else REPO_ROOT / ".venv-vllm" / "bin" / "python"


def model_dir() -> Path:
    """The converted SmolLM2-135M-Instruct folder (may not exist; ``$KVSTORE_MODEL_DIR``)."""
    return realmodel.model_dir("smollm2")


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


def kv_config(role: str, master: str, **extra: Any) -> dict[str, Any]:
    """A ``--kv-transfer-config`` for the kvstore connector (as a dict)."""
    return json.loads(vllm_server.kv_transfer_config(master, role, **extra))


def assert_greedy_close(got: list[tuple[int, set[int]]], want: list[tuple[int, set[int]]]) -> None:
    """Two greedy completions of one prompt agree, up to a near tie: equal tokens, or, at the
    first position where they part, each token among the other's top ``TOP_K`` (after that
    their contexts differ, so nothing more is compared). vLLM's own tests compare so: in bf16
    the last bits of the logits depend on how a prompt was split between cached (or loaded)
    and computed tokens, and on the host's kernels, so a near tie may go either way. Wrong KV
    parts at once, with a token far down the other's list."""
    assert len(got) == len(want), (got, want)
    for i, ((g, g_top), (w, w_top)) in enumerate(zip(got, want, strict=True)):
        if g != w:
            assert g in w_top and w in g_top, f"token {i}: {g} vs {w} (tops {g_top} / {w_top})"
            return


class VLLMServer(vllm_server.VLLMServer):
    """The product's server (:class:`kvstore.demo.vllm_server.VLLMServer`) with the
    real model and the vLLM venv, plus the requests the tests and the benchmark make.

    Args:
        log_path: where its stdout and stderr go.
        kv_transfer: the ``--kv-transfer-config`` dict, or None for no connector.
        cpu: the core its compute threads are pinned to (``VLLM_CPU_OMP_THREADS_BIND``).
        block_size: vLLM's ``--block-size``.
        prefix_caching: vLLM's own prefix cache.
        env: more environment variables.
        extra_args: more ``vllm serve`` flags.
        port: its port (default: a free one; give it when the URL must be known beforehand,
            e.g. to advertise it in the connector's config).
        host: the address it listens on and is reached at.
        launcher: the command it runs under (another host of the test bed).
        reach: the address it is reached at (default ``host``).
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
        extra_args: list[str] | None = None,
        port: int | None = None,
        host: str = "127.0.0.1",
        launcher: list[str] | None = None,
        reach: str | None = None,
    ) -> None:
        super().__init__(
            model_dir(),
            log_path.stem,
            log_path,
            kv_config=None if kv_transfer is None else json.dumps(kv_transfer),
            prefix_caching=prefix_caching,
            cpu_core=cpu,
            python=str(vllm_python()),
            block_size=block_size,
            max_model_len=max_model_len,
            env={"VLLM_LOGGING_LEVEL": "INFO", "TOKENIZERS_PARALLELISM": "false", **(env or {})},
            extra_args=["--max-num-seqs", "4", *(extra_args or [])],
            port=port,
            host=host,
            launcher=launcher,
            reach=reach,
        )

    def wait_ready(self, timeout: float = START_TIMEOUT_S) -> VLLMServer:  # type: ignore[override]
        """Poll ``/health`` until it answers (bounded).

        Raises:
            RuntimeError: the server exited, or was not up within ``timeout``.
        """
        try:
            super().wait_ready(timeout)
        except KVStoreError as err:
            raise RuntimeError(f"{err.message}\n{self.log_tail(60)}") from None
        return self

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

    def _greedy(self, prompt: list[int], max_tokens: int, **extra: Any) -> dict[str, Any]:
        """The first choice of a greedy completion of a token-id prompt (``extra``: more
        request fields)."""
        body = {
            "model": "smollm2",
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "return_token_ids": True,
            "ignore_eos": True,
            **extra,
        }
        return self.post("/v1/completions", body)["choices"][0]

    def complete(self, prompt: list[int], max_tokens: int = 16, **extra: Any) -> list[int]:
        """Greedy completion of a token-id prompt (``extra``: more request fields, e.g.
        ``cache_salt``); returns the generated token ids."""
        return list(self._greedy(prompt, max_tokens, **extra)["token_ids"])

    def complete_top(
        self, prompt: list[int], max_tokens: int = 16, k: int = TOP_K, **extra: Any
    ) -> list[tuple[int, set[int]]]:
        """:meth:`complete`, with the ``k`` most likely token ids at each position."""
        # (top tokens named "token_id:N")
        choice = self._greedy(
            prompt, max_tokens, logprobs=k, return_tokens_as_token_ids=True, **extra
        )
        tops = [
            {int(t.rpartition(":")[2]) for t in top} for top in choice["logprobs"]["top_logprobs"]
        ]
        return list(zip(choice["token_ids"], tops, strict=True))

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


def kvstore_metric(server: VLLMServer, name: str) -> float:
    """The connector's counter ``vllm:kvstore_NAME`` on ``server`` (0 before any)."""
    return server.metrics().get(f"vllm:kvstore_{name}", 0.0)


class PoolServers:
    """A pool (``cluster``) and the vLLM servers a test module starts against it (``servers``,
    set by the subclass once every one is started)."""

    cluster: Any
    servers: tuple[VLLMServer, ...] = ()

    def close(self) -> None:
        for s in self.servers:
            s.stop()
        self.cluster.stop()

    def serve(self) -> Iterator[Any]:
        """A module fixture's body: wait until every server is ready, yield, then stop them."""
        try:
            for s in self.servers:
                s.wait_ready()
            yield self
        finally:
            self.close()


class RouterProcess:
    """``kvstore router`` as a child process (its own session) in front of real servers,
    stopped by its PID.

    Args:
        log_path: where its output goes.
        master: the pool's control address.
        prefill, decode, both: the engines' URLs by role.
        extra_args: more ``kvstore router`` flags.
    """

    def __init__(
        self,
        log_path: Path,
        master: str,
        *,
        prefill: tuple[str, ...] = (),
        decode: tuple[str, ...] = (),
        both: tuple[str, ...] = (),
        extra_args: tuple[str, ...] = (),
    ) -> None:
        self.port = vllm_server.free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        cmd = [sys.executable, "-m", "kvstore", "router", "--master", master]
        cmd += [a for url in prefill for a in ("--prefill", url)]
        cmd += [a for url in decode for a in ("--decode", url)]
        cmd += [a for url in both for a in ("--engine", url)]
        cmd += ["--port", str(self.port), *extra_args]
        with open(log_path, "ab") as log:
            self.proc = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )

    def wait_ready(self, timeout: float = START_TIMEOUT_S) -> RouterProcess:
        """Poll ``/health`` until every engine is healthy (bounded).

        Raises:
            RuntimeError: the router exited, or was not ready within ``timeout``.
        """
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"router exited: {self.log_path.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as resp:
                    if json.loads(resp.read()).get("status") == "ok":
                        return self
            except (OSError, ValueError):
                pass
            time.sleep(0.2)  # polling a state, bounded by the deadline
        raise RuntimeError(f"router not ready after {timeout:.0f} s")

    def post(
        self, path: str, body: dict[str, Any], timeout: float = REQUEST_TIMEOUT_S
    ) -> tuple[int, dict[str, str], Any]:
        """(status, headers, JSON answer) of one request; an HTTP error is an answer too."""
        req = urllib.request.Request(
            self.url + path, json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                return resp.status, dict(resp.headers), json.loads(resp.read())
        except urllib.error.HTTPError as err:
            return err.code, dict(err.headers), json.loads(err.read())

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=20)
