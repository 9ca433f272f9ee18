"""The node's ``read_keys`` verb (one-hop reads, kvstore.placement), against an in-process
DataServer over real sockets: objects held whole in DRAM are sent by key with their stored
checksum; anything else is a miss that changes nothing; a node not sure it is still a member
refuses every item; a tenant's connection finds only its own keys."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import xxhash

from kvstore import auth, protocol
from kvstore.errors import ErrorCode, InvalidRequestError
from kvstore.node.server import DataServer
from kvstore.stored_object import StoredObject
from kvstore.tenants import TenantDirectory, tenant_key, token_digest
from tests.node import data_server

CLUSTER = "cluster-token-0123456789"
ACME = "acme-token-0123456789abcdef"
MISS = int(ErrorCode.KEY_NOT_FOUND)
REFUSED = int(ErrorCode.NODE_UNAVAILABLE)


def _value(n: int, seed: int) -> bytes:
    return bytes((seed + i) % 251 for i in range(n))


@pytest.fixture
def server(tmp_path: Path) -> Iterator[DataServer]:
    directory = TenantDirectory({token_digest(ACME): "acme"}, version=1)
    with data_server.running(
        tmp_path, 1 << 20, 4 << 20, token=auth.Token(CLUSTER), tenants=directory
    ) as srv:
        # Mixed sizes in DRAM, one object on NVMe, one tenant's object.
        for key, size, offset, segment in [
            (b"small", 100, 0, "dram"),
            (b"mid", 70_000, 4096, "dram"),
            (b"big", 300_000, 81920, "dram"),
            (b"cold", 5000, 0, "nvme"),
            (tenant_key("acme", b"doc"), 64, 393216, "dram"),
        ]:
            data = _value(size, len(key))
            obj = StoredObject(segment, offset, key, size, xxhash.xxh3_64_intdigest(data), 1)
            assert srv.store_objects(segment, [(obj, memoryview(data))]) == [None]
        srv.one_hop_until = time.monotonic() + 3600
        yield srv


@pytest.fixture
def connect(server: DataServer) -> Iterator[Any]:
    with data_server.hello_connections(server) as open_as:
        yield open_as


def _read_keys(conn: protocol.FramedSocket, items: list[Any]) -> tuple[list[Any], bytes]:
    conn.send_request("read_keys", {"items": items})
    response, payload_len = conn.read_response()
    body = memoryview(bytearray(payload_len))
    conn.recv_into(body)
    return response.unwrap(), bytes(body)


def test_objects_in_memory_come_by_key_with_their_checksum_and_the_rest_miss(
    server: DataServer, connect: Any
) -> None:
    conn = connect(CLUSTER)
    results, payload = _read_keys(
        conn,
        [[b"big", 1 << 20], [b"nope", 100], [b"small", 100], [b"cold", 5000], [b"mid", 69_999]],
    )
    big, small = _value(300_000, 3), _value(100, 5)
    assert results[0] == [300_000, xxhash.xxh3_64_intdigest(big)]
    assert results[2] == [100, xxhash.xxh3_64_intdigest(small)]
    # Not held, on NVMe (the master's way), larger than the room the client has: misses.
    assert [r[0] for r in (results[1], results[3], results[4])] == [MISS] * 3
    assert payload == big + small
    assert server.num_reads == 2


def test_a_node_not_sure_it_is_still_a_member_refuses_every_item(
    server: DataServer, connect: Any
) -> None:
    """The fence rule: past half of ``node_ttl_s`` since its last acknowledged heartbeat the
    master may have declared the node dead, so the node sends nothing by key."""
    server.one_hop_until = time.monotonic() - 1
    results, payload = _read_keys(connect(CLUSTER), [[b"small", 100], [b"big", 1 << 20]])
    assert [r[0] for r in results] == [REFUSED, REFUSED] and payload == b""


def test_a_tenant_finds_only_its_own_keys(server: DataServer, connect: Any) -> None:
    acme = connect(ACME)
    results, payload = _read_keys(acme, [[tenant_key("acme", b"doc"), 64], [b"small", 100]])
    assert results[0][0] == 64 and results[1][0] == MISS
    assert payload == _value(64, len(tenant_key("acme", b"doc")))


@pytest.mark.parametrize(
    "args",
    [{}, {"items": "x"}, {"items": [["k", 10]]}, {"items": [[b"k"]]}, {"items": [[b"k", "10"]]}],
)
def test_a_malformed_request_is_refused_whole(
    server: DataServer, connect: Any, args: dict[str, Any]
) -> None:
    conn = connect(CLUSTER)
    conn.send_request("read_keys", args)
    response, payload_len = conn.read_response()
    with pytest.raises(InvalidRequestError):
        response.unwrap()
    assert payload_len == 0 and server.num_reads == 0
