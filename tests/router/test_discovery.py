"""The router's engine set from etcd: the registry watch (listing, live changes, resume from the
last revision, a relist after compaction) against a real etcd, and ``kvstore router
--discover`` as a process, with ``kvstore engine register`` sidecars coming and going.

No engine answers at the registered URLs here (the set is what is tested; routing to
discovered engines is tests/router/test_router_discovery.py, with real vLLM)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import aetcd
import pytest
from prometheus_client import generate_latest

from kvstore.engine_registry import EngineRecord, RegisteredEngine
from kvstore.errors import InvalidRequestError
from kvstore.etcd import EtcdStore, parse_endpoints
from kvstore.processes import parse_ready, terminate
from kvstore.router.app import RouterConfig, RouterState
from kvstore.router.discovery import EngineDiscovery
from tests.etcd_harness import EtcdProcess, etcd  # noqa: F401 - fixture
from tests.router.rig import metric
from tests.support import wait_until

PREFIX = "/kvstore/engines"


class Seen:
    """What the discovery reported, in order."""

    def __init__(self) -> None:
        self.log: list[tuple[str, str]] = []

    def add(self, reg: RegisteredEngine) -> None:
        self.log.append(("add", reg.key))

    def remove(self, reg: RegisteredEngine) -> None:
        self.log.append(("remove", reg.key))


async def _until(predicate: Any, what: str, timeout: float = 15.0) -> None:
    """Poll a state on the loop, bounded."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate():
        if loop.time() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


async def _put(store: EtcdStore, role: str, name: str, port: int, lease: int) -> str:
    key = f"{PREFIX}/{role}/{name}"
    record = EngineRecord(f"http://127.0.0.1:{port}", role)
    await store.put(key.encode(), record.encode(), lease=lease)
    return key


def test_listing_then_live_changes_then_resume_from_the_last_revision(
    etcd: EtcdProcess,  # noqa: F811
) -> None:
    async def run() -> None:
        store = EtcdStore(parse_endpoints(etcd.endpoint))
        lease = (await store.grant_lease(60)).lease_id
        a = await _put(store, "prefill", "a", 9001, lease)
        await store.put(f"{PREFIX}/both/junk".encode(), b"not json", lease=lease)
        seen = Seen()
        disc = EngineDiscovery(parse_endpoints(etcd.endpoint), seen.add, seen.remove)
        disc.start()
        await asyncio.wait_for(disc.listed.wait(), 15)
        assert seen.log == [("add", a)] and list(disc.current) == [a]  # junk ignored
        await _until(lambda: disc.watching, "the watch")
        b = await _put(store, "decode", "b", 9002, lease)
        await _until(lambda: len(seen.log) == 2, "b added")
        await store.delete(a.encode())
        await _until(lambda: len(seen.log) == 3, "a removed")
        assert seen.log[1:] == [("add", b), ("remove", a)]

        # The watcher stops; meanwhile an engine comes and another goes; it resumes from the
        # revision it had applied: exactly the missed changes, in order, without a new listing.
        await disc.close()
        c = await _put(store, "both", "c", 9003, lease)
        await store.delete(b.encode())
        disc.start()
        await _until(lambda: len(seen.log) == 5, "the missed changes")
        assert seen.log[3:] == [("add", c), ("remove", b)]
        assert disc.num_listings == 1 and list(disc.current) == [c]

        # A lease revoked (an engine's clean stop) deletes its keys: the watch sees it.
        await store.revoke_lease(lease)
        await _until(lambda: not disc.current, "c removed with its lease")
        assert seen.log[-1] == ("remove", c)
        await disc.close()
        await store.close()

    asyncio.run(run())


def test_the_watch_survives_an_etcd_restart(etcd: EtcdProcess) -> None:  # noqa: F811
    async def run() -> None:
        seen = Seen()
        disc = EngineDiscovery(parse_endpoints(etcd.endpoint), seen.add, seen.remove)
        disc.start()
        await asyncio.wait_for(disc.listed.wait(), 15)
        await _until(lambda: disc.watching, "the watch")
        await asyncio.to_thread(etcd.restart)
        store = EtcdStore(parse_endpoints(etcd.endpoint))
        lease = (await store.grant_lease(60)).lease_id
        a = await _put(store, "both", "a", 9001, lease)
        await _until(lambda: seen.log == [("add", a)], "a seen after the restart", 30)
        assert disc.num_listings == 1
        await disc.close()
        await store.close()

    asyncio.run(run())


def test_a_compacted_history_is_relisted(etcd: EtcdProcess) -> None:  # noqa: F811
    async def run() -> None:
        store = EtcdStore(parse_endpoints(etcd.endpoint))
        lease = (await store.grant_lease(60)).lease_id
        a = await _put(store, "both", "a", 9001, lease)
        seen = Seen()
        disc = EngineDiscovery(parse_endpoints(etcd.endpoint), seen.add, seen.remove)
        disc.start()
        await asyncio.wait_for(disc.listed.wait(), 15)
        await disc.close()
        await store.delete(a.encode())
        b = await _put(store, "both", "b", 9002, lease)
        _, revision = await store.get_prefix_at(b"/")
        raw = aetcd.Client(etcd.endpoint.split(":")[0], int(etcd.endpoint.split(":")[1]))
        await raw.compact(revision, physical=True)
        await raw.close()
        disc.start()
        await _until(lambda: list(disc.current) == [b], "the relisted set")
        assert disc.num_listings == 2
        assert seen.log == [("add", a), ("remove", a), ("add", b)]
        await disc.close()
        await store.close()

    asyncio.run(run())


# ---------------------------------------------------------------- the router process
def _get(url: str) -> tuple[int, Any, Any]:
    try:
        with urllib.request.urlopen(url, timeout=30) as resp:
            return resp.status, resp.headers, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, err.headers, json.loads(err.read())


@pytest.fixture
def router(etcd: EtcdProcess) -> Iterator[str]:  # noqa: F811
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvstore",
            "router",
            "--port",
            "0",
            "--discover",
            etcd.url,
            "--poll-interval",
            "0.2",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        ready = parse_ready(proc.stdout.readline(), "router")
        assert ready is not None and ready["engines"] == 0 and ready["discover"] == etcd.url
        yield ready["url"]
    finally:
        terminate(proc)


def _sidecar(server: EtcdProcess, url: str, role: str, *extra: str) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvstore", "engine", "register", "--etcd", server.url]
        + ["--url", url, "--role", role, *extra],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    assert parse_ready(proc.stdout.readline(), "engine") is not None
    return proc


def test_engines_come_and_go_through_etcd(etcd: EtcdProcess, router: str) -> None:  # noqa: F811
    # Before any engine: 503 with Retry-After, on /health and on the API.
    status, headers, body = _get(router + "/health")
    assert status == 503 and headers["Retry-After"] == "1"
    assert body["engines"] == {} and body["status"] == "down"
    assert body["discovery"]["etcd"] == etcd.url
    status, headers, body = _get(router + "/v1/models")
    assert status == 503 and headers["Retry-After"] == "1"
    assert body["error"]["type"] == "ServiceUnavailableError"

    p, d = "http://127.0.0.1:9101", "http://127.0.0.1:9102"
    sidecars = [_sidecar(etcd, p, "prefill"), _sidecar(etcd, d, "decode", "--ttl", "1")]
    try:

        def engines() -> dict[str, Any]:
            return _get(router + "/health")[2]

        wait_until(lambda: len(engines()["engines"]) == 2, timeout=15, what="both listed")
        body = engines()
        assert body["roles"] == {p: "prefill", d: "decode"}
        assert body["sources"] == {p: "etcd", d: "etcd"}
        assert body["engines"] == {p: False, d: False}  # health-polled: nothing answers there
        assert (
            metric(router, "kvstore_router_engine_info", f'instance="{p}"', 'role="prefill"') == 1
        )
        assert metric(router, "kvstore_router_discovery_up") == 1

        # A clean stop revokes: the engine leaves at once.
        sidecars[0].send_signal(signal.SIGTERM)
        assert sidecars[0].wait(timeout=30) == 0
        wait_until(lambda: list(engines()["engines"]) == [d], timeout=15, what="p gone")
        assert metric(router, "kvstore_router_engine_info", f'instance="{p}"') == 0
        # A killed sidecar: its 1 s lease expires, and the engine leaves with it.
        os.kill(sidecars[1].pid, signal.SIGKILL)
        wait_until(lambda: engines()["engines"] == {}, timeout=15, what="d expired")
        assert metric(router, "kvstore_router_discovery_changes_total", 'kind="removed"') == 2
        assert _get(router + "/health")[0] == 503
    finally:
        for proc in sidecars:
            terminate(proc)


# ---------------------------------------------------------------- the router's engine set
def _reg(key: str, url: str, role: str) -> RegisteredEngine:
    return RegisteredEngine(key, EngineRecord(url, role), 1)


def test_the_engine_set_follows_registrations_and_keeps_static_engines() -> None:
    state = RouterState(RouterConfig(engines=("http://s:1",), discover="etcd://127.0.0.1:2379"))
    assert state.sources == {"http://s:1": "static"} and not state.disaggregated
    # A registered static URL stays one static engine; its key's removal does not remove it.
    state.add_discovered(_reg("/kvstore/engines/both/x", "http://s:1", "both"))
    state.remove_discovered(_reg("/kvstore/engines/both/x", "http://s:1", "both"))
    assert [e.url for e in state.engines] == ["http://s:1"]
    # One URL under two keys is one engine, until its last key goes.
    a, b = _reg("/p/both/a", "http://e:2/", "both"), _reg("/p/both/b", "http://e:2", "both")
    state.add_discovered(a)
    state.add_discovered(b)
    assert [e.url for e in state.engines] == ["http://s:1", "http://e:2"]
    assert state.sources["http://e:2"] == "etcd"
    state.remove_discovered(a)
    assert "http://e:2" in state.by_url
    state.remove_discovered(b)
    assert [e.url for e in state.engines] == ["http://s:1"] and "http://e:2" not in state.sources
    text = generate_latest(state.metrics.registry).decode()
    assert 'instance="http://e:2"' not in text and 'instance="http://s:1"' in text


def test_the_mode_follows_the_discovered_roles() -> None:
    state = RouterState(RouterConfig(discover="etcd://127.0.0.1:2379"))
    assert not state.disaggregated and state.engines == []
    state.add_discovered(_reg("/k/both/a", "http://a:1", "both"))
    assert not state.disaggregated
    state.add_discovered(_reg("/k/decode/b", "http://b:1", "decode"))
    assert state.disaggregated  # P/D; the kv_both engine serves either step
    assert {e.url for e in state.role_engines("both")} == {"http://a:1"}
    state.remove_discovered(_reg("/k/decode/b", "http://b:1", "decode"))
    assert not state.disaggregated


@pytest.mark.parametrize(
    "kwargs",
    [{}, {"discover": "etcd://"}, {"discover": "etcd://h:1", "discover_prefix": "engines"}],
)
def test_router_config_needs_engines_or_a_valid_registry(kwargs: dict[str, Any]) -> None:
    with pytest.raises(InvalidRequestError):
        RouterConfig(**kwargs)
