"""The master's RPC edge over real sockets (an in-process ControlServer on its own event loop):
bounded work per turn of the loop, and the limits that keep one request from freezing it."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

from kvstore import auth, grants, protocol
from kvstore.client.reads import decode_locations
from kvstore.errors import InvalidRequestError
from kvstore.keys import Namespace, block_keys
from kvstore.kvblocks import kv_object_key, tokens_to_wire
from kvstore.master.prefix import MAX_PROMPT_BLOCKS
from kvstore.master.puts import PendingPut
from kvstore.master.rpc_chunks import PACK, pack_items
from kvstore.master.server import (
    CHUNK_ITEMS,
    SWEEP_INTERVAL_S,
    ControlServer,
    dispatch_bounded,
)
from kvstore.master.service import MasterConfig, MasterService, ServiceSlot
from kvstore.types import ObjectInfo, PutTicket, SegmentSpec
from tests.support import wait_until

NS = Namespace(model="m", dtype="float16", num_layers=1, num_kv_heads=1, head_dim=8, block_size=1)


@dataclass
class Live:
    svc: MasterService
    server: ControlServer
    loop: asyncio.AbstractEventLoop

    def connect(self) -> protocol.FramedSocket:
        return protocol.FramedSocket.connect("127.0.0.1", self.server.port, timeout=60)


@pytest.fixture
def live() -> Iterator[Live]:
    svc = MasterService(MasterConfig())
    svc.register(
        "n1", "127.0.0.1", 9, b"s" * 32, [SegmentSpec(name="dram0", tier="dram", capacity=1 << 34)]
    )
    loop = asyncio.new_event_loop()
    server = ControlServer(ServiceSlot(svc), "127.0.0.1", 0)
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    asyncio.run_coroutine_threadsafe(server.start(), loop).result(timeout=30)
    try:
        yield Live(svc, server, loop)
    finally:
        asyncio.run_coroutine_threadsafe(server.stop(), loop).result(timeout=30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=30)
        loop.close()


def _put_ids(conn: protocol.FramedSocket, keys: list[bytes], **extra: Any) -> list[int]:
    reply = conn.call("put_start", {"keys": keys, "sizes": [8] * len(keys), **extra})
    assert all(r[0] == 0 for r in reply), reply[:3]
    return [r[1][0] for r in reply]


@pytest.mark.parametrize(("raw", "window"), [("250", 2 * 250e-6), ("0", 0.0)])
def test_the_master_polls_for_two_windows_after_an_answer_and_never_with_polling_off(
    monkeypatch: pytest.MonkeyPatch, raw: str, window: float
) -> None:
    # A client comes back to the master after a round trip to a node (kvstore.polling).
    monkeypatch.setenv("KVSTORE_POLL_US", raw)
    server = ControlServer(ServiceSlot(MasterService(MasterConfig())), "127.0.0.1", 0)
    assert server._awake.window == pytest.approx(window)


def test_chunked_batches_answer_like_unchunked_ones(live: Live) -> None:
    conn = live.connect()
    n = CHUNK_ITEMS * 4 + 3
    keys = [b"k%d" % i for i in range(n)] + [b""]  # the last one is a bad key: its own error
    reply = conn.call("put_start", {"keys": keys, "sizes": [8] * len(keys)})
    assert len(reply) == n + 1 and all(r[0] == 0 for r in reply[:-1]) and reply[-1][0] != 0
    ids = [r[1][0] for r in reply[:-1]]
    assert conn.call("put_end", {"put_ids": ids, "checksums": [1] * n}) == [[0, None]] * n
    assert conn.call("exists", {"keys": keys}) == [True] * n + [False]
    locs = conn.call("get_locations", {"keys": keys[:-1]})
    granted = [ObjectInfo.from_wire(r[1]).locations[0].grant.key for r in locs]
    assert granted == keys[:-1]  # in order, each its own key
    # With batch grants each chunk signs its own batch (its slot numbers start again), and a
    # node reading the answer in order verifies every key's grant.
    locs = conn.call("get_locations", {"keys": keys[:-1], "batch_grants": True})
    infos = decode_locations(locs)  # the client's own reading of the answer
    assert [i.locations[0].grant.key for i in infos] == keys[:-1]  # type: ignore[union-attr]
    node = grants.VerifiedGrants(b"s" * 32)
    reader = grants.GrantReader(
        lambda b: node.check_batch(b, grants.OP_READ, int(time.time() * 1000)), check=False
    )
    wires = [r[1][2][0][3] for r in locs]
    assert sum(len(w) == 3 for w in wires) == 5  # one batch per chunk of CHUNK_ITEMS
    assert [reader.resolve(w).key for w in wires] == keys[:-1]
    with pytest.raises(InvalidRequestError, match="batch_grants"):
        conn.call("get_locations", {"keys": keys[:1], "batch_grants": 1})


def test_a_kv_commit_answers_before_it_indexes_and_every_later_request_finds_the_prompt(
    live: Live, caplog: pytest.LogCaptureFixture
) -> None:
    """The prompt of a small ``kv_commit`` is indexed once its answer is written: the writer
    waits for none of it, and a request sent after the answer (here on another connection,
    while the index is still being built) is served after it."""
    conn, other = live.connect(), live.connect()
    tokens = np.arange(4, dtype=np.uint32)
    keys = [kv_object_key(NS.digest, k) for k in block_keys(NS, tokens)]
    prompt = {"namespace": NS.to_dict(), "tokens": tokens_to_wire(tokens)}
    indexing, release = threading.Event(), threading.Event()
    index = live.svc.kv_index

    def held_index(namespace: Namespace, toks: np.ndarray) -> int:
        indexing.set()
        assert release.wait(60)
        return index(namespace, toks)

    live.svc.kv_index = held_index  # type: ignore[method-assign]
    matched: list[Any] = []
    try:
        ids = _put_ids(conn, keys, kv=True)
        done = conn.call("kv_commit", {**prompt, "put_ids": ids, "checksums": [1] * 4})
        assert done == {"results": [[0, None]] * 4}  # answered while the index is held
        assert indexing.wait(60)
        asker = threading.Thread(target=lambda: matched.append(other.call("kv_match", prompt)))
        asker.start()
    finally:
        release.set()
    asker.join(60)
    assert matched[0]["num_tokens"] == 4
    # An index that fails after the answer is logged; the puts stay committed, the
    # connection serves on.
    live.svc.kv_index = lambda *a: 1 // 0  # type: ignore[method-assign]
    more = np.arange(100, 102, dtype=np.uint32)
    keys = [kv_object_key(NS.digest, k) for k in block_keys(NS, more)]
    ids = _put_ids(conn, keys, kv=True)
    more_prompt = {"namespace": NS.to_dict(), "tokens": tokens_to_wire(more)}
    done = conn.call("kv_commit", {**more_prompt, "put_ids": ids, "checksums": [1] * 2})
    assert done == {"results": [[0, None]] * 2}
    assert conn.call("exists", {"keys": keys}) == [True, True]
    assert conn.call("kv_match", more_prompt)["num_tokens"] == 0
    assert "work after an answer failed" in caplog.text


def test_chunked_put_starts_batch_their_write_grants_per_chunk(live: Live) -> None:
    conn = live.connect()
    n = CHUNK_ITEMS * 2 + 3
    keys = [b"w%d" % i for i in range(n)] + [b""]  # the last one is a bad key: its own error
    reply = conn.call("put_start", {"keys": keys, "sizes": [8] * len(keys), "batch_grants": True})
    assert all(r[0] == 0 for r in reply[:-1]) and reply[-1][0] != 0
    # The client's reading of the answer: every ticket's grant is its own key's extent.
    reader = grants.GrantReader(grants.open_batch_unverified, check=True)
    tickets = [PutTicket.from_wire(r[1], reader) for r in reply[:-1]]
    assert [t.locations[0].grant.key for t in tickets] == keys[:-1]
    placed = [PendingPut.of(t.put_id, live.svc.puts.pending[t.put_id]).replicas[0] for t in tickets]
    for t, r in zip(tickets, placed, strict=True):
        g = t.locations[0].grant
        assert (g.op, g.segment, g.offset, g.size, g.expires_ms) == (
            "w",
            "dram0",
            r.offset,
            8,
            r.stamp,
        )
    # The node's: one batch per chunk, each verified once, every key's write grant in order.
    node = grants.VerifiedGrants(b"s" * 32)
    verified = grants.GrantReader(
        lambda b: node.check_batch(b, grants.OP_WRITE, int(time.time() * 1000)), check=False
    )
    wires = [r[1][1][0][3] for r in reply[:-1]]
    assert sum(len(w) == 3 for w in wires) == 3  # one batch per chunk of CHUNK_ITEMS
    assert [verified.resolve(w).offset for w in wires] == [r.offset for r in placed]
    ids = [t.put_id for t in tickets]
    assert conn.call("put_end", {"put_ids": ids, "checksums": [1] * n}) == [[0, None]] * n
    with pytest.raises(InvalidRequestError, match="batch_grants"):
        conn.call("put_start", {"keys": [b"x"], "sizes": [8], "batch_grants": "yes"})


def test_a_bad_item_anywhere_in_a_chunked_batch_changes_nothing(live: Live) -> None:
    conn = live.connect()
    n = CHUNK_ITEMS * 3
    keys = [b"bad%d" % i for i in range(n)]
    ids = _put_ids(conn, keys)
    with pytest.raises(InvalidRequestError):
        conn.call("put_end", {"put_ids": ids, "checksums": [1] * (n - 1) + ["x"]})
    assert conn.call("exists", {"keys": keys}) == [False] * n  # no chunk was committed
    with pytest.raises(InvalidRequestError):
        conn.call("put_start", {"keys": keys, "sizes": [8] * (n - 1) + [None]})


def test_prompts_over_the_block_limit_are_refused_and_commit_nothing(live: Live) -> None:
    conn = live.connect()
    tokens = np.arange(MAX_PROMPT_BLOCKS + 1, dtype=np.uint32)
    keys = [kv_object_key(NS.digest, k) for k in block_keys(NS, tokens[:4])]
    ids = _put_ids(conn, keys, kv=True)
    args = {"namespace": NS.to_dict(), "tokens": tokens_to_wire(tokens)}
    with pytest.raises(InvalidRequestError, match="limit"):
        conn.call("kv_commit", {**args, "put_ids": ids, "checksums": [1] * len(ids)})
    assert conn.call("exists", {"keys": keys}) == [False] * len(keys)
    with pytest.raises(InvalidRequestError, match="limit"):
        conn.call("kv_match", args)
    # At the limit it is served (in chunks), and indexes what was committed.
    at_limit = {"namespace": NS.to_dict(), "tokens": tokens_to_wire(tokens[:-1])}
    done = conn.call("kv_commit", {**at_limit, "put_ids": ids, "checksums": [1] * len(ids)})
    assert done == {"results": [[0, None]] * len(ids)}
    assert conn.call("kv_match", at_limit)["num_tokens"] == len(ids)
    # A lookup (``locate: false``) of a long prompt, served in steps too: no locations, so no
    # read leases, as for a short one.
    leased = live.svc.leases.num_outstanding
    looked = conn.call("kv_match", {**at_limit, "locate": False})
    assert looked["num_tokens"] == len(ids) and [b[2] for b in looked["blocks"]] == [None] * 4
    assert live.svc.leases.num_outstanding == leased
    with pytest.raises(InvalidRequestError):  # over max_batch, as before
        conn.call("exists", {"keys": [b"k"] * (live.svc.config.max_batch + 1)})


def test_a_small_call_is_served_while_a_max_size_batch_is_in_progress(live: Live) -> None:
    """Another client's exists() is answered between two chunks of a 65,536-key put_start,
    long before the batch's last chunk runs (progress and order, not wall-clock bounds)."""
    svc = live.svc
    events: list[str] = []
    small_sent = threading.Event()
    put_start, exists = svc.put_start, svc.exists

    def traced_put_start(*a: Any, **kw: Any) -> Any:
        events.append("big chunk")
        if len(events) == 2:  # the batch is under way: let the small call arrive now
            assert small_sent.wait(timeout=60)
        return put_start(*a, **kw)

    def traced_exists(keys: Any) -> Any:
        events.append("small")
        return exists(keys)

    svc.put_start = traced_put_start  # type: ignore[method-assign]
    svc.exists = traced_exists  # type: ignore[method-assign]
    n = svc.config.max_batch
    replies: list[str] = []

    def big() -> None:
        conn = live.connect()
        reply = conn.call("put_start", {"keys": [b"b%d" % i for i in range(n)], "sizes": [8] * n})
        assert len(reply) == n
        replies.append("big")

    def small() -> None:
        conn = live.connect()
        req_id = conn.send_request("exists", {"keys": [b"b0"]})
        small_sent.set()
        response, _ = conn.read_response()
        assert response.req_id == req_id and response.unwrap() == [False]
        replies.append("small")

    threads = [threading.Thread(target=big), threading.Thread(target=small)]
    threads[0].start()
    threads[1].start()
    for t in threads:
        t.join(timeout=300)
        assert not t.is_alive()
    chunks = n // CHUNK_ITEMS
    assert events.count("big chunk") == chunks
    # Served a few chunks after it arrived, far from the end of the batch.
    assert events.index("small") < chunks // 2, events.index("small")
    assert replies == ["small", "big"]


def test_a_hello_sent_in_time_survives_a_stall_of_the_master() -> None:
    """Deadlines measure the peer, not us: a hello that arrived while the master's loop was
    stalled past the hello deadline is still served."""
    svc = MasterService(MasterConfig())
    token = auth.Token("stall-test-token-0123456789abcdef")
    # The daemons' loop: uvloop runs due timers (our sweeper) before it reads sockets.
    uvloop = pytest.importorskip("uvloop")
    loop = uvloop.new_event_loop()
    server = ControlServer(ServiceSlot(svc), "127.0.0.1", 0, token=token)
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    asyncio.run_coroutine_threadsafe(server.start(), loop).result(timeout=30)
    try:
        conn = protocol.FramedSocket.connect("127.0.0.1", server.port, timeout=60)
        wait_until(lambda: len(server.pending) == 1, timeout=30, what="the connection accepted")
        stall = auth.HELLO_TIMEOUT_S + 2 * SWEEP_INTERVAL_S + 1
        loop.call_soon_threadsafe(time.sleep, stall)  # the loop stalls (a GC pause, say)
        auth.hello(conn, token)  # sent at once; answered once the loop runs again
        assert conn.call("ping", {})["role"] == "master"
        conn.close()
    finally:
        asyncio.run_coroutine_threadsafe(server.stop(), loop).result(timeout=30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=30)
        loop.close()


@pytest.mark.parametrize("n", [0, 1, 15, 16, 255, 256, (1 << 16) - 1, 1 << 16])
def test_a_chunk_packs_like_its_items_one_by_one(n: int) -> None:
    """Chunks are packed in one call and joined under one array header: the bytes must be
    those of packing every item alone (whatever the chunk's own header length)."""
    items = [[0, [i, [b"x" * (i % 7)]]] for i in range(n)]
    assert pack_items(items) == b"".join(map(PACK.pack, items))


def test_piggybacked_releases_are_given_back_a_chunk_a_turn() -> None:
    """A client piggybacks thousands of lease tokens after a big read: they are all given back
    before the verb runs, at most a chunk of them per turn of the loop."""
    svc = MasterService(MasterConfig())
    svc.register("n1", "127.0.0.1", 9, b"s" * 32, [SegmentSpec("dram0", "dram", 1 << 30)])
    n = 3 * CHUNK_ITEMS + 7
    keys = [b"k%d" % i for i in range(n)]
    tickets = svc.put_start(keys, [8] * n)
    svc.put_end([t.put_id for t in tickets], [1] * n)  # type: ignore[union-attr]
    tokens = [i.lease for i in svc.get_locations(keys)]  # type: ignore[union-attr]
    assert svc.leases.num_outstanding == n
    released: list[int] = []
    release_leases = svc.release_leases

    def traced(batch: Any) -> Any:
        released.append(len(batch))
        return release_leases(batch)

    svc.release_leases = traced  # type: ignore[method-assign]
    request = protocol.Request(1, "exists", {"keys": [b"k0"], "release": tokens})
    reply = asyncio.run(dispatch_bounded(svc, request, chunk_items=CHUNK_ITEMS))
    assert protocol.decode_response(reply[protocol.HEADER_SIZE :]).unwrap() == [True]
    assert svc.leases.num_outstanding == 0 and sum(released) == n
    assert max(released) <= CHUNK_ITEMS, released


@pytest.mark.parametrize(("blocks", "stepped"), [(4, False), (5, True)])
def test_a_prompt_of_more_blocks_than_a_chunk_is_indexed_and_matched_in_steps(
    blocks: int, stepped: bool
) -> None:
    """A ``kv_commit`` whose prompt fits a chunk is served in one go, even with a put to
    commit (no turn of the loop in between); a longer prompt is indexed a chunk of blocks a
    turn, however few puts it commits. ``kv_match`` likewise. Both answer the same."""
    svc = MasterService(MasterConfig())
    svc.register("n1", "127.0.0.1", 9, b"s" * 32, [SegmentSpec("dram0", "dram", 1 << 30)])
    tokens = np.arange(blocks, dtype=np.uint32)
    keys = [kv_object_key(NS.digest, k) for k in block_keys(NS, tokens)]
    ids = [t.put_id for t in svc.put_start(keys, [8] * blocks, kv_blocks=True)]  # type: ignore[union-attr]
    svc.put_end(ids[:-1], [1] * (blocks - 1))
    calls: list[str] = []
    for name in ("kv_commit", "kv_index_steps", "kv_match", "kv_match_steps"):
        method = getattr(svc, name)
        setattr(svc, name, lambda *a, _m=method, _n=name, **k: calls.append(_n) or _m(*a, **k))
    prompt = {"namespace": NS.to_dict(), "tokens": tokens_to_wire(tokens)}

    def call(verb: str, args: dict[str, Any]) -> Any:
        request = protocol.Request(1, verb, args)
        reply = asyncio.run(dispatch_bounded(svc, request, chunk_items=4))
        return protocol.decode_response(reply[protocol.HEADER_SIZE :]).unwrap()

    done = call("kv_commit", {**prompt, "put_ids": ids[-1:], "checksums": [1]})
    assert done == {"results": [[0, None]]}
    assert calls == (["kv_index_steps"] if stepped else ["kv_commit"])
    calls.clear()
    matched = call("kv_match", prompt)
    assert matched["num_tokens"] == blocks and [b[0] for b in matched["blocks"]] == keys
    assert calls == (["kv_match_steps"] if stepped else ["kv_match"])


def test_event_snapshots_in_flight_are_capped_and_a_reader_that_never_reads_lets_go(
    live: Live, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each snapshot answer may be tens of MB: subscribers that ask and never read hold at most
    SNAPSHOTS_IN_FLIGHT of them; one more is refused OVERLOADED (the client's event stream
    retries), and a slot comes back when its reader hangs up or misses the write timeout."""
    from kvstore.errors import OverloadedError
    from kvstore.master import server as master_server

    monkeypatch.setattr(master_server, "SNAPSHOTS_IN_FLIGHT", 2)
    blob = bytes(16 * 1_000_000)  # a million blocks: far more than the sockets buffer
    monkeypatch.setattr(live.svc.prefix, "snapshot", lambda: (1, 7, {b"n" * 16: blob}))
    idle = [live.connect() for _ in range(2)]
    for conn in idle:
        conn.send_request("events_snapshot", {})  # ... and never read the answer
    asker = live.connect()

    def refused() -> bool:
        try:
            asker.call("events_snapshot", {})
        except OverloadedError:
            return True
        return False

    try:
        wait_until(refused, timeout=30, what="a third snapshot refused")
        idle[0].close()  # a slot comes back when its reader hangs up ...
        wait_until(lambda: not refused(), timeout=30, what="a snapshot answered again")
        # ... or when it does not read within the write timeout.
        late = None
        monkeypatch.setattr(master_server, "SNAPSHOT_WRITE_TIMEOUT_S", 0.2)
        late = live.connect()
        late.send_request("events_snapshot", {})
        wait_until(lambda: live.server._snapshots == 2, timeout=30, what="both slots held")
        wait_until(lambda: live.server._snapshots == 1, timeout=30, what="the late one's slot back")
        late.sock.settimeout(0.5)

        def cut() -> bool:
            try:
                return late.sock.recv(1 << 20) == b""
            except TimeoutError:
                return False
            except ConnectionResetError:
                return True

        wait_until(cut, timeout=30, what="the late reader's connection cut")
    finally:
        for conn in [*idle, asker, late]:
            if conn is not None:
                conn.close()


def test_pipelined_requests_are_answered_once_in_order_and_an_unread_peer_stops_nobody(
    live: Live,
) -> None:
    """A client may send many requests before it reads an answer (the client's pipeline does).
    Each is answered once, in order, a batch served in chunks among them included; a peer that
    does not read its answers is paused (the master stops answering it, then reading it), and
    meanwhile another connection is served; once it reads, every answer is there."""
    keys = [b"%03d" % i + b"x" * 500 for i in range(200)]
    setup = live.connect()
    ids = _put_ids(setup, keys)
    setup.call("put_end", {"put_ids": ids, "checksums": [1] * len(ids)})
    listed = setup.call("list_keys", {"prefix": b"", "limit": 200})
    assert listed == keys
    chunked = [b"c%d" % i for i in range(CHUNK_ITEMS * 3 + 1)]
    # ~100 KB answers: far more than the socket buffers and the transport's high-water mark.
    plan = ["list"] * 200 + ["chunked"] + ["list"] * 200
    flood = live.connect()
    first = flood.next_id() + 1  # (the ids the sender's requests take, in order)

    def send_all() -> None:
        for kind in plan:
            if kind == "chunked":
                flood.send_request("exists", {"keys": chunked})
            else:
                flood.send_request("list_keys", {"prefix": b"", "limit": 200})

    sender = threading.Thread(target=send_all, daemon=True)
    sender.start()
    wait_until(
        lambda: any(c._writing_paused for c in live.server._conns),
        timeout=60,
        what="the master pauses the peer that does not read",
    )
    other = live.connect()
    assert other.call("exists", {"keys": [keys[0], b"nope"]}) == [True, False]
    for i, kind in enumerate(plan):
        response, payload_len = flood.read_response()
        assert response.req_id == first + i and payload_len == 0
        assert response.unwrap() == ([False] * len(chunked) if kind == "chunked" else keys)
    sender.join(timeout=60)
    assert not sender.is_alive()
    assert other.call("exists", {"keys": [keys[-1]]}) == [True]
