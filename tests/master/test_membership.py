"""Membership on its own: registration checks, node identity, heartbeats, expiry, removal."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore import grants
from kvstore.errors import (
    ForbiddenError,
    GrantInvalidError,
    InvalidRequestError,
    NodeUnavailableError,
)
from kvstore.master.allocator import OffsetAllocator
from kvstore.master.budget import ByteBudget
from kvstore.master.config import MasterConfig
from kvstore.master.membership import (
    HOLDING_PAGE_UNITS,
    Holding,
    Membership,
    Node,
    make_allocator,
    make_segment,
)
from kvstore.master.table import Replica
from kvstore.types import SegmentSpec
from tests.master.fakes import FakeClock

DRAM = SegmentSpec("dram", "dram", 1 << 20)
NVME = SegmentSpec("nvme", "nvme", 1 << 20)
SECRET = b"s" * 32
KEY_A = b"identity-key-of-a" * 2
KEY_B = b"identity-key-of-b" * 2


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def members(clock: FakeClock) -> Membership:
    return Membership(MasterConfig(node_ttl_s=3, heartbeat_interval_s=1), clock)


def join(
    members: Membership,
    node_id: str = "n1",
    segments: list[SegmentSpec] | None = None,
    identity: bytes | None = None,
) -> Node:
    node = members.admit(node_id, "127.0.0.1", 9001, SECRET, segments or [DRAM], None, identity)
    members.add(node)
    return node


@pytest.mark.parametrize(
    ("node_id", "port", "secret", "segments", "identity"),
    [
        ("", 9001, SECRET, [DRAM], None),
        ("x" * 129, 9001, SECRET, [DRAM], None),
        ("n1", 0, SECRET, [DRAM], None),
        ("n1", 65536, SECRET, [DRAM], None),
        ("n1", 9001, b"short", [DRAM], None),
        ("n1", 9001, SECRET, [], None),
        ("n1", 9001, SECRET, [DRAM, DRAM], None),
        ("n1", 9001, SECRET, [SegmentSpec("d", "dram", -1)], None),
        ("n1", 9001, SECRET, [SegmentSpec("d", "tape", 1024)], None),
        ("n1", 9001, SECRET, [DRAM], b"too short"),
        ("n1", 9001, SECRET, [DRAM], b"x" * 1025),
    ],
)
def test_a_bad_registration_is_refused_and_binds_nothing(
    members: Membership,
    node_id: str,
    port: int,
    secret: bytes,
    segments: list[SegmentSpec],
    identity: bytes | None,
) -> None:
    with pytest.raises(InvalidRequestError):
        members.admit(node_id, "127.0.0.1", port, secret, segments, None, identity)
    assert not members.nodes and not members.identities


def test_admit_builds_the_record_and_add_makes_it_a_member(
    members: Membership, clock: FakeClock
) -> None:
    node = members.admit(
        "n1", "10.0.0.1", 9001, SECRET, [DRAM, NVME], {"shm": {"path": "/x"}}, None
    )
    assert not members.nodes, "admitting is not joining"
    members.add(node)
    assert members.nodes == {"n1": node} and node.last_seen == clock.now
    assert set(node.segments) == {"dram", "nvme"} and node.state == "active"
    assert members.node_transports() == {"n1": {"shm": {"path": "/x"}}}


def test_each_tier_gets_its_allocator() -> None:
    assert isinstance(make_allocator("dram", 1024), OffsetAllocator)
    assert isinstance(make_allocator("hbm", 1024), OffsetAllocator)
    assert isinstance(make_allocator("nvme", 1024), ByteBudget)


def test_an_identity_binds_the_id_to_its_key(members: Membership) -> None:
    join(members, identity=KEY_A)
    members.check_identity("n1", KEY_A)
    with pytest.raises(ForbiddenError):
        members.check_identity("n1", KEY_B)
    with pytest.raises(ForbiddenError):
        members.check_identity("n1", None)
    with pytest.raises(ForbiddenError):
        members.admit("n1", "127.0.0.1", 9001, SECRET, [DRAM], None, KEY_B)
    members.check_identity("n2", None)  # an unbound id proves nothing and needs nothing


def test_a_heartbeat_hands_out_forgets_and_settles_limbo(
    members: Membership, clock: FakeClock
) -> None:
    node = join(members, segments=[NVME])
    budget = node.segments["nvme"].allocator
    offset = budget.allocate(100)
    assert offset is not None
    in_limbo = budget.free(offset)
    node.forgotten.append(("nvme", offset, 7))
    node.limbo.append(("nvme", in_limbo))
    clock.now += 1
    assert members.heartbeat("n1") == [("nvme", offset, 7)]
    assert node.last_seen == clock.now and node.unconfirmed == [("nvme", offset, 7)]
    assert budget.limbo_bytes == in_limbo, "the node has not dropped them yet"
    assert members.heartbeat("n1") == []
    assert budget.limbo_bytes == 0 and node.unconfirmed == []


def test_a_heartbeat_from_an_unknown_node_asks_it_to_register(members: Membership) -> None:
    with pytest.raises(NodeUnavailableError):
        members.heartbeat("ghost")


def test_silent_nodes_are_those_past_the_ttl(members: Membership, clock: FakeClock) -> None:
    join(members, "n1")
    join(members, "n2")
    clock.now += 2
    members.heartbeat("n2")
    clock.now += 1.5
    assert members.silent() == ["n1"]
    members.heard_from_all(clock.now)
    assert members.silent() == []


def test_removal_keeps_tombstones_of_what_the_node_may_still_hold(members: Membership) -> None:
    node = join(members)
    node.forgotten.append(("dram", 0, 1))
    node.unconfirmed.append(("dram", 64, 2))
    assert members.remove("n1", {("dram", 128)}) is node
    assert "n1" not in members.nodes and not members.owns(node)
    assert members.tombstones["n1"] == {("dram", 0), ("dram", 64), ("dram", 128)}


def test_a_re_registered_node_is_another_incarnation(members: Membership) -> None:
    old = join(members)
    members.remove("n1", set())
    new = join(members)
    assert members.owns(new) and not members.owns(old)


def test_locations_carry_grants_signed_with_the_nodes_secret(
    members: Membership, clock: FakeClock
) -> None:
    join(members)
    replica = Replica("n1", "dram", 64, 100)
    expires = clock.wall_ms() + 5000
    loc = members.location(replica, b"k", grants.OP_READ, expires)
    assert (loc.node_id, loc.host, loc.port) == ("n1", "127.0.0.1", 9001)
    grants.verify(SECRET, loc.grant, grants.OP_READ, clock.wall_ms())
    with pytest.raises(GrantInvalidError):
        grants.verify(b"x" * 32, loc.grant, grants.OP_READ, clock.wall_ms())


def test_a_drained_node_retires_without_tombstones(members: Membership) -> None:
    node = join(members)
    node.retired = True
    assert members.retire("n1") is node
    assert not members.nodes and "n1" not in members.tombstones


@settings(max_examples=150, deadline=None)
@given(
    st.lists(
        st.tuples(st.booleans(), st.integers(0, 3 * HOLDING_PAGE_UNITS), st.integers(0, 200)),
        max_size=120,
    )
)
def test_holding_is_the_mapping_a_dict_would_be(ops: list[tuple[bool, int, int]]) -> None:
    """A segment's holding index (paged for one-unit replicas) answers as a plain dict."""
    holding, model = Holding(64), {}
    for add, unit, size in ops:
        offset = unit * 64 + (size == 7)  # now and then an offset off the unit
        if add:
            holding.add(offset, b"k%d" % unit, size)
            model[offset] = b"k%d" % unit
        else:
            assert holding.pop(offset, None) == model.pop(offset, None)
        assert len(holding) == len(model) and holding == model
        assert holding.get(offset) == model.get(offset)
    assert sorted(holding.items()) == sorted(model.items()) and sorted(holding) == sorted(model)
    for offset in list(model):
        del holding[offset]
    assert holding == {} and not holding._pages


def test_a_segment_pages_its_holding_by_its_offset_unit() -> None:
    dram, nvme = make_segment(DRAM), make_segment(NVME)
    dram.holding.add(128, b"a", 16)
    nvme.holding.add(2, b"b", 16)
    assert dram.holding._pages and dram.holding == {128: b"a"}
    assert not nvme.holding._pages and nvme.holding == {2: b"b"}, "ids are not byte positions"
