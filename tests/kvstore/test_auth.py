"""The cluster token: loading, masking, the handshake gate, bearer checks."""

from __future__ import annotations

import pickle

import pytest

from kvstore import auth, protocol
from kvstore.errors import ErrorCode, InvalidRequestError

SECRET = "tok-0123456789abcdef-secret"


def test_token_never_prints_itself() -> None:
    token = auth.Token(SECRET)
    assert SECRET not in repr(token)
    assert SECRET not in str(token)
    assert SECRET not in f"{token} {token!r} {[token]}"
    with pytest.raises(TypeError):
        pickle.dumps(token)


@pytest.mark.parametrize(
    ("offered", "ok"),
    [
        (SECRET, True),
        (SECRET.encode(), True),
        (SECRET + "x", False),
        ("", False),
        (None, False),
        (123, False),
        (SECRET[:-1], False),
    ],
)
def test_token_matches_only_itself(offered: object, ok: bool) -> None:
    assert auth.Token(SECRET).matches(offered) is ok


@pytest.mark.parametrize(
    "bad",
    [
        "short",
        "x" * 5000,
        "   ",
        "with a space in it 0123",
        "ünïcödé-token-0123456789",
        "tab\there-0123456789",
    ],
)
def test_token_length_is_checked(bad: str) -> None:
    with pytest.raises(InvalidRequestError) as exc:
        auth.Token(bad)
    assert bad.strip()[:8] not in exc.value.message or not bad.strip()


def test_load_token_precedence(tmp_path) -> None:
    f = tmp_path / "tok"
    f.write_text(SECRET + "\n")
    g = tmp_path / "tok2"
    g.write_text("another-token-of-enough-length\n")
    assert auth.load_token(None, env={}) is None
    assert auth.load_token(f, env={}).matches(SECRET)
    assert auth.load_token(None, env={auth.TOKEN_ENV: SECRET}).matches(SECRET)
    assert auth.load_token(None, env={auth.TOKEN_FILE_ENV: str(g)}).matches(
        "another-token-of-enough-length"
    )
    # The flag's file wins over the environment; the env token wins over the env file.
    assert auth.load_token(f, env={auth.TOKEN_ENV: "x" * 20}).matches(SECRET)
    assert auth.load_token(None, env={auth.TOKEN_ENV: SECRET, auth.TOKEN_FILE_ENV: str(g)}).matches(
        SECRET
    )
    with pytest.raises(InvalidRequestError):
        auth.load_token(tmp_path / "missing", env={})


def _request(verb: str, **args: object) -> protocol.Request:
    return protocol.Request(7, verb, dict(args))


def _code(frame: bytes) -> int:
    return protocol.decode_response(frame[protocol.HEADER_SIZE :]).code


def test_gate_without_token_lets_everything_through() -> None:
    gate = auth.Gate(None)
    assert gate.screen(_request("ping")) is None
    reply, close = gate.screen(_request("hello", token="anything"))
    assert _code(reply) == 0 and not close


def test_gate_with_token() -> None:
    gate = auth.Gate(auth.Token(SECRET))
    reply, close = gate.screen(_request("ping"))
    assert _code(reply) == ErrorCode.UNAUTHENTICATED and close
    reply, close = gate.screen(_request("hello", token="wrong-token-0123456789"))
    assert _code(reply) == ErrorCode.UNAUTHENTICATED and close
    assert SECRET.encode() not in reply
    reply, close = gate.screen(_request("hello", token=SECRET))
    assert _code(reply) == 0 and not close
    assert gate.screen(_request("ping")) is None


@pytest.mark.parametrize(
    ("header", "ok"),
    [
        (f"Bearer {SECRET}", True),
        (f"bearer {SECRET}", True),
        (f"Basic {SECRET}", False),
        ("Bearer wrong", False),
        ("", False),
        (None, False),
    ],
)
def test_bearer(header: str | None, ok: bool) -> None:
    assert auth.bearer_ok(header, auth.Token(SECRET)) is ok
    assert auth.bearer_ok(header, None) is True
