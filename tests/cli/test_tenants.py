"""``kvstore tenant create|list|show|set|delete`` as an operator types them: bad input is refused
before any call (exit 2, one line); against a real master with a cluster token, a tenant is
created with quotas and its token printed once (and that token opens the master as the tenant),
listed, shown, its quotas changed and removed, and deleted; without the token nothing changes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvstore import protocol
from kvstore.address import Address
from kvstore.errors import UnauthenticatedError
from tests.support import Daemon, start_master

SECRET = "tenant-cli-test-token-0123456789abcdef"
#: Nothing listens here: a command that reached for the admin API would say "unreachable".
NOWHERE = "http://127.0.0.1:9"


def _master_has_tenant_routes() -> bool:
    """Whether the master's admin API serves /api/v1/tenants yet (the master's half of tenants
    is written in parallel with this one)."""
    routes = Path(__file__).resolve().parents[2] / "master" / "rest" / "routes.py"
    return "/api/v1/tenants" in routes.read_text()


needs_routes = pytest.mark.skipif(
    not _master_has_tenant_routes(), reason="the master's /api/v1/tenants routes are not in yet"
)


def kvstore(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
    return subprocess.run(
        [sys.executable, "-m", "kvstore", "--log-level", "warning", "tenant", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**clean, "HOME": "/nonexistent", **(env or {})},
    )


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["create", "Acme"], "tenant name must be"),
        (["create", "acme", "--dram-quota", "20XB"], "--dram-quota: bad size '20XB'"),
        (["create", "acme", "--nvme-quota", "none"], "--nvme-quota none only removes a quota"),
        (["set", "acme"], "give at least one of --hbm-quota, --dram-quota, --nvme-quota"),
        (["set", "acme", "--hbm-quota=-1GiB"], "--hbm-quota: bad size"),
        (["show", "a/../b"], "tenant name must be"),
        (["delete", "x" * 40], "tenant name must be"),
    ],
    ids=["name", "size", "none-on-create", "set-nothing", "negative", "path-name", "long-name"],
)
def test_bad_input_is_refused_before_any_call(args: list[str], said: str) -> None:
    out = kvstore(*args, "--admin", NOWHERE)
    assert out.returncode == 2, out
    assert out.stderr.startswith("kvstore tenant: ") and said in out.stderr, out.stderr
    assert "unreachable" not in out.stderr and out.stdout == ""


@pytest.fixture
def master(tmp_path: Path) -> Iterator[tuple[Daemon, Path]]:
    token_file = tmp_path / "token"
    token_file.write_text(SECRET + "\n")
    m = start_master("--token-file", str(token_file))
    try:
        yield m, token_file
    finally:
        m.stop()


def _hello(master: Daemon, token: str) -> dict[str, object]:
    """The master's answer to a control connection's hello with ``token``."""
    address = Address.parse(master.field("control"))
    conn = protocol.FramedSocket.connect(address.host, address.port, timeout=10)
    try:
        return conn.call("hello", {"token": token})
    finally:
        conn.close()


def _field(stdout: str, name: str) -> str:
    """The value of a ``name  value`` line of a tenant's printout."""
    for line in stdout.splitlines():
        if line.startswith(name + " "):
            return line[len(name) :].strip()
    raise AssertionError(f"no {name!r} line in {stdout!r}")


@needs_routes
def test_create_list_show_set_delete(master: tuple[Daemon, Path]) -> None:
    m, token_file = master
    admin = ["--admin", m.field("admin"), "--token-file", str(token_file)]

    out = kvstore("create", "acme", "--dram-quota", "20GiB", "--nvme-quota", "200GiB", *admin)
    assert out.returncode == 0, out.stderr
    token = _field(out.stdout, "token")
    assert _field(out.stdout, "dram quota") == "20.0 GiB"
    assert _field(out.stdout, "hbm quota") == "-"
    assert "shown only now" in out.stdout
    assert _hello(m, token).get("tenant") == "acme", "the printed token opens the master as acme"

    out = kvstore("create", "bolt", "--json", *admin)
    assert out.returncode == 0, out.stderr
    bolt = json.loads(out.stdout)  # stdout is JSON alone; the notice goes to stderr
    assert bolt["name"] == "bolt" and bolt["token"] and bolt["token"] != token
    assert "shown only now" in out.stderr

    out = kvstore("create", "acme", *admin)
    assert out.returncode == 2 and "acme" in out.stderr, "a name is taken once"

    out = kvstore("list", *admin)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].split() == [
        "TENANT", "HBM", "QUOTA", "DRAM", "QUOTA", "NVME", "QUOTA", "SHARED", "QUOTA", "CREATED",
    ]  # fmt: skip
    rows = {line.split()[0]: line for line in lines[2:]}
    assert sorted(rows) == ["acme", "bolt"]
    assert "20.0 GiB" in rows["acme"] and "200.0 GiB" in rows["acme"]
    assert token not in out.stdout, "the token is never shown again"
    listed = json.loads(kvstore("list", "--json", *admin).stdout)
    assert {t["name"]: t["quotas"] for t in listed} == {
        "acme": {"dram": 20 << 30, "nvme": 200 << 30},
        "bolt": {},
    }

    out = kvstore("set", "acme", "--dram-quota", "40GiB", "--hbm-quota", "1GiB", *admin)
    assert out.returncode == 0, out.stderr
    out = kvstore("show", "acme", *admin)
    assert out.returncode == 0, out.stderr
    assert _field(out.stdout, "dram quota") == "40.0 GiB"
    assert _field(out.stdout, "hbm quota") == "1.0 GiB"
    assert _field(out.stdout, "nvme quota") == "200.0 GiB"
    assert kvstore("set", "acme", "--dram-quota", "none", *admin).returncode == 0
    shown = json.loads(kvstore("show", "acme", "--json", *admin).stdout)
    assert shown["name"] == "acme" and "token" not in shown
    assert shown["quotas"] == {"hbm": 1 << 30, "nvme": 200 << 30}

    out = kvstore("delete", "acme", *admin)
    assert out.returncode == 0, out.stderr
    assert "deleted tenant 'acme'" in out.stdout and "0 object(s) removed" in out.stdout
    out = kvstore("show", "acme", *admin)
    assert out.returncode == 2 and "acme" in out.stderr
    assert [t["name"] for t in json.loads(kvstore("list", "--json", *admin).stdout)] == ["bolt"]
    with pytest.raises(UnauthenticatedError):  # its token opens nothing any more
        _hello(m, token)


@needs_routes
def test_without_the_operators_token_nothing_changes(master: tuple[Daemon, Path]) -> None:
    m, token_file = master
    admin = ["--admin", m.field("admin")]
    out = kvstore("create", "acme", *admin)
    assert out.returncode == 2 and "token" in out.stderr, out
    assert SECRET not in out.stderr + out.stdout
    out = kvstore("list", "--json", *admin, "--token-file", str(token_file))
    assert out.returncode == 0 and json.loads(out.stdout) == [], out.stderr
