"""``kvstore router --discover`` finding a real vLLM server through etcd (the real model,
temperature 0, the CPU).

A real etcd; a master elected in it and a node that finds the master through it; one kv_both
vLLM server whose kvstore connector has the master as ``etcd://`` and an ``advertise_url``, so
its scheduler side registers the engine. The router starts with no engine flag at all. Killing
the server (its whole process group, SIGKILL: nothing gets to revoke) must drop its key within
the lease's TTL and take it out of the router. Select with ``-m engine``; skipped without the
vLLM virtualenv or the model.
"""

from __future__ import annotations

import asyncio
import json
import signal
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from kvstore.client.engine_registry import EngineRecord, RegisteredEngine, list_engines
from kvstore.demo.vllm_server import free_port
from kvstore.etcd import EtcdStore, parse_endpoints
from kvstore.processes import terminate
from kvstore.topology import Site
from tests.adapters.vllm_servers import VLLMServer, kv_config, missing_engine
from tests.etcd_harness import EtcdProcess, HACluster
from tests.router.rig import start_router
from tests.support import wait_until

pytestmark = [
    pytest.mark.engine,
    pytest.mark.timeout(900),
    pytest.mark.skipif(missing_engine() is not None, reason=str(missing_engine())),
]

TTL_S = 2
CHAT = [
    {"role": "system", "content": "You are a terse geography assistant."},
    {"role": "user", "content": "Name the largest city in Italy and one sight there."},
]


def _registry(server: EtcdProcess) -> dict[str, RegisteredEngine]:
    async def run() -> dict[str, RegisteredEngine]:
        store = EtcdStore(parse_endpoints(server.endpoint))
        try:
            return (await list_engines(store))[0]
        finally:
            await store.close()

    return asyncio.run(run())


def _health(router: str) -> tuple[int, dict[str, Any], Any]:
    try:
        with urllib.request.urlopen(router + "/health", timeout=30) as resp:
            return resp.status, json.loads(resp.read()), resp.headers
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read()), err.headers


def _chat(base: str) -> str:
    client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=300)
    answer = client.chat.completions.create(
        model="smollm2", messages=CHAT, temperature=0, max_tokens=16
    )
    return answer.choices[0].message.content or ""


@pytest.fixture(scope="module")
def pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HACluster]:
    """etcd, a master elected in it and a node that finds the master through it."""
    tmp = Path(tmp_path_factory.mktemp("discovery"))
    etcd = EtcdProcess(tmp / "etcd")
    cluster = HACluster(tmp, etcd)
    try:
        cluster.add_master()
        cluster.leader()
        cluster.add_node("1GiB")
        yield cluster
    finally:
        cluster.stop()
        etcd.stop()


def test_a_vllm_engine_registers_is_routed_to_and_leaves_when_killed(
    pool: HACluster, tmp_path: Path
) -> None:
    etcd = pool.etcd
    server: VLLMServer | None = None
    router_proc = None
    try:
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        kv = kv_config("kv_both", etcd.url, advertise_url=url, engine_ttl_s=TTL_S)
        router_proc, router = start_router(
            etcd.url, "--discover", etcd.url, "--poll-interval", "0.2"
        )
        status, body, headers = _health(router)  # no engine yet: 503, come back soon
        assert status == 503 and body["engines"] == {} and headers["Retry-After"] == "1"

        server = VLLMServer(tmp_path / "e.log", kv, cpu=0, prefix_caching=False, port=port)
        server.wait_ready()
        live = _registry(etcd)
        assert len(live) == 1, live  # the scheduler side registered; the worker did not
        (reg,) = live.values()
        assert reg.key.startswith("/kvstore/engines/both/")
        # (it says where it runs: the hostname, the default rack and zone; kvstore.topology)
        site = tuple(Site.declared().to_wire())
        assert reg.record == EngineRecord(url, "both", model="smollm2", block_size=32, site=site)
        wait_until(
            lambda: _health(router)[1]["engines"] == {url: True},
            timeout=60,
            interval=0.2,
            what="the router to find the engine through etcd and poll it healthy",
        )
        assert _health(router)[1]["sources"] == {url: "etcd"}
        # One call puts the prompt's full blocks in the pool; then through the router and
        # directly both load them and compute the rest (a prompt computed whole rounds
        # differently in bf16, so the first call is not the reference).
        _chat(url)
        routed = _chat(router)
        assert routed == _chat(url) and routed

        server.signal_group(signal.SIGKILL)  # every process of the engine, at once
        killed = time.monotonic()
        wait_until(
            lambda: not _registry(etcd),
            timeout=2 * TTL_S + 10,
            interval=0.1,
            what="the engine's key to expire",
        )
        # etcd expires a lease between one and about two TTLs after its last keep-alive.
        assert time.monotonic() - killed < 2 * TTL_S + 3
        wait_until(
            lambda: _health(router)[1]["engines"] == {},
            timeout=15,
            interval=0.1,
            what="the router to drop the engine",
        )
        client = openai.OpenAI(base_url=router + "/v1", api_key="none", max_retries=0)
        with pytest.raises(openai.APIStatusError) as err:
            client.chat.completions.create(model="smollm2", messages=CHAT, max_tokens=4)
        assert err.value.status_code == 503
        assert err.value.response.headers["Retry-After"] == "1"
    finally:
        if router_proc is not None:
            terminate(router_proc)
        if server is not None:
            server.stop()


def test_a_vllm_engine_stopped_cleanly_revokes_its_registration(
    pool: HACluster, tmp_path: Path
) -> None:
    """SIGTERM to the server: the connector revokes its lease on the signal; the key goes long
    before its 60 s TTL could have expired it. ``--shutdown-timeout 10`` makes this
    deterministic: with vLLM's default (0) its API server SIGKILLs the engine core right after
    signalling it, a race the revocation usually wins and otherwise leaves to the lease."""
    port = free_port()
    kv = kv_config(
        "kv_producer",
        pool.etcd.url,
        advertise_url=f"http://127.0.0.1:{port}",
        engine_instance="p0",
        engine_ttl_s=60,
    )
    server = VLLMServer(
        tmp_path / "p.log",
        kv,
        cpu=0,
        prefix_caching=False,
        port=port,
        extra_args=["--shutdown-timeout", "10"],
    )
    try:
        server.wait_ready()
        assert list(_registry(pool.etcd)) == ["/kvstore/engines/prefill/p0"]
        server.signal_group(signal.SIGTERM)
        server.proc.wait(timeout=60)
        wait_until(
            lambda: not _registry(pool.etcd),
            timeout=20,
            interval=0.1,
            what="the revocation (the lease itself would last 60 s)",
        )
    finally:
        server.stop()
