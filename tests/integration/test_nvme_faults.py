"""The NVMe tier's faults across real processes: a full file system, and records damaged on
disk (bytes flipped, a record cut short) while reads start promotions."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import lmdb
import pytest

from kvstore.client import Client
from kvstore.errors import ChecksumMismatchError, KeyNotFoundError, KVStoreError, NoSpaceError
from kvstore.types import ObjectInfo
from tests.support import Cluster, mount_tmpfs, unmount, wait_until

FAST = ("--heartbeat-interval", "0.1", "--node-ttl", "2")
MIB = 1 << 20


def data_dir_of(cluster: Cluster, node_id: str) -> Path:
    for i in range(len(cluster.nodes)):
        data_dir = cluster.tmp / f"node{i}"
        if (data_dir / "node_id").read_text().strip() == node_id:
            return data_dir
    raise AssertionError(f"no node {node_id} in this cluster")


def damage_nvme_record(data_dir: Path, offset: int, how: str) -> None:
    """Change an NVMe object's lmdb record behind the node's back (another process writing
    the same environment, as lmdb allows): ``flip`` one byte, or ``truncate`` its last chunk."""
    env = lmdb.open(str(data_dir / "nvme"), map_size=0, max_dbs=2, subdir=True)
    try:
        data = env.open_db(b"data", create=False)
        with env.begin(write=True) as txn:
            prefix = offset.to_bytes(8, "big")  # (chunk keys: id, then chunk number)
            cursor = txn.cursor(db=data)
            chunks: list[bytes] = []
            if cursor.set_range(prefix):
                for k in cursor.iternext(values=False):
                    if not k.startswith(prefix):
                        break
                    chunks.append(k)
            assert chunks, f"no NVMe record {offset}"
            target = chunks[0] if how == "flip" else chunks[-1]
            chunk = bytearray(txn.get(target, db=data))
            if how == "flip":
                chunk[len(chunk) // 2] ^= 0xFF
            else:
                del chunk[-1]
            txn.put(target, bytes(chunk), db=data)
    finally:
        env.close()


def only_on_nvme(c: Client, key: str) -> list:
    locations = c.locate(key).locations
    assert [loc.grant.segment for loc in locations] == ["nvme"] * len(locations), locations
    return locations


@pytest.mark.parametrize("how", ["flip", "truncate"])
@pytest.mark.parametrize("replicas", [1, 2])
def test_a_damaged_nvme_replica_is_dropped_though_reads_started_promotions(
    cluster_factory: Callable[..., Cluster], how: str, replicas: int
) -> None:
    # The default --promote-after 3: reads of an NVMe-only object move it up once DRAM has room.
    cluster = cluster_factory(
        num_nodes=2, dram="4MiB", master_args=FAST, node_args=("--nvme", "32MiB")
    )
    value = os.urandom(2 * MIB)
    with Client.connect(cluster.address) as c:
        # DRAM too full for the object on either node: it lands on NVMe and cannot move up.
        # (The fillers are never read: a read's lease would hold their space past the remove.)
        for i in range(2):
            c.put(f"fill/{i}", os.urandom(3 * MIB))
        c.put("obj", value, replicas=replicas)
        only_on_nvme(c, "obj")
        for _ in range(3):  # reads enough to promote it, had DRAM room
            assert c.get("obj") == value
        bad = only_on_nvme(c, "obj")[0]
        damage_nvme_record(data_dir_of(cluster, bad.node_id), bad.grant.offset, how)
        c.batch_remove(["fill/0", "fill/1"])  # DRAM has room: the next read starts a promotion

        def promotions_started() -> int:
            ev = c.stats()["eviction"]
            return ev["num_moves_in_flight"] + ev["num_moves_failed"] + ev["num_promotions"]

        if replicas == 1:
            with pytest.raises(ChecksumMismatchError):
                c.get("obj")
            assert promotions_started() >= 1
            # Reported and dropped, promotion in flight or not: a miss from now on.
            for _ in range(3):
                with pytest.raises(KeyNotFoundError):
                    c.get("obj")
            assert c.stats()["num_corrupt_replicas"] == 1
            return

        # Two replicas: every read is served from the intact one, and the damaged one goes.
        for _ in range(3):
            assert c.get("obj") == value
        assert promotions_started() >= 1
        assert c.stats()["num_corrupt_replicas"] >= 1
        buf = bytearray(len(value))

        def repaired() -> bool:
            info = c.locate("obj")
            if len(info.locations) != 2:
                return False
            for loc in info.locations:  # every replica, read on its own, is intact
                try:
                    c.read_located(ObjectInfo(info.size, info.checksum, [loc]), buf)
                except ChecksumMismatchError:
                    return False  # (reported again: the master drops it)
                if bytes(buf) != value:
                    return False
            return True

        wait_until(repaired, timeout=30, what="the damaged replica to be replaced")
        assert c.get("obj") == value


@pytest.fixture
def small_nvme_disks(tmp_path: Path) -> Iterator[Callable[[Path], None]]:
    """Mounts an 8 MiB tmpfs where a node keeps its NVMe tier; unmounts them afterwards."""
    mounted: list[Path] = []

    def mount(data_dir: Path) -> None:
        mounted.append(mount_tmpfs(data_dir / "nvme", "8m"))

    yield mount
    for where in mounted:
        unmount(where)  # (lazily where a node still has the files open)


def test_puts_fail_typed_on_a_full_nvme_disk_and_succeed_again_after_removes(
    cluster_factory: Callable[..., Cluster],
    small_nvme_disks: Callable[[Path], None],
) -> None:
    cluster = cluster_factory(num_nodes=0, master_args=FAST)
    try:
        # Each node believes it has 32 MiB of NVMe on a file system of 8.
        for i in range(2):
            small_nvme_disks(cluster.tmp / f"node{i}")
            cluster.add_node("1MiB", extra=("--nvme", "32MiB"))
        stored: dict[str, bytes] = {}
        failed: list[KVStoreError] = []
        with Client.connect(cluster.address) as c:
            for i in range(14):  # 21 MiB of objects too large for DRAM, into 16 MiB of disk
                value = os.urandom(3 * MIB // 2)
                try:
                    c.put(f"big/{i}", value)
                except KVStoreError as err:
                    failed.append(err)
                else:
                    stored[f"big/{i}"] = value
            assert failed and all(isinstance(e, NoSpaceError) for e in failed), failed
            assert len(stored) >= 4
            for key, value in stored.items():  # nothing acknowledged was lost
                assert c.get(key) == value
            # Removes free the disks again (once the nodes apply them): puts succeed, no restart.
            kept = sorted(stored)[-1]
            c.batch_remove([k for k in stored if k != kept])
            again: dict[str, bytes] = {}

            def put_fits() -> bool:
                value = os.urandom(3 * MIB // 2)
                key = f"again/{len(again)}"
                try:
                    c.put(key, value)
                except NoSpaceError:
                    return False  # (the nodes have not deleted the removed objects yet)
                again[key] = value
                return len(again) >= 4

            wait_until(put_fits, timeout=30, what="puts to fit again after removes")
            for key, value in {kept: stored[kept], **again}.items():
                assert c.get(key) == value
    finally:
        cluster.stop()  # (before the fixture unmounts what the nodes hold open)
