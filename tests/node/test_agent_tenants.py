"""The node's master link keeps the node's tenant directory (kvstore.node.agent): taken from
every registration reply, and from a heartbeat reply when the master's is newer than the
``tenants_version`` the heartbeat said; a malformed one is logged and changes nothing; a
registration with a restarted master (an older version) is taken whole. Against the scripted
master of test_agent, so each reply is exactly the one under test."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from kvstore import auth, protocol
from kvstore.address import Address
from kvstore.cli.ops import AdminClient
from kvstore.cli.settings import CliConfig
from kvstore.errors import KVStoreError, NodeUnavailableError, UnauthenticatedError
from kvstore.tenants import TenantDirectory, token_digest
from tests.node import data_server
from tests.node.test_agent import WAIT_S, FakeMaster, NodeRig
from tests.support import Cluster, start_master, wait_until

ACME = "acme-token-0123456789abcdef"
BOLT = "bolt-token-0123456789abcdef"


def _wire(version: int, **names: str) -> dict[str, object]:
    """The master's directory: ``names`` maps each tenant to its token."""
    return TenantDirectory(
        {token_digest(token): name for name, token in names.items()}, version
    ).wire()


def _hello_binds(rig: NodeRig, token: str) -> str | None:
    """The tenant the node's data port binds a connection with ``token`` to."""
    with data_server.connected(rig.server) as conn:
        return conn.call("hello", {"token": token}).get("tenant")


def _register(rig: NodeRig, master: FakeMaster, tenants: object) -> None:
    master.script("register", {"heartbeat_interval_s": 0.02, "tenants": tenants})
    rig.start()
    master.next_call("register")
    assert rig.link.registered.wait(WAIT_S)


def test_the_registration_reply_gives_the_node_its_tenants(
    rig: NodeRig, master: FakeMaster
) -> None:
    _register(rig, master, _wire(3, acme=ACME))
    assert rig.server.tenants.version == 3
    assert _hello_binds(rig, ACME) == "acme"
    assert _hello_binds(rig, BOLT) is None, "no tenant's token: the operator's (no cluster token)"
    assert master.next_call("heartbeat")["tenants_version"] == 3


def test_a_heartbeat_reply_with_a_newer_directory_replaces_it(
    rig: NodeRig, master: FakeMaster
) -> None:
    _register(rig, master, _wire(1, acme=ACME))
    sent = master.script("heartbeat", {"tenants": _wire(2, bolt=BOLT)})
    assert master.next_call_after(sent, "heartbeat")["tenants_version"] == 2
    assert _hello_binds(rig, BOLT) == "bolt"
    assert _hello_binds(rig, ACME) is None, "acme was deleted"
    stale = master.script("heartbeat", {"tenants": _wire(1, acme=ACME)})
    assert master.next_call_after(stale, "heartbeat")["tenants_version"] == 2, "older: ignored"
    assert _hello_binds(rig, BOLT) == "bolt"


@pytest.mark.parametrize(
    "bad",
    [
        "not a map",
        {"version": "2", "digests": {}},
        {"version": 2, "digests": {b"short": "acme"}},
        {"version": 2, "digests": {bytes(16): "Not A Name"}},
    ],
    ids=["not-a-map", "version-not-int", "short-digest", "bad-name"],
)
def test_a_malformed_directory_is_logged_and_changes_nothing(
    rig: NodeRig, master: FakeMaster, caplog: pytest.LogCaptureFixture, bad: object
) -> None:
    caplog.set_level(logging.WARNING, logger="kvstore.node.agent")
    _register(rig, master, _wire(1, acme=ACME))
    sent = master.script("heartbeat", {"tenants": bad})
    beat = master.next_call_after(sent, "heartbeat")
    assert beat["tenants_version"] == 1 and beat["_conn"] == 1, "same link, nothing taken"
    assert _hello_binds(rig, ACME) == "acme"
    assert "malformed tenant directory" in caplog.text
    assert rig.link.registered.is_set()


def test_a_malformed_directory_in_the_registration_reply_changes_nothing(
    rig: NodeRig, master: FakeMaster
) -> None:
    _register(rig, master, {"version": 5, "digests": [b"not a map"]})
    assert rig.server.tenants.version == 0 and len(rig.server.tenants) == 0
    assert master.next_call("heartbeat")["tenants_version"] == 0


def test_a_registration_with_a_restarted_master_takes_its_directory_whole(
    rig: NodeRig, master: FakeMaster
) -> None:
    """A restarted master counts its versions from the start again: its directory is the one
    that holds, even at a version the node has seen (or passed)."""
    _register(rig, master, _wire(7, acme=ACME))
    master.script("register", {"heartbeat_interval_s": 0.02, "tenants": _wire(2, bolt=BOLT)})
    master.script("heartbeat", NodeUnavailableError("unknown node"))
    assert master.next_call("register")["_conn"] == 1, "registered again on the same link"
    assert master.next_call("heartbeat")["tenants_version"] == 2
    assert _hello_binds(rig, BOLT) == "bolt" and _hello_binds(rig, ACME) is None


# ------------------------------------------------------------------ with a real master
def _master_has_tenant_routes() -> bool:
    """Whether the master's admin API serves /api/v1/tenants yet (the master's half of tenants
    is written in parallel with the node's)."""
    routes = Path(__file__).resolve().parents[2] / "master" / "rest" / "routes.py"
    return "/api/v1/tenants" in routes.read_text()


SECRET = "agent-tenants-test-token-0123456789"


@pytest.mark.skipif(
    not _master_has_tenant_routes(), reason="the master's /api/v1/tenants routes are not in yet"
)
def test_a_real_masters_tenants_open_and_close_the_nodes_data_port(tmp_path: Path) -> None:
    """Created at the master, a tenant's token opens the node's data port as that tenant once a
    heartbeat carried it; deleted, it opens nothing there."""
    token_file = tmp_path / "token"
    token_file.write_text(SECRET + "\n")
    flags = ("--token-file", str(token_file))
    cluster = Cluster(tmp_path, start_master(*flags), node_args=flags)
    try:
        node = cluster.add_node("32MiB")
        admin = AdminClient(CliConfig(admin=cluster.admin, token=auth.Token(SECRET)))
        token = admin.call("POST", "/api/v1/tenants", {"name": "acme", "quotas": {}})["token"]
        data = Address.parse(node.field("data"))

        def hello() -> str | None | KVStoreError:
            conn = protocol.FramedSocket.connect(data.host, data.port, timeout=10)
            try:
                return conn.call("hello", {"token": token}).get("tenant")
            except KVStoreError as err:
                return err
            finally:
                conn.close()

        wait_until(lambda: hello() == "acme", what="the node to learn acme's token")
        admin.call("DELETE", "/api/v1/tenants/acme")
        wait_until(
            lambda: isinstance(hello(), UnauthenticatedError), what="acme's token to be refused"
        )
    finally:
        cluster.stop()
