"""The shared-file-system tier across real processes: two nodes on one directory, the whole
cluster SIGKILLed, a new cluster on the same path serving every object that reached the tier;
torn and foreign files never served; a full disk a clean error while the upper tiers serve."""

from __future__ import annotations

import os
import random
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvstore.client import Client
from kvstore.errors import ChecksumMismatchError, KeyNotFoundError, KVStoreError, NoSpaceError
from kvstore.node.shared import encode_header, file_name, read_record
from kvstore.node.tiers import checksum_of
from tests.support import Cluster, mount_tmpfs, unmount, wait_until

FAST = ("--heartbeat-interval", "0.1", "--node-ttl", "1")
NS = "it"


def tier_of(c: Client, key: str) -> str:
    return c.locate(key).locations[0].grant.segment


def shared_args(root: Path, size: str = "32MiB") -> tuple[str, ...]:
    return ("--shared-dir", str(root), "--shared", size, "--shared-namespace", NS)


def object_files(root: Path) -> dict[bytes, Path]:
    """Every good object file under the namespace, by the key its header names."""
    out: dict[bytes, Path] = {}
    for path in (root / NS / "owners").glob("*/*.kvo"):
        try:
            out[read_record(path, NS)[0]] = path
        except ChecksumMismatchError:
            continue  # (torn or foreign)
    return out


def moves_settled(c: Client) -> bool:
    return c.stats()["eviction"]["num_moves_in_flight"] == 0


def test_a_new_cluster_on_the_same_path_serves_every_object_that_reached_the_tier(
    cluster_factory: Callable[..., Cluster], tmp_path: Path
) -> None:
    root = tmp_path / "shared"
    first = cluster_factory(
        num_nodes=2,
        dram="1MiB",
        master_args=FAST,
        node_args=("--nvme", "2MiB", *shared_args(root)),
    )
    rng = random.Random(44)
    expected: dict[str, bytes] = {}
    total = 0
    with Client.connect(first.address) as c:
        while total < 10 << 20:  # 10 MiB into 6 MiB of DRAM + NVMe
            keys = [f"s/{len(expected) + i}" for i in range(8)]
            values = [os.urandom(rng.choice([1, 700, 4096, 33_333, 150_000])) for _ in keys]
            assert c.batch_put(keys, values) == [None] * len(keys)
            expected.update(zip(keys, values, strict=True))
            total += sum(map(len, values))
        wait_until(lambda: moves_settled(c), timeout=30, what="demotions to finish")
        on_shared = sorted(k for k in expected if tier_of(c, k) == "shared")  # (none lost)
        # What the upper tiers cannot hold is on the shared tier; which objects went there
        # depends on how far demotion kept up with the puts, so the count is not fixed.
        tiers = c.stats()["tiers"]
        upper = sum(t["capacity_bytes"] for name, t in tiers.items() if name != "shared")
        assert sum(len(expected[k]) for k in on_shared) >= total - upper
        assert len({len(expected[k]) for k in on_shared}) >= 3, "of mixed sizes"
        assert tiers["shared"]["num_replicas"] == len(on_shared)
        wire_key = {k: c.locate(k).locations[0].grant.key for k in on_shared}
    owners = sorted(p.name for p in (root / NS / "owners").iterdir())
    assert len(owners) == 2  # one folder per node, both in one directory

    for d in [*first.nodes, first.master]:  # SIGKILL: nothing is flushed or said goodbye
        d.kill()

    # Damage on disk before the new cluster looks: one file torn, a copy of another with a
    # flipped byte under a new name, a forged key whose bytes fail their checksum, random bytes.
    files = object_files(root)
    assert set(wire_key.values()) <= set(files)
    torn_key, copied_key = on_shared[0], on_shared[1]
    torn = files[wire_key[torn_key]]
    torn.write_bytes(torn.read_bytes()[:-1] if expected[torn_key] else b"x")
    folder = files[wire_key[copied_key]].parent
    raw = bytearray(files[wire_key[copied_key]].read_bytes())
    raw[-1] ^= 0xFF
    (folder / file_name(0xBAD)).write_bytes(raw)
    forged = encode_header(NS, b"forged", 5, checksum_of(b"12345"), 1) + b"12346"
    (folder / file_name(0xBAD + 1)).write_bytes(forged)
    (folder / file_name(0xBAD + 2)).write_bytes(os.urandom(4096))
    num_good = len(object_files(root))  # (what reached the tier, less the torn one)
    assert num_good >= len(on_shared) - 1

    second = cluster_factory(
        num_nodes=2, dram="1MiB", master_args=FAST, node_args=("--nvme", "2MiB", *shared_args(root))
    )
    survivors = [k for k in on_shared if k != torn_key]
    with Client.connect(second.address) as c:
        wait_until(
            lambda: c.stats()["num_objects"] >= num_good,
            timeout=30,
            what="the new cluster to admit the shared tier's objects",
        )
        got = c.batch_get(survivors)
        assert got == [expected[k] for k in survivors]  # bit-exact, from files the first wrote
        assert isinstance(c.batch_get([torn_key])[0], KeyNotFoundError)
        assert isinstance(c.batch_get([b"forged"])[0], KeyNotFoundError)
        assert c.stats()["num_objects"] == num_good  # nothing torn, copied or forged
        # The first cluster's folders were adopted; only those holding bad files are left.
        left = {p.name for p in (root / NS / "owners").iterdir()}
        assert left - set(owners) and left & set(owners) == {folder.name, torn.parent.name}

        # Promotion on read: a shared object read often enough moves up a tier.
        hot = survivors[-1]
        for _ in range(4):
            assert c.get(hot) == expected[hot]
        wait_until(lambda: tier_of(c, hot) != "shared", timeout=15, what="promotion")
        assert c.get(hot) == expected[hot]


@pytest.fixture
def small_shared_fs(tmp_path: Path) -> Iterator[Path]:
    """A 1 MiB tmpfs for the shared tier; unmounted afterwards."""
    mnt = mount_tmpfs(tmp_path / "small", "1m")
    yield mnt
    unmount(mnt)


def test_a_full_shared_disk_is_a_clean_error_and_the_upper_tiers_keep_serving(
    cluster_factory: Callable[..., Cluster], small_shared_fs: Path
) -> None:
    cluster = cluster_factory(num_nodes=0, master_args=FAST)
    try:
        # The node believes it has 32 MiB of shared tier on a file system of 1.
        cluster.add_node("2MiB", extra=shared_args(small_shared_fs))
        stored: dict[str, bytes] = {}
        failed: list[KVStoreError] = []
        with Client.connect(cluster.address) as c:
            for i in range(24):  # 6 MiB of 256 KiB objects
                value = os.urandom(256 << 10)
                try:
                    c.put(f"f/{i}", value)
                except KVStoreError as err:
                    failed.append(err)
                else:
                    stored[f"f/{i}"] = value
            assert failed and all(isinstance(e, NoSpaceError) for e in failed), failed
            wait_until(lambda: moves_settled(c), timeout=30, what="moves to settle")
            tiers = {k: tier_of(c, k) for k in stored}
            assert "dram" in tiers.values() and "shared" in tiers.values()
            for key, value in stored.items():  # nothing acknowledged was lost or torn
                assert c.get(key) == value
            # Still serving: DRAM objects read, and a put that fits in DRAM after removes.
            c.batch_remove([k for k, t in tiers.items() if t == "dram"])
            wait_until(lambda: _put_fits(c, stored), timeout=30, what="a put to fit in DRAM again")
        assert not [p for p in small_shared_fs.rglob(".tmp-*")], "a failed write left a file"
    finally:
        cluster.stop()  # (before the fixture unmounts what the node holds open)


def _put_fits(c: Client, stored: dict[str, bytes]) -> bool:
    value = os.urandom(256 << 10)
    try:
        c.put("f/again", value)
    except NoSpaceError:
        return False
    assert c.get("f/again") == value
    stored["f/again"] = value
    return True
