"""The wire codec: round trips, and every malformed frame is a typed error."""

from __future__ import annotations

import contextlib
import socket
import struct
import threading

import msgpack
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvstore import grants, polling, protocol
from kvstore.env import DEFAULT_POLL_US
from kvstore.errors import (
    ErrorCode,
    KeyNotFoundError,
    KVStoreError,
    NoSpaceError,
    ProtocolError,
)
from kvstore.types import Location, ObjectInfo, PutTicket

msgpack_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats(allow_nan=False)
    | st.text()
    | st.binary(),
    lambda children: (
        st.lists(children, max_size=5) | st.dictionaries(st.text(), children, max_size=5)
    ),
    max_leaves=20,
)


def split(frame: bytes) -> tuple[protocol.FrameHeader, bytes]:
    header = protocol.decode_header(frame[: protocol.HEADER_SIZE])
    return header, frame[protocol.HEADER_SIZE : protocol.HEADER_SIZE + header.body_len]


@given(
    st.integers(0, 2**63),
    st.text(max_size=40),
    st.dictionaries(st.text(max_size=10), msgpack_values, max_size=6),
    st.integers(0, 2**40),
)
def test_request_round_trip(req_id: int, verb: str, args: dict, payload_len: int) -> None:
    header, body = split(protocol.encode_request(req_id, verb, args, payload_len))
    assert header.kind == protocol.KIND_REQUEST
    assert header.payload_len == payload_len
    assert protocol.decode_request(body) == protocol.Request(req_id, verb, args)


@given(st.integers(0, 2**63), msgpack_values)
def test_response_round_trip(req_id: int, result: object) -> None:
    header, body = split(protocol.encode_response(req_id, result))
    assert header.kind == protocol.KIND_RESPONSE
    assert protocol.decode_response(body).unwrap() == result


@pytest.mark.parametrize(
    "err",
    [
        KeyNotFoundError("gone"),
        NoSpaceError("full"),
        ProtocolError("bad", code=ErrorCode.FRAME_TOO_LARGE),
    ],
)
def test_errors_keep_class_and_code(err: KVStoreError) -> None:
    _, body = split(protocol.encode_error(7, err))
    response = protocol.decode_response(body)
    with pytest.raises(type(err)) as info:
        response.unwrap()
    assert info.value.code == err.code and info.value.message == err.message


@given(st.binary(max_size=protocol.HEADER_SIZE * 2))
def test_random_headers_decode_or_fail_typed(data: bytes) -> None:
    try:
        h = protocol.decode_header(data)
    except ProtocolError:
        return
    assert len(data) == protocol.HEADER_SIZE and h.body_len <= protocol.DEFAULT_MAX_BODY


@given(st.binary(max_size=200))
def test_random_bodies_decode_or_fail_typed(data: bytes) -> None:
    for decode in (protocol.decode_request, protocol.decode_response):
        with contextlib.suppress(ProtocolError):
            decode(data)


@pytest.mark.parametrize(
    ("header", "code"),
    [
        (b"XX" + bytes(14), ErrorCode.MALFORMED_FRAME),
        (struct.pack("!2sBBIQ", b"KV", 99, 0, 1, 0), ErrorCode.VERSION_MISMATCH),
        (struct.pack("!2sBBIQ", b"KV", 1, 7, 1, 0), ErrorCode.MALFORMED_FRAME),
        (
            struct.pack("!2sBBIQ", b"KV", 1, 0, protocol.DEFAULT_MAX_BODY + 1, 0),
            ErrorCode.FRAME_TOO_LARGE,
        ),
        (struct.pack("!2sBBIQ", b"KV", 1, 0, 1, 2**50), ErrorCode.FRAME_TOO_LARGE),
        (b"KV\x01", ErrorCode.MALFORMED_FRAME),
    ],
)
def test_bad_headers(header: bytes, code: ErrorCode) -> None:
    with pytest.raises(ProtocolError) as info:
        protocol.decode_header(header)
    assert info.value.code == code


@pytest.mark.parametrize(
    "obj",
    [
        [1, "verb"],
        [1, "verb", {}, 4],
        ["1", "verb", {}],
        [1, 2, {}],
        [1, "verb", []],
        {"a": 1},
        [True, "v", {}],
    ],
)
def test_bad_request_shapes(obj: object) -> None:
    with pytest.raises(ProtocolError):
        protocol.decode_request(msgpack.packb(obj))


def test_from_wire_survives_garbage() -> None:
    assert isinstance(KVStoreError.from_wire(["x"]), ProtocolError)
    assert isinstance(KVStoreError.from_wire([12345, "unknown code"]), ProtocolError)
    assert isinstance(KVStoreError.from_wire([200, "m"]), KeyNotFoundError)


@pytest.mark.parametrize("timeout", [None, 5.0])
@pytest.mark.parametrize("poll_window", [0.0, 50e-6, 0.5])
def test_framed_sockets_read_ahead_and_poll(timeout: float | None, poll_window: float) -> None:
    """Frames, payloads split across read-ahead and socket, and a close: with and without the
    poll before sleeping, on blocking sockets and sockets with a timeout."""
    import socket
    import threading

    a, b = socket.socketpair()
    for s in (a, b):
        s.settimeout(timeout)
    sender, receiver = protocol.FramedSocket(a), protocol.FramedSocket(b)
    receiver.poll_window = poll_window
    big = bytes(range(256)) * 1024  # 256 KiB: more than the read-ahead holds
    small = b"x" * 100

    def send() -> None:
        sender.send_request("one", {"n": 1}, [small])
        sender.send_request("two", {"n": 2}, [big, small])
        a.shutdown(socket.SHUT_WR)

    t = threading.Thread(target=send)
    t.start()
    try:
        h = receiver.read_header()
        req = protocol.decode_request(receiver.read_body(h))
        assert (req.verb, h.payload_len) == ("one", 100)
        assert receiver.recv_exact(100) == small
        h = receiver.read_header()
        assert protocol.decode_request(receiver.read_body(h)).verb == "two"
        first, second = memoryview(bytearray(len(big))), memoryview(bytearray(50))
        receiver.recv_scatter([first, second])
        assert bytes(first) == big and bytes(second) == small[:50]
        receiver.discard(50, memoryview(bytearray(16)))
        with pytest.raises(ConnectionError):
            receiver.read_header()
    finally:
        t.join(timeout=10)
        a.close()
        b.close()


def test_small_reads_before_a_deadline_read_ahead_for_the_items_after_them() -> None:
    """A node writes a batch of tiny objects with one ``recv_into_before`` each: the bytes read
    ahead for one serve the next ones (then the peer's end is seen), large views and a frame
    after the payload included; a deadline already past starts no socket read."""
    import socket
    import time

    a, b = socket.socketpair()
    receiver = protocol.FramedSocket(b)
    items = [bytes([i]) * 16 for i in range(200)]
    big = bytes(range(256)) * 256  # 64 KiB: straight into its view
    try:
        a.sendall(b"".join(items) + big)
        protocol.FramedSocket(a).send_request("next", {}, ())
        a.shutdown(socket.SHUT_WR)
        deadline = time.monotonic() + 10
        for item in items:
            view = memoryview(bytearray(16))
            receiver.recv_into_before(view, deadline, lambda: False)
            assert bytes(view) == item
        view = memoryview(bytearray(len(big)))
        receiver.recv_into_before(view, deadline, lambda: False)
        assert bytes(view) == big
        header = receiver.read_header()
        assert protocol.decode_request(receiver.read_body(header)).verb == "next"
        with pytest.raises(TimeoutError):  # nothing buffered, and the deadline has passed
            receiver.recv_into_before(memoryview(bytearray(1)), time.monotonic(), lambda: False)
        with pytest.raises(TimeoutError):  # cancelled: likewise
            receiver.recv_into_before(memoryview(bytearray(1)), deadline, lambda: True)
    finally:
        a.close()
        b.close()


def test_poll_window_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for raw, want in [
        ("0", 0.0),
        ("120", 120e-6),
        ("-5", 0.0),
        ("junk", DEFAULT_POLL_US * 1e-6),
        ("inf", DEFAULT_POLL_US * 1e-6),
        ("nan", DEFAULT_POLL_US * 1e-6),
        ("1e9", 0.01),
    ]:
        monkeypatch.setenv("KVSTORE_POLL_US", raw)
        assert polling.poll_window() == pytest.approx(want)
    monkeypatch.delenv("KVSTORE_POLL_US")
    assert polling.poll_window() == pytest.approx(DEFAULT_POLL_US * 1e-6)


@pytest.mark.parametrize("num_buffers", [3, 1000, 30000])
def test_send_all_keeps_order_whether_it_joins_or_gathers(num_buffers: int) -> None:
    """Small totals are joined into one send, large ones gathered: same bytes either way."""
    rng = np.random.default_rng(num_buffers)
    parts: list[bytes | memoryview | bytearray] = []
    for i in range(num_buffers):
        raw = rng.integers(0, 256, 1 + i % 40, dtype=np.uint8).tobytes()
        parts.append([raw, memoryview(raw), bytearray(raw)][i % 3])
    expected = b"".join(bytes(p) for p in parts)
    a, b = socket.socketpair()
    got = bytearray()

    def receive() -> None:
        for _ in range(len(expected)):  # bounded: at least one byte per recv
            if len(got) >= len(expected):
                return
            got.extend(b.recv(1 << 16))

    reader = threading.Thread(target=receive)
    reader.start()
    protocol.send_all(a, parts)
    reader.join(10)
    a.close()
    b.close()
    assert bytes(got) == expected


@pytest.mark.parametrize(
    "wire",
    [
        [1, "h", 1, []],
        ["n", b"h", 1, []],
        ["n", "h", "1", []],
        ["n", "h", 1],
        ("n", "h", 1, []),
    ],
)
def test_location_refuses_malformed_wire(wire: object) -> None:
    with pytest.raises(KVStoreError):
        Location.from_wire(wire)


def test_tickets_and_infos_round_trip_through_their_wire_forms() -> None:
    locs = [
        Location(f"n{i}", "127.0.0.1", 9000 + i, grants.sign(b"s" * 32, "w", b"k", "d", i, 16, 7))
        for i in range(3)
    ]
    for n in range(4):
        ticket = PutTicket(5, locs[:n])
        assert ticket.to_wire() == [5, [loc.to_wire() for loc in locs[:n]]]
        assert PutTicket.from_wire(ticket.to_wire()) == ticket
        info = ObjectInfo(16, 99, locs[:n])
        assert info.to_wire() == [16, 99, [loc.to_wire() for loc in locs[:n]]]
        assert ObjectInfo.from_wire(info.to_wire()) == info


@pytest.mark.parametrize("awaits_replies", [True, False])
def test_one_thread_per_process_polls_for_replies(awaits_replies: bool) -> None:
    a, b = socket.socketpair()
    conn = protocol.FramedSocket(a)
    conn.awaits_replies = awaits_replies
    conn.poll_window = 0.001
    polls: list[int] = []
    conn._poll = lambda: polls.append(1) or True  # type: ignore[method-assign]
    try:
        frame = protocol.encode_response(1, "ok")
        # Another thread of this process is polling for its reply: a reply wait sleeps in the
        # kernel instead (a request wait, on the serving side, polls as before).
        with protocol._REPLY_POLLER:
            b.sendall(frame)
            assert conn.read_response()[0].result == "ok"
        assert polls == ([] if awaits_replies else [1])
        b.sendall(frame)
        assert conn.read_response()[0].result == "ok"
        assert len(polls) == (1 if awaits_replies else 2)
        assert protocol._REPLY_POLLER.acquire(blocking=False)  # given back after polling
        protocol._REPLY_POLLER.release()
    finally:
        a.close()
        b.close()
