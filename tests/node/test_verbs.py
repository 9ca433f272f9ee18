"""The node's ``write`` verb, step by step, against an in-process DataServer over real sockets:
a request refused as a whole changes nothing; an item refused alone (bad range, checksum, stale
or expired grant) is answered its error while the others are stored; a batch of mixed sizes
over both kinds of tier is stored and reads back."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import xxhash

from kvstore import grants, protocol
from kvstore.errors import ErrorCode, InvalidRequestError, ProtocolError
from kvstore.node.server import DataServer
from kvstore.node.verbs import check_write_items
from tests.node import data_server

SIZE = 1 << 20
#: Far in the future: a grant that does not expire during the test.
LATER = 2**62


@pytest.fixture
def server(tmp_path: Path) -> Iterator[DataServer]:
    with data_server.running(tmp_path, SIZE, 4 << 20) as srv:
        yield srv


@pytest.fixture
def conn(server: DataServer) -> Iterator[protocol.FramedSocket]:
    with data_server.connected(server) as c:
        yield c


def _grant(
    server: DataServer, key: bytes, segment: str, offset: int, size: int, expires: int = LATER
) -> list[Any]:
    return grants.sign(
        server.secret, grants.OP_WRITE, key, segment, offset, size, expires
    ).to_wire()


def _item(grant: list[Any], data: bytes, start: int = 0) -> list[Any]:
    return [grant, start, len(data), xxhash.xxh3_64_intdigest(data)]


def _write(conn: protocol.FramedSocket, items: list[Any], payload: list[bytes]) -> Any:
    conn.send_request("write", {"items": items}, payload)
    response, _ = conn.read_response()
    return response


def _state(server: DataServer) -> tuple[bytes, list[Any]]:
    """What a write can change: the DRAM arena's first bytes and the manifest."""
    return bytes(server.tiers["dram"].in_place(0, 4096)), sorted(server.manifest.snapshot())


# ------------------------------------------------------------------ check: the whole request
def _request(args: dict[str, Any]) -> protocol.Request:
    return protocol.Request(1, "write", args)


@pytest.mark.parametrize(
    ("args", "payload_len", "error"),
    [
        ({}, 0, InvalidRequestError),
        ({"items": "x"}, 0, InvalidRequestError),
        ({"items": [[b"g", 0, 4]]}, 4, InvalidRequestError),
        ({"items": [(b"g", 0, 4, 0)]}, 4, InvalidRequestError),
        ({"items": [[b"g", 0, -1, 0]]}, 0, InvalidRequestError),
        ({"items": [[b"g", 0, True, 0]]}, 1, InvalidRequestError),
        ({"items": [[b"g", 0, 4.0, 0]]}, 4, InvalidRequestError),
        ({"items": [[b"g", 0, 4, 0]]}, 5, ProtocolError),
        ({"items": [[b"g", 0, 4, 0], [b"h", 0, 4, 0]]}, 4, ProtocolError),
    ],
    ids=[
        "no items",
        "items not a list",
        "three fields",
        "item not a list",
        "negative length",
        "bool length",
        "float length",
        "payload too long",
        "payload too short",
    ],
)
def test_a_malformed_request_is_refused_as_a_whole(
    args: dict[str, Any], payload_len: int, error: type[Exception]
) -> None:
    with pytest.raises(error):
        check_write_items(_request(args), payload_len)


def test_a_request_refused_as_a_whole_changes_nothing_and_claims_nothing(
    server: DataServer, conn: protocol.FramedSocket
) -> None:
    grant = _grant(server, b"k", "dram", 0, 4)
    before = _state(server)
    bad_requests: list[tuple[dict[str, Any], list[bytes]]] = [
        ({"items": [[grant, 0, 4]]}, [b"EVIL"]),
        ({"items": [[grant, 0, -4, 0]]}, []),
        ({"items": [[grant, 0, 4, 0]]}, [b"EVIL!"]),  # more bytes than the items say
    ]
    for args, payload in bad_requests:
        conn.send_request("write", args, payload)
        response, _ = conn.read_response()
        assert response.code in (ErrorCode.INVALID_REQUEST, ErrorCode.MALFORMED_FRAME), response
        assert _state(server) == before
    # The connection still serves, and the grant was never claimed: it writes once now.
    assert _write(conn, [_item(grant, b"GOOD")], [b"GOOD"]).unwrap() == [[0, None]]
    assert bytes(server.tiers["dram"].in_place(0, 4)) == b"GOOD"


# ------------------------------------------------------------------ plan: item by item
def test_items_refused_alone_are_skipped_and_the_rest_stored(
    server: DataServer, conn: protocol.FramedSocket
) -> None:
    forged = grants.sign(b"x" * 32, grants.OP_WRITE, b"f", "dram", 8, 4, LATER).to_wire()
    reads = grants.sign(server.secret, grants.OP_READ, b"r", "dram", 12, 4, LATER).to_wire()
    cases = [
        (_item(_grant(server, b"a", "dram", 0, 4), b"AAAA"), b"AAAA", 0),
        (_item(_grant(server, b"b", "dram", 4, 4), b"BBBBBB"), b"BBBBBB", ErrorCode.OUT_OF_RANGE),
        ([_grant(server, b"c", "dram", 16, 4), 0, 4, "sum"], b"CCCC", ErrorCode.INVALID_REQUEST),
        (_item(forged, b"FFFF"), b"FFFF", ErrorCode.GRANT_INVALID),
        (_item(reads, b"RRRR"), b"RRRR", ErrorCode.GRANT_INVALID),
        (_item(_grant(server, b"s", "nosuch", 0, 4), b"SSSS"), b"SSSS", ErrorCode.GRANT_INVALID),
        # NVMe carries whole objects only: a part of one is refused.
        (_item(_grant(server, b"n", "nvme", 1, 8), b"NNNN"), b"NNNN", ErrorCode.INVALID_REQUEST),
        (_item(_grant(server, b"z", "dram", 24, 4), b"ZZZZ"), b"ZZZZ", 0),
    ]
    response = _write(conn, [c[0] for c in cases], [c[1] for c in cases])
    assert [r[0] for r in response.unwrap()] == [int(c[2]) for c in cases]
    dram = bytes(server.tiers["dram"].in_place(0, 28))
    assert dram[:4] == b"AAAA"
    assert dram[4:24] == bytes(20), "a refused item wrote a byte"
    assert dram[24:28] == b"ZZZZ"
    assert {o.key for o in server.manifest.objects()} == {b"a", b"z"}


def test_an_expired_grant_is_refused_in_memory_and_on_nvme(
    server: DataServer, conn: protocol.FramedSocket
) -> None:
    before = _state(server)
    items = [
        _item(_grant(server, b"old", "dram", 0, 4, expires=1), b"OLD!"),
        _item(_grant(server, b"old", "nvme", 1, 4, expires=1), b"OLD!"),
    ]
    response = _write(conn, items, [b"OLD!", b"OLD!"])
    assert [r[0] for r in response.unwrap()] == [ErrorCode.GRANT_INVALID] * 2
    assert _state(server) == before


# ------------------------------------------------------------------ claim
def test_a_stale_grant_is_refused_once_a_newer_allocation_owns_the_bytes(
    server: DataServer, conn: protocol.FramedSocket
) -> None:
    # Of two grants for overlapping bytes, the one that expires later is the newer allocation.
    newer = _grant(server, b"new", "dram", 0, 8, expires=LATER)
    stale = _grant(server, b"old", "dram", 4, 8, expires=LATER - 60_000)
    assert _write(conn, [_item(newer, b"NEWNEWNE")], [b"NEWNEWNE"]).unwrap() == [[0, None]]
    before = _state(server)
    got = _write(conn, [_item(stale, b"STALESTA")], [b"STALESTA"]).unwrap()
    assert got[0][0] == ErrorCode.GRANT_INVALID and "stale" in got[0][1]
    assert _state(server) == before
    # A grant is used once: the same newer grant again is refused too, and changes nothing.
    again = _write(conn, [_item(newer, b"AGAINAGA")], [b"AGAINAGA"]).unwrap()
    assert again[0][0] == ErrorCode.GRANT_INVALID
    assert bytes(server.tiers["dram"].in_place(0, 8)) == b"NEWNEWNE"


# ------------------------------------------------------------------ receive and store
def test_a_batch_of_mixed_sizes_over_both_tiers_is_stored_and_reads_back(
    server: DataServer, conn: protocol.FramedSocket
) -> None:
    sizes = [1, 7, 64, 4096, 65_537, 0, 200_000]
    items, payload, placed = [], [], []
    offset = 0
    for i, size in enumerate(sizes):
        data = bytes((i * 31 + j) % 251 for j in range(size))
        for segment, at in (("dram", offset), ("nvme", i + 1)):
            key = b"%s/%d" % (segment.encode(), i)
            items.append(_item(_grant(server, key, segment, at, size), data))
            payload.append(data)
            placed.append((key, segment, at, data))
        offset += max(size, 1)  # (a claim covers at least one byte)
    # Half of one object in place: streamed into its range, not a whole object for the manifest.
    part = bytes(range(100))
    items.append(_item(_grant(server, b"dram/part", "dram", offset, 200), part, start=50))
    payload.append(part)
    conn.send_request("write", {"items": items, "short": True}, payload)
    response, _ = conn.read_response()
    assert response.unwrap() == [None] * len(items)
    for key, segment, at, data in placed:
        assert bytes(server.read_object(segment, at, len(data))) == data, key
    assert bytes(server.tiers["dram"].in_place(offset + 50, 100)) == part
    recorded = {o.key: (o.segment, o.offset, o.size) for o in server.manifest.objects()}
    assert recorded == {key: (seg, at, len(data)) for key, seg, at, data in placed}
    assert server.num_writes == len(items)
