"""Whose read leases a connection may give back (kvstore.master.leases owners): a tenant's
release ends its own leases only, the operator's any; a tenant's request goes through the same
edge as on the wire (``rpc_tenants.scope_request``, then its own answer or the usual dispatch)."""

from __future__ import annotations

from typing import Any

import msgpack
import pytest

from kvstore import protocol
from kvstore.master.leases import LEASE_BATCH_SPAN, ReadLeases, lease_owner
from kvstore.master.rpc_tenants import scope_request
from kvstore.master.server import dispatch
from kvstore.master.service import MasterService
from kvstore.master.table import ObjectMeta
from kvstore.tenants import tenant_key
from tests.master.test_tiering import KIB, FakeClock, make, put


def request(svc: MasterService, tenant: str | None, verb: str, args: dict[str, Any]) -> Any:
    """One request of ``tenant``'s connection (None: the operator's); its result, or raises
    AssertionError with the error it was answered."""
    req = protocol.Request(1, verb, args)
    own = scope_request(svc, req, tenant) if tenant is not None else None
    if own is not None and tenant is not None:
        return own(svc, req.args, tenant)
    frame = dispatch(svc, req)
    body = msgpack.unpackb(frame[protocol.HEADER_SIZE :], raw=False)
    assert body[1] == 0, body
    return body[2]


def lease_of(svc: MasterService, tenant: str | None, key: bytes) -> int:
    (answer,) = request(svc, tenant, "get_locations", {"keys": [key]})
    assert answer[0] == 0, answer
    return answer[1][3]


@pytest.fixture
def svc() -> MasterService:
    svc = make(FakeClock(), dram=256 * KIB, nvme=0)
    for stored in (tenant_key("a", b"k"), tenant_key("b", b"k"), b"k"):
        put(svc, stored, 4 * KIB)
    return svc


@pytest.mark.parametrize(
    ("keys", "owner"),
    [
        ([b"\x00a\x00x", b"\x00a\x00y", b"kv/shared"], "a"),
        ([b"plain", b"kv/shared"], None),
        ([b"\x00a\x00x", b"\x00b\x00y"], None),  # (an operator's batch of two tenants' keys)
        ([], None),
    ],
)
def test_a_batch_belongs_to_the_one_tenant_whose_keys_it_names(
    keys: list[bytes], owner: str | None
) -> None:
    assert lease_owner(keys) == owner


def test_only_the_owner_or_the_operator_ends_a_lease() -> None:
    leases = ReadLeases(first_batch=7)
    a, b, op = (ObjectMeta(k, 1, 2, []) for k in (b"\x00a\x00k", b"\x00b\x00k", b"k"))
    ta = leases.grant([a], 10.0, "a")
    tb = leases.grant([b], 10.0, "b")
    to = leases.grant([op], 10.0)
    assert leases.release([ta, to], "b") == ([False, False], [])
    assert a.readers == 1 and op.readers == 1
    assert leases.release([ta], "a") == ([True], [a])
    assert leases.release([tb, to]) == ([True, True], [b, op]), "the operator ends any"
    assert leases.num_outstanding == 0
    assert ta // LEASE_BATCH_SPAN + 1 == tb // LEASE_BATCH_SPAN, "tokens run in sequence"


def test_a_tenant_cannot_release_another_tenants_or_the_operators_lease(
    svc: MasterService,
) -> None:
    mine = lease_of(svc, "a", b"k")
    theirs, operators = lease_of(svc, "b", b"k"), lease_of(svc, None, b"k")
    b_obj, op_obj = svc.objects[tenant_key("b", b"k")], svc.objects[b"k"]
    assert request(svc, "a", "release_leases", {"tokens": [theirs, operators]}) == [False, False]
    assert b_obj.readers == 1 and op_obj.readers == 1
    assert request(svc, "a", "release_leases", {"tokens": [mine]}) == [True]
    assert svc.objects[tenant_key("a", b"k")].readers == 0
    assert request(svc, "b", "release_leases", {"tokens": [theirs]}) == [True]
    assert request(svc, None, "release_leases", {"tokens": [operators]}) == [True]


def test_a_piggybacked_release_of_another_tenants_lease_changes_nothing(
    svc: MasterService,
) -> None:
    theirs, mine = lease_of(svc, "b", b"k"), lease_of(svc, "a", b"k")
    request(svc, "a", "exists", {"keys": [b"k"], "release": [theirs, mine]})
    assert svc.objects[tenant_key("b", b"k")].readers == 1
    assert svc.objects[tenant_key("a", b"k")].readers == 0


def test_the_operator_releases_a_tenants_lease(svc: MasterService) -> None:
    theirs = lease_of(svc, "b", b"k")
    assert svc.release_leases([theirs]) == [True]  # (the master's own restore reads so)
    assert svc.objects[tenant_key("b", b"k")].readers == 0
