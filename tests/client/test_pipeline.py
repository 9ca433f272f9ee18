"""One client shared by many threads, its control requests pipelined on one connection, against
real master and node processes: every result exact; a master or node killed mid-flight fails
every waiting thread with a typed error within its timeout and the client works again after a
restart; a master that stops answering (SIGSTOP) makes those calls time out, each on its own
deadline, and nobody else's."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from kvstore import auth, protocol
from kvstore.client import Client
from kvstore.client.pipeline import Pipeline, pipelined
from kvstore.errors import (
    KeyNotFoundError,
    KVStoreError,
    KVTimeoutError,
    MasterUnavailableError,
    NodeUnavailableError,
)
from tests.support import start_master, wait_until

NUM_THREADS = 8
CALL_TIMEOUT_S = 4.0
#: A thread's join waits at most this long past its call timeout (a hang fails the test).
JOIN_SLACK_S = 10.0


def _in_threads(num_threads: int, work: Callable[[int], Any]) -> list[Any]:
    """Run ``work(t)`` in ``num_threads`` threads; their results (or exceptions), each thread
    joined within a bound (a thread still running fails the test: it hung)."""
    out: list[Any] = [None] * num_threads

    def body(t: int) -> None:
        try:
            out[t] = work(t)
        except BaseException as exc:  # noqa: BLE001 - handed back to the test
            out[t] = exc

    threads = [
        threading.Thread(target=body, args=(t,), name=f"worker-{t}", daemon=True)
        for t in range(num_threads)
    ]
    for th in threads:
        th.start()
    deadline = time.monotonic() + CALL_TIMEOUT_S * 8 + JOIN_SLACK_S
    for th in threads:
        th.join(max(0.0, deadline - time.monotonic()))
    assert not any(th.is_alive() for th in threads), "a thread hung"
    return out


def _waiting(c: Client) -> int:
    pipe = c._control._pipeline
    return 0 if pipe is None else pipe.num_waiting


def test_many_threads_on_one_client_get_exact_results(cluster_factory) -> None:
    cluster = cluster_factory(num_nodes=2, dram="64MiB")
    with Client.connect(cluster.address, timeout=CALL_TIMEOUT_S, shm=False) as c:

        def work(t: int) -> int:
            rng = np.random.default_rng(t)
            mine: dict[str, bytes] = {}
            num_checked = 0
            for i in range(60):
                key = f"t{t}/k{i % 12}"
                op = rng.integers(0, 4)
                if op == 0 or key not in mine:
                    value = rng.integers(0, 256, int(rng.integers(1, 70_000)), np.uint8).tobytes()
                    c.put(key, value)
                    mine[key] = value
                elif op == 1:
                    assert c.get(key) == mine[key]
                    buf = bytearray(len(mine[key]) + 5)
                    assert c.get_into(key, buf) == len(mine[key])
                    assert bytes(buf[: len(mine[key])]) == mine[key]
                elif op == 2:
                    missing = f"t{t}/missing{i}"
                    assert c.batch_exists([key, missing]) == [True, False]
                else:
                    c.remove(key)
                    del mine[key]
                    assert not c.exists(key)
                    try:
                        c.get(key)
                        raise AssertionError("a removed key was read")
                    except KeyNotFoundError:
                        pass
                num_checked += 1
            keys = sorted(mine)
            assert c.batch_get(keys) == [mine[k] for k in keys]
            return num_checked

        results = _in_threads(NUM_THREADS, work)
        assert results == [60] * NUM_THREADS, results
        # Every thread's control requests went on one connection.
        assert c._control.num_connects == 1


def test_a_master_killed_mid_flight_fails_every_waiter_then_a_restart_serves(
    cluster_factory,
) -> None:
    cluster = cluster_factory(master_args=("--heartbeat-interval", "0.2"))
    port = int(cluster.address.rsplit(":", 1)[1])
    with Client.connect(cluster.address, timeout=CALL_TIMEOUT_S, shm=False) as c:
        c.put("before", b"x" * 1000)
        os.kill(cluster.master.pid, signal.SIGSTOP)
        try:
            started = threading.Barrier(NUM_THREADS + 1)

            def work(t: int) -> tuple[Any, float]:
                started.wait(timeout=JOIN_SLACK_S)
                t0 = time.monotonic()
                try:
                    return c.exists(f"k{t}"), time.monotonic() - t0
                except KVStoreError as err:
                    return err, time.monotonic() - t0

            runner = threading.Thread(
                target=lambda: out.extend(_in_threads(NUM_THREADS, work)), daemon=True
            )
            out: list[tuple[Any, float]] = []
            runner.start()
            started.wait(timeout=JOIN_SLACK_S)
            # Every thread's request is sent and waits for its reply: now the master dies.
            wait_until(lambda: _waiting(c) == NUM_THREADS, timeout=CALL_TIMEOUT_S / 2)
            cluster.master.kill()
        finally:
            if cluster.master.proc.poll() is None:
                os.kill(cluster.master.pid, signal.SIGCONT)
        runner.join(CALL_TIMEOUT_S + JOIN_SLACK_S)
        assert not runner.is_alive(), "a thread hung"
        assert len(out) == NUM_THREADS
        for err, seconds in out:
            # All at once, typed, and well before their timeout.
            assert isinstance(err, MasterUnavailableError), err
            assert seconds < CALL_TIMEOUT_S / 2, seconds
        # Calls while the master is down fail fast and typed; after a restart on the same port
        # the client works again (its nodes register anew with the empty master).
        t0 = time.monotonic()
        try:
            c.exists("k")
            raise AssertionError("a call to a dead master succeeded")
        except MasterUnavailableError:
            assert time.monotonic() - t0 < CALL_TIMEOUT_S
        cluster.master = start_master("--port", str(port), "--heartbeat-interval", "0.2")
        num_nodes = len(cluster.nodes)
        wait_until(
            lambda: c.stats()["num_nodes"] == num_nodes, timeout=20, what="the nodes re-registering"
        )
        c.put("after", b"y" * 1000)
        assert c.get("after") == b"y" * 1000
        results = _in_threads(NUM_THREADS, lambda t: c.exists("after"))
        assert results == [True] * NUM_THREADS


def test_a_node_killed_mid_flight_fails_its_readers_typed_then_another_node_serves(
    cluster_factory,
) -> None:
    cluster = cluster_factory(num_nodes=1, dram="64MiB")
    value = bytes(range(256)) * 256  # 64 KiB
    with Client.connect(cluster.address, timeout=CALL_TIMEOUT_S, shm=False) as c:
        for t in range(NUM_THREADS):
            c.put(f"k{t}", value)
        node = cluster.nodes[0]
        os.kill(node.pid, signal.SIGSTOP)
        try:
            started = threading.Barrier(NUM_THREADS + 1)

            def work(t: int) -> tuple[Any, float]:
                started.wait(timeout=JOIN_SLACK_S)
                t0 = time.monotonic()
                try:
                    return c.get(f"k{t}"), time.monotonic() - t0
                except KVStoreError as err:
                    return err, time.monotonic() - t0

            out: list[tuple[Any, float]] = []
            runner = threading.Thread(
                target=lambda: out.extend(_in_threads(NUM_THREADS, work)), daemon=True
            )
            runner.start()
            started.wait(timeout=JOIN_SLACK_S)
            # Every thread has its locations and waits for the node's reply: now it dies.
            wait_until(
                lambda: _threads_in(runner_threads(), "_receive") == NUM_THREADS,
                timeout=CALL_TIMEOUT_S / 2,
                what="every reader waiting for the node",
            )
            node.kill()
        finally:
            if node.proc.poll() is None:
                os.kill(node.pid, signal.SIGCONT)
        runner.join(CALL_TIMEOUT_S + JOIN_SLACK_S)
        assert not runner.is_alive(), "a thread hung"
        assert len(out) == NUM_THREADS
        for err, seconds in out:
            assert isinstance(err, NodeUnavailableError), err
            assert seconds < CALL_TIMEOUT_S, seconds
        cluster.add_node("64MiB", name="node-restarted")
        wait_until(lambda: _put_works(c), timeout=20, what="a put on the new node")
        results = _in_threads(NUM_THREADS, lambda t: (c.put(f"n{t}", value), c.get(f"n{t}"))[1])
        assert results == [value] * NUM_THREADS


def runner_threads() -> list[threading.Thread]:
    return [th for th in threading.enumerate() if th.name.startswith("worker-")]


def _threads_in(threads: list[threading.Thread], function: str) -> int:
    """How many of ``threads`` are inside a call of ``function`` right now (a state, polled)."""
    frames = sys._current_frames()
    n = 0
    for th in threads:
        f = frames.get(th.ident or -1)
        while f is not None:
            if f.f_code.co_name == function:
                n += 1
                break
            f = f.f_back
    return n


def _put_works(c: Client) -> bool:
    try:
        c.put("probe", b"p")
    except KVStoreError:
        return False
    return True


def test_a_silent_master_times_calls_out_each_on_its_own_deadline(cluster_factory) -> None:
    cluster = cluster_factory()
    timeout = 2.0
    with Client.connect(cluster.address, timeout=timeout, shm=False) as c:
        c.put("present", b"z")
        os.kill(cluster.master.pid, signal.SIGSTOP)
        try:
            first = threading.Thread(target=lambda: out.append(_timed(c.exists, "a")), daemon=True)
            out: list[tuple[Any, float, float]] = []
            first_at = time.monotonic()
            first.start()
            wait_until(lambda: _waiting(c) == 1, timeout=timeout / 2, what="the first call sent")
            # A second wave, sent later: it must time out on its own later deadline, not with
            # the first call. Later by a clear margin: a wait ends up to a millisecond or two
            # past its deadline (socket timeouts count whole milliseconds), so deadlines closer
            # than that have no order.
            wait_until(
                lambda: time.monotonic() - first_at > timeout / 10,
                timeout=timeout / 2,
                what="a tenth of the timeout passed",
            )
            rest = _in_threads(3, lambda t: _timed(c.exists, f"b{t}"))
            first.join(timeout + JOIN_SLACK_S)
            assert not first.is_alive(), "a thread hung"
        finally:
            os.kill(cluster.master.pid, signal.SIGCONT)
        (err, start, end), *_ = out
        assert isinstance(err, KVTimeoutError), err
        assert timeout - 0.05 <= end - start < timeout + 1.0
        for err_b, start_b, end_b in rest:
            assert isinstance(err_b, KVTimeoutError), err_b
            assert start_b > start
            assert timeout - 0.05 <= end_b - start_b < timeout + 1.0
            assert end_b > end  # not failed with the first one
        # The master is back: calls are answered (their own answers, by id).
        assert c.batch_exists(["present", "absent"]) == [True, False]
        results = _in_threads(
            NUM_THREADS, lambda t: c.batch_exists(["absent", "present"] if t % 2 else ["present"])
        )
        assert results == [[False, True] if t % 2 else [True] for t in range(NUM_THREADS)]


def _timed(fn: Callable[..., Any], *args: Any) -> tuple[Any, float, float]:
    t0 = time.monotonic()
    try:
        result = fn(*args)
    except KVStoreError as err:
        result = err
    return result, t0, time.monotonic()


def test_data_connections_are_kept_for_as_many_threads_as_share_the_client(
    cluster_factory,
) -> None:
    cluster = cluster_factory(dram="64MiB")
    num_threads = 16  # more than the pool's base size (8)
    value = b"v" * 65536
    with Client.connect(cluster.address, timeout=CALL_TIMEOUT_S, shm=False) as c:
        keys = [f"k{t}" for t in range(num_threads)]
        assert c.batch_put(keys, [value] * num_threads) == [None] * num_threads

        def work(t: int) -> bool:
            return all(c.get(keys[t]) == value for _ in range(20))

        assert _in_threads(num_threads, work) == [True] * num_threads
        # One connection per thread at most (opened when first needed), not one per call
        # beyond the base size.
        assert c._data.tcp.pool.num_connects <= num_threads + 1


@pytest.mark.parametrize(
    ("verb", "args", "expected"),
    [
        ("get_locations", {"keys": [b"k"] * 256}, True),
        ("get_locations", {"keys": [b"k"] * 257}, False),  # large: served in chunks, alone
        ("put_end", {"put_ids": [1] * 300, "checksums": [1] * 300}, False),
        ("kv_match", {"tokens": b"t" * 1024}, True),
        ("kv_match", {"tokens": b"t" * 1025}, False),
        ("events", {"wait_s": 1.0}, False),  # a long poll
        ("list_keys", {"prefix": b""}, False),
        ("exists", {"keys": [b"k"]}, True),
    ],
)
def test_what_goes_on_the_shared_pipeline(verb: str, args: dict[str, Any], expected: bool) -> None:
    assert pipelined(verb, args) is expected


def test_large_batches_and_small_calls_from_many_threads(cluster_factory) -> None:
    cluster = cluster_factory(dram="64MiB")
    with Client.connect(cluster.address, timeout=CALL_TIMEOUT_S, shm=False) as c:
        big = [f"big/{i}" for i in range(1000)]
        assert c.batch_put(big, [b"b" * 100] * len(big)) == [None] * len(big)

        def work(t: int) -> bool:
            if t % 2:
                return c.batch_get(big) == [b"b" * 100] * len(big) and all(c.batch_exists(big))
            c.put(f"small/{t}", b"s")
            return c.get(f"small/{t}") == b"s" and c.exists(f"small/{t}")

        assert _in_threads(NUM_THREADS, work) == [True] * NUM_THREADS
        assert c._control.num_connects == 1


def test_a_call_busy_elsewhere_is_never_left_to_read(cluster_factory) -> None:
    # A thread that sent a request and, before waiting for it, calls the master again (work
    # overlapped with an answer may): while another thread reads, the reading must pass only to
    # a call that waits. Handed to the busy one, nobody would read and the nested call would
    # time out.
    cluster = cluster_factory()
    host, port = cluster.address.rsplit(":", 1)
    conn = protocol.FramedSocket.connect(host, int(port), timeout=CALL_TIMEOUT_S)
    auth.hello(conn, None)
    pipe = Pipeline(conn, cluster.address)
    try:

        def other(_t: int) -> int:
            for _ in range(300):
                assert pipe.call("ping", {}, time.monotonic() + CALL_TIMEOUT_S)["role"] == "master"
            return 300

        def overlapping(_t: int) -> int:
            for _ in range(100):
                deadline = time.monotonic() + CALL_TIMEOUT_S
                req_id, slot = pipe.send("ping", {}, deadline)
                assert pipe.call("ping", {}, deadline)["role"] == "master"  # the nested call
                assert pipe.wait(req_id, slot, deadline, "ping")["role"] == "master"
            return 100

        results = _in_threads(2, lambda t: other(t) if t else overlapping(t))
        assert results == [100, 300], results
        assert pipe.num_waiting == 0
    finally:
        pipe.close()
