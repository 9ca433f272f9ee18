"""Run a prefill or decode worker as its own process, driven by JSON lines on stdin/stdout.

``python -m kvstore.demo.serve --role prefill --master HOST:PORT --model tiny-llama``
prints one ``ready ...`` line (weights digest, namespace digest), then answers one JSON request
per line until stdin closes:

- prefill: ``{"tokens": [...], "use_pool": true, "pipelined": true}`` -> the :class:`PrefillResult` fields
- decode:  ``{"tokens": [...], "max_new_tokens": 8, "first_token": 5, "pipelined": true,
  "use_pool": true}`` -> the :class:`DecodeResult` fields

A request that fails answers ``{"error": CODE, "message": ...}`` and the worker goes on.
:class:`WorkerProcess` starts one and talks to it (the demo, the benchmark and the tests use it).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import queue
import signal
import subprocess
import sys
import threading
from collections.abc import Sequence
from typing import Any

from kvstore.errors import ErrorCode, InvalidRequestError, KVStoreError, KVTimeoutError
from kvstore.processes import terminate

READY_TIMEOUT_S = 120.0


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvstore-worker", description=__doc__.splitlines()[0])
    p.add_argument("--role", choices=("prefill", "decode"), required=True)
    p.add_argument("--master", required=True, help="the master's HOST:PORT")
    p.add_argument("--model", default="tiny-llama", help="a tiny model name or a local folder")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="float32", choices=("float32", "float16", "bfloat16"))
    p.add_argument("--init-range", type=float, default=None)
    p.add_argument("--max-context", type=int, default=4096)
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--fp8", action="store_true", help="store KV as FP8 E4M3 (per-head scales)")
    p.add_argument("--model-id", default=None, help="the namespace's model (default: MODEL@SEED)")
    return p


def _build(args: argparse.Namespace) -> tuple[Any, Any, str]:
    import torch

    from kvstore.client import Client, KVCache
    from kvstore.client.adapters.fp8 import calibrate
    from kvstore.demo import hf
    from kvstore.demo.models import build_model, weights_digest
    from kvstore.demo.workers import DecodeWorker, PrefillWorker

    torch.set_num_threads(1)  # two workers share a small machine
    model = build_model(
        args.model,
        seed=args.seed,
        dtype=hf.NAME_TO_DTYPE[args.dtype],
        max_context=args.max_context,
        init_range=args.init_range,
    )
    model_id = args.model_id or f"{args.model}@{args.seed}"
    scales = None
    kv_dtype = None
    if args.fp8:
        scales = calibrate(model)
        model_id = scales.model_name(model_id)
        kv_dtype = hf.FP8
    namespace = hf.namespace_for(model, model_id, block_size=args.block_size, kv_dtype=kv_dtype)
    client = Client.connect(args.master)
    kv = KVCache(client, namespace)
    cls = PrefillWorker if args.role == "prefill" else DecodeWorker
    worker = cls(model, kv, fp8_scales=scales)
    ready = (
        f"ready role={args.role} weights={weights_digest(model)} namespace={namespace.digest.hex()}"
    )
    return worker, client, ready


def _answer(worker: Any, role: str, request: dict[str, Any]) -> dict[str, Any]:
    if not isinstance(request, dict) or "tokens" not in request:
        raise InvalidRequestError("a request is a JSON object with 'tokens'")
    if role == "prefill":
        result = worker.prefill(
            request["tokens"],
            use_pool=bool(request.get("use_pool", True)),
            pipelined=bool(request.get("pipelined", True)),
        )
    else:
        result = worker.generate(
            request["tokens"],
            int(request.get("max_new_tokens", 8)),
            first_token=request.get("first_token"),
            pipelined=bool(request.get("pipelined", True)),
            use_pool=bool(request.get("use_pool", True)),
        )
    return dataclasses.asdict(result)


def main(argv: Sequence[str] | None = None) -> int:
    """Serve requests until stdin closes (or SIGTERM)."""
    args = _parser().parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    # stdout carries the protocol only: whatever a library prints goes to stderr.
    proto, sys.stdout = sys.stdout, sys.stderr
    try:
        worker, client, ready = _build(args)
    except KVStoreError as err:
        print(f"worker failed to start: {err.message}", file=sys.stderr, flush=True)
        return 2
    print(ready, file=proto, flush=True)
    try:
        for line in sys.stdin:
            if not line.strip():
                continue
            try:
                reply = _answer(worker, args.role, json.loads(line))
            except KVStoreError as err:
                reply = {"error": int(err.code), "message": err.message}
            except (ValueError, TypeError) as exc:
                reply = {"error": int(ErrorCode.INVALID_REQUEST), "message": str(exc)}
            print(json.dumps(reply), file=proto, flush=True)
    finally:
        client.close()
    return 0


class WorkerProcess:
    """A worker in a child process; :meth:`call` sends a request and waits for its answer.

    Args:
        role: ``prefill`` or ``decode``.
        master: the master's address.
        options: more command-line flags (``["--model", "tiny-gpt2", "--fp8"]``).
        wait: wait for the ready line here (else call :meth:`wait_ready`).
    """

    def __init__(
        self, role: str, master: str, options: Sequence[str] = (), *, wait: bool = True
    ) -> None:
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "kvstore.demo.serve",
                "--role",
                role,
                "--master",
                master,
                *options,
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        self._lines: queue.Queue[str | None] = queue.Queue()
        self._stderr: list[str] = []
        threading.Thread(target=self._pump, daemon=True).start()
        threading.Thread(target=self._pump_err, daemon=True).start()
        self.role = role
        self.ready = ""
        self.fields: dict[str, str] = {}
        if wait:
            self.wait_ready()

    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> None:
        """Wait for the worker's ready line (start several workers first, then wait: they boot
        in parallel).

        Raises:
            InvalidRequestError: the worker exited instead (its stderr tail is in the message).
            KVTimeoutError: no ready line in time.
        """
        if self.ready:
            return
        line = self._next(timeout)
        if not line.startswith("ready"):
            self.stop()
            raise InvalidRequestError(f"{self.role} worker did not start: {line}")
        self.ready = line
        self.fields = dict(kv.split("=", 1) for kv in line.split()[1:])

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line.strip())
        self._lines.put(None)

    def _pump_err(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self._stderr.append(line)

    def _next(self, timeout: float) -> str:
        try:
            line = self._lines.get(timeout=timeout)
        except queue.Empty:
            raise KVTimeoutError(f"worker {self.proc.pid} did not answer in {timeout}s") from None
        if line is None:
            self.proc.wait(timeout=10)
            tail = "".join(self._stderr[-20:])
            return f"exited with {self.proc.returncode}: {tail}"
        return line

    def call(self, request: dict[str, Any], timeout: float = 300.0) -> dict[str, Any]:
        """Send one request and return its answer.

        Raises:
            KVStoreError: the worker answered with an error (rebuilt from its code).
            KVTimeoutError: no answer in time.
        """
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        line = self._next(timeout)
        try:
            reply = json.loads(line)
        except ValueError:
            raise InvalidRequestError(f"worker said: {line}") from None
        if "error" in reply:
            raise KVStoreError.from_wire([reply["error"], reply["message"]])
        return reply

    def stop(self) -> None:
        """Close stdin (the worker exits), then make sure: SIGTERM, SIGKILL, by PID."""
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            with contextlib.suppress(OSError):
                self.proc.stdin.close()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            terminate(self.proc)

    def __enter__(self) -> WorkerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


if __name__ == "__main__":
    sys.exit(main())
