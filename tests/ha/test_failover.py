"""HA masters through a real etcd, real processes: failover keeps the cache, fencing, etcd restarts.

The failover figures (time from kill -9 to the first acknowledged put on the new leader, and the
load's counts) are printed: run with ``-s`` to see them.
"""

from __future__ import annotations

import os
import signal
import threading
import time

from kvstore import protocol
from kvstore.address import Address
from kvstore.client import Client
from kvstore.errors import ErrorCode, KVStoreError
from tests.etcd_harness import (  # noqa: F401 - fixtures
    LoadProcess,
    check_all_readable,
    etcd,
    ha_factory,
    outage_after,
)
from tests.support import wait_until

FAST = ("--heartbeat-interval", "0.5", "--node-ttl", "4")


def _serving(m) -> bool:
    said = [ln for ln in m.lines if ln.startswith("kvstore master ")]
    return bool(said) and said[-1].startswith("kvstore master serving")


def _refuses(addr: Address) -> bool:
    conn = protocol.FramedSocket.connect(addr.host, addr.port, timeout=5)
    try:
        conn.call("stats", {})
        return False
    except KVStoreError as err:
        return err.code == ErrorCode.NOT_LEADER
    finally:
        conn.close()


def test_kill_9_of_the_leader_under_load(ha_factory, tmp_path) -> None:  # noqa: F811
    cluster = ha_factory(num_masters=3, num_nodes=3, master_args=FAST)
    old = cluster.leader()
    load = LoadProcess(cluster.url, tmp_path / "load")
    try:
        load.wait_acks(150)
        t_kill = time.time()
        old.kill()
        new = cluster.leader(timeout=30)
        t_new = time.time()
        assert new is not old
        load.wait_acks(150, after=t_kill)
        summary = load.finish()
    finally:
        load.kill()
    acks = load.acks()
    outage = outage_after(acks, t_kill)
    before = [a for a in acks if a[2] <= t_kill]
    bad = check_all_readable(cluster.url, acks)
    print(
        f"\nFAILOVER kill -9 of the leader: new leader serving seen after "
        f"{t_new - t_kill:.2f}s, client outage (longest gap between acks) {outage:.2f}s; "
        f"acknowledged before/after the kill {len(before)}/{len(acks) - len(before)}, "
        f"all {len(acks)} re-read, {bad} wrong or missing; load: {summary}"
    )
    assert bad == 0, f"{bad} acknowledged objects lost or wrong"
    assert summary["gets_wrong"] == 0
    assert summary["failovers"] >= 1


def test_sigstop_leader_steps_down_without_serving_a_write(ha_factory) -> None:  # noqa: F811
    cluster = ha_factory(num_masters=2, num_nodes=2, master_args=FAST)
    old = cluster.leader()
    addr = Address.parse(old.field("control"))
    with Client.connect(cluster.url, timeout=10) as c:
        c.put("before", b"b" * 1000)
        old_epoch = c._control.epoch
        zombie = protocol.FramedSocket.connect(addr.host, addr.port, timeout=30)
        assert zombie.call("ping", {})["role"] == "master"
        os.kill(old.pid, signal.SIGSTOP)
        try:
            new = next(m for m in cluster.masters if m is not old)
            wait_until(lambda: _serving(new), timeout=30, what="the standby to take over")
            wait_until(lambda: c.stats()["num_nodes"] == 2, timeout=30, what="nodes to follow")
            c.put("after", b"a" * 1000)
            assert c._control.epoch > old_epoch
            # Requests that reach the paused leader before it wakes up: the put_start of a
            # client that still believes in it, and one without an epoch at all.
            zombie.send_request(
                "put_start", {"keys": [b"zombie"], "sizes": [10], "epoch": old_epoch}
            )
            zombie.send_request("put_start", {"keys": [b"zombie2"], "sizes": [10]})
        finally:
            os.kill(old.pid, signal.SIGCONT)
        for _ in range(2):
            response, _ = zombie.read_response()
            assert response.code == ErrorCode.NOT_LEADER, response
        zombie.close()
        old.wait_for(r"kvstore master standby", timeout=30)
        assert c.batch_exists(["zombie", "zombie2", "before", "after"]) == [
            False,
            False,
            True,
            True,
        ]
        assert c.get("before") == b"b" * 1000 and c.get("after") == b"a" * 1000
        # The deposed master keeps refusing; the client keeps following the new leader.
        again = protocol.FramedSocket.connect(addr.host, addr.port, timeout=10)
        try:
            again.call("put_start", {"keys": [b"late"], "sizes": [1], "epoch": old_epoch})
            raise AssertionError("a deposed leader accepted a put")
        except KVStoreError as err:
            assert err.code in (ErrorCode.NOT_LEADER, ErrorCode.STALE_EPOCH)
        finally:
            again.close()
        c.put("later", b"l")
        assert c.get("later") == b"l"


def test_threads_sharing_one_client_follow_the_new_leader(ha_factory) -> None:  # noqa: F811
    cluster = ha_factory(num_masters=2, num_nodes=1, master_args=FAST)
    old = cluster.leader()
    num_threads = 8
    with Client.connect(cluster.url, timeout=10) as c:
        c.put("before", b"b" * 1000)
        bound = c._control.failover_timeout + c._control.timeout + 1.0
        killed = threading.Event()
        out: list[tuple[int, list[str], float] | BaseException | None] = [None] * num_threads

        def work(t: int) -> None:
            # Calls until five answers came after the kill (bounded); every call ends within
            # its failover bound, answered or with a typed error.
            errors: list[str] = []
            slowest, num_after = 0.0, 0
            deadline = time.monotonic() + 90
            try:
                while num_after < 5 and time.monotonic() < deadline:
                    t0 = time.monotonic()
                    after = killed.is_set()
                    try:
                        assert isinstance(c.exists("before"), bool)
                        num_after += after
                    except KVStoreError as err:
                        errors.append(type(err).__name__)
                    slowest = max(slowest, time.monotonic() - t0)
                out[t] = (num_after, errors, slowest)
            except BaseException as exc:  # noqa: BLE001 - handed back to the test
                out[t] = exc

        threads = [
            threading.Thread(target=work, args=(t,), daemon=True) for t in range(num_threads)
        ]
        for th in threads:
            th.start()
        wait_until(
            lambda: c._control._pipeline is not None and c._control._pipeline.num_waiting > 0,
            timeout=10,
            what="calls in flight",
        )
        old.kill()
        killed.set()
        for th in threads:
            th.join(120)
        assert not any(th.is_alive() for th in threads), "a thread hung"
        for got in out:
            assert isinstance(got, tuple), got
            num_after, _errors, slowest = got
            assert num_after == 5 and slowest < bound, got
        assert c._control.num_failovers >= 1
        wait_until(lambda: c.stats()["num_nodes"] == 1, timeout=30, what="the node to follow")
        assert c.exists("before") and c.get("before") == b"b" * 1000


def test_etcd_restart_under_load(ha_factory, tmp_path) -> None:  # noqa: F811
    cluster = ha_factory(num_masters=2, num_nodes=2, master_args=FAST)
    leader = cluster.leader()
    addr = Address.parse(leader.field("control"))
    load = LoadProcess(cluster.url, tmp_path / "load")
    try:
        load.wait_acks(100)
        cluster.etcd.stop()
        # Down for longer than the lease: the leader cannot prove it leads, so it refuses.
        wait_until(lambda: _refuses(addr), timeout=20, what="the leader to fence itself")
        t_restart = time.time()
        cluster.etcd.start()
        load.wait_acks(100, after=time.time())
        summary = load.finish()
    finally:
        load.kill()
    acks = load.acks()
    bad = check_all_readable(cluster.url, acks)
    print(
        f"\nETCD RESTART under load: {len(acks)} acknowledged "
        f"({sum(1 for a in acks if a[2] > t_restart)} after the restart), {bad} wrong or missing; "
        f"load: {summary}"
    )
    assert bad == 0
    assert summary["gets_wrong"] == 0
    assert all(m.proc.poll() is None for m in cluster.masters + cluster.nodes)


def test_blanks_of_a_dead_leader_cost_a_put_only_the_usual_way(ha_factory) -> None:  # noqa: F811
    """A client holds blanks (puts started ahead, kvstore.client.blanks) of the leader it put
    through; after a kill -9 of that leader none of them is pending anywhere: each put goes the
    usual way through the new leader, and every acknowledged put reads back."""
    cluster = ha_factory(num_masters=2, num_nodes=2, master_args=FAST)
    old = cluster.leader()
    acked: dict[str, bytes] = {}
    with Client.connect(cluster.url, timeout=10) as c:
        for i in range(12):
            acked[f"b/{i}"] = os.urandom(4096)
            c.put(f"b/{i}", acked[f"b/{i}"])
        assert c._puts.num_into_blanks > 0 and c._puts.blanks.held()
        old.kill()
        cluster.leader(timeout=30)
        wait_until(lambda: c.stats()["num_nodes"] == 2, timeout=30, what="the nodes to follow")
        for i in range(12, 40):
            acked[f"b/{i}"] = os.urandom(4096)
            c.put(f"b/{i}", acked[f"b/{i}"])
        for k, v in acked.items():
            assert c.get(k) == v
        # The new leader's own blanks are taken after its first puts.
        assert c._puts.blanks.held() and c._control.num_failovers >= 1
