"""Tiers across real processes: eviction to NVMe, leases, pins, replication, restart, drain."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import xxhash

from kvstore import protocol
from kvstore.client import Client
from kvstore.errors import (
    ErrorCode,
    GrantInvalidError,
    InvalidRequestError,
    KeyNotFoundError,
    KVStoreError,
    NoSpaceError,
)
from tests.support import wait_until

FAST = ("--heartbeat-interval", "0.1", "--node-ttl", "1")


def tier_of(c: Client, key: str) -> str:
    return c.locate(key).locations[0].grant.segment


def test_fill_to_three_times_dram_then_past_every_tier(cluster_factory) -> None:
    cluster = cluster_factory(
        num_nodes=2, dram="4MiB", master_args=FAST, node_args=("--nvme", "16MiB")
    )
    rng = random.Random(4)
    expected: dict[str, bytes] = {}
    num_gets = 0
    with Client.connect(cluster.address) as c:
        # Phase 1: 3x the cluster's DRAM (24 MiB into 8 MiB of DRAM): everything stays readable.
        written = 0
        while written < 24 << 20:
            keys = [f"o/{len(expected) + i}" for i in range(8)]
            values = [os.urandom(rng.randrange(16 << 10, 256 << 10)) for _ in keys]
            assert c.batch_put(keys, values) == [None] * len(keys)
            expected.update(zip(keys, values, strict=True))
            written += sum(map(len, values))
            probe = rng.sample(sorted(expected), 4)
            assert c.batch_get(probe) == [expected[k] for k in probe]
            num_gets += len(probe)
        wait_until(lambda: c.stats()["eviction"]["num_demotions"] > 0, timeout=30, what="demotions")
        on_nvme = [k for k in expected if tier_of(c, k) == "nvme"]
        num_gets += len(expected)
        assert len(on_nvme) > len(expected) / 2
        assert c.batch_get(on_nvme) == [expected[k] for k in on_nvme]  # exact, from lmdb
        num_gets += len(on_nvme)
        stats = c.stats()
        assert stats["num_objects"] == len(expected)
        assert stats["tiers"]["dram"]["num_replicas"] + stats["tiers"]["nvme"][
            "num_replicas"
        ] == len(expected)
        assert stats["num_hits"] == num_gets and stats["num_misses"] == 0

        # Phase 2: past DRAM + NVMe: the coldest go, puts never fail, gets are exact or a miss.
        first_phase = len(expected)
        while written < 56 << 20:
            keys = [f"o/{len(expected) + i}" for i in range(8)]
            values = [os.urandom(rng.randrange(16 << 10, 256 << 10)) for _ in keys]
            assert c.batch_put(keys, values) == [None] * len(keys)
            expected.update(zip(keys, values, strict=True))
            written += sum(map(len, values))
        got = c.batch_get(sorted(expected))
        misses = 0
        for k, v in zip(sorted(expected), got, strict=True):
            if isinstance(v, KeyNotFoundError):
                misses += 1
            else:
                assert v == expected[k]
        stats = c.stats()
        ev = stats["eviction"]
        evicted = ev["num_evictions"] + ev["num_sync_evictions"]
        # Every miss was evicted; every object is stored or was evicted. (Not misses ==
        # evicted: the reads themselves promote hot NVMe objects, which can push others out
        # after they were read, while a large batch is read a chunk at a time.)
        assert 0 < misses <= evicted
        assert stats["num_objects"] + evicted == len(expected) > first_phase
        assert stats["num_misses"] == misses


def test_lease_protects_a_slow_reader_and_expires_cleanly(cluster_factory) -> None:
    cluster = cluster_factory(num_nodes=1, dram="2MiB", master_args=("--lease", "1.5"))
    with Client.connect(cluster.address) as c:
        value = os.urandom(512 << 10)
        c.put("slow", value)
        info = c.locate("slow")  # a slow reader takes its lease ...
        c.remove("slow")  # ... the object goes, and pressure wants its space
        for i in range(8):
            c.put(f"fill/{i}", os.urandom(256 << 10))
        assert not c.exists("slow")
        buf = bytearray(len(value))
        assert c.read_located(info, buf) == len(value) and bytes(buf) == value

        c.put("late", b"x" * 1000)
        info = c.locate("late")
        expires_ms = info.locations[0].grant.expires_ms
        wait_until(lambda: time.time() * 1000 > expires_ms + 50, timeout=10, what="lease end")
        with pytest.raises(GrantInvalidError):
            c.read_located(info, bytearray(1000))
        assert c.get("late") == b"x" * 1000  # a fresh lease reads again


def test_pinned_objects_survive_pressure(cluster_factory) -> None:
    cluster = cluster_factory(num_nodes=1, dram="2MiB")
    with Client.connect(cluster.address) as c:
        hard, soft = os.urandom(300 << 10), os.urandom(300 << 10)
        c.put("hard", hard)
        c.put("soft", soft)
        c.pin("hard", ttl=600, hard=True)
        c.pin("soft", ttl=600)
        for i in range(24):  # 3x DRAM of unpinned data
            c.put(f"f/{i}", os.urandom(256 << 10))
        assert c.get("hard") == hard and c.get("soft") == soft
        assert c.stats()["eviction"]["num_sync_evictions"] > 0
        with pytest.raises(KeyNotFoundError):
            c.pin("missing", ttl=5)
        with pytest.raises(InvalidRequestError):
            c.pin("hard", ttl=0)
        c.unpin("hard")
        c.unpin("soft")


def test_kill_one_of_three_nodes_with_two_replicas(cluster_factory) -> None:
    cluster = cluster_factory(num_nodes=3, dram="32MiB", master_args=FAST)
    with Client.connect(cluster.address) as c:
        values = {f"r/{i}": os.urandom(random.Random(i).randrange(1, 200_000)) for i in range(60)}
        assert c.batch_put(list(values), list(values.values()), replicas=2) == [None] * 60
        assert all(len(c.locate(k).locations) == 2 for k in values)
        cluster.nodes[1].kill()  # kill -9
        assert c.batch_get(list(values)) == list(values.values())  # falls back to live replicas
        wait_until(lambda: c.stats()["num_nodes"] == 2, timeout=15, what="node declared dead")

        def restored() -> bool:
            return c.stats()["replication"]["num_under_replicated"] == 0 and all(
                len(c.locate(k).locations) == 2 for k in values
            )

        wait_until(restored, timeout=30, what="replica count back to 2")
        assert c.batch_get(list(values)) == list(values.values())
        assert c.stats()["replication"]["num_copies_done"] > 0


def test_node_restart_keeps_its_nvme_objects(cluster_factory) -> None:
    cluster = cluster_factory(
        num_nodes=1, dram="1MiB", master_args=FAST, node_args=("--nvme", "32MiB")
    )
    with Client.connect(cluster.address) as c:
        values = {f"k/{i}": os.urandom(100_000 + i) for i in range(40)}
        assert c.batch_put(list(values), list(values.values())) == [None] * 40
        on_nvme = {k for k in values if tier_of(c, k) == "nvme"}
        assert len(on_nvme) > 20
        cluster.nodes[0].stop()
        cluster.nodes.clear()
        cluster.add_node("1MiB", name="node0")  # the cluster's node_args: --nvme 32MiB
        wait_until(lambda: c.stats()["num_nodes"] == 1, what="node back")
        wait_until(lambda: c.stats()["num_objects"] >= len(on_nvme), what="re-admission")
        for k in on_nvme:
            assert c.get(k) == values[k]
        for k in set(values) - on_nvme:  # DRAM does not survive a restart: a clean miss
            with pytest.raises(KeyNotFoundError):
                c.get(k)


def test_get_under_concurrent_eviction_is_exact_or_a_miss(cluster_factory) -> None:
    cluster = cluster_factory(
        num_nodes=1,
        dram="2MiB",
        master_args=(*FAST, "--lease", "0.2"),
        node_args=("--nvme", "4MiB"),
    )
    stop = threading.Event()
    errors: list[str] = []
    written: dict[str, bytes] = {}
    names: list[str] = []  # appended after ``written`` is set: the reader never iterates a dict

    def writer() -> None:
        with Client.connect(cluster.address) as c:
            i = 0
            while not stop.is_set() and i < 400:
                v = os.urandom(64 << 10)
                err = c.batch_put([f"w/{i}"], [v])[0]
                if err is None:
                    written[f"w/{i}"] = v
                    names.append(f"w/{i}")
                elif not isinstance(err, NoSpaceError) or "leased" not in err.message:
                    # The reader may hold leases on everything left: then (only then) a put
                    # may fail, and it says so.
                    errors.append(f"put: {err!r}")
                i += 1

    t = threading.Thread(target=writer)
    t.start()
    num_exact = 0
    try:
        with Client.connect(cluster.address) as c:
            rng = random.Random(0)
            while t.is_alive():
                # Recent keys (being demoted) and keys near the cold edge (being deleted); not
                # everything, or the reader's leases would pin the whole store.
                n = len(names)
                recent = names[max(0, n - 24) : n]
                edge = names[max(0, n - 100) : max(0, n - 90)]
                keys = rng.sample(recent, min(6, len(recent))) + edge[:2]
                for k, got in zip(keys, c.batch_get(keys), strict=True):
                    if isinstance(got, KeyNotFoundError):
                        continue
                    if isinstance(got, KVStoreError):
                        errors.append(f"get {k}: {got!r}")
                    elif got != written[k]:
                        errors.append(f"get {k}: other bytes")
                    else:
                        num_exact += 1
    finally:
        stop.set()
        t.join(timeout=120)
    assert not errors, errors[:5]
    assert num_exact > 0
    assert len(written) > 96, "more than fits in DRAM + NVMe: eviction ran under the reads"


def test_drain_moves_objects_then_retires_the_node(cluster_factory) -> None:
    cluster = cluster_factory(num_nodes=2, dram="16MiB", master_args=FAST)
    with Client.connect(cluster.address) as c:
        values = {f"d/{i}": os.urandom(50_000 + i) for i in range(40)}
        assert c.batch_put(list(values), list(values.values())) == [None] * 40
        victim = cluster.nodes[0]
        node_id = victim.field("id")
        out = subprocess.run(
            [sys.executable, "-m", "kvstore", "drain", node_id, "--admin", cluster.admin],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert out.returncode == 0, out.stderr
        assert "retired" in out.stdout
        assert victim.proc.wait(timeout=15) == 0  # the node stops by itself
        assert c.stats()["num_nodes"] == 1
        assert c.batch_get(list(values)) == list(values.values())
        bad = subprocess.run(
            [sys.executable, "-m", "kvstore", "drain", "nope", "--admin", cluster.admin],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert bad.returncode == 2 and "not registered" in bad.stderr


def test_bad_tier_input_at_start(tmp_path: Path, cluster_factory) -> None:
    cluster = cluster_factory(num_nodes=0)
    corrupt = tmp_path / "corrupt"
    (corrupt / "nvme").mkdir(parents=True)
    (corrupt / "nvme" / "data.mdb").write_bytes(os.urandom(64 << 10))
    base = [sys.executable, "-m", "kvstore", "--log-level", "error", "node", "--master"]
    for extra, dir_, needle in [
        (("--nvme", "16MiB"), corrupt, "cannot open the NVMe tier"),
        (("--nvme", "lots"), tmp_path / "a", "bad size"),
    ]:
        out = subprocess.run(
            [*base, cluster.address, "--dram", "1MiB", "--data-dir", str(dir_), *extra],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 2 and needle in out.stderr, out.stderr
    out = subprocess.run(
        [sys.executable, "-m", "kvstore", "master", "--port", "0", "--high-watermark", "0.5"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2 and "watermarks" in out.stderr
    with Client.connect(cluster.address) as c, pytest.raises(InvalidRequestError):
        c.put("x", b"1", replicas=0)


def _raw_control(cluster) -> protocol.FramedSocket:
    host, port = cluster.address.split(":")
    return protocol.FramedSocket.connect(host, int(port), timeout=10)


def _raw_put(ctl: protocol.FramedSocket, key: bytes, data: bytes, commit: bool) -> list:
    """put_start, write (with the grant kept), and put_end if ``commit``: the location's wire."""
    code, (put_id, locations) = ctl.call("put_start", {"keys": [key], "sizes": [len(data)]})[0]
    assert code == 0
    loc = locations[0]
    assert _raw_write(loc, data) == 0
    if commit:
        checksum = xxhash.xxh3_64_intdigest(data)
        assert ctl.call("put_end", {"put_ids": [put_id], "checksums": [checksum]}) == [[0, None]]
    return loc


def _raw_write(loc: list, data: bytes) -> int:
    conn = protocol.FramedSocket.connect(loc[1], loc[2], timeout=10)
    try:
        items = [[loc[3], 0, len(data), xxhash.xxh3_64_intdigest(data)]]
        conn.send_frame(protocol.encode_request(1, "write", {"items": items}, len(data)), [data])
        response, _ = conn.read_response()
        return response.unwrap()[0][0]
    finally:
        conn.close()


def _kill_and_restart(cluster, c: Client) -> None:
    cluster.nodes[0].kill()  # kill -9: no goodbye, no last heartbeat
    cluster.nodes.clear()
    cluster.add_node("1MiB", name="node0")  # same data dir; the cluster's node_args
    wait_until(lambda: c.stats()["num_nodes"] == 1, what="node back")


def test_after_kill_9_only_committed_latest_nvme_versions_come_back(cluster_factory) -> None:
    cluster = cluster_factory(
        num_nodes=1, dram="1MiB", master_args=FAST, node_args=("--nvme", "32MiB")
    )
    big = 2 << 20  # larger than DRAM: lands on NVMe
    vals = {k: os.urandom(big) for k in ("pending", "keep", "gone", "v1", "v2")}
    ctl = _raw_control(cluster)
    try:
        with Client.connect(cluster.address) as c:
            loc = _raw_put(ctl, b"pending", vals["pending"], commit=False)  # never put_end'ed
            assert loc[3][2] == "nvme"
            c.put("keep", vals["keep"])
            c.put("gone", vals["gone"])
            c.remove("gone")
            c.put("over", vals["v1"])
            c.put("over", vals["v2"])
            assert {tier_of(c, k) for k in ("keep", "over")} == {"nvme"}
            _kill_and_restart(cluster, c)
            wait_until(lambda: c.exists("keep") and c.exists("over"), what="re-admission")
            assert c.get("keep") == vals["keep"]
            assert c.get("over") == vals["v2"]
            assert not c.exists("pending") and not c.exists("gone")
            with pytest.raises(KeyNotFoundError):
                c.get("pending")
            assert c.stats()["num_objects"] == 2
    finally:
        ctl.close()


def test_a_removed_nvme_key_stays_removed_after_a_late_write_and_restart(
    cluster_factory,
) -> None:
    cluster = cluster_factory(
        num_nodes=1, dram="1MiB", master_args=FAST, node_args=("--nvme", "32MiB")
    )
    first, late = os.urandom(2 << 20), os.urandom(2 << 20)
    ctl = _raw_control(cluster)
    try:
        with Client.connect(cluster.address) as c:
            loc = _raw_put(ctl, b"k", first, commit=True)
            assert loc[3][2] == "nvme" and c.get("k") == first
            c.remove("k")
            # A write carrying the removed version's grant (still unexpired) is refused.
            assert _raw_write(loc, late) == ErrorCode.GRANT_INVALID
            _kill_and_restart(cluster, c)
            c.put("probe", b"p")  # the node serves again
            assert not c.exists("k")
            with pytest.raises(KeyNotFoundError):
                c.get("k")
    finally:
        ctl.close()
