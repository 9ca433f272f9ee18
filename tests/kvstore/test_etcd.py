"""Our etcd interface against a real etcd: compare-and-swap, leases, watches, bounded connects."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from kvstore.address import Address
from kvstore.errors import EtcdUnavailableError, InvalidRequestError
from kvstore.etcd import EtcdStore, EtcdThread, parse_endpoints, prefix_end
from kvstore.etcd_keys import EtcdLayout, LeaderRecord, read_leader, read_members
from tests.etcd_harness import etcd, free_port  # noqa: F401 - fixture


def test_parse_endpoints() -> None:
    assert parse_endpoints("etcd://a:1,b:2") == [Address("a", 1), Address("b", 2)]
    assert parse_endpoints("127.0.0.1:2379") == [Address("127.0.0.1", 2379)]
    for bad in ("", "etcd://", "a", "a:b", "a:0", "a:1,b"):
        with pytest.raises(InvalidRequestError):
            parse_endpoints(bad)
    assert prefix_end(b"/a/") == b"/a0"
    assert prefix_end(b"\xff") == b"\0"


def test_unreachable_etcd_fails_after_bounded_tries() -> None:
    dead = Address("127.0.0.1", free_port())
    t0 = time.monotonic()
    with pytest.raises(EtcdUnavailableError, match="unreachable after 3 tries"):
        asyncio.run(EtcdStore.connect([dead], attempts=3, backoff_s=0.05, op_timeout=1.0))
    assert time.monotonic() - t0 < 30  # bounded (a generous ceiling, not a timing assertion)


def test_kv_cas_leases_and_watch(etcd) -> None:  # noqa: F811
    async def run() -> None:
        # A dead endpoint first: the store moves on to the live one.
        dead = Address("127.0.0.1", free_port())
        store = await EtcdStore.connect(
            [dead, Address.parse(etcd.endpoint)], attempts=4, backoff_s=0.05
        )
        try:
            lease = await store.grant_lease(2)
            won, kv = await store.create_if_absent(b"/t/leader", b"me", lease.lease_id)
            assert won and kv is not None and kv.value == b"me" and kv.lease == lease.lease_id
            again, holder = await store.create_if_absent(b"/t/leader", b"you", 0)
            assert not again and holder == kv
            assert not await store.delete_if_created_at(b"/t/leader", kv.create_revision + 1)

            watch = await store.watch(b"/t/", prefix=True)
            await store.put(b"/t/x", b"1")
            events = watch.events()
            first = await asyncio.wait_for(events.__anext__(), 5)
            assert (first.kind, first.kv.key) == ("put", b"/t/x")

            assert await store.keep_alive(lease.lease_id) > 0
            await store.revoke_lease(lease.lease_id)
            assert await store.get(b"/t/leader") is None  # the key went with its lease
            assert await store.keep_alive(lease.lease_id) == 0
            second = await asyncio.wait_for(events.__anext__(), 5)
            assert (second.kind, second.kv.key) == ("delete", b"/t/leader")
            await watch.cancel()

            assert [k.key for k in await store.get_prefix(b"/t/")] == [b"/t/x"]
            await store.delete_prefix(b"/t/")
            assert await store.get_prefix(b"/t/") == []
        finally:
            await store.close()

    asyncio.run(run())


def test_foreign_records_are_ignored(etcd) -> None:  # noqa: F811
    layout = EtcdLayout("/kv")

    async def run() -> None:
        store = await EtcdStore.connect([Address.parse(etcd.endpoint)])
        try:
            await store.put(layout.leader_key, b"not json")
            assert await read_leader(store, layout) is None  # no lease, not ours
            lease = await store.grant_lease(5)
            await store.put(layout.leader_key, b"{}", lease.lease_id)
            assert await read_leader(store, layout) is None  # undecodable
            await store.put(layout.leader_key, LeaderRecord.encode("h:1", "a"), lease.lease_id)
            rec = await read_leader(store, layout)
            assert rec is not None and rec.control == Address("h", 1) and rec.epoch > 0
            await store.put(layout.node_key("n1"), b'{"data": "h:2"}', lease.lease_id)
            await store.put(layout.node_key("junk"), b"\xff\x00", lease.lease_id)
            await store.put(layout.node_key("nolease"), b'{"data": "h:3"}')
            assert set(await read_members(store, layout)) == {"n1"}
        finally:
            await store.close()

    asyncio.run(run())


def test_a_call_cancelled_under_the_store_is_an_etcd_failure(etcd) -> None:  # noqa: F811
    """grpc cancels the calls of a channel that closes: that is etcd failing, not our caller
    cancelling (a leader's keep-alive once ended on it); a real cancellation still propagates."""

    async def run() -> None:
        store = await EtcdStore.connect([Address.parse(etcd.endpoint)], op_timeout=10)
        in_flight = asyncio.Event()

        async def get_after_signal(c: object) -> object:
            in_flight.set()  # nothing yields between here and grpc's await of the call
            return await c.get(b"/t/k")  # type: ignore[attr-defined]

        os.kill(etcd.proc.pid, signal.SIGSTOP)  # calls now hang in flight
        try:
            call = asyncio.create_task(store._call("get", get_after_signal))
            await in_flight.wait()
            await store._client.close()  # what a failed call on a shared channel did
            with pytest.raises(EtcdUnavailableError, match="cancelled"):
                await asyncio.wait_for(call, 10)
            ours = asyncio.create_task(store.get(b"/t/k"))
            await asyncio.sleep(0)
            ours.cancel()
            with pytest.raises(asyncio.CancelledError):
                await ours
        finally:
            os.kill(etcd.proc.pid, signal.SIGCONT)
        try:
            await store.put(b"/t/k", b"v")  # a fresh connection after the failure
            got = await store.get(b"/t/k")
            assert got is not None and got.value == b"v"
        finally:
            await store.close()

    asyncio.run(run())


def test_etcd_thread_never_hands_a_cancellation_to_its_caller(etcd) -> None:  # noqa: F811
    async def cancelled(store: EtcdStore) -> None:
        raise asyncio.CancelledError  # what a call cancelled on the etcd loop looks like

    th = EtcdThread([Address.parse(etcd.endpoint)])
    try:
        with pytest.raises(EtcdUnavailableError):
            th.run(cancelled)
        th.run(lambda s: s.put(b"/t/after", b"1"))  # the thread's loop still serves
        assert th.run(lambda s: s.get(b"/t/after")).value == b"1"
    finally:
        th.close()
