"""A stand-in for a vLLM server, of our own making, on a real socket: what the router reads of an
engine (``/metrics``, ``/v1/models``) and the two generate routes, with the answers set by the
test. It runs on the test's event loop, next to an in-process router; :meth:`FakeEngine.stop`
closes its socket, as a killed engine's would be."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

from aiohttp import web

MODEL = "fake-model"
#: A small model's ``config.json`` (SmolLM2-135M's shape): the router reads its namespace from it.
MODEL_CONFIG = {
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "hidden_size": 576,
    "head_dim": 64,
    "dtype": "bfloat16",
}


def metrics_text(
    running: str = "0", waiting: str = "0", usage: str = "0.0", block_size: str = "32"
) -> str:
    """A ``/metrics`` body with the gauges the router reads (values as the engine writes them)."""
    return (
        "# HELP vllm:num_requests_running Number of requests in model execution batches.\n"
        "# TYPE vllm:num_requests_running gauge\n"
        f'vllm:num_requests_running{{engine="0",model_name="{MODEL}"}} {running}\n'
        f'vllm:num_requests_waiting{{engine="0",model_name="{MODEL}"}} {waiting}\n'
        f'vllm:kv_cache_usage_perc{{engine="0",model_name="{MODEL}"}} {usage}\n'
        f'vllm:cache_config_info{{block_size="{block_size}",cache_dtype="auto",'
        f'num_gpu_blocks="1000"}} 1.0\n'
    )


def write_model(folder: Path) -> Path:
    """Write the model folder a ``/v1/models`` entry names (its ``config.json``)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(MODEL_CONFIG))
    return folder


def models_body(root: Path, max_model_len: int = 2048) -> bytes:
    """A ``/v1/models`` body as vLLM writes it."""
    entry = {"id": MODEL, "object": "model", "root": str(root), "max_model_len": max_model_len}
    return json.dumps({"object": "list", "data": [entry]}).encode()


class FakeEngine:
    """Start with :meth:`start` (returns its URL), stop with :meth:`stop`.

    Attributes:
        metrics: the ``/metrics`` body it answers (the test changes it at will).
        models: the ``/v1/models`` body it answers (bytes, sent as JSON).
        hits: requests served, by path.
        bodies: the generate requests' bodies, in order.
    """

    def __init__(self, model_root: Path, max_model_len: int = 2048) -> None:
        self.metrics = metrics_text()
        self.models = models_body(model_root, max_model_len)
        self.hits: Counter[str] = Counter()
        self.bodies: list[dict[str, Any]] = []
        self.url = ""
        self._runner: web.AppRunner | None = None

    async def _metrics(self, request: web.Request) -> web.Response:
        self.hits[request.path] += 1
        return web.Response(text=self.metrics, content_type="text/plain")

    async def _models(self, request: web.Request) -> web.Response:
        self.hits[request.path] += 1
        return web.Response(body=self.models, content_type="application/json")

    async def _generate(self, request: web.Request) -> web.Response:
        self.hits[request.path] += 1
        self.bodies.append(await request.json())
        answer = {"object": "text_completion", "model": MODEL, "choices": [{"text": "ok"}]}
        return web.json_response(answer)

    async def start(self) -> str:
        app = web.Application()
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/completions", self._generate)
        app.router.add_post("/v1/chat/completions", self._generate)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        host, port = self._runner.addresses[0][:2]
        self.url = f"http://{host}:{port}"
        return self.url

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
