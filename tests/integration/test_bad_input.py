"""Raw bytes thrown at live master and node sockets: typed errors or a clean close, the server
keeps serving everyone else, and no stored object changes."""

from __future__ import annotations

import socket
import struct

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvstore import grants, protocol
from kvstore.client import Client
from kvstore.errors import ErrorCode, KVStoreError


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    from tests.support import Cluster, start_master

    c = Cluster(tmp_path_factory.mktemp("bad"), start_master())
    c.add_node("8MiB")
    client = Client.connect(c.address)
    client.put("keep", b"precious bytes" * 100)
    yield c, client
    client.close()
    c.stop()


def endpoints(live) -> tuple[tuple[str, int], tuple[str, int]]:
    c, _ = live
    mh, mp = c.address.split(":")
    nh, np_ = c.nodes[0].field("data").split(":")
    return (mh, int(mp)), (nh, int(np_))


def exchange(addr: tuple[str, int], data: bytes, timeout: float = 2.0) -> bytes:
    """Send raw bytes, half-close, and read whatever comes back until the server closes."""
    with socket.create_connection(addr, timeout=timeout) as s:
        try:
            s.sendall(data)
            s.shutdown(socket.SHUT_WR)
        except OSError:
            pass  # the server answered and hung up before we finished: read what it said
        out = b""
        try:
            while chunk := s.recv(65536):
                out += chunk
        except (TimeoutError, OSError):
            pass
        return out


def replies(raw: bytes) -> list[protocol.Response]:
    out = []
    while len(raw) >= protocol.HEADER_SIZE:
        h = protocol.decode_header(raw[: protocol.HEADER_SIZE])
        out.append(
            protocol.decode_response(raw[protocol.HEADER_SIZE : protocol.HEADER_SIZE + h.body_len])
        )
        raw = raw[protocol.HEADER_SIZE + h.body_len + h.payload_len :]
    return out


def still_healthy(live) -> None:
    _, client = live
    assert client.get("keep") == b"precious bytes" * 100
    client.put("probe", b"ok")
    assert client.get("probe") == b"ok"


def req(verb: str, args: object, req_id: int = 9, payload_len: int = 0) -> bytes:
    body = msgpack.packb([req_id, verb, args], use_bin_type=True)
    return protocol.encode_header(protocol.KIND_REQUEST, len(body), payload_len) + body


MASTER_CASES = [
    (b"GET / HTTP/1.1\r\n\r\n", ErrorCode.MALFORMED_FRAME),
    (struct.pack("!2sBBIQ", b"KV", 2, 0, 0, 0), ErrorCode.VERSION_MISMATCH),
    (struct.pack("!2sBBIQ", b"KV", 1, 0, 1 << 31, 0), ErrorCode.FRAME_TOO_LARGE),
    (struct.pack("!2sBBIQ", b"KV", 1, 0, 3, 5) + b"abc", ErrorCode.FRAME_TOO_LARGE),
    (req("no_such_verb", {}), ErrorCode.UNKNOWN_VERB),
    (req("get_locations", {"keys": "notalist"}), ErrorCode.INVALID_REQUEST),
    (req("put_start", {"keys": [b"a"], "sizes": ["x"]}), ErrorCode.INVALID_REQUEST),
    (req("put_start", {"keys": [b"a"], "sizes": [1, 2]}), ErrorCode.INVALID_REQUEST),
    (req("put_end", {"put_ids": [1], "checksums": None}), ErrorCode.INVALID_REQUEST),
    (req("put_blanks", {"size": -1, "count": 1}), ErrorCode.INVALID_REQUEST),
    (req("put_blanks", {"size": 10, "count": 10_000}), ErrorCode.INVALID_REQUEST),
    (req("put_blanks", {"size": 10, "nodes": [["n", 1, 2]]}), ErrorCode.INVALID_REQUEST),
    (req("put_end", {"put_ids": [1], "checksums": [1], "keys": []}), ErrorCode.INVALID_REQUEST),
    (
        req("put_end", {"put_ids": [1] * 2000, "checksums": [1] * 2000, "keys": [None] * 2000}),
        ErrorCode.INVALID_REQUEST,
    ),  # fmt: skip
    (req("register", {"node_id": 5}), ErrorCode.INVALID_REQUEST),
    (req("heartbeat", {"node_id": "ghost"}), ErrorCode.NODE_UNAVAILABLE),
    (protocol.encode_header(0, 3) + b"\xc1\xc1\xc1", ErrorCode.MALFORMED_FRAME),
]


@pytest.mark.parametrize(("data", "code"), MASTER_CASES)
def test_master_answers_bad_frames_with_typed_errors(live, data: bytes, code: ErrorCode) -> None:
    master, _ = endpoints(live)
    got = replies(exchange(master, data))
    assert got, "expected an error reply"
    assert got[0].code == code, got[0]
    still_healthy(live)


def test_master_per_key_errors_for_bad_keys(live) -> None:
    master, _ = endpoints(live)
    (r,) = replies(exchange(master, req("get_locations", {"keys": [b"", b"k" * 600, 7, b"keep"]})))
    codes = [item[0] for item in r.unwrap()]
    assert codes == [
        ErrorCode.INVALID_REQUEST,
        ErrorCode.INVALID_REQUEST,
        ErrorCode.INVALID_REQUEST,
        0,
    ]
    (r,) = replies(
        exchange(master, req("put_start", {"keys": [b"neg", b"huge"], "sizes": [-5, 1 << 62]}))
    )
    assert [item[0] for item in r.unwrap()] == [
        ErrorCode.INVALID_REQUEST,
        ErrorCode.INVALID_REQUEST,
    ]
    still_healthy(live)


def test_a_blank_misused_changes_nothing(live) -> None:
    """A blank (a put started before its key is known) committed without its key, under a key
    a blank may not hold, or with a bad ask for more blanks: each refusal is the blank's own or
    the ask's own, and what it changes is nothing."""
    _, client = live
    master, node = endpoints(live)
    (r,) = replies(exchange(master, req("put_blanks", {"size": 14, "count": 1})))
    started = r.unwrap()
    assert started and all(loc[3][1] == grants.BLANK_KEY for _, loc in started)
    put_id, loc = started[0]
    # The master's blank grant writes nothing as it is: it is used for a key.
    got = replies(
        exchange(node, req("write", {"items": [[loc[3], 0, 4, 0]]}, payload_len=4) + b"EVIL")
    )
    assert got[0].unwrap()[0][0] == ErrorCode.GRANT_INVALID
    for keys, code in (
        ([None], ErrorCode.INVALID_REQUEST),
        ([b""], ErrorCode.INVALID_REQUEST),
        ([b"kv/" + b"k" * 32], ErrorCode.INVALID_REQUEST),
    ):
        args = {"put_ids": [put_id], "checksums": [1], "keys": keys, "blanks": "bad"}
        (r,) = replies(exchange(master, req("put_end", args)))
        answer = r.unwrap()
        assert answer["results"][0][0] == code and answer["blanks"][0] == ErrorCode.INVALID_REQUEST
    assert client.exists("keep") and not client.exists(b"kv/" + b"k" * 32)
    (r,) = replies(exchange(master, req("put_revoke", {"put_ids": [put_id]})))
    assert r.unwrap() == [[0, None]], "the blank was still pending: refused, not consumed"
    still_healthy(live)


def test_node_refuses_ungranted_and_out_of_range_access(live) -> None:
    _, client = live
    _, node = endpoints(live)
    info = client._reads.locate([b"keep"])[0]
    good = info.locations[0].grant
    forged = grants.Grant(
        good.op, good.key, good.segment, 0, 8 << 20, good.expires_ms, good.signature
    )
    ref = grants.GrantRefs().wire(good)  # a member of the answer's batch grant, by reference
    cases = [
        (req("read", {"items": [[forged.to_wire(), None]]}), ErrorCode.GRANT_INVALID),
        (req("read", {"items": [[ref, [[0, good.size + 1]]]]}), ErrorCode.OUT_OF_RANGE),
        (req("read", {"items": [[ref, [[-1, 1]]]]}), ErrorCode.OUT_OF_RANGE),
        # A read grant cannot write.
        (
            req("write", {"items": [[ref, 0, 4, 0]]}, payload_len=4) + b"EVIL",
            ErrorCode.GRANT_INVALID,
        ),
    ]
    for data, code in cases:
        got = replies(exchange(node, data))
        item_code = got[0].unwrap()[0][0]
        assert item_code == code
    still_healthy(live)


NODE_CASES = [
    (b"\x00" * 64, ErrorCode.MALFORMED_FRAME),
    (req("read", {"items": "x"}), ErrorCode.INVALID_REQUEST),
    (req("write", {"items": [[None, 0, 4, 0]]}, payload_len=3) + b"abc", ErrorCode.MALFORMED_FRAME),
    (req("nope", {}, payload_len=5) + b"12345", ErrorCode.UNKNOWN_VERB),
    (req("read", {"items": []}, payload_len=2) + b"xx", ErrorCode.MALFORMED_FRAME),
]


@pytest.mark.parametrize(("data", "code"), NODE_CASES)
def test_node_answers_bad_frames_with_typed_errors(live, data: bytes, code: ErrorCode) -> None:
    _, node = endpoints(live)
    got = replies(exchange(node, data))
    assert got and got[0].code == code, got
    still_healthy(live)


def test_client_disconnecting_mid_write_changes_nothing(live) -> None:
    _, client = live
    _, node = endpoints(live)
    before = client.get("keep")
    info = client._reads.locate([b"keep"])[0]
    with socket.create_connection(node) as s:
        s.sendall(
            req(
                "write",
                {"items": [[grants.GrantRefs().wire(info.locations[0].grant), 0, 1000, 0]]},
                payload_len=1000,
            )
            + b"x" * 10
        )
    assert client.get("keep") == before
    still_healthy(live)


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(st.binary(min_size=1, max_size=300))
def test_random_bytes_never_hurt_anyone(live, data: bytes) -> None:
    master, node = endpoints(live)
    for addr in (master, node):
        # Whatever comes back must be well-formed frames (usually one typed error), or nothing.
        replies_or_garbage(exchange(addr, data, timeout=1.0))
    still_healthy(live)


def replies_or_garbage(raw: bytes) -> list[protocol.Response]:
    try:
        return replies(raw)
    except KVStoreError:
        pytest.fail(f"server sent an undecodable reply: {raw[:64]!r}")
