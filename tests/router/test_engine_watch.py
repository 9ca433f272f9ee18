"""The router's engine set from etcd: the registry watch (listing, live changes, resume from the
last revision, a relist after compaction) against a real etcd, and ``kvstore router
--discover`` as a process, with ``kvstore engine register`` sidecars coming and going.

No engine answers at the registered URLs here (the set is what is tested; routing to
discovered engines is tests/router/test_router_discovery.py, with real vLLM)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aetcd
import aiohttp
import pytest
from prometheus_client import generate_latest

from kvstore.client.engine_registry import EngineRecord, RegisteredEngine
from kvstore.demo.vllm_server import free_port
from kvstore.errors import InvalidRequestError
from kvstore.etcd import EtcdStore, parse_endpoints
from kvstore.processes import parse_ready, terminate
from kvstore.router.config import RouterConfig
from kvstore.router.engine_watch import EngineDiscovery
from kvstore.router.state import RouterState
from tests.etcd_harness import EtcdProcess, etcd  # noqa: F401 - fixture
from tests.router.fake_engine import FakeEngine, write_model
from tests.router.inproc import health, health_is, post, register, until
from tests.router.inproc import router as router_in_process
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
    [
        {},
        {"discover": "etcd://"},
        {"discover": "etcd://h:1", "discover_prefix": "engines"},
        {"engines": ("127.0.0.1:8100",)},
        {"engines": ("http://127.0.0.1:8100\r\nx",)},
        {"prefill": ("http://p:1",), "decode": ("http://user@d:1",)},
    ],
)
def test_router_config_needs_engines_or_a_valid_registry(kwargs: dict[str, Any]) -> None:
    with pytest.raises(InvalidRequestError):
        RouterConfig(**kwargs)


# ---------------------------------------------------------------- refused registrations
#: Engine URLs no registration may carry: each was accepted and routed to (and the CR/LF one
#: wrote a line of its own into the router's log).
BAD_URLS = [
    "http://127.0.0.1:9101 x",
    "http://127.0.0.1:9101\r\nrouter: engine http://10.6.6.6:1 (both) discovered via /forged",
    "http://127.0.0.1:9101\n",
    "http://127.0.0.1\t:9101",
    "http://127.0.0.1:9101\x00",
    "http://user:secret@127.0.0.1:9101",
    "http://@127.0.0.1:9101",
    "http://127.0.0.1:9101/v1?x=1",
    "http://127.0.0.1:9101#top",
    "http://127.0.0.1:99999",
    "http://127.0.0.1:0",
    "http://127.0.0.1:port",
    "http://exa mple:9101",
    "http://ex\u00e4mple:9101",
    "http://[::1:9101",
    "http://-host:9101",
    "ftp://127.0.0.1:9101",
]
GOOD_URLS = [
    "http://127.0.0.1:8101",
    "https://engine-0.pool.example.com",
    "http://[::1]:8000",
    "http://vllm_prefill:8000/",
    "http://10.0.0.5:8101/vllm/a",
]


@pytest.mark.parametrize("url", BAD_URLS)
def test_engine_urls_that_are_not_plain_http_are_refused(url: str) -> None:
    with pytest.raises(InvalidRequestError) as err:
        EngineRecord(url, "both")
    assert "\n" not in err.value.message and "\r" not in err.value.message


@pytest.mark.parametrize("url", GOOD_URLS)
def test_plain_engine_urls_are_taken(url: str) -> None:
    assert EngineRecord(url, "both").url == url


def test_the_router_refuses_bad_registrations_once_and_logs_them_escaped(
    etcd: EtcdProcess,  # noqa: F811
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO)

    async def run() -> None:
        engine = FakeEngine(write_model(tmp_path / "model"))
        await engine.start()
        store = EtcdStore(parse_endpoints(etcd.endpoint))
        config = RouterConfig(discover=etcd.url, poll_s=0.05)
        try:
            async with router_in_process(config) as (url, state), aiohttp.ClientSession() as http:
                bad = [
                    await register(store, f"bad{i}", u, raw=True) for i, u in enumerate(BAD_URLS)
                ]
                # An instance name that is not one line: the key is refused, whatever its URL.
                bad.append(await register(store, "x\r\nrouter: forged", engine.url))
                await register(store, "good", engine.url)
                # In revision order: once the last key is routed, every earlier one was seen.
                await until(lambda: health_is(http, url, engine.url, True), "the good engine")
                assert await health(http, url) == {engine.url: True}
                assert state.sources == {engine.url: "etcd"}
                assert metric_value(
                    state, "kvstore_router_discovery_changes_total", 'kind="ignored"'
                ) == len(bad)
                # A bad key written again, unchanged, is not logged again.
                await register(store, "bad0", BAD_URLS[0], raw=True)
                await register(store, "good2", engine.url)
                await until(lambda: len(state.discovery.current) == 2, "good2 listed")
        finally:
            await store.close()
            await engine.stop()
        messages = [r.getMessage() for r in caplog.records]
        assert not [m for m in messages if "\n" in m or "\r" in m or "\x00" in m]
        refused = [m for m in messages if "ignoring" in m]
        for u in BAD_URLS:
            assert sum(repr(u) in m for m in refused) == 1, u

    asyncio.run(run())


def metric_value(state: RouterState, name: str, *labels: str) -> float:
    """The sum of a router metric's samples whose labels include every one of ``labels``."""
    text = generate_latest(state.metrics.registry).decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name) and all(label in line for label in labels)
    )


def _own_addresses() -> set[str]:
    """This machine's IPv4 addresses other than loopback ones, as far as it knows them."""
    found = set()
    with contextlib.suppress(OSError):
        for info in socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET):
            found.add(info[4][0])
    with contextlib.suppress(OSError), socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect(("192.0.2.1", 9))  # no packet is sent: this only picks the outgoing address
        found.add(s.getsockname()[0])
    return {a for a in found if not a.startswith("127.")}


@pytest.mark.parametrize("bind", ["127.0.0.1", "0.0.0.0", "localhost"])
def test_a_registration_of_the_routers_own_address_is_refused(
    etcd: EtcdProcess,  # noqa: F811
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    bind: str,
) -> None:
    """Registered, the router's own URL had it send requests to itself. Refused: its bound
    address and port under any name that reaches that socket; not another address at the
    same port, nor another port."""
    caplog.set_level(logging.INFO)

    async def run() -> None:
        engine = FakeEngine(write_model(tmp_path / "model"))
        await engine.start()
        store = EtcdStore(parse_endpoints(etcd.endpoint))
        config = RouterConfig(discover=etcd.url, poll_s=0.05)
        try:
            async with (
                router_in_process(config, host=bind) as (url, state),
                aiohttp.ClientSession() as http,
            ):
                port = int(url.rsplit(":", 1)[1])
                own = [f"http://127.0.0.1:{port}", f"http://localhost:{port}"]
                own.append(f"http://LocalHost.:{port}/")
                others = [f"http://127.0.0.1:{port + 1}"]
                if bind == "0.0.0.0":  # every address of this machine reaches it
                    own += [f"http://127.0.0.2:{port}", f"http://127.0.0.1:{port}/v1"]
                    own += [f"http://{a}:{port}" for a in sorted(_own_addresses())]
                    with contextlib.suppress(OSError):
                        socket.getaddrinfo(socket.gethostname(), port)
                        own.append(f"http://{socket.gethostname().lower()}:{port}")
                else:  # only its own address does
                    others.append(f"http://127.0.0.2:{port}")
                for i, u in enumerate(own):
                    await register(store, f"own{i}", u)
                for i, u in enumerate(others):
                    await register(store, f"other{i}", u)
                await register(store, "good", engine.url)
                await until(lambda: health_is(http, url, engine.url, True), "the good engine")
                assert set(await health(http, url)) == {engine.url, *others}
                status, answer = await post(
                    http, url + "/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 2}
                )
                assert status == 200 and answer["choices"][0]["text"] == "ok"
                assert engine.bodies
        finally:
            await store.close()
            await engine.stop()
        refused = [r.getMessage() for r in caplog.records if "ignoring" in r.getMessage()]
        for u in own:
            assert sum(repr(u) in m and "own address" in m for m in refused) == 1, (u, refused)

    asyncio.run(run())


def test_a_router_given_its_own_url_does_not_route_to_itself(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Whatever name reached it (a DNS alias, a port mapping), a router that polls itself
    reads its own id in the answer: that engine is never healthy, and it is said once."""
    caplog.set_level(logging.INFO)

    async def run() -> None:
        engine = FakeEngine(write_model(tmp_path / "model"))
        await engine.start()
        port = free_port()
        own = f"http://127.0.0.1:{port}"
        config = RouterConfig(engines=(engine.url, own), poll_s=0.05)
        try:
            async with (
                router_in_process(config, port=port) as (url, _),
                aiohttp.ClientSession() as http,
            ):
                await until(lambda: health_is(http, url, engine.url, True), "the engine")
                await until(lambda: engine.hits["/metrics"] >= 10, "more polls")
                assert await health(http, url) == {engine.url: True, own: False}
                status, answer = await post(
                    http, url + "/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 2}
                )
                assert status == 200 and answer["choices"][0]["text"] == "ok"
        finally:
            await engine.stop()
        said = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
        assert len([m for m in said if own in m and "this router itself" in m]) == 1, said

    asyncio.run(run())
