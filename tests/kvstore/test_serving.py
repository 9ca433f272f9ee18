"""The serving rules both servers share: deadlines, header and body checks, refusals."""

from __future__ import annotations

import pytest

from kvstore import auth, protocol, serving
from kvstore.errors import (
    ErrorCode,
    InvalidRequestError,
    KVStoreError,
    ProtocolError,
    UnauthenticatedError,
)

TOKEN = "a-cluster-token-of-some-length"
LIMITS = {"write": 1 << 30, "ping": 0}


def header(
    body: bytes, payload_len: int = 0, kind: int = protocol.KIND_REQUEST
) -> protocol.FrameHeader:
    return protocol.FrameHeader(protocol.PROTOCOL_VERSION, kind, len(body), payload_len)


def body(verb: str, args: dict | None = None, req_id: int = 7) -> bytes:
    frame = protocol.encode_request(req_id, verb, args or {})
    return frame[protocol.HEADER_SIZE :]


def answer(frame: bytes) -> protocol.Response:
    return protocol.decode_response(frame[protocol.HEADER_SIZE :])


def test_deadlines_before_and_after_the_hello() -> None:
    s = serving.FrameSession(auth.Token(TOKEN), accepted_at=100.0)
    assert not s.authenticated
    # Before the token is proved, everything must be in by the hello's deadline.
    assert s.header_deadline(150.0) == s.body_deadline(150.0, header(b"x" * 10**6)) == 105.0
    hello = body(auth.HELLO_VERB, {"token": TOKEN})
    step = s.open_request(header(hello), hello)
    assert isinstance(step, serving.Refusal) and not step.hang_up
    assert answer(step.frame).result == {"authenticated": True}
    assert s.authenticated
    # Then each frame has its own deadline from its first byte, longer for a long body.
    assert s.header_deadline(150.0) == 150.0 + protocol.FRAME_TIMEOUT_S
    big = 8 << 20
    assert s.body_deadline(150.0, header(b"x" * big)) == 150.0 + protocol.frame_deadline_s(big)


def test_a_session_keeps_its_server_s_deadlines() -> None:
    deadlines = serving.WireDeadlines(frame_s=2.0, hello_s=0.5, min_rate=1000)
    s = serving.FrameSession(auth.Token(TOKEN), accepted_at=100.0, deadlines=deadlines)
    assert s.header_deadline(150.0) == s.body_deadline(150.0, header(b"x" * 10**6)) == 100.5
    hello = body(auth.HELLO_VERB, {"token": TOKEN})
    s.open_request(header(hello), hello)
    assert s.header_deadline(150.0) == 152.0
    assert s.body_deadline(150.0, header(b"x" * 3000)) == 150.0 + 2.0 + 3.0


def test_the_default_deadlines_are_the_protocol_s() -> None:
    d = serving.WireDeadlines()
    assert (d.frame_s, d.hello_s, d.min_rate) == (
        protocol.FRAME_TIMEOUT_S,
        auth.HELLO_TIMEOUT_S,
        protocol.MIN_FRAME_RATE,
    )
    assert d == serving.DEFAULT_DEADLINES
    assert d.frame_deadline_s(8 << 20) == protocol.frame_deadline_s(8 << 20)


@pytest.mark.parametrize("bad", [0, 0.0, -1.0, float("nan"), float("inf"), True, "5"])
@pytest.mark.parametrize(
    ("field", "named"),
    [("frame_s", "--frame-timeout"), ("hello_s", "--hello-timeout"), ("min_rate", "rate")],
)
def test_deadlines_must_be_finite_and_positive(field: str, named: str, bad: object) -> None:
    with pytest.raises(InvalidRequestError, match=named):
        serving.WireDeadlines(**{field: bad})  # type: ignore[arg-type]


def test_header_checks() -> None:
    s = serving.FrameSession(auth.Token(TOKEN), 0.0)
    with pytest.raises(ProtocolError):
        s.check_header(header(b"", kind=protocol.KIND_RESPONSE))
    with pytest.raises(UnauthenticatedError):
        s.check_header(header(b"", payload_len=1))  # no payload before the hello
    with pytest.raises(UnauthenticatedError):
        s.check_header(header(b"x" * (auth.PRE_AUTH_MAX_BODY + 1)))
    open_ = serving.FrameSession(None, 0.0)
    open_.check_header(header(b"x" * (auth.PRE_AUTH_MAX_BODY + 1), payload_len=5))


def test_a_verb_before_the_hello_or_a_wrong_token_hangs_up() -> None:
    s = serving.FrameSession(auth.Token(TOKEN), 0.0)
    ping = body("ping")
    step = s.open_request(header(ping), ping)
    assert isinstance(step, serving.Refusal) and step.hang_up
    assert answer(step.frame).code == ErrorCode.UNAUTHENTICATED
    wrong = body(auth.HELLO_VERB, {"token": "nope"})
    step = s.open_request(header(wrong), wrong)
    assert isinstance(step, serving.Refusal) and step.hang_up and not s.authenticated


@pytest.mark.parametrize(
    ("verb", "payload_len", "code", "skip", "hang_up"),
    [
        ("ping", 0, None, 0, False),  # dispatched
        ("write", 1 << 20, None, 0, False),
        ("nope", 10, ErrorCode.UNKNOWN_VERB, 10, False),  # small payload: skipped
        ("ping", 10, ErrorCode.MALFORMED_FRAME, 10, False),  # takes none
        ("write", (1 << 30) + 1, ErrorCode.MALFORMED_FRAME, 0, True),  # too large: not read
        ("nope", serving.MAX_DISCARD + 1, ErrorCode.UNKNOWN_VERB, 0, True),
    ],
)
def test_verbs_and_payload_lengths(
    verb: str, payload_len: int, code: ErrorCode | None, skip: int, hang_up: bool
) -> None:
    s = serving.FrameSession(None, 0.0, LIMITS)
    raw = body(verb)
    step = s.open_request(header(raw, payload_len), raw)
    if code is None:
        assert step == protocol.Request(7, verb, {})
        return
    assert isinstance(step, serving.Refusal)
    assert (step.skip, step.hang_up) == (skip, hang_up)
    got = answer(step.frame)
    assert (got.req_id, got.code) == (7, code)


def test_without_limits_every_verb_is_dispatched() -> None:
    """The master checks verbs itself (and its header limit refuses every payload)."""
    s = serving.FrameSession(None, 0.0)
    raw = body("anything")
    assert s.open_request(header(raw), raw) == protocol.Request(7, "anything", {})


def test_an_undecodable_body_is_answered_with_its_request_id_if_any() -> None:
    s = serving.FrameSession(None, 0.0, LIMITS)
    raw = protocol.encode_response(9, None)[protocol.HEADER_SIZE :]  # [9, 0, None]: no verb
    step = s.open_request(header(raw), raw)
    assert isinstance(step, serving.Refusal) and not step.hang_up
    assert (answer(step.frame).req_id, answer(step.frame).code) == (9, ErrorCode.MALFORMED_FRAME)
    step = s.open_request(header(b"\xc1"), b"\xc1")
    assert isinstance(step, serving.Refusal) and answer(step.frame).req_id == 0


def test_refuse() -> None:
    err = KVStoreError("no")
    small = serving.refuse(3, err, header(b"", payload_len=serving.MAX_DISCARD))
    assert (small.skip, small.hang_up) == (serving.MAX_DISCARD, False)
    large = serving.refuse(3, err, header(b"", payload_len=serving.MAX_DISCARD + 1))
    assert (large.skip, large.hang_up) == (0, True)
    assert answer(large.frame).req_id == 3
