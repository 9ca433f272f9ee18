"""Operator settings: flags > environment > config file > defaults."""

from __future__ import annotations

import pytest

from kvstore.cli import settings
from kvstore.errors import InvalidRequestError

TOKEN_A = "token-from-file-a-0123456789"
TOKEN_B = "token-from-file-b-0123456789"
TOKEN_ENV = "token-from-env-0123456789"


@pytest.fixture
def files(tmp_path):
    a = tmp_path / "a"
    a.write_text(TOKEN_A)
    b = tmp_path / "b"
    b.write_text(TOKEN_B)
    cfg = tmp_path / "config.toml"
    cfg.write_text(f'admin = "http://file:1"\ntoken_file = "{b}"\ntimeout = 3\n')
    return a, b, cfg


NONE = {"admin": None, "token_file": None, "ca_file": None, "timeout": None}


@pytest.mark.parametrize(
    ("flags", "env", "use_file", "admin", "token", "timeout", "src"),
    [
        ({}, {}, False, settings.DEFAULT_ADMIN, None, 10.0, "default"),
        ({}, {}, True, "http://file:1", TOKEN_B, 3.0, "file"),
        (
            {},
            {"KVSTORE_ADMIN": "http://env:2", "KVSTORE_TOKEN": TOKEN_ENV, "KVSTORE_TIMEOUT": "4"},
            True,
            "http://env:2",
            TOKEN_ENV,
            4.0,
            "env",
        ),
        (
            {"admin": "https://flag:3", "token_file": "A", "timeout": 5.0},
            {"KVSTORE_ADMIN": "http://env:2", "KVSTORE_TOKEN": TOKEN_ENV},
            True,
            "https://flag:3",
            TOKEN_A,
            5.0,
            "flag",
        ),
    ],
)
def test_precedence(files, flags, env, use_file, admin, token, timeout, src) -> None:
    a, _, cfg = files
    flags = {**NONE, **{k: (str(a) if v == "A" else v) for k, v in flags.items()}}
    got = settings.resolve(flags, env=env, config_path=str(cfg) if use_file else None)
    assert got.admin == admin
    assert got.timeout == timeout
    assert (got.token is None) if token is None else got.token.matches(token)
    assert got.sources["admin"] == src
    for secret in (TOKEN_A, TOKEN_B, TOKEN_ENV):
        assert secret not in repr(got)


def test_config_from_env_variable(files, monkeypatch) -> None:
    _, _, cfg = files
    got = settings.resolve(NONE, env={"KVSTORE_CONFIG": str(cfg)})
    assert got.admin == "http://file:1" and got.sources["token"] == "file"


@pytest.mark.parametrize(
    "text",
    ["admin = ", 'unknown = "x"', "timeout = true", "admin = 3"],
)
def test_bad_config_files(tmp_path, text: str) -> None:
    cfg = tmp_path / "bad.toml"
    cfg.write_text(text)
    with pytest.raises(InvalidRequestError):
        settings.resolve(NONE, env={}, config_path=str(cfg))


@pytest.mark.parametrize(
    "flags", [{"admin": "ftp://x"}, {"timeout": -1.0}, {"token_file": "/nonexistent/tok"}]
)
def test_bad_flags(flags) -> None:
    with pytest.raises(InvalidRequestError):
        settings.resolve({**NONE, **flags}, env={})


def test_named_config_must_exist(tmp_path) -> None:
    with pytest.raises(InvalidRequestError):
        settings.resolve(NONE, env={}, config_path=str(tmp_path / "nope.toml"))
