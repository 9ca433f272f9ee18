"""What kvstore keeps in etcd (kvstore.etcd_keys): the key layout, leader and node records and
their epochs, and foreign values that are ignored rather than trusted. A fake store of our own
stands in for etcd; the resolver's bound is checked against an etcd that is not there."""

from __future__ import annotations

import asyncio
import socket
import time

import pytest

from kvstore.address import Address
from kvstore.errors import InvalidRequestError, MasterUnavailableError
from kvstore.etcd import KeyValue
from kvstore.etcd_keys import (
    EtcdLayout,
    LeaderRecord,
    LeaderResolver,
    NodeRecord,
    read_leader,
    read_members,
)

LAYOUT = EtcdLayout("/kv/test")


def kv(key: bytes, value: bytes, lease: int = 7, create: int = 3) -> KeyValue:
    return KeyValue(key, value, create, create, lease)


class FakeStore:
    """The two reads discovery makes of etcd, over a dict."""

    def __init__(self, *kvs: KeyValue) -> None:
        self.kvs = {k.key: k for k in kvs}

    async def get(self, key: bytes) -> KeyValue | None:
        return self.kvs.get(key)

    async def get_prefix(self, prefix: bytes) -> list[KeyValue]:
        return [v for k, v in sorted(self.kvs.items()) if k.startswith(prefix)]


@pytest.mark.parametrize("prefix", ["kv", "/kv/", "", "/" + "x" * 200])
def test_a_bad_prefix_is_refused(prefix: str) -> None:
    with pytest.raises(InvalidRequestError):
        EtcdLayout(prefix)


def test_the_keys_live_under_the_prefix() -> None:
    assert LAYOUT.leader_key == b"/kv/test/leader"
    assert LAYOUT.node_key("n1") == b"/kv/test/nodes/n1"
    assert LAYOUT.node_key("n1").startswith(LAYOUT.nodes_prefix)
    assert EtcdLayout().leader_key == b"/kvstore/default/leader"


def test_a_leader_record_round_trips_and_its_epoch_is_the_create_revision() -> None:
    raw = LeaderRecord.encode("10.0.0.1:7000", "http://10.0.0.1:7001")
    rec = LeaderRecord.from_kv(kv(LAYOUT.leader_key, raw, create=42))
    assert rec == LeaderRecord(Address("10.0.0.1", 7000), "http://10.0.0.1:7001", 42)


@pytest.mark.parametrize(
    ("value", "lease"),
    [
        (LeaderRecord.encode("h:1", ""), 0),  # no lease: not written by a master
        (b"not json", 7),
        (b'{"admin": "x"}', 7),
        (b'{"control": "no-port"}', 7),
        (b'["h:1"]', 7),
    ],
    ids=["no-lease", "not-json", "no-control", "bad-address", "not-a-map"],
)
def test_a_foreign_leader_value_is_refused(value: bytes, lease: int) -> None:
    with pytest.raises(InvalidRequestError):
        LeaderRecord.from_kv(kv(LAYOUT.leader_key, value, lease=lease))


def test_a_node_record_round_trips() -> None:
    rec = NodeRecord.from_kv(LAYOUT, kv(LAYOUT.node_key("n1"), NodeRecord.encode("h:9")))
    assert rec == NodeRecord("n1", "h:9")


@pytest.mark.parametrize(
    ("key", "value", "lease"),
    [
        (LAYOUT.node_key("n1"), NodeRecord.encode("h:9"), 0),
        (LAYOUT.node_key(""), NodeRecord.encode("h:9"), 7),
        (LAYOUT.node_key("a/b"), NodeRecord.encode("h:9"), 7),
        (LAYOUT.node_key("n1"), b"{}", 7),
        (LAYOUT.node_key("n1"), b"\xff", 7),
    ],
    ids=["no-lease", "no-id", "nested", "no-data", "not-json"],
)
def test_a_foreign_node_value_is_refused(key: bytes, value: bytes, lease: int) -> None:
    with pytest.raises(InvalidRequestError):
        NodeRecord.from_kv(LAYOUT, kv(key, value, lease=lease))


def test_read_leader_ignores_what_a_master_did_not_write() -> None:
    good = kv(LAYOUT.leader_key, LeaderRecord.encode("h:1", "a"), create=9)
    assert asyncio.run(read_leader(FakeStore(good), LAYOUT)) == LeaderRecord(
        Address("h", 1), "a", 9
    )
    assert asyncio.run(read_leader(FakeStore(), LAYOUT)) is None
    foreign = kv(LAYOUT.leader_key, b"hello", create=9)
    assert asyncio.run(read_leader(FakeStore(foreign), LAYOUT)) is None


def test_read_members_keeps_only_our_node_records() -> None:
    store = FakeStore(
        kv(LAYOUT.node_key("n1"), NodeRecord.encode("h:1")),
        kv(LAYOUT.node_key("n2"), NodeRecord.encode("h:2")),
        kv(LAYOUT.node_key("bad"), b"garbage"),
        kv(LAYOUT.node_key("n3"), NodeRecord.encode("h:3"), lease=0),
        kv(LAYOUT.leader_key, LeaderRecord.encode("h:1", "")),
        kv(b"/kv/other/nodes/n9", NodeRecord.encode("h:9")),
    )
    members = asyncio.run(read_members(store, LAYOUT))
    assert members == {"n1": NodeRecord("n1", "h:1"), "n2": NodeRecord("n2", "h:2")}


def test_the_resolver_gives_up_at_its_bound_without_etcd() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    resolver = LeaderResolver([Address("127.0.0.1", port)], LAYOUT)
    try:
        started = time.monotonic()
        with pytest.raises(MasterUnavailableError) as err:
            resolver.resolve(timeout=0.5)
        assert f"127.0.0.1:{port}" in err.value.message
        assert time.monotonic() - started < 30
    finally:
        resolver.close()
