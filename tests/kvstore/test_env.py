"""The ``KVSTORE_*`` reader: one type, one default and one error per variable."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvstore.env import DEFAULT_CHUNK_ITEMS, DEFAULT_POLL_US, Env, EnvError, read_poll_us
from kvstore.errors import InvalidRequestError


def test_defaults_when_nothing_is_set() -> None:
    env = Env.read({})
    assert env == Env()
    assert env.log_level == "info" and env.chunk_items == DEFAULT_CHUNK_ITEMS
    assert env.poll_us == DEFAULT_POLL_US and env.prefault and env.rdma
    assert env.token is None and env.master is None and env.timeout_s is None


def test_every_variable_is_typed() -> None:
    env = Env.read(
        {
            "KVSTORE_LOG_LEVEL": "DEBUG",
            "KVSTORE_TOKEN": "secret-token-0123456789",
            "KVSTORE_TOKEN_FILE": "/run/tok",
            "KVSTORE_MASTER": "etcd://h:2379",
            "KVSTORE_ADMIN": "http://a:1",
            "KVSTORE_CA_FILE": "/ca.pem",
            "KVSTORE_TIMEOUT": "2.5",
            "KVSTORE_CONFIG": "/c.toml",
            "KVSTORE_MODEL_DIR": "/models/m",
            "KVSTORE_POLL_US": "0",
            "KVSTORE_PREFAULT": "0",
            "KVSTORE_CHUNK_ITEMS": "64",
            "KVSTORE_RDMA": "off",
            "KVSTORE_RDMA_DEVICE": "mlx5_0",
            "KVSTORE_RDMA_PORT": "2",
            "KVSTORE_RDMA_GID_INDEX": "3",
            "KVSTORE_TEST_RDMA_DEVICE": "pretend0",
            "UNRELATED": "x",
        }
    )
    assert env.log_level == "debug"
    assert env.token == "secret-token-0123456789" and env.token_file == Path("/run/tok")
    assert env.master == "etcd://h:2379" and env.admin == "http://a:1"
    assert env.ca_file == "/ca.pem" and env.timeout_s == 2.5 and env.config == Path("/c.toml")
    assert env.model_dir == Path("/models/m")
    assert env.poll_us == 0.0 and env.prefault is False and env.chunk_items == 64
    assert env.rdma is False and env.rdma_device == "mlx5_0"
    assert (env.rdma_port, env.rdma_gid_index, env.test_rdma_device) == (2, 3, "pretend0")


def test_the_token_never_shows_in_repr() -> None:
    assert "secret-token" not in repr(Env.read({"KVSTORE_TOKEN": "secret-token-0123456789"}))


def test_an_empty_variable_counts_as_unset() -> None:
    assert Env.read({"KVSTORE_CHUNK_ITEMS": "", "KVSTORE_MASTER": ""}) == Env()


@pytest.mark.parametrize(
    ("variable", "value"),
    [
        ("KVSTORE_LOG_LEVEL", "loud"),
        ("KVSTORE_TIMEOUT", "soon"),
        ("KVSTORE_TIMEOUT", "0"),
        ("KVSTORE_TIMEOUT", "inf"),
        ("KVSTORE_PREFAULT", "maybe"),
        ("KVSTORE_RDMA", "2"),
        ("KVSTORE_CHUNK_ITEMS", "0"),
        ("KVSTORE_CHUNK_ITEMS", "many"),
        ("KVSTORE_RDMA_PORT", "0"),
        ("KVSTORE_RDMA_PORT", "256"),
        ("KVSTORE_RDMA_GID_INDEX", "-1"),
    ],
)
def test_a_bad_value_is_a_typed_error_naming_the_variable(variable: str, value: str) -> None:
    with pytest.raises(EnvError) as info:
        Env.read({variable: value})
    assert isinstance(info.value, InvalidRequestError)
    assert info.value.variable == variable and info.value.value == value
    assert variable in info.value.message


@pytest.mark.parametrize(
    ("raw", "want"),
    [("junk", DEFAULT_POLL_US), ("nan", DEFAULT_POLL_US), ("-5", 0.0), ("1e9", 10_000.0)],
)
def test_the_poll_window_is_lenient_and_clamped(raw: str, want: float) -> None:
    assert Env.read({"KVSTORE_POLL_US": raw}).poll_us == want
    assert read_poll_us({"KVSTORE_POLL_US": raw}) == want


def test_a_connection_s_poll_window_ignores_other_variables_bad_values() -> None:
    """Every connection reads the window when it opens: another variable's bad value is the
    business of whoever reads that one, not a reason for a socket to fail."""
    env = {"KVSTORE_POLL_US": "50", "KVSTORE_RDMA_PORT": "not-a-port"}
    assert read_poll_us(env) == 50.0
    assert read_poll_us({}) == DEFAULT_POLL_US == read_poll_us({"KVSTORE_POLL_US": ""})


@pytest.mark.parametrize(
    ("raw", "want"), [("1", True), ("on", True), ("OFF", False), ("no", False)]
)
def test_switches(raw: str, want: bool) -> None:
    assert Env.read({"KVSTORE_PREFAULT": raw}).prefault is want


def test_nothing_is_read_at_import(monkeypatch: pytest.MonkeyPatch) -> None:
    """A variable set after import still counts: readers call Env.read when they start."""
    from kvstore import pages, polling

    monkeypatch.setenv("KVSTORE_PREFAULT", "0")
    monkeypatch.setenv("KVSTORE_POLL_US", "250")
    assert pages.enabled() is False
    assert polling.LoopAwake().window == pytest.approx(250e-6)
