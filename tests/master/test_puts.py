"""Two-phase puts on their own: start, end, revoke and reclaim over the owners they use, with a
placement of the test's making (the tier manager's is tested in test_tiering.py)."""

from __future__ import annotations

import gc
from dataclasses import dataclass

import pytest

from kvstore import grants
from kvstore.errors import (
    BlankTooOldError,
    InvalidRequestError,
    NoSpaceError,
    ObjectBusyError,
    ObjectExistsError,
    PutNotFoundError,
)
from kvstore.kvblocks import is_kv_key
from kvstore.master.config import MasterConfig
from kvstore.master.event_ring import EventLog
from kvstore.master.leases import PIN_SOFT
from kvstore.master.membership import Membership, Node, Segment
from kvstore.master.prefix import PrefixIndex
from kvstore.master.puts import Puts
from kvstore.master.space import Space
from kvstore.master.table import ObjectTable
from kvstore.types import PutTicket, SegmentSpec
from tests.master.fakes import FakeClock

SECRETS = {"n1": b"1" * 32, "n2": b"2" * 32}
KV_KEY = b"kv/" + b"k" * 32


@dataclass
class Rig:
    clock: FakeClock
    members: Membership
    objects: ObjectTable
    space: Space
    puts: Puts

    def place(
        self, size: int, num_replicas: int, count: int = 1, home: str | None = None
    ) -> tuple[list[tuple[Segment, Node]], int]:
        """The first nodes whose DRAM segment has room (``home`` first), for as many objects
        as all their largest free extents hold."""
        picks = []
        nodes = sorted(self.members.nodes.values(), key=lambda n: n.node_id != home)
        for node in nodes:
            seg = node.segments["dram"]
            if seg.allocator.largest_free >= seg.allocator.reserved_size(size):
                picks.append((seg, node))
        if len(picks) < num_replicas:
            raise NoSpaceError("no room")
        picks = picks[:num_replicas]
        fits = min(s.allocator.largest_free // s.allocator.reserved_size(size) for s, _ in picks)
        return picks, min(count, fits)

    def dram(self, node_id: str) -> Segment:
        return self.members.nodes[node_id].segments["dram"]

    def start(self, key: bytes, size: int = 100, **kw: object) -> PutTicket:
        (ticket,) = self.puts.start([key], [size], self.place, **kw)  # type: ignore[arg-type]
        assert isinstance(ticket, PutTicket), ticket
        return ticket


def make_rig(first_put_id: int = 1, segment_bytes: int = 4096) -> Rig:
    clock = FakeClock()
    config = MasterConfig(put_timeout_s=10, node_ttl_s=3, heartbeat_interval_s=1)
    members = Membership(config, clock)
    for node_id, secret in SECRETS.items():
        members.add(
            members.admit(
                node_id, "127.0.0.1", 9001, secret, [SegmentSpec("dram", "dram", segment_bytes)]
            )
        )
    objects = ObjectTable()
    space = Space(
        config, members, objects, PrefixIndex(EventLog()), clock, clock.wall_ms, lease_grace_s=0.25
    )
    puts = Puts(config, members, objects, space, clock, first_put_id)
    return Rig(clock, members, objects, space, puts)


@pytest.fixture
def rig() -> Rig:
    return make_rig()


def test_start_allocates_and_grants_a_write_per_replica(rig: Rig) -> None:
    ticket = rig.start(b"k", 100, replicas=2)
    assert ticket.put_id == 1 and [loc.node_id for loc in ticket.locations] == ["n1", "n2"]
    for loc in ticket.locations:
        grants.verify(SECRETS[loc.node_id], loc.grant, grants.OP_WRITE, rig.clock.wall_ms())
        assert rig.dram(loc.node_id).allocator.used_bytes == 128
    assert b"k" not in rig.objects, "nothing is visible before put_end"
    assert rig.puts.writing_on("n1") and rig.puts.num_writing_on({"n2", "n3"}) == 1
    assert [p.key for p in rig.puts.on_node("n2")] == [b"k"]


def test_put_ids_start_where_the_term_says() -> None:
    first = (7 << 32) + 1
    assert make_rig(first).start(b"k").put_id == first


def test_end_commits_cold_and_indexes_the_replica(rig: Rig) -> None:
    ticket = rig.start(b"k", 100)
    assert rig.puts.end([ticket.put_id], [42]) == [None]
    assert rig.objects.num_hot == 0, "a commit is stored as a tuple"
    obj = rig.objects[b"k"]
    assert (obj.size, obj.checksum, obj.num_replicas) == (100, 42, 1)
    (replica,) = obj.replicas
    assert rig.dram(replica.node_id).holding == {replica.offset: b"k"}
    assert not rig.puts.pending and not rig.puts.pending_by_key


def test_a_second_start_of_a_pending_key_is_busy(rig: Rig) -> None:
    rig.start(b"k")
    (err,) = rig.puts.start([b"k"], [10], rig.place)
    assert isinstance(err, ObjectBusyError)


@pytest.mark.parametrize(
    ("key", "size", "kv_blocks", "error"),
    [
        (b"k", -1, False, InvalidRequestError),
        (b"k", True, False, InvalidRequestError),
        (b"k", 1 << 62, False, InvalidRequestError),
        (KV_KEY, 10, False, InvalidRequestError),
        (b"k", 1 << 20, False, NoSpaceError),
    ],
)
def test_a_bad_key_gets_its_error_in_place(
    rig: Rig, key: bytes, size: int, kv_blocks: bool, error: type
) -> None:
    assert is_kv_key(KV_KEY)
    ok, bad = rig.puts.start([b"fine", key], [10, size], rig.place, kv_blocks=kv_blocks)
    assert isinstance(ok, PutTicket) and isinstance(bad, error)
    assert list(rig.puts.pending_by_key) == [b"fine"]


def test_a_stored_kv_block_is_immutable(rig: Rig) -> None:
    ticket = rig.start(KV_KEY, kv_blocks=True)
    rig.puts.end([ticket.put_id], [1])
    (err,) = rig.puts.start([KV_KEY], [10], rig.place, kv_blocks=True)
    assert isinstance(err, ObjectExistsError)


@pytest.mark.parametrize(
    ("keys", "sizes", "replicas"),
    [([b"a", b"b"], [1], 1), ([b"a"], [1], 0), ([b"a"], [1], 17), ([b"a"], [1], True)],
)
def test_a_malformed_batch_is_refused_whole(
    rig: Rig, keys: list[bytes], sizes: list[int], replicas: int
) -> None:
    with pytest.raises(InvalidRequestError):
        rig.puts.start(keys, sizes, rig.place, replicas)
    assert not rig.puts.pending


def test_a_batch_over_the_limit_is_refused(rig: Rig) -> None:
    n = rig.puts.config.max_batch + 1
    with pytest.raises(InvalidRequestError):
        rig.puts.start([b"k"] * n, [1] * n, rig.place)
    with pytest.raises(InvalidRequestError):
        rig.puts.end([1] * n, [1] * n)


def test_end_of_an_unknown_put_or_with_a_bad_checksum(rig: Rig) -> None:
    ticket = rig.start(b"k")
    results = rig.puts.end([999, ticket.put_id], [1, -1])
    assert isinstance(results[0], PutNotFoundError) and isinstance(results[1], InvalidRequestError)
    assert ticket.put_id in rig.puts.pending, "a bad checksum leaves the put pending"


def test_an_overwrite_frees_the_old_version_and_keeps_the_pin(rig: Rig) -> None:
    first = rig.start(b"k")
    rig.puts.end([first.put_id], [1])
    old = rig.objects[b"k"]
    old.pin, old.pin_until = PIN_SOFT, rig.clock.now + 60
    (old_replica,) = old.replicas
    second = rig.start(b"k")
    assert rig.puts.end([second.put_id], [2]) == [None]
    new = rig.objects[b"k"]
    assert new.checksum == 2 and (new.pin, new.pin_until) == (old.pin, old.pin_until)
    node = rig.members.nodes[old_replica.node_id]
    assert (old_replica.segment, old_replica.offset, old_replica.stamp) in node.forgotten


def test_revoke_frees_the_space_and_shows_nothing(rig: Rig) -> None:
    ticket = rig.start(b"k", 100, replicas=2)
    assert rig.puts.revoke([ticket.put_id, 999])[0] is None
    assert isinstance(rig.puts.revoke([ticket.put_id])[0], PutNotFoundError)
    assert b"k" not in rig.objects and not rig.puts.pending
    assert all(rig.dram(n).allocator.used_bytes == 0 for n in SECRETS)


def test_puts_not_committed_in_time_are_reclaimed(rig: Rig) -> None:
    ticket = rig.start(b"old")
    rig.clock.now += 5
    rig.start(b"young")
    rig.clock.now += 5
    assert rig.puts.reclaim_expired() == 1 and rig.puts.num_reclaimed == 1
    assert list(rig.puts.pending_by_key) == [b"young"]
    assert isinstance(rig.puts.end([ticket.put_id], [1])[0], PutNotFoundError)


def _num_tracked(generation: int = 2) -> int:
    """Objects the cyclic collector tracks after a collection of ``generation`` (a young one
    untracks the tuples it may, and then only those that survived it are tracked)."""
    gc.collect(generation)
    return len(gc.get_objects())


@pytest.mark.parametrize("num_replicas", [1, 2])
def test_a_maximum_size_batch_of_pending_puts_costs_the_collector_nothing_per_key(
    num_replicas: int,
) -> None:
    """Pending puts live for as long as the client writes (seconds, for a maximum-size batch):
    long enough to reach the collector's old generation, which every full collection walks
    while the master serves no one. So no owner keeps a tracked object per pending put
    (puts.py's docstring): the collector's work does not grow with the batch."""
    rig = make_rig(segment_bytes=1 << 30)
    n = rig.puts.config.max_batch
    keys = [b"big/%d" % i for i in range(n)]
    before = _num_tracked()
    put_ids = []
    for lo in range(0, n, 256):  # as the RPC edge serves it: in chunks
        tickets = rig.puts.start(keys[lo : lo + 256], [8] * 256, rig.place, num_replicas)
        put_ids += [t.put_id for t in tickets if isinstance(t, PutTicket)]
    del tickets
    assert len(put_ids) == n and len(rig.puts.pending) == n
    # Untracked by their first young collection: none reaches the old generation tracked.
    assert _num_tracked(generation=0) - before < n // 20, "tracked objects kept per pending put"
    assert {p.key for p in rig.puts.on_node("n1")} == set(keys)
    for lo in range(0, n, 256):
        assert rig.puts.end(put_ids[lo : lo + 256], [1] * 256) == [None] * 256
    assert not rig.puts.pending and len(rig.objects) == n
    if num_replicas == 1:  # (an object of several replicas is a record: see table.py)
        assert _num_tracked() - before < n // 20, "tracked objects kept per committed object"


# ---------------------------------------------------------------- blanks: puts started ahead
def test_blanks_lie_on_the_nodes_asked_and_commit_under_the_key_named(rig: Rig) -> None:
    started = rig.puts.blanks(100, [("n2", 2), ("n1", 1)], rig.place)
    assert [loc[0] for _, loc in started] == ["n2", "n2", "n1"]
    assert rig.dram("n2").allocator.used_bytes == 256 and rig.dram("n1").allocator.used_bytes == 128
    (put_id, loc), *_ = started
    grant = grants.Grant.from_wire(loc[3])
    assert grant.key == grants.BLANK_KEY and grant.op == grants.OP_WRITE and grant.size == 100
    # The writer uses the grant for its key: it verifies over the blank, and for no other range.
    grants.verify(SECRETS["n2"], grant.for_key(b"mine"), grants.OP_WRITE, rig.clock.wall_ms())
    assert not rig.puts.pending_by_key, "a blank has no key until it is committed"
    assert rig.puts.num_blanks == 3
    assert rig.puts.end([put_id], [7], [b"mine"]) == [None]
    assert rig.puts.num_blanks == 2
    obj = rig.objects[b"mine"]
    assert (obj.size, obj.checksum, obj.replicas[0].node_id) == (100, 7, "n2")
    assert rig.dram("n2").holding == {obj.replicas[0].offset: b"mine"}
    assert len(rig.puts.pending) == 2 and not rig.puts.pending_by_key


def test_a_blank_replaces_an_older_version_like_any_put(rig: Rig) -> None:
    rig.puts.end([rig.start(b"k", 100).put_id], [1])
    rig.clock.now += 0.001  # (a version's stamp is its put's start, in wall milliseconds)
    ((put_id, _),) = rig.puts.blanks(100, [("n2", 1)], rig.place)
    assert rig.puts.end([put_id], [2], [b"k"]) == [None]
    assert rig.objects[b"k"].checksum == 2
    assert rig.dram("n1").allocator.used_bytes + rig.dram("n2").allocator.used_bytes == 128


def test_a_blank_older_than_the_stored_version_is_refused_and_stays_pending(rig: Rig) -> None:
    """Versions are ordered by their stamps (the node's newest record, a new leader choosing
    among claims): a blank started before the stored version would be the older one."""
    ((old_blank, _),) = rig.puts.blanks(100, [("n1", 1)], rig.place)
    rig.clock.now += 0.001
    rig.puts.end([rig.start(b"k", 100).put_id], [1])
    (err,) = rig.puts.end([old_blank], [2], [b"k"])
    assert isinstance(err, BlankTooOldError) and old_blank in rig.puts.pending
    assert rig.objects[b"k"].checksum == 1
    # Started in the same millisecond is no newer either; a key never stored takes any blank.
    ((same, _),) = rig.puts.blanks(100, [("n1", 1)], rig.place)
    rig.puts.end([rig.start(b"t", 100).put_id], [3])
    assert isinstance(rig.puts.end([same], [4], [b"t"])[0], BlankTooOldError)
    assert rig.puts.end([old_blank], [5], [b"fresh"]) == [None]


@pytest.mark.parametrize(
    ("key", "error"),
    [
        (None, InvalidRequestError),  # a blank is committed with its key
        (KV_KEY, InvalidRequestError),  # KV blocks go through KVCache's own puts
        (b"\x00tenant/k", InvalidRequestError),  # a tenant's keys are placed against its quotas
        (InvalidRequestError("key must not be empty"), InvalidRequestError),
        (b"busy", ObjectBusyError),  # another put of the key is in flight
    ],
)
def test_a_blank_refused_at_its_commit_stays_pending_for_its_writer(
    rig: Rig, key: object, error: type
) -> None:
    rig.start(b"busy")
    ((put_id, _),) = rig.puts.blanks(100, [("n1", 1)], rig.place)
    (err,) = rig.puts.end([put_id], [1], [key])  # type: ignore[list-item]
    assert isinstance(err, error)
    assert put_id in rig.puts.pending and set(rig.objects.keys()) == set()
    assert rig.puts.revoke([put_id]) == [None]
    assert rig.dram("n1").allocator.used_bytes == 128, "only the busy key's put holds room"


def test_a_key_named_for_a_put_started_with_its_key_is_refused(rig: Rig) -> None:
    ticket = rig.start(b"k", 100)
    (err,) = rig.puts.end([ticket.put_id], [1], [b"other"])
    assert isinstance(err, InvalidRequestError) and ticket.put_id in rig.puts.pending
    assert rig.puts.end([ticket.put_id], [1], [None]) == [None]
    assert b"k" in rig.objects


@pytest.mark.parametrize(
    ("size", "wanted"),
    [(0, [("n1", 1)]), (1 << 62, [("n1", 1)]), (True, [("n1", 1)]), (10, [("n1", 65)])],
)
def test_bad_asks_for_blanks_are_refused_and_start_nothing(
    rig: Rig, size: object, wanted: list[tuple[str, int]]
) -> None:
    with pytest.raises(InvalidRequestError):
        rig.puts.blanks(size, wanted, rig.place)  # type: ignore[arg-type]
    assert not rig.puts.pending


def test_blanks_are_as_many_as_there_is_room_for_and_go_back_in_time(rig: Rig) -> None:
    started = rig.puts.blanks(1000, [("n1", 64)], rig.place)
    assert len(started) == 8  # (two 4 KiB segments: four 1 KiB extents each)
    assert rig.puts.blanks(1000, [("n1", 1)], rig.place) == []
    rig.clock.now += 10
    assert rig.puts.reclaim_expired() == 8 and rig.puts.num_blanks == 0
    assert all(rig.dram(n).allocator.used_bytes == 0 for n in SECRETS)
    assert isinstance(rig.puts.end([started[0][0]], [1], [b"late"])[0], PutNotFoundError)


def test_blanks_on_a_node_that_died_are_discarded_with_its_puts(rig: Rig) -> None:
    rig.puts.blanks(100, [("n1", 2), ("n2", 1)], rig.place)
    on_n1 = rig.puts.on_node("n1")
    assert len(on_n1) == 2 and {p.key for p in on_n1} == {grants.BLANK_KEY}
    for put in on_n1:
        rig.puts.discard(put)
    assert rig.dram("n1").allocator.used_bytes == 0 and len(rig.puts.pending) == 1
