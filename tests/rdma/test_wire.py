"""What RDMA peers exchange: the offer and queue-pair endpoint wire forms, and a bad offer
ignored."""

from __future__ import annotations

import pytest

from kvstore import rdma
from kvstore.errors import ProtocolError


def test_offer_and_endpoint_wire_forms() -> None:
    offer = rdma.RdmaOffer("mlx5_0", 1, b"\x00" * 16, 3, {"dram": (0x1000, 4096, 77)})
    assert rdma.RdmaOffer.from_wire(offer.to_wire()) == offer
    ep = rdma.QpEndpoint(b"\x01" * 16, 3, 0x1234, 0x42)
    assert rdma.QpEndpoint.from_wire(ep.to_wire()) == ep


@pytest.mark.parametrize(
    "bad",
    [
        None,
        {"device": "x", "port": 1, "gid": b"short", "lid": 0, "regions": {}},
        {"device": "x", "port": 1, "gid": b"\x00" * 16, "lid": 0, "regions": {"d": [1, 0, 1]}},
        {"device": "x", "port": 1, "gid": b"\x00" * 16, "lid": 0},
    ],
)
def test_malformed_offer(bad) -> None:
    with pytest.raises(ProtocolError):
        rdma.RdmaOffer.from_wire(bad)


@pytest.mark.parametrize(
    "bad", [None, [b"\x00" * 16, 0, 1 << 24, 0, 4096], [b"\x00" * 16, 0, 1, 0, 1000], [1, 2]]
)
def test_malformed_endpoint(bad) -> None:
    with pytest.raises(ProtocolError):
        rdma.QpEndpoint.from_wire(bad)


def test_bad_offer_from_a_node_is_ignored() -> None:
    assert rdma.choose({"nonsense": 1}, rdma.RdmaDevice("mlx5_0")) is None
    assert rdma.choose(None, rdma.RdmaDevice("mlx5_0")) is None
