"""A small OpenAI-shaped endpoint of our own, in a thread, for the load generator's tests.

``/v1/completions`` streams ``max_tokens`` chunks, one a token, then a usage chunk and
``[DONE]``. It answers every ``reject_every``-th request with HTTP 429, sends
``x-kvstore-engine`` and ``x-kvstore-cached-tokens`` (the prompt tokens it has seen as a prefix
before, in whole 32-token blocks) when ``headers`` is on, and records every prompt and the most
requests it had in flight at once.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
from typing import Any

from aiohttp import web


class FakeOpenAI:
    """Start with :meth:`start`, stop with :meth:`stop` (or use as a context manager)."""

    def __init__(self, *, headers: bool = True, reject_every: int = 0, block: int = 32) -> None:
        self.headers = headers
        self.reject_every = reject_every
        self.block = block
        self.prompts: list[list[int]] = []
        self.bodies: list[dict[str, Any]] = []
        self.max_in_flight = 0
        self._in_flight = 0
        self._seen: set[tuple[int, ...]] = set()
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._sock = socket.socket()
        self._sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._sock.getsockname()[1]}"
        self._runner: web.AppRunner | None = None

    def _cached(self, prompt: list[int]) -> int:
        hit = 0
        for end in range(self.block, len(prompt), self.block):
            if tuple(prompt[:end]) not in self._seen:
                break
            hit = end
        for end in range(self.block, len(prompt) + 1, self.block):
            self._seen.add(tuple(prompt[:end]))
        return hit

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "fake-model"}]})

    async def _complete(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        if self.reject_every and len(self.bodies) % self.reject_every == 0:
            return web.json_response({"error": {"message": "busy"}}, status=429)
        prompt = list(body["prompt"])
        self.prompts.append(prompt)
        cached = self._cached(prompt)
        headers = {"Content-Type": "text/event-stream"}
        if self.headers:
            headers["x-kvstore-engine"] = f"engine-{len(self.prompts) % 2}"
            headers["x-kvstore-cached-tokens"] = str(cached)
        resp = web.StreamResponse(headers=headers)
        self._in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self._in_flight)
        try:
            await resp.prepare(request)
            for i in range(body["max_tokens"]):
                await asyncio.sleep(0.002)  # a token's compute time, not synchronisation
                chunk = {"choices": [{"index": 0, "text": f" t{i}"}]}
                await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
            usage = {
                "choices": [],
                "usage": {
                    "prompt_tokens": len(prompt),
                    "completion_tokens": body["max_tokens"],
                    "prompt_tokens_details": None,
                },
            }
            await resp.write(f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode())
        finally:
            self._in_flight -= 1
        return resp

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        app = web.Application()
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/completions", self._complete)
        self._runner = web.AppRunner(app)
        self._loop.run_until_complete(self._runner.setup())
        self._loop.run_until_complete(web.SockSite(self._runner, self._sock).start())
        self._ready.set()
        self._loop.run_forever()

    def start(self) -> FakeOpenAI:
        self._thread.start()
        if not self._ready.wait(timeout=10):
            raise RuntimeError("fake endpoint did not start")
        return self

    def stop(self) -> None:
        async def shutdown() -> None:
            assert self._runner is not None
            await self._runner.cleanup()

        asyncio.run_coroutine_threadsafe(shutdown(), self._loop).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)

    def __enter__(self) -> FakeOpenAI:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
