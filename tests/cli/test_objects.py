"""``kvstore get|put|ls|rm`` against a real master and node, as a user types them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kvstore.cli import settings


def kv(master: str, *args: str, stdin: bytes | None = None) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(
        [sys.executable, "-m", "kvstore", "--log-level", "warning", args[0], "--master", master]
        + list(args[1:]),
        capture_output=True,
        timeout=60,
        input=stdin,
    )


def test_put_get_ls_rm_like_redis_cli(cluster_factory, tmp_path: Path) -> None:
    cluster = cluster_factory(num_nodes=1)
    m = cluster.address
    blob = bytes(range(256)) * 10
    (tmp_path / "blob").write_bytes(blob)

    out = kv(m, "put", "greeting", "hello")
    assert out.returncode == 0 and out.stdout == b"stored 'greeting' (5 bytes)\n", out
    assert kv(m, "put", "gr/blob", "--file", str(tmp_path / "blob")).returncode == 0
    assert kv(m, "put", "other", "x").returncode == 0
    assert kv(m, "put", "gr/piped", "--file", "-", stdin=blob[:100]).returncode == 0
    assert kv(m, "get", "gr/piped").stdout == blob[:100]
    assert kv(m, "rm", "gr/piped").returncode == 0

    assert kv(m, "get", "greeting").stdout == b"hello"  # a pipe gets the bytes as stored
    assert kv(m, "get", "gr/blob").stdout == blob
    assert kv(m, "get", "gr/blob", "--out", str(tmp_path / "back")).returncode == 0
    assert (tmp_path / "back").read_bytes() == blob

    assert kv(m, "ls").stdout.decode().splitlines() == ["gr/blob", "greeting", "other"]
    assert kv(m, "ls", "gr").stdout.decode().splitlines() == ["gr/blob", "greeting"]

    missing = kv(m, "get", "nope")
    assert (missing.returncode, missing.stderr) == (1, b"kvstore get: no key 'nope'\n")
    removed = kv(m, "rm", "greeting", "nope")
    assert (removed.returncode, removed.stderr) == (1, b"kvstore rm: no key 'nope'\n")
    assert kv(m, "ls").stdout.decode().splitlines() == ["gr/blob", "other"]


def test_put_needs_one_value(cluster_factory) -> None:
    cluster = cluster_factory(num_nodes=1)
    out = kv(cluster.address, "put", "k")
    assert out.returncode == 2
    assert out.stderr == b"kvstore put: give VALUE or --file FILE (exactly one)\n"


@pytest.mark.parametrize(
    ("flag", "env", "in_file", "want"),
    [
        (None, {}, False, (settings.DEFAULT_MASTER, "default")),
        (None, {}, True, ("file:1", "file")),
        (None, {"KVSTORE_MASTER": "env:2"}, True, ("env:2", "env")),
        ("flag:3", {"KVSTORE_MASTER": "env:2"}, True, ("flag:3", "flag")),
    ],
)
def test_where_the_data_commands_connect(tmp_path: Path, flag, env, in_file, want) -> None:
    cfg = tmp_path / "config.toml"
    cfg.write_text('master = "file:1"\n')
    got = settings.resolve_master(flag, env=env, config_path=str(cfg) if in_file else None)
    assert got == want
