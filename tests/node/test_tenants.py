"""Tenants on a node's data port (kvstore.node.server, verbs, shm_verbs): a connection bound to
a tenant at ``hello`` may use only grants for its own tenant's keys. Another tenant's grants, or
grants for the operator's key space, however validly signed (a replayed grant), are refused per
item with FORBIDDEN and change nothing, one-key and batch, read, write and shm commit; the
operator's connection uses any grant; a deleted tenant's open connection is refused at its next
request. Against an in-process DataServer over real sockets, with a directory the test fills."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import xxhash

from kvstore import auth, grants, protocol
from kvstore.errors import (
    ErrorCode,
    ForbiddenError,
    TransportUnavailableError,
    UnauthenticatedError,
)
from kvstore.node.rdma import NodeRdma, make_rdma_connect
from kvstore.node.server import DataServer
from kvstore.node.shm_verbs import make_shm_commit
from kvstore.rdma import wire as rdma_wire
from kvstore.stored_object import StoredObject
from kvstore.tenants import TenantDirectory, tenant_key, token_digest
from tests.node import data_server

SIZE = 1 << 20
#: Far in the future: a grant that does not expire during the test.
LATER = 2**62
CLUSTER = "cluster-token-0123456789"
ACME = "acme-token-0123456789abcdef"
BOLT = "bolt-token-0123456789abcdef"
FORBIDDEN = int(ErrorCode.FORBIDDEN)
#: Each owner's object: its stored key and where it lies in the DRAM arena.
OBJECTS = {
    "acme": (tenant_key("acme", b"doc"), 0),
    "bolt": (tenant_key("bolt", b"doc"), 4096),
    "operator": (b"doc", 8192),
}
OBJ_SIZE = 64
#: Where writes land (away from the seeded objects), per owner.
WRITE_AT = {"acme": 16384, "bolt": 20480, "operator": 24576}

Connect = data_server.Connect


@pytest.fixture
def directory() -> TenantDirectory:
    return TenantDirectory({token_digest(ACME): "acme", token_digest(BOLT): "bolt"}, version=1)


@pytest.fixture
def server(tmp_path: Path, directory: TenantDirectory) -> Iterator[DataServer]:
    token = auth.Token(CLUSTER)
    with data_server.running(tmp_path, SIZE, 4 << 20, token=token, tenants=directory) as srv:
        srv.register_verb("shm_commit", make_shm_commit(srv))
        for owner, (key, offset) in OBJECTS.items():
            data = _content(owner)
            obj = StoredObject("dram", offset, key, OBJ_SIZE, xxhash.xxh3_64_intdigest(data), 1)
            assert srv.store_objects("dram", [(obj, memoryview(data))]) == [None]
        yield srv


@pytest.fixture
def connect(server: DataServer) -> Iterator[Connect]:
    """Opens a connection that said hello with a token (closed after the test)."""
    with data_server.hello_connections(server) as open_as:
        yield open_as


def _content(owner: str) -> bytes:
    return (owner.encode() * OBJ_SIZE)[:OBJ_SIZE]


def _state(server: DataServer) -> tuple[bytes, list[Any]]:
    """What a refused request must not change: the arena's used bytes and the manifest."""
    return bytes(server.tiers["dram"].in_place(0, 32768)), sorted(server.manifest.snapshot())


def _grants(server: DataServer, op: str, owners: list[str], batch: bool) -> list[Any]:
    """Wire grants for ``op`` on each owner's object (reads) or write place (writes): one-key
    grants, or references into one batch grant."""
    places = [
        (OBJECTS[o][0], OBJECTS[o][1] if op == grants.OP_READ else WRITE_AT[o]) for o in owners
    ]
    if not batch:
        return [
            grants.sign(server.secret, op, key, "dram", off, OBJ_SIZE, LATER).to_wire()
            for key, off in places
        ]
    signed = grants.sign_batch(
        server.secret, op, LATER, [[key, "dram", off, OBJ_SIZE] for key, off in places]
    )
    return [[0, 0, signed]] + [[0, i] for i in range(1, len(places))]


def _read(conn: protocol.FramedSocket, wires: list[Any]) -> tuple[list[Any], bytes]:
    conn.send_request("read", {"items": [[g, None] for g in wires]})
    response, payload = conn.read_response()
    body = memoryview(bytearray(payload))
    conn.recv_into(body)
    return response.unwrap(), bytes(body)


def _write(conn: protocol.FramedSocket, wires: list[Any], data: list[bytes]) -> list[Any]:
    items = [[g, 0, len(d), xxhash.xxh3_64_intdigest(d)] for g, d in zip(wires, data, strict=True)]
    conn.send_request("write", {"items": items}, data)
    response, _ = conn.read_response()
    return response.unwrap()


def _codes(results: list[Any]) -> list[int]:
    return [r[0] for r in results]


# ------------------------------------------------------------------ reads
@pytest.mark.parametrize("batch", [False, True], ids=["one-key", "batch"])
def test_a_tenant_reads_its_own_objects_and_no_one_elses(
    server: DataServer, connect: Connect, batch: bool
) -> None:
    acme = connect(ACME)
    owners = ["acme", "bolt", "operator", "acme"]
    before = _state(server)
    results, payload = _read(acme, _grants(server, grants.OP_READ, owners, batch))
    assert _codes(results) == [0, FORBIDDEN, FORBIDDEN, 0]
    assert payload == _content("acme") * 2, "not one byte of another's object"
    assert _state(server) == before


@pytest.mark.parametrize("batch", [False, True], ids=["one-key", "batch"])
def test_the_operator_reads_every_tenants_objects(
    server: DataServer, connect: Connect, batch: bool
) -> None:
    owners = ["acme", "bolt", "operator"]
    results, payload = _read(connect(CLUSTER), _grants(server, grants.OP_READ, owners, batch))
    assert _codes(results) == [0, 0, 0]
    assert payload == b"".join(_content(o) for o in owners)


def test_a_replayed_grant_is_refused_to_another_tenant(
    server: DataServer, connect: Connect
) -> None:
    """The same wire grant that just served acme (and sits in the node's memo of verified
    grants) is refused to bolt's connection."""
    wires = _grants(server, grants.OP_READ, ["acme"], batch=False)
    assert _codes(_read(connect(ACME), wires)[0]) == [0]
    results, payload = _read(connect(BOLT), wires)
    assert _codes(results) == [FORBIDDEN] and payload == b""
    assert "acme" not in results[0][1], "the refusal does not say whose the key is"


# ------------------------------------------------------------------ writes
@pytest.mark.parametrize("batch", [False, True], ids=["one-key", "batch"])
def test_a_tenant_cannot_write_with_another_tenants_grants(
    server: DataServer, connect: Connect, batch: bool
) -> None:
    bolt = connect(BOLT)
    owners = ["acme", "operator", "bolt"]
    data = [b"B" * OBJ_SIZE for _ in owners]
    before = _state(server)
    results = _write(bolt, _grants(server, grants.OP_WRITE, owners, batch), data)
    assert _codes(results) == [FORBIDDEN, FORBIDDEN, 0]
    arena, manifest = _state(server)
    at = WRITE_AT["bolt"]
    assert arena[at : at + OBJ_SIZE] == b"B" * OBJ_SIZE, "its own item was written"
    expected = bytearray(before[0])
    expected[at : at + OBJ_SIZE] = b"B" * OBJ_SIZE
    assert arena == bytes(expected), "nothing else changed"
    checksum = xxhash.xxh3_64_intdigest(b"B" * OBJ_SIZE)
    stored = StoredObject("dram", at, OBJECTS["bolt"][0], OBJ_SIZE, checksum, LATER)
    assert [StoredObject.from_wire(m) for m in manifest if m not in before[1]] == [stored]
    # The refused grants stay unused: their owners still write with them afterwards.
    refused = _grants(server, grants.OP_WRITE, ["acme"], batch=False)
    assert _codes(_write(connect(ACME), refused, [b"A" * OBJ_SIZE])) == [0]


@pytest.mark.parametrize("batch", [False, True], ids=["one-key", "batch"])
def test_the_operator_writes_with_any_grant(
    server: DataServer, connect: Connect, batch: bool
) -> None:
    owners = ["acme", "bolt", "operator"]
    data = [o.upper().encode() * (OBJ_SIZE // len(o)) for o in owners]
    results = _write(connect(CLUSTER), _grants(server, grants.OP_WRITE, owners, batch), data)
    assert _codes(results) == [0, 0, 0]
    for owner, d in zip(owners, data, strict=True):
        at = WRITE_AT[owner]
        assert bytes(server.tiers["dram"].in_place(at, len(d))) == d


# ------------------------------------------------------------------ shared memory
@pytest.mark.parametrize("batch", [False, True], ids=["one-key", "batch"])
def test_a_tenant_cannot_commit_another_tenants_bytes_written_in_place(
    server: DataServer, connect: Connect, batch: bool
) -> None:
    """What a same-host client does (kvstore.client.shm): copy bytes in place, then
    ``shm_commit`` them on its data connection: bolt's commit of acme's grant records nothing."""
    arena = server.segments["dram"].view
    data = b"S" * OBJ_SIZE
    for at in WRITE_AT.values():
        arena[at : at + OBJ_SIZE] = data
    checksum = xxhash.xxh3_64_intdigest(data)
    owners = ["acme", "operator", "bolt"]
    wires = _grants(server, grants.OP_WRITE, owners, batch)
    before = sorted(server.manifest.snapshot())
    results = connect(BOLT).call("shm_commit", {"items": [[g, checksum] for g in wires]})
    assert _codes(results) == [FORBIDDEN, FORBIDDEN, 0]
    added = [m for m in sorted(server.manifest.snapshot()) if m not in before]
    assert [StoredObject.from_wire(m).key for m in added] == [OBJECTS["bolt"][0]]
    # Their owners commit them: acme its own, the operator one in its key space.
    acme, operator = _grants(server, grants.OP_WRITE, ["acme", "operator"], batch=False)
    assert _codes(connect(ACME).call("shm_commit", {"items": [[acme, checksum]]})) == [0]
    assert _codes(connect(CLUSTER).call("shm_commit", {"items": [[operator, checksum]]})) == [0]


def test_a_tenant_gets_no_rdma_queue_pair(server: DataServer, connect: Connect) -> None:
    """A queue pair opens the whole arena to one-sided access that no grant checks: a tenant's
    connection is told to use TCP, before any queue pair is made."""

    def no_queue_pair(ctx: object) -> object:
        raise AssertionError("no queue pair for a tenant")

    server.register_verb("rdma_connect", make_rdma_connect(NodeRdma(None, make_qp=no_queue_pair)))
    endpoint = rdma_wire.QpEndpoint(bytes(16), 1, 7, 9).to_wire()
    with pytest.raises(TransportUnavailableError, match="TCP"):
        connect(ACME).call("rdma_connect", {"endpoint": endpoint})


# ------------------------------------------------------------------ the rest of the port
def test_a_tenant_may_not_read_the_manifest(server: DataServer, connect: Connect) -> None:
    with pytest.raises(ForbiddenError):
        connect(ACME).call("manifest", {})
    assert len(connect(CLUSTER).call("manifest", {})) == len(OBJECTS)


def test_a_deleted_tenants_open_connection_is_refused_at_its_next_request(
    server: DataServer, connect: Connect, directory: TenantDirectory
) -> None:
    acme, bolt = connect(ACME), connect(BOLT)
    wires = _grants(server, grants.OP_READ, ["acme"], batch=False)
    assert _codes(_read(acme, wires)[0]) == [0]
    assert directory.replace({token_digest(BOLT): "bolt"}, version=2)  # acme deleted
    with pytest.raises(UnauthenticatedError):
        _read(acme, wires)
    with pytest.raises(UnauthenticatedError):  # and its token opens no new one
        connect(ACME)
    assert _codes(_read(bolt, _grants(server, grants.OP_READ, ["bolt"], batch=False))[0]) == [0]


def test_a_connection_that_says_hello_again_is_bound_to_its_new_token(
    server: DataServer, connect: Connect
) -> None:
    conn = connect(ACME)
    wires = _grants(server, grants.OP_READ, ["bolt"], batch=False)
    assert _codes(_read(conn, wires)[0]) == [FORBIDDEN]
    conn.call("hello", {"token": BOLT})
    assert _codes(_read(conn, wires)[0]) == [0]
    conn.call("hello", {"token": CLUSTER})
    operator = _grants(server, grants.OP_READ, ["operator"], batch=False)
    assert _codes(_read(conn, operator)[0]) == [0]
