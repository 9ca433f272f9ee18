"""The client's shm transport against a real arena file: copies, grants, and a file that is
truncated or removed under it (typed errors, fallback, nothing stored touched)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from kvstore import grants
from kvstore.client.shm import ShmMapping, ShmTransport
from kvstore.client.transport import ReadItem, WriteItem
from kvstore.errors import OutOfRangeError, TransportUnavailableError
from kvstore.node.arena import ShmArena
from kvstore.transports import ShmOffer
from kvstore.types import Location

SECRET = b"s" * 32
SIZE = 1 << 16


@pytest.fixture
def arena(tmp_path: Path):
    a = ShmArena(tmp_path / "kvstore-test.dram", SIZE)
    a.view[:SIZE] = bytes(range(256)) * (SIZE // 256)
    yield a
    a.close()


def loc(op: str, offset: int, size: int, expires_in_s: float = 60) -> Location:
    expires = int((time.time() + expires_in_s) * 1000)
    return Location(
        "n1", "127.0.0.1", 1, grants.sign(SECRET, op, b"k", "dram", offset, size, expires)
    )


def transport(arena: ShmArena) -> ShmTransport:
    t = ShmTransport()
    t.learn("n1", ShmOffer.of_files({"dram": arena.path}).to_wire())
    return t


def test_read_and_write_in_place(arena: ShmArena) -> None:
    t = transport(arena)
    dest = memoryview(bytearray(100))
    item = ReadItem(loc("r", 1000, 100), dest)
    assert t.read([item]) == []
    assert item.result is None and bytes(dest) == bytes(arena.view[1000:1100])
    ranged = ReadItem(loc("r", 1000, 100), memoryview(bytearray(6)), ranges=[[0, 2], [10, 4]])
    assert t.read([ranged]) == []
    assert bytes(ranged.dest) == bytes(arena.view[1000:1002]) + bytes(arena.view[1010:1014])
    w = WriteItem(loc("w", 2000, 5), memoryview(b"hello"), 0)
    written, rest = t.write([w])
    assert written == [w] and rest == []
    assert bytes(arena.view[2000:2005]) == b"hello"
    t.close()


def test_out_of_range_ranges_are_typed_errors(arena: ShmArena) -> None:
    t = transport(arena)
    item = ReadItem(loc("r", 0, 10), memoryview(bytearray(20)), ranges=[[0, 20]])
    assert t.read([item]) == []
    assert isinstance(item.result, OutOfRangeError)
    t.close()


@pytest.mark.parametrize(
    "location",
    [loc("w", 0, 10), loc("r", SIZE - 4, 10), loc("r", 0, 10, expires_in_s=-1)],
    ids=["wrong-op", "past-the-file", "expired"],
)
def test_grants_that_do_not_fit_go_to_tcp(arena: ShmArena, location: Location) -> None:
    t = transport(arena)
    item = ReadItem(location, memoryview(bytearray(10)))
    assert t.read([item]) == [item]
    assert item.result is None and item.filled == 0
    t.close()


def test_truncated_file_falls_back_and_touches_nothing(arena: ShmArena) -> None:
    t = transport(arena)
    first = ReadItem(loc("r", 0, 10), memoryview(bytearray(10)))
    assert t.read([first]) == []  # mapped
    before = bytes(arena.view[:100])
    os.truncate(arena.path, SIZE // 2)
    try:
        item = ReadItem(loc("r", 0, 10), memoryview(bytearray(10)))
        assert t.read([item]) == [item]  # left for TCP, no copy attempted
        w = WriteItem(loc("w", 0, 10), memoryview(b"x" * 10), 0)
        assert t.write([w]) == ([], [w])
        assert t.mapping("n1", "dram") is None  # dropped until the node is asked again
    finally:
        os.truncate(arena.path, SIZE)
    assert bytes(arena.view[:100]) == before
    t.close()


def test_removed_file_falls_back(arena: ShmArena) -> None:
    t = transport(arena)
    assert t.mapping("n1", "dram") is not None
    os.unlink(arena.path)
    item = ReadItem(loc("r", 0, 10), memoryview(bytearray(10)))
    assert t.read([item]) == [item]
    t.close()


def test_mapping_refuses_a_replaced_file(arena: ShmArena, tmp_path: Path) -> None:
    offer = ShmOffer.of_files({"dram": arena.path})
    os.unlink(arena.path)
    fd = os.open(arena.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    os.ftruncate(fd, SIZE)
    os.close(fd)
    with pytest.raises(TransportUnavailableError, match="replaced"):
        ShmMapping(offer.segments["dram"], offer)
    t = ShmTransport()
    t.learn("n1", offer.to_wire())
    assert t.mapping("n1", "dram") is None


def test_unknown_node_and_bad_offer() -> None:
    t = ShmTransport()
    t.learn("n2", {"nonsense": True})
    assert t.mapping("n2", "dram") is None
    item = ReadItem(loc("r", 0, 1), memoryview(bytearray(1)))
    assert t.read([item]) == [item]
