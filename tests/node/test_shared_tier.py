"""The shared-file-system tier (kvstore.node.shared) on real files: atomic writes, ownership by
folder lock, adoption of a gone node's folder, torn and foreign files ignored, a full disk."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvstore.errors import (
    ChecksumMismatchError,
    InvalidRequestError,
    KeyNotFoundError,
    NoSpaceError,
    TierError,
)
from kvstore.node import shared
from kvstore.node.shared import SharedTier, encode_header, file_name, read_record
from kvstore.node.tiers import StoredObject, checksum_of
from tests.support import mount_tmpfs, unmount

SIZES = [0, 1, 4095, 65_536, 1_000_003]


def obj(
    offset: int, data: bytes, key: bytes = b"k", stamp: int = 7
) -> tuple[StoredObject, memoryview]:
    return StoredObject(
        "shared", offset, key + b"/%d" % offset, len(data), checksum_of(data), stamp
    ), memoryview(data)


def tier(root: Path, owner: str = "node-a", **kw: object) -> SharedTier:
    return SharedTier(root, "ns1", owner, 64 << 20, **kw)  # type: ignore[arg-type]


def fill(t: SharedTier, sizes: list[int] = SIZES, first: int = 1) -> dict[int, bytes]:
    values = {i: os.urandom(n) for i, n in enumerate(sizes, start=first)}
    assert t.write([obj(i, v) for i, v in values.items()]) == [None] * len(values)
    return values


def test_round_trip_one_file_per_object_and_no_temp_left(tmp_path: Path) -> None:
    t = tier(tmp_path)
    values = fill(t)
    for i, v in values.items():
        assert bytes(t.read(i, len(v))) == v
    names = sorted(os.listdir(t.path))
    assert names == sorted([".lock", *(file_name(i) for i in values)])
    assert t.path == tmp_path / "ns1" / "owners" / "node-a"
    key, size, checksum, stamp, _ = read_record(t.path / file_name(5), "ns1")
    assert (key, size, checksum, stamp) == (b"k/5", len(values[5]), checksum_of(values[5]), 7)
    assert t.used_bytes() == sum(SIZES)
    t.close()


def test_restart_on_the_same_folder_keeps_ids_and_bytes(tmp_path: Path) -> None:
    t = tier(tmp_path)
    values = fill(t)
    before = sorted(t.stored(), key=lambda o: o.offset)
    t.close()
    again = tier(tmp_path)
    assert sorted(again.stored(), key=lambda o: o.offset) == before
    for i, v in values.items():
        assert bytes(again.read(i, len(v))) == v
    assert again.report.num_objects == len(values) and again.report.num_adopted == 0
    again.close()


def test_forget_deletes_the_file(tmp_path: Path) -> None:
    t = tier(tmp_path)
    values = fill(t)
    t.forget([2, 999])
    assert not (t.path / file_name(2)).exists()
    with pytest.raises(KeyNotFoundError):
        t.read(2, len(values[2]))
    assert {o.offset for o in t.stored()} == set(values) - {2}
    t.close()


def test_a_live_folder_is_not_served_twice(tmp_path: Path) -> None:
    a = tier(tmp_path, "node-a")
    fill(a)
    with pytest.raises(TierError, match="another live process"):
        tier(tmp_path, "node-a")
    b = tier(tmp_path, "node-b")  # a's lock is held: b adopts nothing
    assert b.stored() == [] and b.report.num_adopted == 0
    assert len(a.stored()) == len(SIZES)
    b.close()
    a.close()


def test_a_gone_nodes_folder_is_adopted_once_under_fresh_ids(tmp_path: Path) -> None:
    a = tier(tmp_path, "node-a")
    values = fill(a)
    by_key = {o.key: values[o.offset] for o in a.stored()}
    a.close()  # (as a SIGKILL would: the lock goes with the process)
    b = tier(tmp_path, "node-b")
    assert b.report.num_adopted == len(values)
    assert not (tmp_path / "ns1" / "owners" / "node-a").exists()
    stored = b.stored()
    assert {o.key for o in stored} == set(by_key)
    assert min(o.offset for o in stored) > max(values)  # fresh ids, above the wall clock
    for o in stored:
        assert bytes(b.read(o.offset, o.size)) == by_key[o.key]
        assert o.stamp == 7 and o.checksum == checksum_of(by_key[o.key])
    c = tier(tmp_path, "node-c")  # b holds what it adopted
    assert c.stored() == []
    c.close()
    b.close()


def _damage(path: Path, how: str) -> None:
    raw = bytearray(path.read_bytes())
    if how == "truncated":
        path.write_bytes(raw[:-10])
    elif how == "longer":
        path.write_bytes(raw + b"x")
    elif how == "random":
        path.write_bytes(os.urandom(len(raw)))
    elif how == "bad checksum":
        raw[-1] ^= 0xFF
        path.write_bytes(raw)
    elif how == "other namespace":
        _, size, checksum, stamp, header_bytes = read_record(path, "ns1")
        key = bytes(raw[shared._HEADER.size : header_bytes])
        path.write_bytes(encode_header("ns2", key, size, checksum, stamp) + raw[header_bytes:])
    elif how == "empty":
        path.write_bytes(b"")


@pytest.mark.parametrize(
    "how", ["truncated", "longer", "random", "bad checksum", "other namespace", "empty"]
)
@pytest.mark.parametrize("owner", ["node-a", "node-b"])  # its own folder, an adopted one
def test_torn_and_foreign_files_are_ignored_never_served(
    tmp_path: Path, how: str, owner: str
) -> None:
    a = tier(tmp_path, "node-a")
    values = fill(a)
    damaged = a.path / file_name(5)
    a.close()
    _damage(damaged, how)
    t = tier(tmp_path, owner)
    assert t.report.num_ignored == 1, t.report.reasons
    keys = {o.key for o in t.stored()}
    assert b"k/5" not in keys and len(keys) == len(values) - 1
    for o in t.stored():
        assert bytes(t.read(o.offset, o.size)) == values[int(o.key.split(b"/")[1])]
    with pytest.raises(KeyNotFoundError):
        t.read(5, len(values[5]))
    assert damaged.exists()  # left for the operator, never claimed
    t.close()


def test_stray_files_and_temp_files(tmp_path: Path) -> None:
    a = tier(tmp_path)
    fill(a, [100])
    a.close()
    (a.path / "notes.txt").write_text("hello")
    (a.path / ".tmp-0000000000000009-abcd").write_bytes(b"half a write")
    again = tier(tmp_path)
    assert [o.offset for o in again.stored()] == [1]
    assert again.report.num_ignored == 1 and again.report.num_temp_removed == 1
    assert not (a.path / ".tmp-0000000000000009-abcd").exists()
    again.close()


def test_a_file_replaced_under_the_tier_is_not_served(tmp_path: Path) -> None:
    t = tier(tmp_path)
    values = fill(t)
    path = t.path / file_name(4)
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 1
    path.write_bytes(raw)
    with pytest.raises(ChecksumMismatchError):
        t.read(4, len(values[4]))
    path.unlink()
    with pytest.raises(KeyNotFoundError):
        t.read(4, len(values[4]))
    t.close()


def test_bad_writes_store_nothing(tmp_path: Path) -> None:
    t = tier(tmp_path)
    good, data = obj(1, b"abc")
    wrong = StoredObject("shared", 2, b"x", 3, checksum_of(b"abd"))
    short = StoredObject("shared", 3, b"y", 4, checksum_of(b"abc"))
    errs = t.write([(good, data), (wrong, memoryview(b"abc")), (short, memoryview(b"abc"))])
    assert errs[0] is None
    assert isinstance(errs[1], ChecksumMismatchError)
    assert isinstance(errs[2], InvalidRequestError)
    assert [o.offset for o in t.stored()] == [1]
    t.close()


@pytest.mark.parametrize(
    "kw", [{"capacity": 0}, {"namespace": "../up"}, {"namespace": ""}, {"owner": "a/b"}]
)
def test_bad_arguments(tmp_path: Path, kw: dict[str, object]) -> None:
    args: dict[str, object] = {"namespace": "ns1", "owner": "node-a", "capacity": 1 << 20}
    args.update(kw)
    with pytest.raises(InvalidRequestError):
        SharedTier(tmp_path, **args)  # type: ignore[arg-type]


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    """A 1 MiB tmpfs: a real file system that fills up (ENOSPC), unmounted afterwards."""
    mnt = mount_tmpfs(tmp_path / "fs", "1m")
    try:
        yield mnt
    finally:
        unmount(mnt)


def test_a_full_disk_is_no_space_and_leaves_nothing(small_fs: Path) -> None:
    t = tier(small_fs)  # believes it has 64 MiB on 1 MiB
    value = os.urandom(300_000)
    errs = t.write([obj(i, value) for i in range(1, 6)])
    assert errs[:3] == [None] * 3
    assert all(isinstance(e, NoSpaceError) for e in errs[3:]), errs
    assert "full" in errs[3].message  # type: ignore[union-attr]
    assert sorted(o.offset for o in t.stored()) == [1, 2, 3]
    assert not [n for n in os.listdir(t.path) if n.startswith(".tmp-")]
    assert t.num_writes_full == 2
    t.forget([1, 2])  # room again
    assert t.write([obj(9, value)]) == [None]
    assert bytes(t.read(9, len(value))) == value
    t.close()
