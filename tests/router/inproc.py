"""An in-process router for tests: started as ``kvstore router`` starts it (its real
application on a real socket), with the tokenizer loader injected, and the helpers that talk to
it and to the engine registry from the test's event loop."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp

from kvstore.client.engine_registry import DEFAULT_ENGINES_PREFIX, EngineRecord
from kvstore.etcd import EtcdStore
from kvstore.router.app import start_router
from kvstore.router.config import RouterConfig
from kvstore.router.state import STATE, RouterState


async def until(
    check: Callable[[], Awaitable[bool] | bool], what: str, timeout: float = 30.0
) -> None:
    """Poll a state from the loop until ``check`` holds; bounded."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        got = check()
        if await got if isinstance(got, Awaitable) else got:
            return
        if loop.time() > deadline:
            raise TimeoutError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.02)


class SpyTokenizer:
    """A tokenizer that counts its loads and calls (one token a word)."""

    def __init__(self) -> None:
        self.loads: list[str] = []
        self.calls = 0

    def load(self, folder: str) -> SpyTokenizer:
        self.loads.append(folder)
        return self

    def __call__(self, text: str) -> dict[str, list[int]]:
        self.calls += 1
        return {"input_ids": [len(w) for w in text.split()]}

    def apply_chat_template(self, messages: list[dict[str, Any]], **kw: Any) -> list[int]:
        self.calls += 1
        return [len(str(m.get("content"))) for m in messages]


@contextlib.asynccontextmanager
async def router(
    config: RouterConfig,
    tokenizer: SpyTokenizer | None = None,
    host: str = "127.0.0.1",
    port: int = 0,
) -> AsyncIterator[tuple[str, RouterState]]:
    """The router on ``host:port`` (0: a free one); yields its loopback URL and its state."""
    spy = tokenizer or SpyTokenizer()
    runner = await start_router(config, host, port, load_tokenizer=spy.load)
    try:
        bound = runner.addresses[0][1]
        yield f"http://127.0.0.1:{bound}", runner.app[STATE]
    finally:
        await runner.cleanup()


async def health(http: aiohttp.ClientSession, url: str) -> dict[str, bool]:
    """``/health``'s engines (it answers 503 while none is healthy)."""
    async with http.get(url + "/health") as resp:
        return (await resp.json())["engines"]


async def health_is(
    http: aiohttp.ClientSession, url: str, engine: str, healthy: bool | None
) -> bool:
    """Whether ``/health`` has ``engine`` as ``healthy`` (None: not listed at all)."""
    return (await health(http, url)).get(engine) is healthy


async def post(http: aiohttp.ClientSession, url: str, body: Any) -> tuple[int, Any]:
    """POST a JSON body; the status and the JSON answer (its text when it is not JSON)."""
    async with http.post(url, json=body) as resp:
        text = await resp.text()
    try:
        return resp.status, json.loads(text)
    except ValueError:
        return resp.status, text


async def register(
    store: EtcdStore, instance: str, url: str, *, raw: bool = False, role: str = "both"
) -> str:
    """Register an engine as the connector does (under a lease); ``raw`` writes the URL
    unchecked, as any etcd client may. Returns the key."""
    lease = (await store.grant_lease(60)).lease_id
    if raw:
        value = json.dumps({"url": url, "role": role}).encode()
    else:
        value = EngineRecord(url, role).encode()
    key = f"{DEFAULT_ENGINES_PREFIX}/{role}/{instance}"
    await store.put(key.encode(), value, lease=lease)
    return key
