"""``kvstore tenant share|unshare|shared`` as an operator types them: a bad digest is refused
before any call (exit 2, one line); against a real master, a namespace is shared, listed and
unshared; without the operator's token nothing changes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.cli.test_tenants import NOWHERE, kvstore, master  # noqa: F401 (master: a fixture)
from tests.support import Daemon

DIGEST = bytes(range(16)).hex()


@pytest.mark.parametrize("bad", ["abc", DIGEST[:-1], DIGEST + "0", "z" * 32])
@pytest.mark.parametrize("verb", ["share", "unshare"])
def test_bad_digests_are_refused_before_any_call(verb: str, bad: str) -> None:
    out = kvstore(verb, bad, "--admin", NOWHERE)
    assert out.returncode == 2, out
    assert out.stderr.startswith("kvstore tenant: ") and "hex characters" in out.stderr
    assert "unreachable" not in out.stderr and out.stdout == ""


def test_share_shared_unshare(master: tuple[Daemon, Path]) -> None:  # noqa: F811
    m, token_file = master
    admin = ["--admin", m.field("admin"), "--token-file", str(token_file)]
    out = kvstore("share", DIGEST.upper(), *admin)
    assert out.returncode == 0, out.stderr
    assert f"namespace {DIGEST} is shared" in out.stdout
    out = kvstore("shared", *admin)
    assert out.returncode == 0 and out.stdout.splitlines()[2:] == [DIGEST], out
    assert json.loads(kvstore("shared", "--json", *admin).stdout) == [DIGEST]
    out = kvstore("unshare", DIGEST, "--json", *admin)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["shared"] is False
    assert json.loads(kvstore("shared", "--json", *admin).stdout) == []
    out = kvstore("unshare", DIGEST, *admin)
    assert out.returncode == 2 and "not shared" in out.stderr, out


def test_without_the_operators_token_nothing_is_shared(master: tuple[Daemon, Path]) -> None:  # noqa: F811
    m, token_file = master
    out = kvstore("share", DIGEST, "--admin", m.field("admin"))
    assert out.returncode == 2 and "token" in out.stderr, out
    out = kvstore("shared", "--json", "--admin", m.field("admin"), "--token-file", str(token_file))
    assert out.returncode == 0 and json.loads(out.stdout) == [], out.stderr
