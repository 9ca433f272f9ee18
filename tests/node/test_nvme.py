"""The NVMe tier on real lmdb files."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvstore.errors import (
    ChecksumMismatchError,
    InvalidRequestError,
    KeyNotFoundError,
    KVStoreError,
    NoSpaceError,
    TierError,
)
from kvstore.node import nvme
from kvstore.node.nvme import NvmeTier
from kvstore.node.tiers import StoredObject, checksum_of
from tests.support import mount_tmpfs, unmount, wait_until


def obj(offset: int, data: bytes, key: bytes = b"k") -> tuple[StoredObject, memoryview]:
    return StoredObject(
        "nvme", offset, key + b"/%d" % offset, len(data), checksum_of(data)
    ), memoryview(data)


def test_round_trip_split_into_chunks_and_survives_reopen(tmp_path: Path) -> None:
    tier = NvmeTier(tmp_path / "nvme", 8 << 20, chunk_bytes=4096)
    values = {i: os.urandom(n) for i, n in enumerate([0, 1, 4095, 4096, 4097, 100_000], start=1)}
    assert tier.write([obj(i, v) for i, v in values.items()]) == [None] * len(values)
    for i, v in values.items():
        assert bytes(tier.read(i, len(v))) == v
    tier.close()
    again = NvmeTier(tmp_path / "nvme", 8 << 20, chunk_bytes=4096)
    stored = {o.offset: o for o in again.stored()}
    assert set(stored) == set(values)
    assert all(stored[i].size == len(v) and stored[i].key == b"k/%d" % i for i, v in values.items())
    assert bytes(again.read(6, 100_000)) == values[6]
    again.forget([6, 99])
    with pytest.raises(KeyNotFoundError):
        again.read(6, 100_000)
    assert {o.offset for o in again.stored()} == set(values) - {6}
    again.close()


def test_bad_writes_and_reads(tmp_path: Path) -> None:
    tier = NvmeTier(tmp_path / "nvme", 1 << 20)
    good, view = obj(1, b"hello")
    wrong = StoredObject("nvme", 2, b"x", 5, checksum_of(b"other"))
    short = StoredObject("nvme", 3, b"y", 10, checksum_of(b"hello"))
    res = tier.write([(good, view), (wrong, memoryview(b"hello")), (short, memoryview(b"hello"))])
    assert res[0] is None
    assert isinstance(res[1], ChecksumMismatchError)
    assert isinstance(res[2], InvalidRequestError)
    assert [o.offset for o in tier.stored()] == [1]
    with pytest.raises(KeyNotFoundError):
        tier.read(1, 6)  # the wrong size never returns other bytes
    with pytest.raises(KeyNotFoundError):
        tier.read(42, 5)
    tier.close()


@pytest.mark.parametrize("size", [0, -1])
def test_bad_sizes(tmp_path: Path, size: int) -> None:
    with pytest.raises(InvalidRequestError):
        NvmeTier(tmp_path / "nvme", size)


def test_corrupt_file_is_a_tier_error(tmp_path: Path) -> None:
    path = tmp_path / "nvme"
    path.mkdir()
    (path / "data.mdb").write_bytes(os.urandom(64 << 10))
    with pytest.raises(TierError):
        NvmeTier(path, 1 << 20)


def test_full_lmdb_file_fails_the_items_that_do_not_fit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(nvme, "_OVERHEAD_BYTES", 256 << 10)
    tier = NvmeTier(tmp_path / "nvme", 1 << 20)
    items = [obj(i, os.urandom(300_000)) for i in range(1, 11)]  # 3 MB into a ~2.3 MB map
    res = tier.write(items)
    assert any(r is None for r in res)
    assert any(isinstance(r, NoSpaceError) for r in res)
    for (o, v), r in zip(items, res, strict=True):
        if r is None:
            assert bytes(tier.read(o.offset, o.size)) == bytes(v)
    tier.close()


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    """An 8 MiB tmpfs: a real file system that fills up (ENOSPC), unmounted afterwards."""
    mnt = mount_tmpfs(tmp_path / "fs", "8m")
    try:
        yield mnt
    finally:
        unmount(mnt)  # (lazily where a failed test left the lmdb files open)


def _fill(tier: NvmeTier, size: int, first: int = 1) -> tuple[dict[int, bytes], KVStoreError]:
    """Store objects of ``size`` bytes from id ``first`` on until one fails; the stored ones and
    the error."""
    stored: dict[int, bytes] = {}
    for offset in range(first, first + 1000):
        data = os.urandom(size)
        (err,) = tier.write([obj(offset, data)])
        if err is not None:
            return stored, err
        stored[offset] = data
    raise AssertionError("the file system never filled up")


def test_a_full_file_system_fails_the_put_and_serves_again_after_deletes(small_fs: Path) -> None:
    # A tier that thinks it has 32 MiB on a file system of 8: the disk fills first.
    tier = NvmeTier(small_fs / "nvme", 32 << 20)
    stored, err = _fill(tier, 512 << 10)
    assert isinstance(err, NoSpaceError), err
    assert len(stored) > 4
    for offset, data in stored.items():  # nothing acknowledged was lost
        assert bytes(tier.read(offset, len(data))) == data
    with pytest.raises(KeyNotFoundError):
        tier.read(max(stored) + 1, 512 << 10)  # the failed put left nothing
    # The master deletes objects; new puts fit again, without a restart.
    gone = sorted(stored)[:-2]
    tier.forget(gone)
    kept = {o: stored[o] for o in sorted(stored)[-2:]}
    for offset in range(1000, 1000 + len(gone) // 2):
        data = os.urandom(512 << 10)
        assert tier.write([obj(offset, data)]) == [None], offset
        kept[offset] = data
    for offset, data in kept.items():
        assert bytes(tier.read(offset, len(data))) == data
    assert {o.offset for o in tier.stored()} == set(kept)
    tier.close()
    again = NvmeTier(small_fs / "nvme", 32 << 20)  # what was acknowledged survives a restart
    assert {o.offset for o in again.stored()} == set(kept)
    again.close()


def test_reads_on_other_threads_go_on_while_failed_commits_reopen(small_fs: Path) -> None:
    tier = NvmeTier(small_fs / "nvme", 32 << 20)
    hot = os.urandom(100_000)
    assert tier.write([obj(1, hot)]) == [None]
    stop = threading.Event()
    num_reads = [0, 0]  # per reader thread: reads that got the exact bytes
    failures: list[BaseException] = []

    def reader(slot: int) -> None:
        try:
            while not stop.is_set():
                assert bytes(tier.read(1, len(hot))) == hot
                assert 1 in {o.offset for o in tier.stored()}
                num_reads[slot] += 1
        except BaseException as exc:  # noqa: BLE001 - reported by the test thread
            failures.append(exc)

    threads = [threading.Thread(target=reader, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    try:
        _stored, err = _fill(tier, 512 << 10, first=10)
        assert isinstance(err, NoSpaceError), err
        for offset in range(2000, 2004):  # every one of these fails, reopens and retries
            seen = sum(num_reads)
            wait_until(lambda n=seen: sum(num_reads) > n or bool(failures), what="reads to go on")
            (err,) = tier.write([obj(offset, os.urandom(512 << 10))])
            assert isinstance(err, NoSpaceError), err
        assert tier.num_reopens >= 8
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=30)
        tier.close()
    assert not failures, failures
