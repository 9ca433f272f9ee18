"""The control-channel interface (kvstore.client.control): both channels implement it, the
address picks one, and overlapped work runs while (fixed) or before (HA) the master answers."""

from __future__ import annotations

import inspect
from typing import Any

import pytest

from kvstore.address import Address
from kvstore.client.control import ControlChannel, FixedChannel, open_channel
from kvstore.client.leader import LeaderChannel
from kvstore.errors import InvalidRequestError

PROTOCOL_METHODS = ("call", "call_epoch", "call_overlapped", "close")
PROTOCOL_ATTRIBUTES = ("timeout", "epoch", "releases")


@pytest.mark.parametrize("address", ["127.0.0.1:7700", "etcd://127.0.0.1:2379"])
def test_both_channels_implement_the_interface(address: str) -> None:
    channel = open_channel(address, 1.0, None)  # (connects on first use only)
    try:
        for name in PROTOCOL_METHODS:
            want = inspect.signature(getattr(ControlChannel, name))
            got = inspect.signature(getattr(type(channel), name))
            assert list(got.parameters) == list(want.parameters), (type(channel).__name__, name)
        for name in PROTOCOL_ATTRIBUTES:
            assert hasattr(channel, name), (type(channel).__name__, name)
    finally:
        channel.close()


def test_the_address_picks_the_channel() -> None:
    fixed = open_channel("127.0.0.1:7700", 1.0, None)
    assert isinstance(fixed, FixedChannel) and fixed.address == Address("127.0.0.1", 7700)
    fixed.close()
    ha = open_channel("etcd://127.0.0.1:2379", 1.0, None)
    try:
        assert isinstance(ha, LeaderChannel)
    finally:
        ha.close()
    with pytest.raises(InvalidRequestError):
        open_channel("no port", 1.0, None)


def test_the_fixed_channel_runs_work_while_the_master_answers(cluster_factory) -> None:
    cluster = cluster_factory(num_nodes=0)
    channel = FixedChannel(Address.parse(cluster.address), 5.0)
    try:
        ran: list[str] = []
        reply, epoch = channel.call_overlapped("ping", {}, lambda: ran.append("work"))
        assert ran == ["work"] and epoch is None and reply["role"] == "master"

        def fails() -> None:
            raise RuntimeError("the work's error wins")

        with pytest.raises(RuntimeError, match="the work's error wins"):
            channel.call_overlapped("ping", {}, fails)
        assert channel.call("ping", {})["role"] == "master"  # (the answer was read and dropped)
        assert channel.num_connects == 1
    finally:
        channel.close()


def test_the_leader_channel_runs_work_then_the_call(monkeypatch) -> None:
    channel = LeaderChannel("etcd://127.0.0.1:2379", 1.0)
    order: list[str] = []

    def call_epoch(verb: str, args: dict[str, Any], pin_epoch: int | None = None) -> Any:
        order.append(verb)
        return "answer", 3

    monkeypatch.setattr(channel, "call_epoch", call_epoch)
    try:
        got = channel.call_overlapped("put_start", {}, lambda: order.append("work"))
        assert got == ("answer", 3) and order == ["work", "put_start"]
    finally:
        channel.close()
