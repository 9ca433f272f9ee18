"""The checksum table at the end of a block object: chunk sizes, and what it catches."""

from __future__ import annotations

import numpy as np
import pytest
import xxhash

from kvstore.kvblocks import (
    HASH_RUN,
    checksum_table,
    checksum_table_bytes,
    chunks_per_plane,
    seal_block,
    verify_chunks,
)


@pytest.mark.parametrize(
    ("block_size", "chunks"), [(1, 1), (2, 2), (3, 3), (5, 1), (6, 3), (16, 4), (512, 4)]
)
def test_chunks_divide_the_block(block_size: int, chunks: int) -> None:
    assert chunks_per_plane(block_size) == chunks
    assert block_size % chunks == 0


def test_table_catches_flips_in_data_table_and_seal() -> None:
    bs, stride, num_planes = 16, 8, 6
    planes = np.random.default_rng(0).integers(0, 256, (num_planes, bs * stride), dtype=np.uint8)
    table = checksum_table(b"kv/a", planes, bs)
    assert table.nbytes == checksum_table_bytes(num_planes, bs)
    chunk = bs // chunks_per_plane(bs) * stride
    first_two = {p: planes[p, : 2 * chunk] for p in range(num_planes)}
    assert verify_chunks(b"kv/a", table.tobytes(), first_two, bs, chunk)
    assert not verify_chunks(b"kv/b", table.tobytes(), first_two, bs, chunk), "another key"
    bad = {**first_two, 3: first_two[3].copy()}
    bad[3][chunk + 1] ^= 1
    assert not verify_chunks(b"kv/a", table.tobytes(), bad, bs, chunk)
    raw = bytearray(table.tobytes())
    raw[5] ^= 1
    assert not verify_chunks(b"kv/a", bytes(raw), first_two, bs, chunk), "a flipped table entry"
    assert not verify_chunks(b"kv/a", table.tobytes(), {0: planes[0, :5]}, bs, chunk), "partial"


def test_a_table_from_separate_planes_equals_the_table_from_their_rows() -> None:
    # KVCache.store seals a block from its planes as they lie in the engine's tensors.
    bs, stride, num_planes = 64, 24, 6
    rows = np.random.default_rng(1).integers(0, 256, (num_planes, bs * stride), dtype=np.uint8)
    separate = [rows[p].reshape(bs, stride).copy() for p in range(num_planes)]
    assert np.array_equal(checksum_table(b"kv/a", separate, bs), checksum_table(b"kv/a", rows, bs))


@pytest.mark.parametrize("block_size", [1, 6, 16, 64])
def test_a_seal_fills_the_table_and_returns_the_whole_objects_checksum(block_size: int) -> None:
    # KVCache.store hashes each block once, in the seal: its table must be the table readers
    # check chunks against, and its checksum the xxh3_64 of the object as stored (planes, table).
    stride, num_planes = 24, 6
    rows = np.random.default_rng(2).integers(
        0, 256, (num_planes, block_size * stride), dtype=np.uint8
    )
    table = np.zeros(checksum_table_bytes(num_planes, block_size) // 8, dtype="<u8")
    digest = seal_block(b"kv/a", [memoryview(r) for r in rows], block_size, table)
    assert np.array_equal(table, checksum_table(b"kv/a", rows, block_size))
    assert digest == xxhash.xxh3_64_intdigest(rows.tobytes() + table.tobytes())


def test_a_seal_over_planes_larger_than_a_cache_run_hashes_every_chunk_in_order() -> None:
    # Planes are hashed in cache-sized runs (HASH_RUN): the table must still be each plane's
    # chunks in order and the seal, and the checksum that of every plane then the table,
    # whatever the split (7 planes of 100 KiB: runs of 2, 2, 2 and 1).
    block_size, stride, num_planes = 64, 1600, 7
    assert HASH_RUN // (block_size * stride) == 2  # two planes a run
    rows = np.random.default_rng(3).integers(
        0, 256, (num_planes, block_size * stride), dtype=np.uint8
    )
    n = chunks_per_plane(block_size)
    step = block_size * stride // n
    want = [
        xxhash.xxh3_64_intdigest(r[o : o + step]) for r in rows for o in range(0, n * step, step)
    ]
    want.append(xxhash.xxh3_64_intdigest(b"kv/a" + np.array(want, dtype="<u8").tobytes()))
    table = np.zeros(checksum_table_bytes(num_planes, block_size) // 8, dtype="<u8")
    digest = seal_block(b"kv/a", [memoryview(r) for r in rows], block_size, table)
    assert table.tolist() == want
    assert digest == xxhash.xxh3_64_intdigest(rows.tobytes() + table.tobytes())
