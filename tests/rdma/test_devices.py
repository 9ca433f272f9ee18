"""Discovery, settings and fallback: what runs without a device (one log line, then TCP)."""

from __future__ import annotations

import logging

import pytest

from kvstore import rdma
from kvstore.errors import InvalidRequestError
from tests.support import has_rdma_device


@pytest.mark.skipif(has_rdma_device(), reason="this host has an RDMA device")
def test_no_device_falls_back_with_one_log_line(caplog) -> None:
    rdma.devices._logged.clear()
    with caplog.at_level(logging.DEBUG, logger="kvstore.rdma"):
        assert rdma.first_device("client") is None
        assert rdma.first_device("client") is None
        offer = rdma.RdmaOffer("mlx5_0", 1, b"\x00" * 16, 3, {"dram": (0x1000, 4096, 77)})
        assert rdma.choose(offer.to_wire(), None) is None
        assert rdma.choose(offer.to_wire(), None) is None
    fallbacks = [
        (r.levelno, r.getMessage())
        for r in caplog.records
        if "RDMA off" in r.getMessage() and r.getMessage().endswith("; using TCP")
    ]
    # Once for "no device", once for choose. Nobody asked for RDMA and there is no device: a
    # debug line, not noise on every start; a node offers RDMA that this host cannot use: INFO.
    assert [level for level, _ in fallbacks] == [logging.DEBUG, logging.INFO], fallbacks


@pytest.mark.skipif(has_rdma_device(), reason="this host has an RDMA device")
def test_a_device_asked_for_by_name_and_absent_is_said_at_info(caplog) -> None:
    rdma.devices._logged.clear()
    with caplog.at_level(logging.INFO, logger="kvstore.rdma"):
        assert rdma.first_device("node", rdma.RdmaConfig(device="mlx5_9")) is None
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and lines[0].startswith("node: RDMA off ("), lines


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({}, rdma.RdmaConfig()),
        ({"KVSTORE_RDMA": "off"}, rdma.RdmaConfig(enabled=False)),
        (
            {
                "KVSTORE_RDMA_DEVICE": "mlx5_1",
                "KVSTORE_RDMA_PORT": "2",
                "KVSTORE_RDMA_GID_INDEX": "3",
            },
            rdma.RdmaConfig(device="mlx5_1", port=2, gid_index=3),
        ),
        ({rdma.TEST_DEVICE_ENV: "pretend0"}, rdma.RdmaConfig(pretend_device="pretend0")),
    ],
)
def test_settings_from_env(env, expected) -> None:
    assert rdma.RdmaConfig.from_env(env) == expected


@pytest.mark.parametrize(
    "env",
    [{"KVSTORE_RDMA_PORT": "x"}, {"KVSTORE_RDMA_PORT": "0"}, {"KVSTORE_RDMA_GID_INDEX": "-1"}],
)
def test_bad_settings_are_refused(env) -> None:
    with pytest.raises(InvalidRequestError):
        rdma.RdmaConfig.from_env(env)


def test_disabled_and_pretend_devices(caplog) -> None:
    rdma.devices._logged.clear()
    with caplog.at_level(logging.DEBUG, logger="kvstore.rdma"):
        assert rdma.first_device("client", rdma.RdmaConfig(enabled=False)) is None
    assert [r.levelno for r in caplog.records if "KVSTORE_RDMA=off" in r.getMessage()] == [
        logging.DEBUG
    ]
    pretend = rdma.RdmaConfig(pretend_device="pretend0")
    assert rdma.first_device("client", pretend) == rdma.RdmaDevice("pretend0")
