"""The byte-level client against real processes: no call waits past its timeout, whatever the
other threads of the client do (shm reads whose grants expired, overlapped master calls), and
many client processes on a small tiered cluster never hang; Client.list_keys pages through a
prefix."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

from kvstore.client import Client
from kvstore.errors import ChecksumMismatchError, InvalidRequestError
from kvstore.types import ObjectInfo
from tests.support import flip_arena_byte, wait_until

CALL_TIMEOUT_S = 3.0


def _run_bounded(fn, timeout: float) -> tuple[bool, object]:
    """Run ``fn`` in a daemon thread; (whether it returned within ``timeout``, its result)."""
    out: list[object] = []

    def run() -> None:
        try:
            out.append(fn())
        except BaseException as exc:  # noqa: BLE001 - handed back to the test
            out.append(exc)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout)
    return not t.is_alive(), (out[0] if out else None)


def test_shm_reads_after_the_lease_never_hang(cluster_factory) -> None:
    # The steps with a 1 s lease: cached locations whose grants expired, two reads that
    # drop them, a pause past the offer refresh interval, then a read that must ask the master
    # for node transports while it overlaps get_locations.
    cluster = cluster_factory(master_args=("--lease", "1"), node_args=("--shm",))
    c = Client.connect(cluster.address, timeout=CALL_TIMEOUT_S)
    hung = False
    try:
        rng = np.random.default_rng(3)
        values = {f"k{i}": rng.integers(0, 256, 4096, dtype=np.uint8) for i in range(1, 4)}
        for k, v in values.items():
            c.put(k, v)
        buf = np.empty(4096, dtype=np.uint8)
        for k in values:
            assert c.get_into(k, buf) == 4096
        time.sleep(1.5)  # let the read grants expire (time must pass; nothing to wait on)
        for k in ("k1", "k2"):
            assert c.get_into(k, buf) == 4096 and np.array_equal(buf, values[k])
        time.sleep(1.2)  # past the client's 1 s refresh interval for node offers
        t0 = time.monotonic()
        done, result = _run_bounded(lambda: c.get_into("k3", buf), 4 * CALL_TIMEOUT_S)
        print(f"\nget_into after the lease: returned={done} in {time.monotonic() - t0:.3f}s")
        other, exists = _run_bounded(lambda: c.exists("k1"), 4 * CALL_TIMEOUT_S)
        hung = not (done and other)
        assert done, "get_into hung"
        assert other, "exists() on another thread hung"
        assert result == 4096 and np.array_equal(buf, values["k3"])
        assert exists is True
    finally:
        if not hung:  # a hung client would block close() too; its daemon threads go with us
            c.close()


_WORKER = textwrap.dedent(
    """
    import json, sys, time
    import numpy as np
    from kvstore.client import Client
    from kvstore.errors import KVStoreError

    address, seed, duration, timeout = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4])
    rng = np.random.default_rng(seed)
    c = Client.connect(address, timeout=timeout, lease_reads=bool(seed % 2))
    slowest, calls, errors = 0.0, 0, {}
    end = time.monotonic() + duration
    buf = np.empty(1 << 20, dtype=np.uint8)
    while time.monotonic() < end:
        key = f"k{rng.integers(0, 48)}"
        op = rng.integers(0, 6)
        t0 = time.monotonic()
        try:
            if op <= 1:
                c.put(key, rng.integers(0, 256, int(rng.integers(1, 1 << 20)), dtype=np.uint8))
            elif op == 2:
                c.get(key)
            elif op == 3:
                c.get_into(key, buf)
            elif op == 4:
                c.batch_exists([key, "k1", "k2"])
            else:
                c.remove(key)
        except KVStoreError as err:
            errors[type(err).__name__] = errors.get(type(err).__name__, 0) + 1
        slowest = max(slowest, time.monotonic() - t0)
        calls += 1
    c.close()
    print(json.dumps({"slowest": slowest, "calls": calls, "errors": errors}))
    """
)


def test_client_processes_under_load_never_hang(cluster_factory) -> None:
    cluster = cluster_factory(
        dram="16MiB",
        master_args=("--lease", "1", "--put-timeout", "3"),
        node_args=("--shm", "--nvme", "64MiB"),
    )
    duration = 8.0
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-c",
                _WORKER,
                cluster.address,
                str(i),
                str(duration),
                str(CALL_TIMEOUT_S),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(4)
    ]
    reports = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=duration + 6 * CALL_TIMEOUT_S + 30)
            assert p.returncode == 0, err
            reports.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)
    print(f"\nSTRESS {len(reports)} client processes, {duration}s: {reports}")
    for r in reports:
        assert r["calls"] > 0
        # No call waited past its timeout (a put is up to three master calls and a write).
        assert r["slowest"] < 4 * CALL_TIMEOUT_S, r


def test_a_corrupt_replica_falls_back_to_the_next_and_is_dropped(cluster_factory) -> None:
    cluster = cluster_factory(num_nodes=2)
    value = np.random.default_rng(5).integers(0, 256, 100_000, dtype=np.uint8)
    with Client.connect(cluster.address, timeout=CALL_TIMEOUT_S) as c:
        c.put("k", value, replicas=2)
        first = c.locate("k").locations[0]
        flip_arena_byte(cluster, first.node_id, first.grant.offset + 1234)
        # The first replica fails its checksum: the read takes the second, intact one.
        assert c.get("k") == value.tobytes()
        buf = np.empty_like(value)
        assert c.get_into("k", buf) == value.nbytes and np.array_equal(buf, value)
        # The bad replica was reported and dropped; replication copies a good one back.
        assert c.stats()["num_corrupt_replicas"] >= 1

        def repaired() -> bool:
            info = c.locate("k")
            if len(info.locations) != 2:
                return False
            for loc in info.locations:  # every replica, read on its own, is intact
                one = ObjectInfo(info.size, info.checksum, [loc])
                try:
                    c.read_located(one, buf)
                except ChecksumMismatchError:
                    return False  # (reported again: the master drops it)
                if not np.array_equal(buf, value):
                    return False
            return True

        wait_until(repaired, timeout=20, what="the corrupt replica to be replaced")


def test_list_keys_pages_through_a_prefix(cluster_factory) -> None:
    cluster = cluster_factory(num_nodes=1)
    with Client.connect(cluster.address) as c:
        keys = [f"lk/{i:03d}" for i in range(25)]
        assert c.batch_put(keys, [b"v"] * 25) == [None] * 25
        c.put("other/1", b"v")
        assert c.list_keys("lk/") == [k.encode() for k in keys]
        assert c.list_keys(b"lk/", page=4) == [k.encode() for k in keys]  # 7 pages
        assert c.list_keys("lk/01") == [f"lk/01{i}".encode() for i in range(10)]
        assert set(c.list_keys()) == {k.encode() for k in keys} | {b"other/1"}
        c.remove("lk/000")
        assert b"lk/000" not in c.list_keys("lk/")
        assert c.list_keys("none/") == []


def test_list_keys_refuses_bad_input(cluster_factory) -> None:
    cluster = cluster_factory(num_nodes=1)
    with Client.connect(cluster.address) as c:
        with pytest.raises(InvalidRequestError):
            c.list_keys(5)  # type: ignore[arg-type]
        with pytest.raises(InvalidRequestError):
            c.list_keys("x" * 600)
        for page in (0, 10_001, True):
            with pytest.raises(InvalidRequestError):
                c.list_keys("", page=page)


def test_clients_dropped_without_close_give_back_their_descriptors_and_threads(
    cluster_factory,
) -> None:
    """A client that is dropped (an engine's worker forgetting close(), a failed start) is closed
    when collected: its sockets, its shared-memory mappings (whose descriptors keep an unlinked
    arena alive after a node restart) and its lease thread go with it."""
    import gc
    import os

    cluster = cluster_factory(node_args=("--shm",))
    with Client.connect(cluster.address) as writer:
        writer.batch_put(["a", "b"], [b"a" * 4096, b"b" * 65536])

    def open_fds() -> int:
        return len(os.listdir("/proc/self/fd"))

    gc.collect()
    fds, threads = open_fds(), threading.active_count()
    for _ in range(300):
        c = Client.connect(cluster.address)
        assert c.batch_get(["a", "b"]) == [b"a" * 4096, b"b" * 65536]  # maps both arenas
        del c
    gc.collect()
    assert open_fds() <= fds + 2, "dropped clients kept their descriptors"
    wait_until(lambda: threading.active_count() <= threads, what="the clients' threads to end")
