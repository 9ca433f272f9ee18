"""``shm_commit`` (kvstore.node.shm_verbs): bytes a same-host client copied into the arena are
committed only with a live write grant, a claim on the range, and a matching checksum; a refused
commit changes nothing."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import xxhash

from kvstore import grants, protocol
from kvstore.errors import ErrorCode, KVStoreError
from kvstore.node.arena import ShmArena
from kvstore.node.server import DataServer
from kvstore.node.shm_verbs import make_shm_commit
from kvstore.stored_object import StoredObject

SIZE = 1 << 16
NOW_MS = 1_000_000_000
TTL_MS = 10_000


class Clock:
    """Wall-clock milliseconds the test moves by hand."""

    def __init__(self) -> None:
        self.now_ms = NOW_MS

    def __call__(self) -> int:
        return self.now_ms


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def server(tmp_path: Path, clock: Clock) -> Iterator[DataServer]:
    arena = ShmArena(tmp_path / "arena", SIZE, prefault=False)
    srv = DataServer({"dram": arena}, grants.new_secret(), clock_ms=clock)
    srv.register_verb("shm_commit", make_shm_commit(srv))
    srv.register_verb("rdma_commit", make_shm_commit(srv, via="RDMA"))
    srv.start()
    yield srv
    srv.stop()
    arena.close()


@pytest.fixture
def conn(server: DataServer) -> Iterator[protocol.FramedSocket]:
    c = protocol.FramedSocket.connect(server.host, server.port, timeout=10)
    yield c
    c.close()


def grant(
    server: DataServer,
    offset: int,
    size: int,
    *,
    key: bytes = b"k",
    op: str = grants.OP_WRITE,
    expires_ms: int = NOW_MS + TTL_MS,
    segment: str = "dram",
    secret: bytes | None = None,
) -> grants.Grant:
    return grants.sign(secret or server.secret, op, key, segment, offset, size, expires_ms)


def copy_in(server: DataServer, offset: int, data: bytes) -> int:
    """What a same-host client does: copy the bytes in place; returns their checksum."""
    server.segments["dram"].view[offset : offset + len(data)] = data
    return xxhash.xxh3_64_intdigest(data)


def commit(
    conn: protocol.FramedSocket, items: list[tuple[grants.Grant, object]], verb: str = "shm_commit"
) -> list[int]:
    """The per-item result codes of one commit request."""
    results = conn.call(verb, {"items": [[g.to_wire(), c] for g, c in items]})
    return [r[0] for r in results]


def stored(server: DataServer) -> set[StoredObject]:
    return set(server.manifest.objects())


def test_a_commit_records_the_object_in_the_manifest(
    server: DataServer, conn: protocol.FramedSocket
) -> None:
    g = grant(server, 128, 5, key=b"obj")
    checksum = copy_in(server, 128, b"hello")
    assert commit(conn, [(g, checksum)]) == [ErrorCode.OK]
    assert stored(server) == {StoredObject("dram", 128, b"obj", 5, checksum, g.expires_ms)}
    assert server.stats()["num_writes"] == 1


@pytest.mark.parametrize("left_ms", [TTL_MS, 1, 0])
def test_a_grant_commits_up_to_its_expiry(
    server: DataServer, conn: protocol.FramedSocket, clock: Clock, left_ms: int
) -> None:
    g = grant(server, 0, 4)
    clock.now_ms = g.expires_ms - left_ms
    assert commit(conn, [(g, copy_in(server, 0, b"abcd"))]) == [ErrorCode.OK]


BAD = [
    # (what is wrong, grant keywords, checksum: None means the right one, then the code)
    ("expired", {"expires_ms": NOW_MS - 1}, None, ErrorCode.GRANT_INVALID),
    ("read grant", {"op": grants.OP_READ}, None, ErrorCode.GRANT_INVALID),
    ("forged", {"secret": b"f" * 32}, None, ErrorCode.GRANT_INVALID),
    ("no such segment", {"segment": "hbm"}, None, ErrorCode.GRANT_INVALID),
    ("bytes differ", {}, 12345, ErrorCode.CHECKSUM_MISMATCH),
    ("checksum not an int", {}, "x", ErrorCode.INVALID_REQUEST),
    ("checksum a bool", {}, True, ErrorCode.INVALID_REQUEST),
]


@pytest.mark.parametrize(
    ("grant_kw", "checksum", "code"), [b[1:] for b in BAD], ids=[b[0] for b in BAD]
)
def test_a_refused_commit_changes_nothing(
    server: DataServer,
    conn: protocol.FramedSocket,
    grant_kw: dict[str, object],
    checksum: object,
    code: ErrorCode,
) -> None:
    good = copy_in(server, 64, b"data")
    g = grant(server, 64, 4, **grant_kw)  # type: ignore[arg-type]
    assert commit(conn, [(g, good if checksum is None else checksum)]) == [code]
    assert stored(server) == set() and server.stats()["num_objects"] == 0
    # The range is still free for its own allocation's commit.
    right = grant(server, 64, 4)
    assert commit(conn, [(right, good)]) == [ErrorCode.OK]


def test_a_grant_past_the_segment_is_out_of_range(
    server: DataServer, conn: protocol.FramedSocket
) -> None:
    assert commit(conn, [(grant(server, SIZE - 2, 4), 0)]) == [ErrorCode.OUT_OF_RANGE]
    assert stored(server) == set()


def test_a_failed_checksum_does_not_use_the_grant_up(
    server: DataServer, conn: protocol.FramedSocket
) -> None:
    g = grant(server, 0, 4)
    right = xxhash.xxh3_64_intdigest(b"good")
    copy_in(server, 0, b"half")  # the copy is not finished yet
    assert commit(conn, [(g, right)]) == [ErrorCode.CHECKSUM_MISMATCH]
    copy_in(server, 0, b"good")
    assert commit(conn, [(g, right)]) == [ErrorCode.OK]


def test_a_commit_uses_the_grant_up(server: DataServer, conn: protocol.FramedSocket) -> None:
    g = grant(server, 0, 4)
    checksum = copy_in(server, 0, b"once")
    assert commit(conn, [(g, checksum)]) == [ErrorCode.OK]
    server.manifest.clear()
    assert commit(conn, [(g, checksum)]) == [ErrorCode.GRANT_INVALID], "a replay"
    assert stored(server) == set()


def test_a_newer_allocation_refuses_an_older_grant(
    server: DataServer, conn: protocol.FramedSocket
) -> None:
    # The master freed [0, 8) and handed [4, 12) to the next object (a later put: a later
    # expiry). Once the new tenant committed, the old grant commits nothing there.
    old = grant(server, 0, 8, key=b"old", expires_ms=NOW_MS + TTL_MS)
    new = grant(server, 4, 8, key=b"new", expires_ms=NOW_MS + TTL_MS + 1)
    new_sum = copy_in(server, 4, b"NEWBYTES")
    assert commit(conn, [(new, new_sum)]) == [ErrorCode.OK]
    old_sum = xxhash.xxh3_64_intdigest(bytes(server.segments["dram"].view[0:8]))
    assert commit(conn, [(old, old_sum)]) == [ErrorCode.GRANT_INVALID]
    assert {o.key for o in stored(server)} == {b"new"}


def test_a_newer_grant_commits_over_an_older_one(
    server: DataServer, conn: protocol.FramedSocket
) -> None:
    old = grant(server, 0, 4, key=b"old", expires_ms=NOW_MS + TTL_MS)
    assert commit(conn, [(old, copy_in(server, 0, b"old!"))]) == [ErrorCode.OK]
    new = grant(server, 0, 4, key=b"new", expires_ms=NOW_MS + TTL_MS + 5)
    assert commit(conn, [(new, copy_in(server, 0, b"new!"))]) == [ErrorCode.OK]
    assert [o.key for o in stored(server)] == [b"new"], "one record per place"


def test_each_item_of_a_batch_stands_alone(server: DataServer, conn: protocol.FramedSocket) -> None:
    a, b, c = grant(server, 0, 4, key=b"a"), grant(server, 64, 4, key=b"b"), grant(server, 128, 4)
    sums = [
        copy_in(server, 0, b"aaaa"),
        copy_in(server, 64, b"bbbb"),
        copy_in(server, 128, b"cccc"),
    ]
    assert commit(conn, [(a, sums[0]), (b, 1), (c, sums[2])]) == [
        ErrorCode.OK,
        ErrorCode.CHECKSUM_MISMATCH,
        ErrorCode.OK,
    ]
    assert {o.offset for o in stored(server)} == {0, 128}


@pytest.mark.parametrize(
    "args",
    [{}, {"items": "x"}, {"items": [[1, 2, 3]]}, {"items": [None]}],
    ids=["no-items", "not-a-list", "three-fields", "not-a-pair"],
)
def test_a_malformed_request_is_refused_whole(
    server: DataServer, conn: protocol.FramedSocket, args: dict[str, object]
) -> None:
    with pytest.raises(KVStoreError) as err:
        conn.call("shm_commit", args)
    assert err.value.code == ErrorCode.INVALID_REQUEST
    assert conn.call("ping", {}) == {"role": "node"}, "the connection stays usable"


def test_a_commit_carries_no_payload(server: DataServer, conn: protocol.FramedSocket) -> None:
    g = grant(server, 0, 4)
    conn.send_request("shm_commit", {"items": [[g.to_wire(), 0]]}, [b"abcd"])
    response, _ = conn.read_response()
    assert response.code != 0
    assert stored(server) == set()
    assert conn.call("ping", {}) == {"role": "node"}


def test_rdma_commit_says_which_transport_wrote_the_bytes(
    server: DataServer, conn: protocol.FramedSocket
) -> None:
    g = grant(server, 0, 4)
    (result,) = conn.call("rdma_commit", {"items": [[g.to_wire(), 1]]})
    assert result[0] == ErrorCode.CHECKSUM_MISMATCH and "RDMA" in result[1]
    assert commit(conn, [(g, copy_in(server, 0, b"rdma"))], "rdma_commit") == [ErrorCode.OK]


def test_a_new_secret_refuses_grants_of_the_old_one(
    server: DataServer, conn: protocol.FramedSocket
) -> None:
    g = grant(server, 0, 4)
    checksum = copy_in(server, 0, b"abcd")
    server.secret = grants.new_secret()  # the node registered again
    assert commit(conn, [(g, checksum)]) == [ErrorCode.GRANT_INVALID]
    assert stored(server) == set()
