"""Read leases counted per reader and given back when reads finish, with a fake clock."""

from __future__ import annotations

import msgpack
import pytest

from kvstore import protocol
from kvstore.errors import InvalidRequestError, NoSpaceError
from kvstore.master.leases import LEASE_BATCH_SPAN, ReadLeases
from kvstore.master.server import dispatch
from kvstore.master.service import MasterService
from kvstore.master.table import ObjectMeta
from kvstore.types import ObjectInfo, PutTicket
from tests.master.test_tiering import KIB, MIB, FakeClock, make, put


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


def lease(svc: MasterService, key: bytes) -> int:
    (info,) = svc.get_locations([key])
    assert isinstance(info, ObjectInfo) and info.lease, info
    return info.lease


def used(svc: MasterService) -> int:
    return sum(s.allocator.used_bytes for n in svc.nodes.values() for s in n.segments.values())


def can_put(svc: MasterService, key: bytes, size: int) -> bool:
    (ticket,) = svc.put_start([key], [size])
    if isinstance(ticket, PutTicket):
        svc.put_revoke([ticket.put_id])
        return True
    assert isinstance(ticket, NoSpaceError), ticket
    return False


def call(svc: MasterService, verb: str, args: dict[str, object]) -> tuple[int, object]:
    """One request through the RPC edge: (error code, result or error message)."""
    frame = dispatch(svc, protocol.Request(1, verb, args))
    body = msgpack.unpackb(frame[protocol.HEADER_SIZE :], raw=False)
    return body[1], body[2]


# ---------------------------------------------------------------- per-reader counting
def test_two_readers_the_object_stays_leased_until_both_gave_back(clock: FakeClock) -> None:
    svc = make(clock, dram=128 * KIB, nvme=0)
    put(svc, b"a", 64 * KIB)
    t1, t2 = lease(svc, b"a"), lease(svc, b"a")
    assert t1 != t2 and svc.objects[b"a"].readers == 2
    svc.remove([b"a"])  # its space waits for both readers
    assert used(svc) == 64 * KIB
    assert svc.release_leases([t1]) == [True]
    assert used(svc) == 64 * KIB, "the second reader still reads those bytes"
    assert svc.stats()["held_bytes"] == 64 * KIB
    assert svc.release_leases([t2]) == [True]
    assert used(svc) == 0 and svc.stats()["held_bytes"] == 0, "freed at once, not at lease end"
    assert svc.stats()["leases"]["num_outstanding"] == 0


def test_eviction_waits_for_the_last_reader_only(clock: FakeClock) -> None:
    svc = make(clock, dram=128 * KIB, nvme=0)
    put(svc, b"a", 64 * KIB)
    put(svc, b"b", 64 * KIB)
    ta, tb1, tb2 = lease(svc, b"a"), lease(svc, b"b"), lease(svc, b"b")
    assert not can_put(svc, b"c", 64 * KIB), "both objects are leased"
    svc.release_leases([tb1])
    assert not can_put(svc, b"c", 64 * KIB), "b still has a reader"
    svc.release_leases([tb2])
    put(svc, b"c", 64 * KIB)
    assert b"b" not in svc.objects and b"a" in svc.objects, "b went as soon as nobody read it"
    assert svc.objects[b"a"].readers == 1 and svc.release_leases([ta]) == [True]


def test_an_unreleased_lease_still_ends_at_lease_s(clock: FakeClock) -> None:
    svc = make(clock, dram=128 * KIB, nvme=0)  # lease_s = 2
    put(svc, b"a", 64 * KIB)
    t1 = lease(svc, b"a")
    lease(svc, b"a")  # a reader that crashed: never given back
    svc.remove([b"a"])
    svc.release_leases([t1])
    clock.now += 1.9
    svc.tick()
    assert used(svc) == 64 * KIB
    clock.now += 0.2  # the crashed reader's lease is over...
    svc.tick()
    assert used(svc) == 64 * KIB, "...but its read may still reach a node whose clock lags"
    clock.now += svc.tiering.config.lease_grace_s
    svc.tick()
    assert used(svc) == 0
    stats = svc.stats()["leases"]
    assert stats["num_expired"] == 1 and stats["num_released"] == 1
    assert stats["num_outstanding"] == 0


def test_a_release_after_an_unreleased_lease_ended_waits_out_the_grace(clock: FakeClock) -> None:
    svc = make(clock, dram=128 * KIB, nvme=0)
    put(svc, b"a", 64 * KIB)
    lease(svc, b"a")  # never given back
    clock.now += 1.0
    t2 = lease(svc, b"a")
    svc.remove([b"a"])
    clock.now += 1.05  # the first lease ended 0.05 s ago
    svc.tick()
    svc.release_leases([t2])
    assert used(svc) == 64 * KIB, "the first reader's read may still be on its way"
    clock.now += svc.tiering.config.lease_grace_s
    svc.tick()
    assert used(svc) == 0, "then it goes, long before the second lease would have ended"


# ---------------------------------------------------------------- balance
def test_double_and_late_release_change_nothing(clock: FakeClock) -> None:
    svc = make(clock, dram=128 * KIB, nvme=0)
    put(svc, b"a", 64 * KIB)
    t1, t2 = lease(svc, b"a"), lease(svc, b"a")
    assert svc.release_leases([t1, t1]) == [True, False]
    assert svc.release_leases([t1]) == [False]
    assert svc.objects[b"a"].readers == 1, "the other reader's lease is untouched"
    clock.now += 3  # t2 ran out
    svc.tick()
    t3 = lease(svc, b"a")  # a new reader
    assert svc.release_leases([t2, t1]) == [False, False], "late: its lease ended already"
    assert svc.objects[b"a"].readers == 1 and svc.objects[b"a"].lease_until > clock.now
    assert not can_put(svc, b"b", 128 * KIB), "the new reader's lease still holds a"
    assert svc.release_leases([t3]) == [True]
    assert svc.stats()["leases"] == {
        "num_outstanding": 0,
        "num_granted": 3,
        "num_released": 2,
        "num_expired": 1,
    }


def test_tokens_never_issued_change_nothing(clock: FakeClock) -> None:
    svc = make(clock)
    put(svc, b"a", KIB)
    t = lease(svc, b"a")
    others = [0, t + 1, t - 1, t + LEASE_BATCH_SPAN, (1 << 64) - 1]
    assert svc.release_leases(others) == [False] * len(others)
    assert svc.objects[b"a"].readers == 1


def test_a_miss_takes_no_lease_and_tokens_follow_the_batch(clock: FakeClock) -> None:
    svc = make(clock)
    put(svc, b"a", KIB)
    put(svc, b"b", KIB)
    a, miss, b = svc.get_locations([b"a", b"nope", b"b"])
    assert isinstance(a, ObjectInfo) and isinstance(b, ObjectInfo)
    assert b.lease == a.lease + 2 and not isinstance(miss, ObjectInfo)
    assert svc.release_leases([a.lease + 1]) == [False]
    assert svc.release_leases([b.lease, a.lease]) == [True, True]
    assert svc.stats()["leases"]["num_outstanding"] == 0


def test_a_move_frees_its_old_space_when_the_reader_gives_back(clock: FakeClock) -> None:
    svc = make(clock, dram=128 * KIB, nvme=4 * MIB, high_watermark=0.5, low_watermark=0.25)
    put(svc, b"a", 96 * KIB)
    t = lease(svc, b"a")
    clock.now += 3  # the lease ran out: demotion may take a
    svc.tick()
    t = lease(svc, b"a")  # read again while the move is in flight
    (task,) = svc.take_tasks("n0")
    svc.tasks_done("n0", [[task["id"], 0, None]])
    dram = svc.nodes["n0"].segments["dram"].allocator
    assert dram.used_bytes > 0, "the reader may still read the DRAM copy"
    svc.release_leases([t])
    assert dram.used_bytes == 0


def test_object_meta_stays_slotted() -> None:
    meta = ObjectMeta(b"k", 1, 2, [])
    assert not hasattr(meta, "__dict__") and meta.readers == 0


def test_batches_are_forgotten_once_given_back() -> None:
    leases = ReadLeases(first_batch=7)

    class Obj:
        readers = 0

    objs = [Obj(), Obj()]
    first = leases.grant(list(objs), 10.0)
    assert first == 7 * LEASE_BATCH_SPAN and leases.grant([None], 10.0) == 0
    ended, emptied = leases.release([first + 1, first])
    assert ended == [True, True] and emptied == [objs[1], objs[0]]
    assert not leases._batches and not leases._order
    assert leases.expire(100.0) == []


# ---------------------------------------------------------------- bad input
@pytest.mark.parametrize(
    "bad",
    [["x"], [-1], [True], [1 << 64], [1.5], "tokens", None, [[1]]],
)
def test_bad_tokens_are_refused_and_nothing_changes(clock: FakeClock, bad: object) -> None:
    svc = make(clock)
    put(svc, b"a", KIB)
    t = lease(svc, b"a")
    tokens = [t, *bad] if isinstance(bad, list) else bad
    with pytest.raises(InvalidRequestError):
        svc.release_leases(tokens)
    assert svc.objects[b"a"].readers == 1, "the good token in the same list stays leased"
    code, _ = call(svc, "release_leases", {"tokens": tokens})
    assert code == InvalidRequestError.code
    code, _ = call(svc, "exists", {"keys": [b"a"], "release": tokens})
    assert code == InvalidRequestError.code
    assert svc.objects[b"a"].readers == 1


def test_too_many_tokens_are_refused(clock: FakeClock) -> None:
    svc = make(clock)
    put(svc, b"a", KIB)
    t = lease(svc, b"a")
    with pytest.raises(InvalidRequestError):
        svc.release_leases([t] * (svc.config.max_batch + 1))
    assert svc.objects[b"a"].readers == 1


# ---------------------------------------------------------------- the RPC edge
def test_release_leases_verb_answers_per_token(clock: FakeClock) -> None:
    svc = make(clock)
    put(svc, b"a", KIB)
    t = lease(svc, b"a")
    assert call(svc, "release_leases", {"tokens": [t, t, 5]}) == (0, [True, False, False])


def test_piggybacked_release_goes_before_the_verb(clock: FakeClock) -> None:
    svc = make(clock, dram=128 * KIB, nvme=0)
    put(svc, b"a", 64 * KIB)
    t = lease(svc, b"a")
    code, result = call(svc, "remove", {"keys": [b"a"], "release": [t]})
    assert code == 0 and result == [[0, None]]
    assert used(svc) == 0, "the reader's release arrived with the remove: nothing is held"
    code, _ = call(svc, "no_such_verb", {"release": [t]})
    assert code != 0
