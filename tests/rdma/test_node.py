"""The node's RDMA side: queue-pair bookkeeping (pure), and a node without a device refusing
``rdma_connect`` with a typed error over a real socket, from a real node process."""

from __future__ import annotations

import threading

import pytest

from kvstore import protocol, rdma
from kvstore.errors import ProtocolError, TransportUnavailableError
from kvstore.node.rdma import QpBook


def test_book_bounds_the_number_of_queue_pairs() -> None:
    book: QpBook[str] = QpBook(max_qps=3)
    book.add(1, "a")
    book.add(1, "b")
    book.add(2, "c")
    with pytest.raises(TransportUnavailableError, match="at most 3"):
        book.add(3, "d")
    assert len(book) == 3 and book.of(3) == []  # the refused one is not recorded
    assert sorted(book.close_conn(1)) == ["a", "b"]  # teardown hands back that connection's
    assert len(book) == 1 and book.of(1) == []
    book.add(3, "d")  # room again
    assert book.close_conn(1) == []  # closing twice (or a connection that never asked) is a no-op
    assert book.close_conn(2) == ["c"] and book.close_conn(3) == ["d"] and len(book) == 0


def test_book_counts_stay_exact_under_concurrent_connections() -> None:
    book: QpBook[int] = QpBook(max_qps=50)
    refused: list[int] = []

    def client(conn_id: int) -> None:
        for i in range(10):
            try:
                book.add(conn_id, i)
            except TransportUnavailableError:
                refused.append(conn_id)

    threads = [threading.Thread(target=client, args=(c,)) for c in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    assert len(book) == 50 and len(refused) == 30
    assert sum(len(book.close_conn(c)) for c in range(8)) == 50 and len(book) == 0


def test_book_refuses_a_zero_bound() -> None:
    with pytest.raises(ValueError):
        QpBook(max_qps=0)


def _node_conn(cluster) -> protocol.FramedSocket:
    host, port = cluster.nodes[0].field("data").split(":")
    return protocol.FramedSocket.connect(host, int(port), timeout=5)


def test_node_without_a_device_refuses_rdma_connect(cluster_factory) -> None:
    cluster = cluster_factory()
    conn = _node_conn(cluster)
    try:
        ep = rdma.QpEndpoint(b"\x00" * 16, 0, 0x42, 0x1234).to_wire()
        with pytest.raises(TransportUnavailableError, match="no usable RDMA device"):
            conn.call("rdma_connect", {"endpoint": ep})
        with pytest.raises(ProtocolError):  # malformed input: typed, checked first
            conn.call("rdma_connect", {"endpoint": [1, 2]})
        assert conn.call("ping", {}) == {"role": "node"}  # the connection is still good
        assert conn.call("stats", {})["num_objects"] == 0  # nothing changed
    finally:
        conn.close()
