"""The HA control channel (kvstore.client.leader.LeaderChannel) against scripted masters and a
resolver of our own: every call carries its leader's epoch, a leader change or a silent leader
moves the call to the next leader, a pinned call never moves, and other errors are not retried."""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from kvstore import protocol
from kvstore.address import Address
from kvstore.client.leader import LeaderChannel
from kvstore.errors import (
    KeyNotFoundError,
    KVStoreError,
    MasterUnavailableError,
    NotLeaderError,
    StaleEpochError,
)
from kvstore.etcd_keys import LeaderRecord

WAIT_S = 10.0
Handler = Callable[[str, dict[str, Any]], Any]


class ScriptedMaster:
    """A listening socket answering each request with ``handler(verb, args)`` (an error it
    returns is sent as one); ``calls`` records every request."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = Address("127.0.0.1", self.listener.getsockname()[1])
        self.calls: list[tuple[str, dict[str, Any]]] = []
        self.num_connections = 0
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        while True:
            try:
                sock, _ = self.listener.accept()
            except OSError:
                return
            self.num_connections += 1
            t = threading.Thread(target=self._serve, args=(sock,), daemon=True)
            self._threads.append(t)
            t.start()

    def _serve(self, sock: socket.socket) -> None:
        fs = protocol.FramedSocket(sock)
        try:
            while not self._stop.is_set():
                header = fs.read_header()
                req = protocol.decode_request(fs.read_body(header))
                self.calls.append((req.verb, req.args))
                answer = self.handler(req.verb, req.args)
                if isinstance(answer, KVStoreError):
                    fs.send_frame(protocol.encode_error(req.req_id, answer))
                else:
                    fs.send_frame(protocol.encode_response(req.req_id, answer))
        except (ConnectionError, OSError):
            pass
        finally:
            sock.close()

    def verbs(self) -> list[str]:
        return [v for v, _ in self.calls]

    def close(self) -> None:
        self._stop.set()
        self.listener.close()
        for t in self._threads:
            t.join(timeout=WAIT_S)


class FakeResolver:
    """Names the leaders in ``leaders`` in turn, one per resolve (the last one stays)."""

    def __init__(self, *leaders: LeaderRecord) -> None:
        self.leaders = list(leaders)
        self.num_resolves = 0

    def resolve(self, timeout: float, interval: float = 0.05) -> LeaderRecord:
        self.num_resolves += 1
        if not self.leaders:
            raise MasterUnavailableError("no leading master")
        return self.leaders.pop(0) if len(self.leaders) > 1 else self.leaders[0]

    def close(self) -> None:
        pass


def leader(master: ScriptedMaster, epoch: int) -> LeaderRecord:
    return LeaderRecord(master.address, "", epoch)


@pytest.fixture
def masters() -> Iterator[Callable[[Handler], ScriptedMaster]]:
    made: list[ScriptedMaster] = []

    def make(handler: Handler) -> ScriptedMaster:
        made.append(ScriptedMaster(handler))
        return made[-1]

    yield make
    for m in made:
        m.close()


def channel_with(resolver: FakeResolver, timeout: float = 2.0) -> LeaderChannel:
    channel = LeaderChannel("etcd://127.0.0.1:1", timeout)
    channel.resolver.close()
    channel.resolver = resolver  # type: ignore[assignment]
    return channel


def answers(result: Any) -> Handler:
    return lambda verb, args: result


def test_every_call_carries_its_leaders_epoch(
    masters: Callable[[Handler], ScriptedMaster],
) -> None:
    m = masters(lambda verb, args: {"verb": verb, "epoch": args["epoch"]})
    channel = channel_with(FakeResolver(leader(m, 5)))
    try:
        assert channel.call_epoch("stats", {}) == ({"verb": "stats", "epoch": 5}, 5)
        assert channel.call("list_keys", {"prefix": b""})["epoch"] == 5  # (its own connection)
        assert channel.resolver.num_resolves == 1, "the leader is remembered"  # type: ignore[attr-defined]
        assert channel.num_failovers == 0
    finally:
        channel.close()


@pytest.mark.parametrize("refusal", [NotLeaderError("not me"), StaleEpochError("old epoch")])
@pytest.mark.parametrize("verb", ["stats", "list_keys"], ids=["pipelined", "exclusive"])
def test_a_call_follows_a_leader_change(
    masters: Callable[[Handler], ScriptedMaster], refusal: KVStoreError, verb: str
) -> None:
    old = masters(answers(refusal))
    new = masters(lambda v, args: ["new", args["epoch"]])
    channel = channel_with(FakeResolver(leader(old, 5), leader(new, 6)))
    try:
        assert channel.call_epoch(verb, {}) == (["new", 6], 6)
        assert channel.num_failovers == 1 and (channel.epoch, channel.address) == (6, new.address)
        assert old.verbs() == [verb] and new.verbs() == [verb]
    finally:
        channel.close()


def test_a_silent_leader_is_left_for_the_next(
    masters: Callable[[Handler], ScriptedMaster],
) -> None:
    release = threading.Event()

    def silent(verb: str, args: dict[str, Any]) -> Any:
        release.wait(WAIT_S)
        return "too late"

    old = masters(silent)
    new = masters(answers("answered"))
    channel = channel_with(FakeResolver(leader(old, 5), leader(new, 6)), timeout=0.3)
    try:
        assert channel.call_epoch("stats", {}) == ("answered", 6)
    finally:
        release.set()
        channel.close()


def test_a_pinned_call_never_moves_to_another_leader(
    masters: Callable[[Handler], ScriptedMaster],
) -> None:
    old = masters(answers(NotLeaderError("deposed")))
    new = masters(answers("wrong leader"))
    channel = channel_with(FakeResolver(leader(old, 5), leader(new, 6)))
    try:
        with pytest.raises(NotLeaderError):
            channel.call("put_end", {"put_ids": [1]}, pin_epoch=5)
        # The next pinned call finds the new leader and refuses before sending anything.
        with pytest.raises(StaleEpochError):
            channel.call("put_end", {"put_ids": [1]}, pin_epoch=5)
        assert new.verbs() == [], "a put id means nothing to another leader"
    finally:
        channel.close()


def test_a_masters_own_error_is_not_retried(
    masters: Callable[[Handler], ScriptedMaster],
) -> None:
    m = masters(answers(KeyNotFoundError("no such key")))
    channel = channel_with(FakeResolver(leader(m, 5)))
    try:
        with pytest.raises(KeyNotFoundError):
            channel.call("remove", {"keys": [b"k"]})
        assert m.verbs() == ["remove"] and channel.num_failovers == 0
        assert channel.resolver.num_resolves == 1  # type: ignore[attr-defined]
    finally:
        channel.close()


def test_no_leader_within_the_failover_timeout_is_master_unavailable() -> None:
    channel = channel_with(FakeResolver(), timeout=0.3)
    try:
        with pytest.raises(MasterUnavailableError):
            channel.call("stats", {})
        assert channel.resolver.num_resolves >= 1  # type: ignore[attr-defined]
    finally:
        channel.close()


def test_a_leader_that_is_gone_is_looked_up_again(
    masters: Callable[[Handler], ScriptedMaster],
) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        gone = LeaderRecord(Address("127.0.0.1", s.getsockname()[1]), "", 5)
    new = masters(answers("here"))
    channel = channel_with(FakeResolver(gone, leader(new, 6)))
    try:
        assert channel.call_epoch("stats", {}) == ("here", 6)
    finally:
        channel.close()
