"""The two-phase put on its own (kvstore.client.puts), against a fake master and fake nodes:
put_start, the writes, put_end (or kv_commit with the prompt), a dead node's keys tried again
elsewhere, the second phase pinned to the first's epoch, and the location cache forgotten."""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import xxhash

from kvstore.client.locations import LocationCache
from kvstore.client.puts import PUT_CHUNK, PromptCommit, PutBatch, Putter
from kvstore.client.transport import WriteItem
from kvstore.errors import (
    MasterUnavailableError,
    NodeUnavailableError,
    NoSpaceError,
    PutNotFoundError,
)
from kvstore.grants import Grant
from kvstore.keys import Namespace
from kvstore.kvblocks import tokens_to_wire
from kvstore.types import Location, ObjectInfo, PutTicket, result_to_wire

EPOCH = 7


class FakeMaster:
    """put_start places each key on the first live node of ``nodes`` not excluded."""

    def __init__(self, nodes: tuple[str, ...] = ("n1", "n2")) -> None:
        self.nodes = nodes
        self.calls: list[tuple[str, dict[str, Any], int | None]] = []
        self.next_id = 1
        self.full = False
        self.timeout = 5.0
        self.epoch = EPOCH
        self.releases = None

    def call(self, verb: str, args: dict[str, Any], pin_epoch: int | None = None) -> Any:
        self.calls.append((verb, args, pin_epoch))
        if verb == "put_start":
            out = []
            for key, size in zip(args["keys"], args["sizes"], strict=True):
                live = [n for n in self.nodes if n not in args["exclude"]]
                if not live or self.full:
                    out.append(result_to_wire(NoSpaceError("no room")))
                    continue
                grant = Grant("w", key, "dram", 0, size, 0, b"")
                out.append(
                    result_to_wire(PutTicket(self.next_id, [Location(live[0], "h", 1, grant)]))
                )
                self.next_id += 1
            return out
        if verb == "put_end":
            return [result_to_wire(None) for _ in args["put_ids"]]
        if verb == "kv_commit":
            return {"results": [result_to_wire(None) for _ in args["put_ids"]]}
        if verb == "put_revoke":
            return None
        raise AssertionError(verb)

    def call_epoch(self, verb: str, args: dict[str, Any], pin_epoch: int | None = None) -> Any:
        return self.call(verb, args, pin_epoch), EPOCH

    def call_overlapped(
        self,
        verb: str,
        args: dict[str, Any],
        work: Callable[[], None],
        pin_epoch: int | None = None,
    ) -> tuple[Any, int]:
        work()
        return self.call(verb, args, pin_epoch), EPOCH

    def verbs(self) -> list[str]:
        return [v for v, _, _ in self.calls]


class FakeNodes:
    def __init__(self) -> None:
        self.dead: set[str] = set()
        self.stored: dict[tuple[str, bytes], bytes] = {}
        self.refreshed: list[set[str]] = []

    def refresh_offers(self, node_ids: Any = (), *, force: bool = False) -> None:
        self.refreshed.append(set(node_ids))

    def write(self, items: list[WriteItem]) -> None:
        for item in items:
            node = item.location.node_id
            if node in self.dead:
                item.result = NodeUnavailableError(f"{node} is down")
            else:
                assert item.checksum == xxhash.xxh3_64_intdigest(item.data)
                self.stored[(node, item.location.grant.key)] = bytes(item.data)

    # As TCP: the bytes are taken, and acknowledged, once the sender waits for them.
    def write_begin(self, items: list[WriteItem]) -> list[WriteItem]:
        return list(items)

    def write_end(self, in_flight: list[WriteItem]) -> None:
        if in_flight:
            self.write(in_flight)


def run(master: FakeMaster, nodes: FakeNodes, batch: PutBatch, cache: LocationCache) -> None:
    Putter(master, nodes, cache).run(batch)  # type: ignore[arg-type]


def batch_of(*pairs: tuple[bytes, bytes], prompt: PromptCommit | None = None) -> PutBatch:
    return PutBatch([k for k, _ in pairs], [memoryview(v) for _, v in pairs], prompt=prompt)


@pytest.fixture
def cache() -> LocationCache:
    return LocationCache()


def test_a_batch_is_allocated_written_and_committed(cache: LocationCache) -> None:
    master, nodes = FakeMaster(), FakeNodes()
    batch = batch_of((b"a", b"x" * 10), (b"b", b"y" * 3))
    run(master, nodes, batch, cache)
    assert batch.results == [None, None]
    assert master.verbs() == ["put_start", "put_end"]
    assert nodes.stored == {("n1", b"a"): b"x" * 10, ("n1", b"b"): b"y" * 3}
    (_, end, pinned) = master.calls[1]
    assert end["checksums"] == [
        xxhash.xxh3_64_intdigest(b"x" * 10),
        xxhash.xxh3_64_intdigest(b"yyy"),
    ]
    assert pinned == EPOCH  # a put id means nothing to another leader
    assert nodes.refreshed == [{"n1"}]  # transports refreshed before the write, not inside


def test_keys_whose_node_died_are_put_again_elsewhere(cache: LocationCache) -> None:
    master, nodes = FakeMaster(), FakeNodes()
    nodes.dead.add("n1")
    batch = batch_of((b"a", b"x" * 10))
    run(master, nodes, batch, cache)
    assert batch.results == [None]
    assert master.verbs() == ["put_start", "put_revoke", "put_start", "put_end"]
    assert master.calls[1][2] == EPOCH  # the revoke is pinned too
    assert master.calls[2][1]["exclude"] == ["n1"] and batch.excluded == ["n1"]
    assert nodes.stored == {("n2", b"a"): b"x" * 10}


def test_a_retry_that_finds_no_room_reports_the_dead_node(cache: LocationCache) -> None:
    master, nodes = FakeMaster(nodes=("n1",)), FakeNodes()
    nodes.dead.add("n1")
    batch = batch_of((b"a", b"x"))
    run(master, nodes, batch, cache)
    assert isinstance(batch.results[0], NodeUnavailableError)


def test_a_prompt_commits_through_kv_commit(cache: LocationCache) -> None:
    master, nodes = FakeMaster(), FakeNodes()
    ns = Namespace("m", "float16", 1, 1, 2, block_size=4)
    tokens = np.arange(8)
    batch = batch_of((b"kv/a", b"x"), prompt=PromptCommit(ns, tokens))
    run(master, nodes, batch, cache)
    assert master.verbs() == ["put_start", "kv_commit"]
    assert master.calls[0][1]["kv"] is True
    commit = master.calls[1][1]
    assert commit["namespace"] == ns.to_dict() and commit["tokens"] == tokens_to_wire(tokens)


def test_the_location_cache_forgets_every_key_put(cache: LocationCache) -> None:
    loc = Location("n1", "h", 1, Grant("r", b"a", "dram", 0, 1, 0, b""))
    cache.put_many([b"a"], [ObjectInfo(1, 0, [loc])])
    run(FakeMaster(), FakeNodes(), batch_of((b"a", b"z")), cache)
    assert cache.get_many([b"a"]) == [None]


class AnswersAtSend(FakeMaster):
    """A master that answers a request as it arrives: an overlapped call's answer is decided
    before the work that runs while it is in flight (as on the wire)."""

    def call_overlapped(
        self,
        verb: str,
        args: dict[str, Any],
        work: Callable[[], None],
        pin_epoch: int | None = None,
    ) -> tuple[Any, int]:
        reply = self.call(verb, args, pin_epoch)
        work()
        return reply, EPOCH


def test_a_large_batch_is_put_a_chunk_ahead_and_a_dead_nodes_chunks_go_elsewhere(
    cache: LocationCache,
) -> None:
    # Chunk i+1's put_start is in flight while chunk i is written, and chunk i-2's put_end
    # while chunk i is sent and chunk i-1 acknowledged. The node dies after the first chunk is
    # written: the chunks placed on it are revoked and, in the second round (again in
    # chunks), put on the other node; the dead node is excluded once.
    master, nodes = AnswersAtSend(), FakeNodes()
    n = 2 * PUT_CHUNK + 5
    batch = batch_of(*[(b"k%d" % i, b"v%d" % i) for i in range(n)])
    node_write = nodes.write

    def write(items: list[WriteItem]) -> None:
        if nodes.stored:
            nodes.dead.add("n1")
        node_write(items)

    nodes.write = write  # type: ignore[method-assign]
    run(master, nodes, batch, cache)
    assert batch.results == [None] * n
    assert master.verbs() == [
        "put_start",  # chunk 1, the values hashed meanwhile
        "put_start",  # chunk 2, sent before chunk 1 is written
        "put_start",  # chunk 3, sent before chunk 2 is written ...
        "put_end",  # ... and chunk 1's commit, once it is acknowledged, with chunk 3 sent
        "put_revoke",  # chunk 2: its node died
        "put_revoke",  # chunk 3 likewise (nothing of either to commit)
        "put_start",  # round 2: chunks 2 and 3's keys, on n2
        "put_start",
        "put_end",  # the first chunk of round 2, while its second is acknowledged
        "put_end",  # the last chunk, once acknowledged
    ]
    assert all(pinned == EPOCH for v, _, pinned in master.calls if v == "put_end")
    assert [len(a["keys"]) for v, a, _ in master.calls if v == "put_start"] == [
        PUT_CHUNK,
        PUT_CHUNK,
        5,
        PUT_CHUNK,
        5,
    ]
    assert all(a["exclude"] == ["n1"] for v, a, _ in master.calls[6:] if v == "put_start")
    assert batch.excluded == ["n1"]
    for i in range(n):
        node = "n1" if i < PUT_CHUNK else "n2"
        assert nodes.stored[(node, b"k%d" % i)] == b"v%d" % i


def test_a_put_runs_with_the_collector_paused_and_turns_it_back_on(cache: LocationCache) -> None:
    assert gc.isenabled()
    master, nodes = FakeMaster(), FakeNodes()
    on_in_write: list[bool] = []
    write = nodes.write
    nodes.write = lambda items: (on_in_write.append(gc.isenabled()), write(items))[1]  # type: ignore[method-assign]
    run(master, nodes, batch_of((b"a", b"x" * 10)), cache)
    assert on_in_write == [False] and gc.isenabled()


class RefusesSomeCommits(AnswersAtSend):
    """Answers ``put_end`` of the put ids in ``refuse`` with an error."""

    def __init__(self, refuse: set[int]) -> None:
        super().__init__()
        self.refuse = refuse

    def call(self, verb: str, args: dict[str, Any], pin_epoch: int | None = None) -> Any:
        if verb != "put_end":
            return super().call(verb, args, pin_epoch)
        self.calls.append((verb, args, pin_epoch))
        return [
            result_to_wire(PutNotFoundError("timed out") if p in self.refuse else None)
            for p in args["put_ids"]
        ]


def test_a_chunk_is_sent_before_the_one_before_is_acknowledged_and_committed_after(
    cache: LocationCache,
) -> None:
    # The nodes take chunk i while the client sends chunk i+1; a chunk is committed only once
    # its writes are acknowledged (nothing acknowledged to the caller before that).
    master, nodes = FakeMaster(), FakeNodes()
    events: list[tuple[str, bytes]] = []
    begin, end, call = nodes.write_begin, nodes.write_end, master.call

    def write_begin(items: list[WriteItem]) -> list[WriteItem]:
        events.append(("send", items[0].location.grant.key))
        return begin(items)

    def write_end(in_flight: list[WriteItem]) -> None:
        end(in_flight)
        events.append(("ack", in_flight[0].location.grant.key))

    def master_call(verb: str, args: dict[str, Any], pin_epoch: int | None = None) -> Any:
        if verb == "put_end":
            events.append(("commit", b"k%d" % (args["put_ids"][0] - 1)))
        return call(verb, args, pin_epoch)

    nodes.write_begin, nodes.write_end = write_begin, write_end  # type: ignore[method-assign]
    master.call = master_call  # type: ignore[method-assign]
    n = 4 * PUT_CHUNK
    batch = batch_of(*[(b"k%d" % i, b"v%d" % i) for i in range(n)])
    run(master, nodes, batch, cache)
    assert batch.results == [None] * n and len(nodes.stored) == n
    firsts = [b"k%d" % (c * PUT_CHUNK) for c in range(4)]
    at = {event: i for i, event in enumerate(events)}
    assert len(events) == 12
    for c, key in enumerate(firsts):
        assert at["send", key] < at["ack", key] < at["commit", key]
        if c + 1 < len(firsts):
            assert at["send", firsts[c + 1]] < at["ack", key]


def test_a_master_lost_mid_batch_leaves_no_write_in_flight(cache: LocationCache) -> None:
    # The third put_start fails: the batch raises, and the writes sent before it (chunk 2's,
    # in flight at the nodes) are taken first (no connection left mid-reply); what was not
    # committed stays uncommitted (the master takes its space back after the put timeout).
    master, nodes = FakeMaster(), FakeNodes()
    sent: list[int] = []
    taken: list[int] = []
    begin, end, call = nodes.write_begin, nodes.write_end, master.call

    def write_begin(items: list[WriteItem]) -> list[WriteItem]:
        sent.append(len(items))
        return begin(items)

    def write_end(in_flight: list[WriteItem]) -> None:
        taken.append(len(in_flight))
        end(in_flight)

    def master_call(verb: str, args: dict[str, Any], pin_epoch: int | None = None) -> Any:
        if verb == "put_start" and master.verbs().count("put_start") == 2:
            raise MasterUnavailableError("master gone")
        return call(verb, args, pin_epoch)

    nodes.write_begin, nodes.write_end = write_begin, write_end  # type: ignore[method-assign]
    master.call = master_call  # type: ignore[method-assign]
    batch = batch_of(*[(b"k%d" % i, b"v%d" % i) for i in range(4 * PUT_CHUNK)])
    with pytest.raises(MasterUnavailableError):
        run(master, nodes, batch, cache)
    assert sent == taken == [PUT_CHUNK, PUT_CHUNK]
    assert [len(a["put_ids"]) for v, a, _ in master.calls if v == "put_end"] == []


def test_every_chunks_commit_answer_reaches_its_keys(cache: LocationCache) -> None:
    """A chunk's put_end is answered while the next chunk is written (and the last one's
    after the batch is written): each key's result is its own commit's answer, in order."""
    n = 3 * PUT_CHUNK + 7
    refuse = {2, PUT_CHUNK + 1, 3 * PUT_CHUNK + 7}  # put ids start at 1: one key per commit
    master, nodes = RefusesSomeCommits(refuse), FakeNodes()
    batch = batch_of(*[(b"k%d" % i, b"v%d" % i) for i in range(n)])
    run(master, nodes, batch, cache)
    assert [v for v in master.verbs() if v == "put_end"] == ["put_end"] * 4
    ends = [a for v, a, _ in master.calls if v == "put_end"]
    assert [len(a["put_ids"]) for a in ends] == [PUT_CHUNK] * 3 + [7]
    assert sorted(p for a in ends for p in a["put_ids"]) == list(range(1, n + 1))
    failed = [i for i, r in enumerate(batch.results) if r is not None]
    assert failed == [p - 1 for p in sorted(refuse)]
    assert all(isinstance(batch.results[i], PutNotFoundError) for i in failed)
    assert len(nodes.stored) == n
