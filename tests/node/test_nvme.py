"""The NVMe tier on real lmdb files."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvstore.errors import (
    ChecksumMismatchError,
    InvalidRequestError,
    KeyNotFoundError,
    NoSpaceError,
    TierError,
)
from kvstore.node import nvme
from kvstore.node.nvme import NvmeTier
from kvstore.node.tiers import StoredObject, checksum_of


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
