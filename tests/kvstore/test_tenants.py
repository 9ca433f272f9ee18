"""Tenants in the core: names, the tenant's part of the key space, the token directory, and a
connection bound to its tenant at hello (refused once the tenant is deleted)."""

from __future__ import annotations

import pytest

from kvstore import auth, protocol, serving, tenants
from kvstore.errors import ErrorCode, InvalidRequestError
from kvstore.limits import MAX_KEY_BYTES

CLUSTER = "the-operators-cluster-token"
ACME = "acme-token-0123456789abcdef"
BETA = "beta-token-0123456789abcdef"


def directory(version: int = 1, **named: str) -> tenants.TenantDirectory:
    return tenants.TenantDirectory({tenants.token_digest(t): n for n, t in named.items()}, version)


def hello(session: serving.FrameSession, token: str) -> protocol.Response:
    body = protocol.encode_request(1, auth.HELLO_VERB, {"token": token})[protocol.HEADER_SIZE :]
    head = protocol.FrameHeader(protocol.PROTOCOL_VERSION, protocol.KIND_REQUEST, len(body), 0)
    step = session.open_request(head, body)
    assert isinstance(step, serving.Refusal)
    return protocol.decode_response(step.frame[protocol.HEADER_SIZE :])


def ping(session: serving.FrameSession) -> protocol.Response | None:
    body = protocol.encode_request(2, "ping", {})[protocol.HEADER_SIZE :]
    head = protocol.FrameHeader(protocol.PROTOCOL_VERSION, protocol.KIND_REQUEST, len(body), 0)
    step = session.open_request(head, body)
    if isinstance(step, serving.Refusal):
        return protocol.decode_response(step.frame[protocol.HEADER_SIZE :])
    return None


@pytest.mark.parametrize("name", ["acme", "a", "team-7_x", "a" * 32])
def test_a_good_name_passes(name: str) -> None:
    assert tenants.check_name(name) == name


@pytest.mark.parametrize("name", ["", "Acme", "7up", "a" * 33, "a/b", "a\x00", None, 3])
def test_a_bad_name_is_refused_typed(name: object) -> None:
    with pytest.raises(InvalidRequestError, match="tenant name"):
        tenants.check_name(name)


def test_two_tenants_keys_never_collide_and_each_sees_only_its_own() -> None:
    a, b = tenants.tenant_key("acme", b"k"), tenants.tenant_key("beta", b"k")
    assert a != b != b"k"
    assert tenants.owner_of(a) == "acme" and tenants.owner_of(b) == "beta"
    assert tenants.owner_of(b"k") is None
    assert tenants.user_key("acme", a) == b"k" and tenants.user_key("acme", b) is None
    assert tenants.user_key("acme", b"k") is None  # the operator's key space is not acme's
    assert tenants.user_key(None, a) == a  # the operator knows every key by its stored form
    # A prefix of another tenant's name is no way in: "acme" cannot reach "acme2"'s keys.
    assert tenants.user_key("acme", tenants.tenant_key("acme2", b"k")) is None


def test_a_tenant_cannot_name_a_stored_key_of_another() -> None:
    forged = tenants.tenant_key("beta", b"k")
    with pytest.raises(InvalidRequestError, match="NUL"):
        tenants.tenant_key("acme", forged)
    assert tenants.tenant_key(None, forged) == forged  # the operator may


def test_a_tenant_key_too_long_in_its_key_space_is_refused_naming_its_limit() -> None:
    room = MAX_KEY_BYTES - len(tenants.prefix_of("acme"))
    assert len(tenants.tenant_key("acme", b"k" * room)) == MAX_KEY_BYTES
    with pytest.raises(InvalidRequestError, match=f"at most {room}"):
        tenants.tenant_key("acme", b"k" * (room + 1))


def test_the_directory_keeps_digests_and_only_newer_versions() -> None:
    d = directory(1, acme=ACME)
    assert d.resolve(ACME) == "acme" and d.resolve(ACME.encode()) == "acme"
    assert d.resolve(BETA) is None and d.resolve(None) is None and d.resolve(7) is None
    assert ACME.encode() not in repr(d.wire()).encode()  # digests only, never a token
    assert not d.replace({tenants.token_digest(BETA): "beta"}, 1)  # same version: kept
    assert d.replace({tenants.token_digest(BETA): "beta"}, 2)
    assert d.resolve(ACME) is None and d.resolve(BETA) == "beta"
    node = tenants.TenantDirectory()
    assert node.take_wire(d.wire()) and node.resolve(BETA) == "beta"
    assert not node.take_wire(d.wire())  # nothing newer


@pytest.mark.parametrize(
    "wire",
    [
        [],
        {"version": "1", "digests": {}},
        {"version": 3, "digests": {b"short": "acme"}},
        {"version": 3, "digests": {b"x" * 16: "Bad Name"}},
    ],
)
def test_a_malformed_directory_changes_nothing(wire: object) -> None:
    d = directory(1, acme=ACME)
    with pytest.raises(InvalidRequestError):
        d.take_wire(wire)
    assert d.resolve(ACME) == "acme" and d.version == 1


def test_hello_binds_the_connection_to_the_tenant_whose_token_it_carries() -> None:
    d = directory(1, acme=ACME, beta=BETA)
    s = serving.FrameSession(auth.Token(CLUSTER), 0.0, tenants=d)
    assert hello(s, ACME).result == {"authenticated": True, "tenant": "acme"}
    assert s.tenant == "acme" and ping(s) is None
    op = serving.FrameSession(auth.Token(CLUSTER), 0.0, tenants=d)
    assert hello(op, CLUSTER).result == {"authenticated": True} and op.tenant is None
    bad = serving.FrameSession(auth.Token(CLUSTER), 0.0, tenants=d)
    assert hello(bad, "no-such-token-anywhere-here").code == ErrorCode.UNAUTHENTICATED
    assert not bad.authenticated


def test_a_deleted_tenants_connection_is_refused_at_its_next_request() -> None:
    d = directory(1, acme=ACME, beta=BETA)
    a = serving.FrameSession(auth.Token(CLUSTER), 0.0, tenants=d)
    b = serving.FrameSession(auth.Token(CLUSTER), 0.0, tenants=d)
    hello(a, ACME)
    hello(b, BETA)
    d.replace({tenants.token_digest(BETA): "beta"}, 2)  # acme deleted
    refused = ping(a)
    assert refused is not None and refused.code == ErrorCode.UNAUTHENTICATED
    assert "deleted" in refused.result
    assert not a.authenticated
    assert ping(b) is None  # beta keeps working
    fresh = serving.FrameSession(auth.Token(CLUSTER), 0.0, tenants=d)
    assert hello(fresh, ACME).code == ErrorCode.UNAUTHENTICATED
