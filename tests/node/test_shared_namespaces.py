"""Shared namespaces on a node's data port: a tenant's connection may use a grant for a block
of a namespace the operator shared (a key with no tenant prefix, ``kv/<digest hex>/...``), while
another tenant's keys, the operator's other keys and blocks of namespaces not shared stay
refused. The node takes the shared set from the master's directory wire form. Against an
in-process DataServer over real sockets, as tests/node/test_tenants.py."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import xxhash

from kvstore import auth, grants, protocol
from kvstore.errors import ErrorCode, InvalidRequestError
from kvstore.keys import BLOCK_KEY_BYTES
from kvstore.kvblocks import kv_meta_key, kv_object_key
from kvstore.node.server import DataServer
from kvstore.stored_object import StoredObject
from kvstore.tenants import TenantDirectory, tenant_key, token_digest
from tests.node import data_server

SIZE = 1 << 20
LATER = 2**62
CLUSTER = "cluster-token-0123456789"
ACME = "acme-token-0123456789abcdef"
BOLT = "bolt-token-0123456789abcdef"
FORBIDDEN = int(ErrorCode.FORBIDDEN)
SHARED = bytes(range(16))
PRIVATE = bytes(range(16, 32))
BLOCK = b"\x07" * BLOCK_KEY_BYTES
#: Each object: its stored key and where it lies in the DRAM arena.
OBJECTS = {
    "shared": (kv_object_key(SHARED, BLOCK), 0),
    "shared-meta": (kv_meta_key(SHARED, BLOCK), 4096),
    "acme": (tenant_key("acme", kv_object_key(SHARED, BLOCK)), 8192),
    "unshared": (kv_object_key(PRIVATE, BLOCK), 12288),
    "operator": (b"doc", 16384),
}
OBJ_SIZE = 64


def _content(name: str) -> bytes:
    return (name.encode() * OBJ_SIZE)[:OBJ_SIZE]


@pytest.fixture
def server(tmp_path: Path) -> Iterator[DataServer]:
    digests = {token_digest(ACME): "acme", token_digest(BOLT): "bolt"}
    directory = TenantDirectory(digests, 1)
    token = auth.Token(CLUSTER)
    with data_server.running(tmp_path, SIZE, 4 << 20, token=token, tenants=directory) as srv:
        for name, (key, offset) in OBJECTS.items():
            data = _content(name)
            obj = StoredObject("dram", offset, key, OBJ_SIZE, xxhash.xxh3_64_intdigest(data), 1)
            assert srv.store_objects("dram", [(obj, memoryview(data))]) == [None]
        # What the node's agent does with the master's reply: the shared set comes with it.
        master = TenantDirectory(digests, version=2, shared=[SHARED])
        assert srv.tenants.take_wire(master.wire())
        yield srv


@pytest.fixture
def bolt(server: DataServer) -> Iterator[protocol.FramedSocket]:
    with contextlib.ExitStack() as stack:
        conn = stack.enter_context(data_server.connected(server))
        conn.call("hello", {"token": BOLT})
        yield conn


def _read(server: DataServer, conn: protocol.FramedSocket, names: list[str]) -> list[Any]:
    wires = [
        grants.sign(
            server.secret, grants.OP_READ, OBJECTS[n][0], "dram", OBJECTS[n][1], OBJ_SIZE, LATER
        ).to_wire()
        for n in names
    ]
    conn.send_request("read", {"items": [[g, None] for g in wires]})
    response, payload = conn.read_response()
    body = memoryview(bytearray(payload))
    conn.recv_into(body)
    results = response.unwrap()
    return [bytes(body) if r == [0, OBJ_SIZE] else r for r in results]


def _code(result: Any) -> int | None:
    return result[0] if isinstance(result, list) and result and result[0] != 0 else None


def test_a_tenant_reads_shared_blocks_but_not_anothers(server: DataServer, bolt) -> None:
    for name in ("shared", "shared-meta"):
        assert _read(server, bolt, [name]) == [_content(name)], name
    for name in ("acme", "unshared", "operator"):
        assert _code(_read(server, bolt, [name])[0]) == FORBIDDEN, name


def test_unsharing_closes_the_shared_blocks(server: DataServer, bolt) -> None:
    digests = server.tenants.wire()["digests"]
    assert server.tenants.take_wire({"version": 3, "digests": digests})  # no "shared": none
    assert not server.tenants.shared
    assert _code(_read(server, bolt, ["shared"])[0]) == FORBIDDEN


def test_the_wire_form_is_backward_compatible_and_checked() -> None:
    plain = TenantDirectory({token_digest(ACME): "acme"}, 5)
    assert "shared" not in plain.wire()  # a node that predates shared namespaces reads it
    d = TenantDirectory()
    assert d.take_wire(plain.wire()) and not d.shared
    with pytest.raises(InvalidRequestError):
        d.take_wire({"version": 9, "digests": {}, "shared": [b"short"]})
    with pytest.raises(InvalidRequestError):
        d.take_wire({"version": 9, "digests": {}, "shared": "x"})
    assert d.version == 5  # a malformed form changed nothing
    assert d.take_wire(TenantDirectory({}, 6, shared=[SHARED]).wire())
    assert d.shared == {SHARED}
    assert d.is_shared_key(kv_object_key(SHARED, BLOCK))
    assert d.is_shared_key(kv_meta_key(SHARED, BLOCK))
    assert not d.is_shared_key(kv_object_key(PRIVATE, BLOCK))
    assert not d.is_shared_key(b"kv/" + SHARED.hex().encode())  # no "/" after the digest
    assert not d.is_shared_key(tenant_key("acme", kv_object_key(SHARED, BLOCK)))
    assert not d.is_shared_key(b"kv/" + SHARED.hex().upper().encode() + b"/x")
