"""The read pipeline on its own (kvstore.client.reads), against a fake master and fake nodes:
which step serves a key (lease, speculation, locate), replica fallback, corrupt replicas
reported, byte ranges with their own check, leases given back, and no master call from inside
a data read."""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import Any

import pytest
import xxhash

from kvstore.client.locations import LocationCache
from kvstore.client.reads import LOCATE_CHUNK, LocatedRead, ReadPipeline
from kvstore.client.releases import LeaseReturns
from kvstore.client.transport import ReadItem
from kvstore.errors import (
    ChecksumMismatchError,
    InvalidRequestError,
    KeyNotFoundError,
    MasterUnavailableError,
    NodeUnavailableError,
)
from kvstore.grants import Grant
from kvstore.types import Location, ObjectInfo, result_to_wire


class FakeCluster:
    """A master and its nodes in one object: ``objects`` is what the master knows (key ->
    size, checksum, replica node ids), ``nodes`` what each node holds (node -> key -> bytes)."""

    def __init__(self) -> None:
        self.objects: dict[bytes, tuple[int, int, list[str]]] = {}
        self.nodes: dict[str, dict[bytes, bytes]] = {}
        self.down: set[str] = set()
        #: Nodes whose copy fails the node's own check (an NVMe record cut short): they answer
        #: CHECKSUM_MISMATCH and send no bytes.
        self.damaged: set[str] = set()
        self.calls: list[str] = []  # master verbs, in order
        self.data_reads = 0
        self.reported: list[list[Any]] = []
        self.refreshed: list[set[str]] = []
        self.next_lease = 1
        self.in_data_read = False
        # Whether a data read fills its items when sent (as shm and RDMA do), not when its
        # replies are taken (as TCP does).
        self.fill_when_sent = False
        # ControlChannel attributes
        self.timeout = 5.0
        self.epoch = None
        self.releases = None

    def put(self, key: bytes, value: bytes, nodes: tuple[str, ...] = ("n1",)) -> None:
        self.objects[key] = (len(value), xxhash.xxh3_64_intdigest(value), list(nodes))
        for n in nodes:
            self.nodes.setdefault(n, {})[key] = value

    def info(self, key: bytes) -> ObjectInfo:
        size, csum, nodes = self.objects[key]
        lease, self.next_lease = self.next_lease, self.next_lease + 1
        locs = [
            Location(n, "127.0.0.1", 1, Grant("r", key, "dram", 0, size, 0, b"")) for n in nodes
        ]
        return ObjectInfo(size, csum, locs, lease)

    # ------------------------------------------------------------ the control channel
    def call(self, verb: str, args: dict[str, Any], pin_epoch: int | None = None) -> Any:
        assert not self.in_data_read, f"{verb} called from inside a data read"
        if verb == "live_nodes":
            return {"nodes": []}  # (no one-hop reads here: tests/integration/test_one_hop_reads.py)
        self.calls.append(verb)
        if verb == "get_locations":
            return [
                result_to_wire(
                    self.info(k) if k in self.objects else KeyNotFoundError(f"{k!r} not stored")
                )
                for k in args["keys"]
            ]
        if verb == "report_corrupt":
            self.reported.extend(args["items"])
            return None
        raise AssertionError(f"unexpected verb {verb}")

    def call_epoch(self, verb: str, args: dict[str, Any], pin_epoch: int | None = None) -> Any:
        return self.call(verb, args), None

    def call_overlapped(
        self,
        verb: str,
        args: dict[str, Any],
        work: Callable[[], None],
        pin_epoch: int | None = None,
    ) -> tuple[Any, None]:
        self.calls.append("overlapped")
        work()
        return self.call(verb, args), None

    def close(self) -> None:
        pass

    # ------------------------------------------------------------ the data path
    def refresh_offers(self, node_ids: Any = (), *, force: bool = False) -> None:
        self.refreshed.append(set(node_ids))

    def read(self, items: list[ReadItem]) -> None:
        self.in_data_read = True
        try:
            self.data_reads += 1
            for item in items:
                node = item.location.node_id
                if node in self.down:
                    item.result = NodeUnavailableError(f"node {node} is down")
                    continue
                if node in self.damaged:
                    item.result = ChecksumMismatchError("NVMe object 7 is truncated")
                    continue
                value = self.nodes[node][item.location.grant.key]
                if item.ranges is None:
                    item.dest[: len(value)] = value
                else:
                    pos = 0
                    for off, n in item.ranges:
                        item.dest[pos : pos + n] = value[off : off + n]
                        pos += n
        finally:
            self.in_data_read = False

    def read_begin(self, items: list[ReadItem]) -> list[ReadItem]:
        if self.fill_when_sent:
            self.read(items)
            return []
        return list(items)

    def read_end(self, in_flight: list[ReadItem]) -> None:
        if in_flight:
            self.read(in_flight)


@pytest.fixture
def cluster() -> FakeCluster:
    return FakeCluster()


def pipeline(cluster: FakeCluster, *, lease_reads: bool = False) -> tuple[ReadPipeline, list]:
    returned: list[int] = []
    returns = LeaseReturns(lambda tokens: None)
    returns.give_back = lambda tokens: returned.extend(t for t in tokens if t)  # type: ignore[method-assign]
    cache = LocationCache(give_back=returns.give_back if lease_reads else None)
    reads = ReadPipeline(cluster, cluster, cache, returns)  # type: ignore[arg-type]
    if lease_reads:
        reads.use_lease_reads(5.0)
    return reads, returned


def test_get_locates_reads_and_gives_the_leases_back(cluster: FakeCluster) -> None:
    cluster.put(b"a", b"x" * 100)
    cluster.put(b"b", b"y" * 10)
    reads, returned = pipeline(cluster)
    got = reads.get([b"a", b"missing", b"b"])
    assert got[0] == b"x" * 100 and got[2] == b"y" * 10
    assert isinstance(got[1], KeyNotFoundError)
    assert cluster.calls == ["get_locations"] and cluster.data_reads == 1
    assert sorted(returned) == [1, 2]  # both answers' leases, once the read is done


def test_get_into_fills_buffers_and_refuses_small_ones(cluster: FakeCluster) -> None:
    cluster.put(b"a", b"x" * 100)
    cluster.put(b"b", b"y" * 100)
    reads, _ = pipeline(cluster)
    big, small = bytearray(128), bytearray(10)
    got = reads.get_into([b"a", b"b"], [memoryview(big), memoryview(small)])
    assert got[0] == 100 and bytes(big[:100]) == b"x" * 100
    assert isinstance(got[1], InvalidRequestError)


def test_a_cached_answer_is_read_while_the_master_answers(cluster: FakeCluster) -> None:
    cluster.put(b"a", b"x" * 100)
    reads, _ = pipeline(cluster)
    buf = bytearray(100)
    assert reads.get_into([b"a"], [memoryview(buf)]) == [100]
    cluster.calls.clear()
    cluster.data_reads = 0
    assert reads.get_into([b"a"], [memoryview(buf)]) == [100]
    assert cluster.calls == ["overlapped", "get_locations"]
    assert cluster.data_reads == 1  # the guess was confirmed: no second read


def test_a_guess_the_master_does_not_confirm_is_read_again(cluster: FakeCluster) -> None:
    cluster.put(b"a", b"old" * 10)
    reads, _ = pipeline(cluster)
    buf = bytearray(64)
    assert reads.get_into([b"a"], [memoryview(buf)]) == [30]
    cluster.put(b"a", b"new!" * 10, nodes=("n2",))  # another client overwrote it elsewhere
    cluster.data_reads = 0
    assert reads.get_into([b"a"], [memoryview(buf)]) == [40]
    assert bytes(buf[:40]) == b"new!" * 10
    assert cluster.data_reads == 2  # the stale guess, then the fresh answer


def test_a_gone_replica_falls_back_to_the_next(cluster: FakeCluster) -> None:
    cluster.put(b"a", b"v" * 50, nodes=("n1", "n2"))
    cluster.down.add("n1")
    reads, _ = pipeline(cluster)
    assert reads.get([b"a"]) == [b"v" * 50]
    assert cluster.reported == []  # gone is not corrupt


def test_a_corrupt_replica_is_reported_and_the_next_one_read(cluster: FakeCluster) -> None:
    cluster.put(b"a", b"v" * 50, nodes=("n1", "n2"))
    cluster.nodes["n1"][b"a"] = b"V" + b"v" * 49
    reads, _ = pipeline(cluster)
    assert reads.get([b"a"]) == [b"v" * 50]
    assert [r[1] for r in cluster.reported] == ["n1"]
    assert cluster.calls[-1] == "report_corrupt"


def test_a_corrupt_last_replica_is_a_checksum_error(cluster: FakeCluster) -> None:
    cluster.put(b"a", b"v" * 50)
    cluster.nodes["n1"][b"a"] = b"V" + b"v" * 49
    reads, _ = pipeline(cluster)
    (got,) = reads.get([b"a"])
    assert isinstance(got, ChecksumMismatchError)


@pytest.mark.parametrize("num_replicas", [1, 2])
def test_a_replica_its_node_finds_damaged_is_reported_too(
    cluster: FakeCluster, num_replicas: int
) -> None:
    cluster.put(b"a", b"v" * 50, nodes=("n1", "n2")[:num_replicas])
    cluster.damaged.add("n1")
    reads, _ = pipeline(cluster)
    (got,) = reads.get([b"a"])
    if num_replicas == 2:
        assert got == b"v" * 50  # served from the intact replica
    else:
        assert isinstance(got, ChecksumMismatchError)
    _size, checksum, _nodes = cluster.objects[b"a"]
    assert cluster.reported == [[b"a", "n1", "dram", 0, checksum]]


def test_lease_reads_skip_the_master_within_the_lease(cluster: FakeCluster) -> None:
    cluster.put(b"a", b"x" * 100)
    reads, returned = pipeline(cluster, lease_reads=True)
    assert reads.get([b"a"]) == [b"x" * 100]
    assert returned == []  # the cache keeps the answer, and its lease
    cluster.calls.clear()
    assert reads.get([b"a"]) == [b"x" * 100]
    buf = bytearray(100)
    assert reads.get_into([b"a"], [memoryview(buf)]) == [100]
    assert cluster.calls == []


def test_a_failed_leased_read_asks_the_master(cluster: FakeCluster) -> None:
    cluster.put(b"a", b"x" * 100)
    reads, _ = pipeline(cluster, lease_reads=True)
    assert reads.get([b"a"]) == [b"x" * 100]
    cluster.down.add("n1")
    cluster.put(b"a", b"x" * 100, nodes=("n2",))  # moved while n1 died
    cluster.calls.clear()
    assert reads.get([b"a"]) == [b"x" * 100]
    assert cluster.calls == ["get_locations"]


def test_range_reads_bring_their_own_check(cluster: FakeCluster) -> None:
    value = bytes(range(100))
    cluster.put(b"a", value, nodes=("n1", "n2"))
    cluster.nodes["n1"][b"a"] = bytes(100)  # corrupt on n1
    reads, _ = pipeline(cluster)
    (info,) = reads.locate([b"a"])
    assert isinstance(info, ObjectInfo)
    ranges = [[10, 5], [90, 10]]
    checked: list[str] = []

    def verify(item: ReadItem) -> bool:
        checked.append(item.location.node_id)
        return bytes(item.dest) == value[10:15] + value[90:100]

    dest = memoryview(bytearray(15))
    rd = LocatedRead(info, dest, ranges, verify)
    reads.read([rd])
    assert rd.result == 100 and checked == ["n1", "n2"]
    assert bytes(dest) == value[10:15] + value[90:100]
    assert [r[1] for r in cluster.reported] == ["n1"]


def test_an_answer_without_replicas_is_unavailable(cluster: FakeCluster) -> None:
    reads, _ = pipeline(cluster)
    rd = LocatedRead(ObjectInfo(10, 0, []), memoryview(bytearray(10)))
    reads.read([rd])
    assert isinstance(rd.result, NodeUnavailableError)


def test_node_transports_are_refreshed_before_a_data_read_never_inside(
    cluster: FakeCluster,
) -> None:
    cluster.put(b"a", b"x" * 10, nodes=("n7",))
    reads, _ = pipeline(cluster)
    buf = bytearray(10)
    reads.get_into([b"a"], [memoryview(buf)])  # (FakeCluster.call asserts: not inside a read)
    reads.get_into([b"a"], [memoryview(buf)])  # speculative: the guess is read overlapped
    assert cluster.refreshed and all(r == {"n7"} for r in cluster.refreshed)


def test_a_large_batch_is_located_a_chunk_ahead_of_its_reads(cluster: FakeCluster) -> None:
    # The master locates chunk i+1 while chunk i is read: every read but the last is sent
    # inside the overlapped call that sends the next chunk's get_locations, and the nodes'
    # replies to chunk i are taken only after chunk i+1's reads are sent. Results stay in key
    # order across chunks, a missing key in any chunk is that key's error, every lease goes
    # back.
    n = 2 * LOCATE_CHUNK + 10
    keys = [b"k%d" % i for i in range(n)]
    missing = {3, LOCATE_CHUNK + 1, n - 1}
    for i, k in enumerate(keys):
        if i not in missing:
            cluster.put(k, b"v%d" % i)
    reads, returned = pipeline(cluster)
    begin, end = cluster.read_begin, cluster.read_end

    def read_begin(items: list[ReadItem]) -> list[ReadItem]:
        cluster.calls.append(f"send {len(items)}")
        return begin(items)

    def read_end(in_flight: list[ReadItem]) -> None:
        cluster.calls.append(f"take {len(in_flight)}")
        end(in_flight)

    cluster.read_begin, cluster.read_end = read_begin, read_end  # type: ignore[method-assign]
    got = reads.get(keys)
    for i, g in enumerate(got):
        assert isinstance(g, KeyNotFoundError) if i in missing else g == b"v%d" % i
    assert cluster.calls == [
        "get_locations",
        "overlapped",
        f"send {LOCATE_CHUNK - 1}",
        "get_locations",
        "overlapped",
        f"send {LOCATE_CHUNK - 1}",
        f"take {LOCATE_CHUNK - 1}",
        "get_locations",
        "send 9",
        f"take {LOCATE_CHUNK - 1}",
        "take 9",
    ]
    assert sorted(returned) == list(range(1, n - len(missing) + 1))
    bufs = [bytearray(8) for _ in keys]
    into = reads.get_into(keys, [memoryview(b) for b in bufs])
    for i, (r, b) in enumerate(zip(into, bufs, strict=True)):
        if i not in missing:
            assert r == len(b"v%d" % i) and bytes(b[:r]) == b"v%d" % i


@pytest.mark.parametrize("lease_reads", [False, True], ids=["plain", "lease-reads"])
def test_a_chunk_filled_as_it_is_sent_does_not_overwrite_the_chunk_before(
    cluster: FakeCluster, lease_reads: bool
) -> None:
    # Through shared memory (or RDMA) a read fills its buffers when it is sent: chunk i+1's
    # bytes land before chunk i's are copied out into new bytes, so the two chunks' buffers
    # must not overlap. With lease reads, keys read under lease first take a buffer too.
    cluster.fill_when_sent = True
    n = 3 * LOCATE_CHUNK + 1
    keys = [b"k%d" % i for i in range(n)]
    for i, k in enumerate(keys):
        cluster.put(k, bytes([i % 251]) * (1 + i % 7))
    reads, _ = pipeline(cluster, lease_reads=lease_reads)
    expected = [bytes([i % 251]) * (1 + i % 7) for i in range(n)]
    assert reads.get(keys) == expected
    half = LOCATE_CHUNK // 2
    got = reads.get(keys[:half] + [b"new"] + keys[half:])
    assert isinstance(got[half], KeyNotFoundError) and got[:half] + got[half + 1 :] == expected


@pytest.mark.parametrize("lease_reads", [False, True], ids=["guesses", "lease-reads"])
def test_a_bulk_reads_answers_are_kept_only_with_lease_reads(
    cluster: FakeCluster, lease_reads: bool
) -> None:
    # Without lease reads kept answers are only guesses for small rereads: a bulk read does not
    # keep thousands of them (and gives every lease back); with lease reads it keeps them, and
    # their leases, to read again without the master.
    n = LOCATE_CHUNK + 1
    keys = [b"k%d" % i for i in range(n)]
    for k in keys:
        cluster.put(k, k)
    reads, returned = pipeline(cluster, lease_reads=lease_reads)
    assert reads.get(keys) == keys
    if lease_reads:
        assert len(reads._cache) == n and returned == []
        assert reads.get(keys) == keys and cluster.calls.count("get_locations") == 2
    else:
        assert len(reads._cache) == 0 and sorted(returned) == list(range(1, n + 1))


def test_reads_run_with_the_collector_paused_and_leave_it_as_they_found_it(
    cluster: FakeCluster,
) -> None:
    """A data call's per-key records die by reference counting; collections in the middle of
    it would only promote them (kvstore.gc_policy.PausedCollector)."""
    assert gc.isenabled()
    cluster.put(b"a", b"x" * 10)
    on_in_read: list[bool] = []
    read = cluster.read
    cluster.read = lambda items: (on_in_read.append(gc.isenabled()), read(items))[1]  # type: ignore[method-assign]
    reads, _ = pipeline(cluster)
    assert reads.get([b"a"]) == [b"x" * 10]
    assert reads.get_into([b"a"], [memoryview(bytearray(10))]) == [10]
    located = LocatedRead(cluster.info(b"a"), memoryview(bytearray(10)))
    reads.read([located])
    assert located.result == 10
    assert on_in_read == [False, False, False] and gc.isenabled()

    gc.disable()  # an engine that runs without the collector keeps it off
    try:
        reads.get([b"a"])
        assert not gc.isenabled()
    finally:
        gc.enable()

    def master_gone(verb: str, args: dict[str, Any], pin_epoch: int | None = None) -> Any:
        raise MasterUnavailableError("gone")

    cluster.call = master_gone  # type: ignore[method-assign]
    with pytest.raises(MasterUnavailableError):
        reads.get([b"a"])
    assert gc.isenabled(), "a call that failed left the collector off"
