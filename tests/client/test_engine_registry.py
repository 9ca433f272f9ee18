"""The engine registry against a real etcd: records, the announcer's lease (expiry, revocation,
re-registration), the ``kvstore engine register`` sidecar, and refused values."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from kvstore.address import Address
from kvstore.client.engine_registry import (
    EngineAnnouncer,
    EngineRecord,
    RegisteredEngine,
    engine_key,
    list_engines,
)
from kvstore.errors import InvalidRequestError
from kvstore.etcd import EtcdStore, KeyValue, parse_endpoints
from kvstore.processes import parse_ready, terminate
from tests.etcd_harness import EtcdProcess, etcd  # noqa: F401 - fixture
from tests.support import wait_until

URL = "http://127.0.0.1:8101"
PREFIX = "/kvstore/engines"


def _list(server: EtcdProcess, prefix: str = PREFIX) -> dict[str, RegisteredEngine]:
    async def run() -> dict[str, RegisteredEngine]:
        store = EtcdStore(parse_endpoints(server.endpoint))
        try:
            return (await list_engines(store, prefix))[0]
        finally:
            await store.close()

    return asyncio.run(run())


@pytest.fixture
def announcers() -> Iterator[list[EngineAnnouncer]]:
    made: list[EngineAnnouncer] = []
    yield made
    for a in made:
        a.stop()


def test_a_record_round_trips_and_its_key_names_the_role() -> None:
    rec = EngineRecord(URL, "prefill", model="smollm2", block_size=32, kv_events="tcp://h:5557")
    assert EngineRecord.decode(rec.encode()) == rec
    assert json.loads(rec.encode()) == {
        "url": URL,
        "role": "prefill",
        "model": "smollm2",
        "block_size": 32,
        "kv_events": "tcp://h:5557",
    }
    assert engine_key(PREFIX, "decode", "a1") == b"/kvstore/engines/decode/a1"
    kv = KeyValue(b"/kvstore/engines/prefill/a1", rec.encode(), 5, 5, 77)
    assert RegisteredEngine.from_kv(PREFIX, kv) == RegisteredEngine(
        "/kvstore/engines/prefill/a1", rec, 77
    )


@pytest.mark.parametrize(
    "fields",
    [
        {"url": "127.0.0.1:8101", "role": "both"},  # no scheme
        {"url": "http://0.0.0.0:8101", "role": "both"},  # bind-all: unreachable
        {"url": "http://:8101", "role": "both"},
        {"url": URL, "role": "kv_both"},  # vLLM's word, not ours
        {"url": URL, "role": "both", "block_size": 0},
        {"url": URL, "role": "both", "block_size": True},
        {"url": URL, "role": "both", "model": ""},
        {"url": URL, "role": "both", "kv_events": "http://h:1"},
    ],
)
def test_bad_records_are_refused_with_a_typed_error(fields: dict) -> None:
    with pytest.raises(InvalidRequestError):
        EngineRecord(**fields)


@pytest.mark.parametrize(
    "key, value, lease",
    [
        (b"/kvstore/engines/both/a", b"not json", 1),
        (b"/kvstore/engines/both/a", b"[1]", 1),
        (b"/kvstore/engines/both/a", b'{"url": "http://h:1"}', 1),  # no role
        (b"/kvstore/engines/both/a", b'{"url": "http://h:1", "role": "both", "x": 1}', 1),
        (b"/kvstore/engines/both/a", b'{"url": "http://h:1", "role": "decode"}', 1),  # contradicts
        (b"/kvstore/engines/both/a", b'{"url": "http://h:1", "role": "both"}', 0),  # no lease
        (b"/kvstore/engines/gpu/a", b'{"url": "http://h:1", "role": "both"}', 1),
        (b"/kvstore/engines/both/a/b", b'{"url": "http://h:1", "role": "both"}', 1),
    ],
)
def test_foreign_keys_are_refused(key: bytes, value: bytes, lease: int) -> None:
    with pytest.raises(InvalidRequestError):
        RegisteredEngine.from_kv(PREFIX, KeyValue(key, value, 1, 1, lease))


def test_announcer_arguments_are_checked() -> None:
    rec = EngineRecord(URL, "both")
    ep = [Address("127.0.0.1", 2379)]
    for kwargs in ({"ttl_s": 0}, {"instance": "a/b"}, {"prefix": "kvstore"}, {"prefix": "/x/"}):
        with pytest.raises(InvalidRequestError):
            EngineAnnouncer(ep, rec, **kwargs)


def test_register_then_revoke_on_stop(
    etcd: EtcdProcess,  # noqa: F811
    announcers: list[EngineAnnouncer],
) -> None:
    rec = EngineRecord(URL, "decode", model="smollm2", block_size=32)
    a = EngineAnnouncer(parse_endpoints(etcd.endpoint), rec, instance="d0", ttl_s=30)
    announcers.append(a)
    a.start()
    assert a.registered.wait(15)
    live = _list(etcd)
    assert list(live) == ["/kvstore/engines/decode/d0"] == [a.key]
    assert live[a.key].record == rec and live[a.key].lease != 0
    a.stop()
    # Revoked at once: gone well before its 30 s TTL could have expired it.
    assert _list(etcd) == {}


def test_default_instance_is_the_lease_id_and_two_engines_coexist(
    etcd: EtcdProcess,  # noqa: F811
    announcers: list[EngineAnnouncer],
) -> None:
    for url in (URL, "http://127.0.0.1:8102"):
        a = EngineAnnouncer(parse_endpoints(etcd.endpoint), EngineRecord(url, "both"), ttl_s=10)
        announcers.append(a)
        a.start()
        assert a.registered.wait(15)
    live = _list(etcd)
    assert sorted(r.record.url for r in live.values()) == [URL, "http://127.0.0.1:8102"]
    for reg in live.values():
        assert reg.key.endswith(f"/{reg.lease:x}")


def _sidecar(server: EtcdProcess, *extra: str) -> tuple[subprocess.Popen, dict]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvstore", "engine", "register", "--etcd", server.url, *extra],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    ready = parse_ready(line, "engine")
    if ready is None:
        terminate(proc)
        raise AssertionError(f"kvstore engine register did not register: {line!r}")
    return proc, ready


def test_sidecar_sigterm_revokes_and_sigkill_expires_within_the_ttl(
    etcd: EtcdProcess,  # noqa: F811
) -> None:
    common = ("--url", URL, "--role", "prefill", "--model", "smollm2")
    proc, ready = _sidecar(etcd, *common, "--ttl", "60")
    try:
        assert ready["key"] in _list(etcd) and ready["engine_role"] == "prefill"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        assert _list(etcd) == {}  # revoked before exit, not left to its 60 s TTL
    finally:
        terminate(proc)

    ttl = 2
    proc, ready = _sidecar(etcd, *common, "--ttl", str(ttl), "--instance", "p0")
    try:
        assert list(_list(etcd)) == [ready["key"]] == ["/kvstore/engines/prefill/p0"]
        os.kill(proc.pid, signal.SIGKILL)  # dies without a word: only the lease can clean up
        proc.wait(timeout=30)
        killed = time.monotonic()
        wait_until(lambda: not _list(etcd), timeout=ttl + 10, interval=0.1, what="lease expiry")
        # etcd expires a lease between TTL and about 2 x TTL after its last keep-alive.
        assert time.monotonic() - killed < 2 * ttl + 3
    finally:
        terminate(proc)


def test_sidecar_refuses_bad_values_before_touching_etcd(etcd: EtcdProcess) -> None:  # noqa: F811
    for args in (
        ["--url", "localhost:8101", "--role", "both"],
        ["--url", URL, "--role", "both", "--ttl", "0"],
    ):
        out = subprocess.run(
            [sys.executable, "-m", "kvstore", "engine", "register", "--etcd", etcd.url, *args],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 2 and "kvstore engine:" in out.stderr
    assert _list(etcd) == {}


def test_an_outage_longer_than_the_ttl_registers_again(
    etcd: EtcdProcess,  # noqa: F811
    announcers: list[EngineAnnouncer],
) -> None:
    """etcd frozen past the lease's TTL: the lease expires; the engine kept serving meanwhile
    and its announcer registers it again once etcd answers."""
    a = EngineAnnouncer(
        parse_endpoints(etcd.endpoint), EngineRecord(URL, "both"), instance="b0", ttl_s=1
    )
    announcers.append(a)
    a.start()
    assert a.registered.wait(15)
    etcd.pause(4)  # the fault itself: longer than the TTL and several keep-alive periods
    wait_until(
        lambda: a.registered.is_set() and "/kvstore/engines/both/b0" in _list(etcd),
        timeout=30,
        what="registered again",
    )
