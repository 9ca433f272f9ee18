"""The stored-object record: one shape for tiers, the node's manifest and a master's claims."""

from __future__ import annotations

import pytest

from kvstore import stored_object
from kvstore.errors import InvalidRequestError
from kvstore.stored_object import ManifestClaim, StoredObject


def test_the_claim_is_the_stored_object() -> None:
    assert ManifestClaim is StoredObject


def test_wire_round_trip_and_the_stampless_form() -> None:
    obj = StoredObject("dram", 64, b"k", 10, 2**64 - 1, 123)
    assert obj.to_wire() == ["dram", 64, b"k", 10, 2**64 - 1, 123]
    assert StoredObject.from_wire(obj.to_wire()) == obj
    assert StoredObject.from_wire(("nvme", 1, b"k", 1, 1)).stamp == 0  # an older node's claim


@pytest.mark.parametrize(
    "wire",
    [
        "junk",
        ["dram", 0, b"k", 1],
        [1, 0, b"k", 1, 1, 1],
        ["dram", -1, b"k", 1, 1, 1],
        ["dram", 0, b"k", True, 1, 1],
        ["dram", 0, b"k", 1, 2**64, 1],
        ["dram", 0, b"", 1, 1, 1],
    ],
)
def test_malformed_records_are_refused(wire: object) -> None:
    with pytest.raises(InvalidRequestError):
        StoredObject.from_wire(wire)


def test_claims_from_wire_keeps_errors_in_place() -> None:
    out = stored_object.claims_from_wire([["dram", 0, b"k", 1, 1, 1], "junk"])
    assert out[0] == StoredObject("dram", 0, b"k", 1, 1, 1)
    assert isinstance(out[1], InvalidRequestError)
