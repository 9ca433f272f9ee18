"""The transport offers a node publishes through the master, and the same-host checks."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvstore.errors import InvalidRequestError, ProtocolError, TransportUnavailableError
from kvstore.transports import (
    MAX_TRANSPORTS_BYTES,
    ShmOffer,
    ShmSegment,
    boot_id,
    check_same_host_file,
    check_transports,
)


@pytest.mark.parametrize(
    "obj",
    [
        [],
        {"shm": 1},
        {1: {}},
        {"shm": {"x": b"y" * (MAX_TRANSPORTS_BYTES + 1)}},
    ],
)
def test_check_transports_refuses_malformed(obj) -> None:
    with pytest.raises(InvalidRequestError):
        check_transports(obj)


def test_check_transports_accepts_maps() -> None:
    assert check_transports({"shm": {"a": 1}, "rdma": {}}) == {"shm": {"a": 1}, "rdma": {}}


@pytest.fixture
def arena_file(tmp_path: Path) -> Path:
    path = tmp_path / "arena"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    os.ftruncate(fd, 8192)
    os.close(fd)
    return path


def test_offer_round_trips_and_passes_checks(arena_file: Path) -> None:
    offer = ShmOffer.of_files({"dram": arena_file})
    again = ShmOffer.from_wire(offer.to_wire())
    assert again == offer
    seg = again.segments["dram"]
    check_same_host_file(seg, os.stat(arena_file), again)


@pytest.mark.parametrize("bad", [None, {}, {"boot_id": "x", "uid": 1}, {"segments": []}])
def test_malformed_offer(bad) -> None:
    with pytest.raises(ProtocolError):
        ShmOffer.from_wire(bad)


def _variant(offer: ShmOffer, **changes) -> tuple[ShmSegment, ShmOffer]:
    seg = offer.segments["dram"]
    seg_fields = {k: changes.pop(k) for k in ("dev", "ino", "size") if k in changes}
    seg = ShmSegment(
        seg.path, **{**{"dev": seg.dev, "ino": seg.ino, "size": seg.size}, **seg_fields}
    )
    return seg, ShmOffer(
        changes.get("boot_id", offer.boot_id), changes.get("uid", offer.uid), {"dram": seg}
    )


@pytest.mark.parametrize(
    ("changes", "why"),
    [
        ({"boot_id": "another-host"}, "another host"),
        ({"uid": os.getuid() + 1}, "another user"),
        ({"ino": 1}, "replaced"),
        ({"size": 4096}, "advertised"),
    ],
)
def test_same_host_checks_refuse(arena_file: Path, changes, why) -> None:
    seg, offer = _variant(ShmOffer.of_files({"dram": arena_file}), **changes)
    with pytest.raises(TransportUnavailableError, match=why):
        check_same_host_file(seg, os.stat(arena_file), offer)


def test_world_readable_file_is_refused(arena_file: Path) -> None:
    offer = ShmOffer.of_files({"dram": arena_file})
    os.chmod(arena_file, 0o644)
    with pytest.raises(TransportUnavailableError, match="private"):
        check_same_host_file(offer.segments["dram"], os.stat(arena_file), offer)


def test_boot_id_is_stable() -> None:
    assert boot_id() == boot_id()
