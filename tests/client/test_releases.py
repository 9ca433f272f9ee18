"""Finished reads' lease tokens on their way back: piggybacked, or flushed on their own."""

from __future__ import annotations

import threading
import time

import pytest

from kvstore.client import releases
from kvstore.client.locations import LocationCache
from kvstore.client.releases import MAX_PIGGYBACK, LeaseReturns
from kvstore.errors import MasterUnavailableError
from kvstore.grants import Grant
from kvstore.types import Location, ObjectInfo

WAIT_S = 5.0


class Sink:
    """Records what a flush sends; ``fail`` makes it raise like an unreachable master."""

    def __init__(self, fail: bool = False) -> None:
        self.sent: list[list[int]] = []
        self.fail = fail
        self.arrived = threading.Event()

    def __call__(self, tokens: list[int]) -> None:
        self.sent.append(tokens)
        self.arrived.set()
        if self.fail:
            raise MasterUnavailableError("gone")


def test_tokens_ride_on_the_next_request() -> None:
    sink = Sink()
    returns = LeaseReturns(sink, delay_s=60.0)  # the flush would come far too late
    try:
        returns.give_back([5, 0, 7])
        args = {"keys": [b"k"]}
        assert returns.attach(args) == {"keys": [b"k"], "release": [5, 7]}
        assert args == {"keys": [b"k"]}, "the caller's dict is not changed"
        assert returns.attach(args) is args, "nothing left to carry"
        assert returns.pending() == 0 and not sink.sent
    finally:
        returns.close()


def test_a_request_carries_at_most_max_piggyback() -> None:
    returns = LeaseReturns(Sink(), delay_s=60.0)
    try:
        returns.give_back(range(1, MAX_PIGGYBACK + 11))
        assert len(returns.attach({})["release"]) == MAX_PIGGYBACK
        assert returns.attach({})["release"] == list(range(MAX_PIGGYBACK + 1, MAX_PIGGYBACK + 11))
    finally:
        returns.close()


def test_idle_tokens_are_flushed_on_their_own() -> None:
    sink = Sink()
    returns = LeaseReturns(sink, delay_s=0.01)
    try:
        returns.give_back([1, 2])
        assert sink.arrived.wait(WAIT_S)
        assert sink.sent == [[1, 2]] and returns.pending() == 0
    finally:
        returns.close()


def test_a_flusher_gone_idle_is_woken_by_the_next_token(monkeypatch: pytest.MonkeyPatch) -> None:
    # A busy client's reads do not wake the flusher (it looks every delay_s on its own); once
    # it has seen no token for BUSY_FOR_S it sleeps, and the next token must wake it.
    monkeypatch.setattr(releases, "BUSY_FOR_S", 0.05)
    monkeypatch.setattr(releases, "IDLE_WAIT_S", 60.0)  # only a wake-up flushes within WAIT_S
    sink = Sink()
    returns = LeaseReturns(sink, delay_s=0.01)
    try:
        returns.give_back([1])
        assert sink.arrived.wait(WAIT_S)
        sink.arrived.clear()
        deadline = time.monotonic() + WAIT_S
        while not returns.sleeping() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert returns.sleeping(), "idle past BUSY_FOR_S: the flusher sleeps until woken"
        returns.give_back([2])
        assert sink.arrived.wait(WAIT_S)
        assert sink.sent == [[1], [2]]
    finally:
        returns.close()


def test_a_failed_flush_drops_its_tokens_and_the_flusher_lives_on() -> None:
    sink = Sink(fail=True)
    returns = LeaseReturns(sink, delay_s=0.01)
    try:
        returns.give_back([1])
        assert sink.arrived.wait(WAIT_S)
        sink.arrived.clear()
        returns.give_back([2])
        assert sink.arrived.wait(WAIT_S)
        assert sink.sent == [[1], [2]]
    finally:
        returns.close()
    returns.give_back([3])  # after close: dropped, no thread
    assert returns.pending() == 0


def info(lease: int) -> ObjectInfo:
    grant = Grant("read", b"k", "dram", 0, 10, 0, b"")
    return ObjectInfo(10, 1, [Location("n", "127.0.0.1", 1, grant)], lease)


def test_a_plain_cache_owns_no_lease() -> None:
    cache = LocationCache()
    assert cache.put_many([b"a", b"b"], [info(1), info(2)]) == [1, 2], "the read gives both back"
    cache.forget([b"a"])  # nothing to give back, nowhere to give it


def test_a_lease_reads_cache_owns_the_leases_it_keeps_until_the_entry_ends() -> None:
    given: list[int] = []
    cache = LocationCache(max_entries=3, give_back=given.extend)
    err = MasterUnavailableError("x")
    assert cache.put_many([b"a", b"b", b"c"], [info(1), info(2), err]) == []
    assert given == []
    assert cache.put_many([b"a"], [info(3)]) == [] and given == [1], "replaced: the old goes"
    cache.forget([b"b", b"zz"])
    assert given == [1, 2]
    stale = cache.generation
    cache.forget([b"q"])
    assert cache.put_many([b"d"], [info(4)], generation=stale) == [4], "not kept: the read's"
    assert cache.put_many([b"e", b"f", b"g"], [info(5), info(6), info(7)]) == []
    assert given == [1, 2, 3], "the cache started over: every lease it held went back"
    cache.clear()
    assert sorted(given) == [1, 2, 3, 5, 6, 7]
