"""The records that cross the wire (kvstore.types): each survives its own wire form (through
msgpack, as it travels), malformed forms are refused with a ProtocolError, and per-key results
split into an error or a value."""

from __future__ import annotations

from typing import Any

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvstore.errors import (
    ErrorCode,
    GrantInvalidError,
    KeyNotFoundError,
    KVStoreError,
    ProtocolError,
)
from kvstore.grants import Grant
from kvstore.types import (
    NODE_STATES,
    Location,
    ObjectInfo,
    PutTicket,
    SegmentSpec,
    node_state,
    result_from_wire,
    result_to_wire,
)


def over_the_wire(obj: Any) -> Any:
    return msgpack.unpackb(msgpack.packb(obj, use_bin_type=True), raw=False)


GRANTS = st.builds(
    Grant,
    st.sampled_from(["r", "w"]),
    st.binary(min_size=1, max_size=32),
    st.text(min_size=1, max_size=8),
    st.integers(0, 1 << 40),
    st.integers(0, 1 << 40),
    st.integers(0, 1 << 50),
    st.binary(min_size=16, max_size=16),
)
LOCATIONS = st.builds(
    Location, st.text(max_size=8), st.text(max_size=16), st.integers(0, 65535), GRANTS
)


@given(LOCATIONS)
def test_a_location_survives_the_wire(loc: Location) -> None:
    assert Location.from_wire(over_the_wire(loc.to_wire())) == loc


@given(st.integers(1, 1 << 62), st.lists(LOCATIONS, max_size=3))
def test_a_put_ticket_survives_the_wire(put_id: int, locations: list[Location]) -> None:
    ticket = PutTicket(put_id, locations)
    assert PutTicket.from_wire(over_the_wire(ticket.to_wire())) == ticket


@given(
    st.integers(0, 1 << 40),
    st.integers(0, (1 << 64) - 1),
    st.lists(LOCATIONS, max_size=3),
    st.integers(0, 1 << 62),
)
def test_object_info_survives_the_wire_with_or_without_a_lease(
    size: int, checksum: int, locations: list[Location], lease: int
) -> None:
    info = ObjectInfo(size, checksum, locations, lease)
    wire = info.to_wire()
    assert len(wire) == (4 if lease else 3), "no lease, no field"
    assert ObjectInfo.from_wire(over_the_wire(wire)) == info


def test_a_segment_spec_survives_the_wire() -> None:
    spec = SegmentSpec("dram", "dram", 1 << 30, "/dev/shm/x")
    assert SegmentSpec.from_wire(over_the_wire(spec.to_wire())) == spec


GRANT_WIRE = ["r", b"k", "dram", 0, 4, 1, b"s" * 16]


@pytest.mark.parametrize(
    ("decode", "wire", "error"),
    [
        (Location.from_wire, None, ProtocolError),
        (Location.from_wire, ["n", "h", 1], ProtocolError),
        (Location.from_wire, ("n", "h", 1, GRANT_WIRE), ProtocolError),  # a tuple is no list
        (Location.from_wire, [1, "h", 1, GRANT_WIRE], ProtocolError),
        (Location.from_wire, ["n", "h", "1", GRANT_WIRE], ProtocolError),
        (Location.from_wire, ["n", "h", 1, ["x"]], GrantInvalidError),
        (Location.from_wire, ["n", "h", 1, ["r", b"k", "dram", -1, 4, 1, b"s"]], GrantInvalidError),
        (PutTicket.from_wire, [1], ProtocolError),
        (PutTicket.from_wire, [1, [["n"]]], ProtocolError),
        (ObjectInfo.from_wire, [1, 2], ProtocolError),
        (ObjectInfo.from_wire, [1, 2, [], -1], ProtocolError),  # a negative lease
        (ObjectInfo.from_wire, [1, 2, [], True], ProtocolError),
        (ObjectInfo.from_wire, [1, 2, [], 1, 5], ProtocolError),
        # a master (or something posing as one) that sends numbers of the wrong type
        (PutTicket.from_wire, ["7", []], ProtocolError),
        (PutTicket.from_wire, [7, None], ProtocolError),
        (ObjectInfo.from_wire, ["big", 2, []], ProtocolError),
        (ObjectInfo.from_wire, [1, 2.5, []], ProtocolError),
        (ObjectInfo.from_wire, [1, 2, None], ProtocolError),
        (ObjectInfo.from_wire, [-1, 2, []], ProtocolError),
        (SegmentSpec.from_wire, ["dram", "dram", "big", ""], ProtocolError),
        (SegmentSpec.from_wire, ["dram", "dram", 1], ProtocolError),
    ],
)
def test_malformed_wire_forms_are_refused(decode: Any, wire: Any, error: type) -> None:
    with pytest.raises(error):
        decode(wire)


def test_malformed_grants_are_grant_errors_the_node_can_name() -> None:
    with pytest.raises(KVStoreError) as err:
        Location.from_wire(["n", "h", 1, ["r"]])
    assert err.value.code == ErrorCode.GRANT_INVALID


# ---------------------------------------------------------------- per-key results
@pytest.mark.parametrize(
    "value",
    [None, 7, b"bytes", [1, 2], ObjectInfo(3, 4, []), SegmentSpec("s", "dram", 1)],
    ids=["none", "int", "bytes", "list", "object-info", "segment"],
)
def test_a_value_result_comes_back_as_its_wire_form(value: Any) -> None:
    err, payload = result_from_wire(over_the_wire(result_to_wire(value)))
    assert err is None
    assert payload == (value.to_wire() if hasattr(value, "to_wire") else value)


def test_an_error_result_comes_back_as_its_error() -> None:
    err, payload = result_from_wire(over_the_wire(result_to_wire(KeyNotFoundError("no k"))))
    assert isinstance(err, KeyNotFoundError) and payload is None
    assert err.code == ErrorCode.KEY_NOT_FOUND and "no k" in err.message


@pytest.mark.parametrize("wire", [None, [], [0], [0, 1, 2], ["0", 1], 5, {"code": 0}])
def test_a_malformed_result_is_a_protocol_error(wire: Any) -> None:
    err, payload = result_from_wire(wire)
    assert isinstance(err, ProtocolError) and payload is None


# ---------------------------------------------------------------- node states
@pytest.mark.parametrize(
    ("draining", "retired", "state"),
    [
        (False, False, "active"),
        (True, False, "draining"),
        (True, True, "retired"),
        (False, True, "retired"),
    ],
)
def test_node_states_are_one_vocabulary(draining: bool, retired: bool, state: str) -> None:
    assert node_state(draining, retired) == state
    assert state in NODE_STATES
