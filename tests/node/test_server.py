"""The data server: its verb registry, its frame loop, and grants over its tiers."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import xxhash

from kvstore import grants, protocol
from kvstore.errors import (
    ErrorCode,
    GrantInvalidError,
    InvalidRequestError,
    KVStoreError,
    OutOfRangeError,
)
from kvstore.node.arena import DramTier
from kvstore.node.server import DataServer
from tests.node import data_server

SIZE = 1 << 16


@pytest.fixture
def server(tmp_path: Path) -> Iterator[DataServer]:
    with data_server.running(tmp_path, SIZE, 1 << 20) as srv:
        yield srv


@pytest.fixture
def conn(server: DataServer) -> Iterator[protocol.FramedSocket]:
    with data_server.connected(server) as c:
        yield c


def test_every_segment_is_a_tier(server: DataServer) -> None:
    assert isinstance(server.tiers["dram"], DramTier)
    assert set(server.tiers) == {"dram", "nvme"}
    with pytest.raises(GrantInvalidError):
        server.tier_of("hbm")


def test_registered_verbs_are_served_with_their_payload_limit(
    server: DataServer, conn: protocol.FramedSocket
) -> None:
    got: list[bytes] = []

    def echo(fs: protocol.FramedSocket, req: protocol.Request, n: int, scratch: memoryview) -> None:
        if req.args.get("refuse"):
            raise InvalidRequestError("refused before the payload")
        buf = memoryview(bytearray(n))
        fs.recv_into(buf)
        got.append(bytes(buf))
        fs.send_frame(protocol.encode_response(req.req_id, n))

    server.register_verb("echo", echo, max_payload=8)
    req_id = conn.send_request("echo", {}, [b"12345678"])
    response, _ = conn.read_response()
    assert (response.req_id, response.unwrap(), got) == (req_id, 8, [b"12345678"])
    # Over the verb's limit: refused, the payload skipped, the connection still usable.
    conn.send_request("echo", {}, [b"123456789"])
    response, _ = conn.read_response()
    assert response.code == ErrorCode.MALFORMED_FRAME
    # Refused by the handler before the payload: skipped too.
    conn.send_request("echo", {"refuse": True}, [b"1234"])
    response, _ = conn.read_response()
    assert response.code == ErrorCode.INVALID_REQUEST
    assert conn.call("ping", {}) == {"role": "node"}
    with pytest.raises(KVStoreError) as err:
        conn.call("nope", {})
    assert err.value.code == ErrorCode.UNKNOWN_VERB
    assert got == [b"12345678"]


def test_granted_views_in_place_and_through_a_tier(server: DataServer) -> None:
    def grant(op: str, segment: str, offset: int, size: int) -> list[object]:
        return grants.sign(server.secret, op, b"k", segment, offset, size, 2**62).to_wire()

    server.tiers["dram"].in_place(0, 4)[:] = b"abcd"
    _, view = server.granted_view(grant(grants.OP_READ, "dram", 0, 4), grants.OP_READ, owned=None)
    assert bytes(view) == b"abcd"
    with pytest.raises(OutOfRangeError, match="granted range"):
        server.granted_view(grant(grants.OP_READ, "dram", SIZE - 2, 4), grants.OP_READ, owned=None)
    with pytest.raises(InvalidRequestError, match="whole-object"):
        server.granted_view(grant(grants.OP_WRITE, "nvme", 3, 4), grants.OP_WRITE, owned=None)
    with pytest.raises(GrantInvalidError):
        server.granted_view(grant(grants.OP_READ, "hbm", 0, 4), grants.OP_READ, owned=None)


def test_a_read_takes_batch_grants_by_reference_and_a_write_refuses_a_read_batch(
    server: DataServer, conn: protocol.FramedSocket
) -> None:
    server.tiers["dram"].in_place(0, 12)[:] = b"abcdefghijkl"
    items = [[b"k%d" % i, "dram", 4 * i, 4] for i in range(3)]
    batch = grants.sign_batch(server.secret, grants.OP_READ, 2**62, items)
    forged = list(batch)
    forged[2] = grants.sign_batch(b"x" * 32, grants.OP_READ, 2**62, [[b"k", "dram", 0, 12]])[2]
    one_key = grants.sign(server.secret, grants.OP_READ, b"o", "dram", 8, 4, 2**62).to_wire()
    req = [
        [[0, 2, batch], None],
        [[1, 0, forged], None],  # its items changed: the signature no longer covers them
        [[0, 0], [[1, 2]]],
        [one_key, None],
        [[1, 0], None],
        [[0, 3], None],  # no such item
    ]
    conn.send_request("read", {"items": req})
    response, payload = conn.read_response()
    codes = [r[0] for r in response.unwrap()]
    bad = int(GrantInvalidError.code)
    assert codes == [0, bad, 0, 0, bad, bad]
    body = memoryview(bytearray(payload))
    conn.recv_into(body)
    assert bytes(body) == b"ijkl" + b"bc" + b"ijkl"
    # A read batch grant writes nothing.
    conn.send_request("write", {"items": [[[0, 0, batch], 0, 4, 0]]}, [b"EVIL"])
    response, _ = conn.read_response()
    assert response.unwrap()[0][0] == bad
    assert bytes(server.tiers["dram"].in_place(0, 4)) == b"abcd"


def test_a_write_takes_write_batch_grants_by_reference_each_item_once(
    server: DataServer, conn: protocol.FramedSocket
) -> None:
    items = [[b"w%d" % i, "dram", 4 * i, 4] for i in range(3)]
    wbatch = grants.sign_batch(server.secret, grants.OP_WRITE, 2**62, items)
    forged = list(wbatch)
    forged[2] = grants.sign_batch(b"x" * 32, grants.OP_WRITE, 2**62, [[b"w", "dram", 0, 12]])[2]
    a, c = xxhash.xxh3_64_intdigest(b"AAAA"), xxhash.xxh3_64_intdigest(b"CCCC")
    req = [
        [[0, 0, wbatch], 0, 4, a],
        [[0, 2], 0, 4, c],
        [[1, 0, forged], 0, 4, a],  # its items changed: the signature no longer covers them
        [[0, 0], 0, 4, a],  # item 0 again: a write grant is used once
        [[0, 7], 0, 4, a],  # no such item
    ]
    conn.send_request("write", {"items": req}, [b"AAAA", b"CCCC", b"EVIL", b"BAD!", b"BAD!"])
    response, _ = conn.read_response()
    bad = int(GrantInvalidError.code)
    assert [r[0] for r in response.unwrap()] == [0, 0, bad, bad, bad]
    assert bytes(server.tiers["dram"].in_place(0, 12))[:4] == b"AAAA"
    assert bytes(server.tiers["dram"].in_place(8, 4)) == b"CCCC"
    assert {(o.key, o.offset) for o in server.manifest.objects()} >= {
        (b"w0", 0),
        (b"w2", 8),
    }
    # A write batch grant reads nothing.
    conn.send_request("read", {"items": [[[0, 1, wbatch], None]]})
    response, _ = conn.read_response()
    assert response.unwrap()[0][0] == bad


def test_asked_short_a_success_is_answered_by_its_value_alone_an_error_in_full(
    server: DataServer, conn: protocol.FramedSocket
) -> None:
    # What a client asks for ("short": true): a write's success is None, a read's its length,
    # in memory and on NVMe alike; errors keep their [code, message]. Unasked, as before.
    def grant(op: str, key: bytes, segment: str, offset: int, size: int) -> list[object]:
        return grants.sign(server.secret, op, key, segment, offset, size, 2**62).to_wire()

    stale = grants.sign(b"x" * 32, grants.OP_WRITE, b"s", "dram", 8, 4, 2**62).to_wire()
    req = [
        [grant(grants.OP_WRITE, b"a", "dram", 0, 4), 0, 4, xxhash.xxh3_64_intdigest(b"AAAA")],
        [stale, 0, 4, 0],
        [grant(grants.OP_WRITE, b"n", "nvme", 1, 4), 0, 4, xxhash.xxh3_64_intdigest(b"NNNN")],
    ]
    conn.send_request("write", {"items": req, "short": True}, [b"AAAA", b"EVIL", b"NNNN"])
    response, _ = conn.read_response()
    bad = int(GrantInvalidError.code)
    got = response.unwrap()
    assert got[0] is None and got[1][0] == bad and got[2] is None
    reads = [
        [grant(grants.OP_READ, b"a", "dram", 0, 4), None],
        [grant(grants.OP_READ, b"a", "dram", 0, 4), [[1, 2]]],
        [stale, None],
        [grant(grants.OP_READ, b"n", "nvme", 1, 4), None],
    ]
    conn.send_request("read", {"items": reads, "short": True})
    response, payload = conn.read_response()
    got = response.unwrap()
    assert got[:2] == [4, 2] and got[2][0] == bad and got[3] == 4
    body = memoryview(bytearray(payload))
    conn.recv_into(body)
    assert bytes(body) == b"AAAA" + b"AA" + b"NNNN"
    conn.send_request("read", {"items": reads[:1]})
    response, payload = conn.read_response()
    assert response.unwrap() == [[0, 4]]
    conn.recv_into(memoryview(bytearray(payload)))
