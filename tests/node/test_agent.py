"""The node's master link (kvstore.node.agent.MasterLink) against a scripted master: what a
registration offers and claims, what a heartbeat carries and what its reply makes the node do
(forget, run tasks and report them, register again, retire)."""

from __future__ import annotations

import logging
import queue
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvstore import grants, protocol
from kvstore.address import Address
from kvstore.errors import ErrorCode, ForbiddenError, KVStoreError, NodeUnavailableError
from kvstore.node.agent import MasterLink
from kvstore.node.arena import ShmArena
from kvstore.node.nvme import NvmeTier
from kvstore.node.server import DataServer
from kvstore.node.tiers import checksum_of
from kvstore.stored_object import StoredObject
from kvstore.types import SegmentSpec
from tests.support import wait_until

WAIT_S = 10.0
BEAT_S = 0.02
SIZE = 1 << 16


class Scripted:
    """An answer queued for a call: which call it answered (``seq``), and when it was sent."""

    def __init__(self, answer: Any) -> None:
        self.answer = answer
        self.seq = -1
        self.sent = threading.Event()


class FakeMaster:
    """A listening socket that answers ``register`` and ``heartbeat`` like a master would.

    Every call lands in :attr:`calls`, its args with ``_conn`` added (the connection's number,
    from 1); :meth:`script` queues the answers (or errors) of the next calls of a verb, which
    otherwise answer a short heartbeat interval (``register``) or ``{}`` (``heartbeat``).
    ``hang_up`` closes the connection after the next answer.
    """

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = Address("127.0.0.1", self.listener.getsockname()[1])
        #: Every call, in order; next_call reads from a cursor.
        self.calls: list[tuple[str, dict[str, Any]]] = []
        self._cursor = 0
        self._arrived = threading.Condition()
        self._scripts: dict[str, queue.Queue[Scripted]] = {
            "register": queue.Queue(),
            "heartbeat": queue.Queue(),
        }
        self.hang_up = threading.Event()
        self.num_connections = 0
        self._stopped = threading.Event()
        self._threads: list[threading.Thread] = []
        self._accept = threading.Thread(target=self._run, daemon=True)
        self._accept.start()

    def _run(self) -> None:
        while True:
            try:
                sock, _ = self.listener.accept()
            except OSError:
                return
            self.num_connections += 1
            t = threading.Thread(target=self._serve, args=(sock, self.num_connections), daemon=True)
            self._threads.append(t)
            t.start()

    def script(self, verb: str, answer: Any) -> Scripted:
        """Answer the next ``verb`` call with ``answer`` (after those scripted before)."""
        scripted = Scripted(answer)
        self._scripts[verb].put(scripted)
        return scripted

    def _answer(self, verb: str, seq: int) -> tuple[Any, Scripted | None]:
        try:
            scripted = self._scripts[verb].get_nowait()
        except queue.Empty:
            return ({"heartbeat_interval_s": BEAT_S} if verb == "register" else {}), None
        scripted.seq = seq
        return scripted.answer, scripted

    def _serve(self, sock: socket.socket, conn_number: int) -> None:
        fs = protocol.FramedSocket(sock)
        try:
            while not self._stopped.is_set():
                header = fs.read_header()
                req = protocol.decode_request(fs.read_body(header))
                with self._arrived:
                    seq = len(self.calls)
                    self.calls.append((req.verb, {**req.args, "_conn": conn_number}))
                    self._arrived.notify_all()
                answer, sent = self._answer(req.verb, seq)
                if isinstance(answer, KVStoreError):
                    fs.send_frame(protocol.encode_error(req.req_id, answer))
                else:
                    fs.send_frame(protocol.encode_response(req.req_id, answer))
                if sent is not None:
                    sent.sent.set()
                if self.hang_up.is_set():
                    self.hang_up.clear()
                    return
        except (ConnectionError, OSError):
            pass
        finally:
            sock.close()

    def next_call(
        self, verb: str, where: Callable[[dict[str, Any]], bool] = lambda a: True
    ) -> dict[str, Any]:
        """The args of the next ``verb`` call that satisfies ``where`` (waiting at most WAIT_S)."""
        deadline = time.monotonic() + WAIT_S
        with self._arrived:
            while True:
                while self._cursor < len(self.calls):
                    got, args = self.calls[self._cursor]
                    self._cursor += 1
                    if got == verb and where(args):
                        return args
                left = deadline - time.monotonic()
                assert left > 0, f"no {verb} call in {WAIT_S}s"
                self._arrived.wait(left)

    def more_calls_within(self, num_calls: int, timeout: float) -> bool:
        """Whether ``num_calls`` calls in all arrive within ``timeout`` seconds."""
        with self._arrived:
            return self._arrived.wait_for(lambda: len(self.calls) >= num_calls, timeout)

    def next_call_after(self, scripted: Scripted, verb: str) -> dict[str, Any]:
        """The args of the first ``verb`` call after the one ``scripted`` answered (the link
        acts on an answer before it sends its next call)."""
        assert scripted.sent.wait(WAIT_S), "the scripted answer was never sent"
        with self._arrived:
            self._cursor = max(self._cursor, scripted.seq + 1)
        return self.next_call(verb)

    def close(self) -> None:
        self._stopped.set()
        self.listener.close()
        for t in self._threads:
            t.join(timeout=WAIT_S)


class NodeRig:
    """A data server (DRAM, optionally NVMe) and its master link, stopped in order."""

    def __init__(self, tmp: Path, master: FakeMaster, nvme: bool = False) -> None:
        self.arena = ShmArena(tmp / "arena", SIZE, prefault=False)
        self.nvme = NvmeTier(tmp / "nvme", 1 << 20) if nvme else None
        tiers = {"nvme": self.nvme} if self.nvme is not None else {}
        self.server = DataServer({"dram": self.arena}, grants.new_secret(), tiers=tiers)
        self.server.start()
        segments = [SegmentSpec("dram", "dram", SIZE, str(self.arena.path))]
        if self.nvme is not None:
            segments.append(SegmentSpec("nvme", "nvme", 1 << 20))
        self.segments = segments
        self.link = MasterLink(
            master.address,
            "node-a",
            "10.0.0.7",
            self.server,
            segments,
            transports={"shm": {"dram": str(self.arena.path)}},
            identity=b"i" * 32,
        )
        self.started = False

    def start(self) -> None:
        self.link.start()
        self.started = True

    def put_dram(self, offset: int, key: bytes, data: bytes, stamp: int = 1) -> StoredObject:
        obj = StoredObject("dram", offset, key, len(data), checksum_of(data), stamp)
        assert self.server.store_objects("dram", [(obj, memoryview(data))]) == [None]
        return obj

    def close(self) -> None:
        if self.started:
            self.link.stop()
        self.server.stop()
        self.arena.close()
        if self.nvme is not None:
            self.nvme.close()


def test_registration_offers_the_node_and_a_fresh_secret(rig: NodeRig, master: FakeMaster) -> None:
    old_secret = rig.server.secret
    master.script("register", {"heartbeat_interval_s": 0.5, "admission": {"num_admitted": 0}})
    rig.start()
    args = master.next_call("register")
    assert rig.link.registered.wait(WAIT_S)
    assert args["node_id"] == "node-a" and args["host"] == "10.0.0.7"
    assert args["port"] == rig.server.port
    assert [SegmentSpec.from_wire(s) for s in args["segments"]] == rig.segments
    assert args["transports"] == {"shm": {"dram": str(rig.arena.path)}}
    assert args["identity"] == b"i" * 32
    assert args["secret"] == rig.server.secret != old_secret, "no grant of an earlier life opens"
    assert "manifest" not in args, "nothing durable to claim"
    assert rig.link.heartbeat_interval_s == 0.5
    assert rig.link.last_admission == {"num_admitted": 0}


def test_a_fresh_registration_drops_what_only_dram_held(rig: NodeRig, master: FakeMaster) -> None:
    rig.put_dram(0, b"old", b"bytes of an earlier master")
    rig.start()
    master.next_call("register")
    assert rig.link.registered.wait(WAIT_S)
    assert rig.server.manifest.objects() == []


def test_a_durable_tier_claims_its_objects(tmp_path: Path, master: FakeMaster) -> None:
    rig = NodeRig(tmp_path, master, nvme=True)
    try:
        data = b"kept across restarts"
        kept = StoredObject("nvme", 7, b"durable", len(data), checksum_of(data), 3)
        assert rig.server.store_objects("nvme", [(kept, memoryview(data))]) == [None]
        rig.put_dram(0, b"volatile", b"gone on restart")
        rig.start()
        args = master.next_call("register")
        assert [StoredObject.from_wire(c) for c in args["manifest"]] == [kept]
        assert rig.server.manifest.objects() == [kept]
    finally:
        rig.close()


def test_heartbeats_carry_the_node_and_apply_forgets(rig: NodeRig, master: FakeMaster) -> None:
    rig.start()
    master.next_call("register")
    assert rig.link.registered.wait(WAIT_S)
    a = rig.put_dram(0, b"a", b"AAAA", stamp=5)
    b = rig.put_dram(64, b"b", b"BBBB", stamp=6)
    # A forget naming another version of b's place leaves b alone (the place was reused).
    sent = master.script("heartbeat", {"forget": [["dram", 0, 5], ["dram", 64, 99]]})
    beat = master.next_call_after(sent, "heartbeat")
    assert beat["node_id"] == "node-a" and beat["identity"] == b"i" * 32
    assert beat["done"] == []
    assert rig.server.manifest.objects() == [b] and a != b


def test_tasks_run_and_are_reported_in_the_next_heartbeat(rig: NodeRig, master: FakeMaster) -> None:
    data = b"move me to another place"
    rig.put_dram(0, b"m", data)
    move = {
        "id": 11,
        "kind": "move",
        "key": b"m",
        "size": len(data),
        "checksum": checksum_of(data),
        "src": ["dram", 0],
        "dst": ["dram", 4096],
        "stamp": 9,
    }
    bogus = {
        "id": 12,
        "kind": "teleport",
        "key": b"x",
        "size": 1,
        "checksum": 0,
        "dst": ["dram", 0],
    }
    rig.start()
    master.next_call("register")  # (it dropped the DRAM record: a fresh master knows none)
    sent = master.script("heartbeat", {"tasks": [move, bogus]})
    beat = master.next_call_after(sent, "heartbeat")
    done = {d[0]: d[1] for d in beat["done"]}
    assert done == {11: 0, 12: ErrorCode.INVALID_REQUEST}
    assert bytes(rig.arena.view[4096 : 4096 + len(data)]) == data
    assert rig.server.manifest.objects() == [
        StoredObject("dram", 4096, b"m", len(data), checksum_of(data), 9)
    ]
    assert master.next_call("heartbeat")["done"] == [], "a result is reported once"


def test_a_master_that_forgot_the_node_gets_a_new_registration(
    rig: NodeRig, master: FakeMaster
) -> None:
    rig.start()
    first = master.next_call("register")
    master.script("heartbeat", NodeUnavailableError("unknown node"))
    second = master.next_call("register")
    assert second["secret"] != first["secret"]
    assert master.num_connections == 1, "registered again on the same connection"
    master.next_call("heartbeat")
    assert rig.link.registered.is_set()


def test_a_refused_registration_is_retried(rig: NodeRig, master: FakeMaster) -> None:
    master.script("register", ForbiddenError("node id bound to another key"))
    rig.start()
    master.next_call("register")
    master.next_call("register")  # after a backoff, on a new connection
    assert rig.link.registered.wait(WAIT_S)
    assert master.num_connections == 2


def test_a_lost_connection_registers_again(rig: NodeRig, master: FakeMaster) -> None:
    rig.start()
    master.next_call("register")
    master.hang_up.set()
    master.next_call("register")
    assert rig.link.registered.wait(WAIT_S)
    assert master.num_connections == 2


def test_a_retired_node_stops_its_link(rig: NodeRig, master: FakeMaster) -> None:
    master.script("heartbeat", {"retire": True})
    rig.start()
    assert rig.link.retired.wait(WAIT_S)
    master.next_call("heartbeat")
    # No call follows the heartbeat that retired it (a beating link would send one per BEAT_S).
    assert not master.more_calls_within(3, 10 * BEAT_S)
    assert [verb for verb, _ in master.calls] == ["register", "heartbeat"]


def test_an_unreachable_master_leaves_the_node_unregistered(rig: NodeRig) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    link = MasterLink(Address("127.0.0.1", port), "n", "h", rig.server, rig.segments)
    link.start()
    try:
        assert not link.registered.wait(0.3)
    finally:
        link.stop()


def test_a_master_not_there_yet_is_said_once_then_retried_quietly(
    rig: NodeRig, master: FakeMaster, caplog: pytest.LogCaptureFixture
) -> None:
    """A node started before its master: one line at once (which master, that it retries and
    for how long), each retry at DEBUG, then it registers when the master answers."""
    tries: list[int] = []
    with socket.create_server(("127.0.0.1", 0)) as refusing:  # accepts, then hangs up

        def hang_up() -> None:
            while True:
                try:
                    conn, _ = refusing.accept()
                except OSError:
                    return
                tries.append(1)
                conn.close()

        threading.Thread(target=hang_up, daemon=True).start()
        address = Address("127.0.0.1", refusing.getsockname()[1])
        link = MasterLink(address, "node-a", "h", rig.server, rig.segments)
        link.max_backoff_s = 0.02
        link.patience_s = 30.0
        with caplog.at_level(logging.DEBUG, logger="kvstore.node.agent"):
            link.start()
            try:
                wait_until(lambda: len(tries) >= 5, what="five tries")
                link.master = master.address  # the master is up now
                assert link.registered.wait(WAIT_S)
            finally:
                link.stop()
    said = [r for r in caplog.records if "unreachable" in r.getMessage()]
    loud = [r.getMessage() for r in said if r.levelno >= logging.INFO]
    assert len(loud) == 1, loud
    assert loud[0].startswith(f"master {address} unreachable ("), loud
    assert loud[0].endswith("); retrying every 0.02s at most for up to 30s, quietly"), loud
    assert len(said) - len(loud) >= 4  # the other tries, at DEBUG


# ---------------------------------------------------------------- with a resolver (HA)
class Leader:
    """The resolver of an HA node: the leader's address and epoch, as etcd would name them."""

    def __init__(self, master: FakeMaster, epoch: int) -> None:
        self.master = master
        self.epoch = epoch

    def __call__(self) -> tuple[Address, int]:
        return self.master.address, self.epoch


def ha_link(rig: NodeRig, leader: Leader) -> MasterLink:
    return MasterLink(
        leader.master.address, "node-a", "h", rig.server, rig.segments, resolver=leader
    )


def test_an_ha_registration_claims_only_what_reads_back_intact(
    rig: NodeRig, master: FakeMaster
) -> None:
    intact = rig.put_dram(0, b"intact", b"these bytes hold")
    rig.put_dram(64, b"torn", b"overwritten later")
    rig.arena.view[64:68] = b"XXXX"  # a newer allocation wrote over part of it
    link = ha_link(rig, Leader(master, 7))
    link.start()
    try:
        args = master.next_call("register")
    finally:
        link.stop()
    assert args["epoch"] == 7
    assert [StoredObject.from_wire(c) for c in args["manifest"]] == [intact]
    assert rig.server.manifest.objects() == [intact], "the torn record is forgotten"


def test_the_same_leader_is_resumed_a_new_one_registered_with_a_new_secret(
    rig: NodeRig, master: FakeMaster
) -> None:
    leader = Leader(master, 7)
    link = ha_link(rig, leader)
    link.start()
    try:
        first = master.next_call("register")
        master.hang_up.set()  # the connection drops; the leader stays
        beat = master.next_call("heartbeat", lambda a: a["_conn"] == 2)
        assert beat["epoch"] == 7
        assert [v for v, _ in master.calls].count("register") == 1, "resumed, not re-registered"
        leader.epoch = 8  # a failover: the next connection finds a new term
        master.hang_up.set()
        second = master.next_call("register")
        assert second["epoch"] == 8
        assert second["secret"] != first["secret"], "grants of the deposed leader open nothing"
        assert master.next_call("heartbeat")["epoch"] == 8
    finally:
        link.stop()


def test_a_link_never_started_stops_quietly(rig: NodeRig, master: FakeMaster) -> None:
    """A node that fails between building its master link and starting it still shuts down."""
    rig.link.stop()
    assert master.num_connections == 0
