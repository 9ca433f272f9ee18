"""The data path's node offers (kvstore.client.datapath): asked for before a data call when a node
is new (rate-limited), on demand at connect, and never from inside a read or a write."""

from __future__ import annotations

import socket
from typing import Any

import pytest

from kvstore.client import datapath
from kvstore.client.buffers import Segments
from kvstore.client.datapath import DataPath
from kvstore.client.transport import ReadItem, WriteItem
from kvstore.errors import MasterUnavailableError
from kvstore.grants import Grant
from kvstore.types import Location


class Offers:
    def __init__(self, answer: dict[str, Any] | None = None) -> None:
        self.answer = answer if answer is not None else {}
        self.calls = 0
        self.fail = False

    def __call__(self) -> dict[str, Any]:
        self.calls += 1
        if self.fail:
            raise MasterUnavailableError("master away")
        return self.answer


@pytest.fixture
def offers() -> Offers:
    return Offers({"n1": {}, "n2": {}})


@pytest.fixture
def data(offers: Offers) -> DataPath:
    path = DataPath(1.0, offers, shm=True)
    yield path
    path.close()


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_reads_and_writes_never_ask_the_master(offers: Offers, data: DataPath) -> None:
    port = _closed_port()
    grant = Grant("r", b"k", "dram", 0, 4, 0, b"")
    read = ReadItem(Location("n9", "127.0.0.1", port, grant), memoryview(bytearray(4)))
    write = WriteItem(Location("n9", "127.0.0.1", port, grant), memoryview(b"abcd"), 0)
    data.read([read])
    data.write([write])
    assert read.result is not None and write.result is not None  # nothing listens there
    assert offers.calls == 0


def test_an_unknown_node_asks_once_per_interval(offers: Offers, data: DataPath) -> None:
    data.refresh_offers({"n1"})
    assert offers.calls == 1
    data.refresh_offers({"n1", "n2"})  # both known now
    assert offers.calls == 1
    data.refresh_offers({"n3"})  # new, but asked less than a second ago
    assert offers.calls == 1
    data.refresh_offers(force=True)  # (at connect)
    assert offers.calls == 2


def test_the_ask_at_connect_leaves_the_rate_limit_alone(offers: Offers, data: DataPath) -> None:
    data.refresh_offers(force=True)
    data.refresh_offers({"n3"})  # a node that registered after the client connected
    assert offers.calls == 2


def test_an_unknown_node_asks_again_after_the_interval(
    offers: Offers, data: DataPath, monkeypatch
) -> None:
    monkeypatch.setattr(datapath, "REFRESH_INTERVAL_S", 0.0)
    data.refresh_offers({"n1"})
    data.refresh_offers({"n3"})
    assert offers.calls == 2
    data.refresh_offers({"n3"})  # n3 was asked about: known (TCP only) from now on
    assert offers.calls == 2


def test_a_failed_ask_changes_nothing(offers: Offers, data: DataPath, monkeypatch) -> None:
    monkeypatch.setattr(datapath, "REFRESH_INTERVAL_S", 0.0)
    offers.fail = True
    data.refresh_offers({"n1"})  # no error: TCP still works
    offers.fail = False
    data.refresh_offers({"n1"})
    assert offers.calls == 2


def test_without_shm_or_rdma_nothing_is_asked(offers: Offers, monkeypatch) -> None:
    monkeypatch.setenv("KVSTORE_RDMA", "off")
    path = DataPath(1.0, offers, shm=False)
    try:
        path.refresh_offers({"n1"}, force=True)
        assert offers.calls == 0
    finally:
        path.close()


def test_an_object_given_as_pieces_goes_by_tcp_not_rdma() -> None:
    # RDMA writes from registered contiguous memory; pieces are gathered by TCP's sendmsg.
    class Rdma:
        def __init__(self) -> None:
            self.got: list[WriteItem] = []

        def write(self, items: list[WriteItem]) -> tuple[list[WriteItem], list[WriteItem]]:
            self.got = list(items)
            return list(items), []

    class Tcp:
        def __init__(self) -> None:
            self.written: list[WriteItem] = []
            self.committed: list[WriteItem] = []

        def write_begin(self, items: list[WriteItem]) -> list[WriteItem]:
            self.written = list(items)
            return self.written

        def write_end(self, in_flight: list[WriteItem]) -> None:
            assert in_flight is self.written

        def call_per_node(self, verb: str, items: list[WriteItem], args: Any) -> None:
            assert verb == "rdma_commit"
            self.committed = list(items)

    path = DataPath(1.0, Offers(), shm=False)
    rdma, tcp, real_tcp = Rdma(), Tcp(), path.tcp
    path.rdma, path.tcp = rdma, tcp  # type: ignore[assignment]
    grant = Grant("w", b"k", "dram", 0, 3, 0, b"")
    plain = WriteItem(Location("n1", "h", 1, grant), memoryview(b"abc"), 0)
    pieces = WriteItem(Location("n1", "h", 1, grant), Segments.of([b"a", b"bc"]), 0)
    path.write([plain, pieces])
    assert rdma.got == [plain] and tcp.committed == [plain] and tcp.written == [pieces]
    path.rdma, path.tcp = None, real_tcp
    path.close()


def test_a_read_into_pieces_goes_by_tcp_not_rdma() -> None:
    # RDMA reads into registered contiguous memory; pieces are scattered by TCP's recvmsg_into.
    class Rdma:
        def __init__(self) -> None:
            self.got: list[ReadItem] = []

        def read(self, items: list[ReadItem]) -> list[ReadItem]:
            self.got = list(items)
            return []

    class Tcp:
        def __init__(self) -> None:
            self.got: list[ReadItem] = []

        def read_begin(self, items: list[ReadItem]) -> list[ReadItem]:
            self.got = list(items)
            return self.got

        def read_end(self, in_flight: list[ReadItem]) -> None:
            assert in_flight is self.got

    path = DataPath(1.0, Offers(), shm=False)
    rdma, tcp, real_tcp = Rdma(), Tcp(), path.tcp
    path.rdma, path.tcp = rdma, tcp  # type: ignore[assignment]
    grant = Grant("r", b"k", "dram", 0, 3, 0, b"")
    plain = ReadItem(Location("n1", "h", 1, grant), memoryview(bytearray(3)))
    pieces = ReadItem(Location("n1", "h", 1, grant), Segments.of([bytearray(1), bytearray(2)]))
    path.read([plain, pieces])
    assert rdma.got == [plain] and tcp.got == [pieces]
    path.rdma, path.tcp = None, real_tcp
    path.close()
