"""How KV-cache blocks map onto stored objects (shared by the client and the master).

A block object is stored under ``kv/<namespace digest hex>/<block key hex>``: the block key
already identifies the whole prefix (chained hash), and carrying the namespace digest lets the
master drop a block from the right prefix tree when its object goes away.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import msgpack
import numpy as np
import xxhash

from kvstore.errors import InvalidRequestError
from kvstore.keys import BLOCK_KEY_BYTES, BlockKey

KV_PREFIX = b"kv/"
#: One small object per stored prompt: the namespace and the tokens of its full blocks. It lives
#: in the pool like any object, so it survives a master failover in the nodes' manifests, and a
#: new leader rebuilds the prefix index from it (block objects hold KV bytes only, no tokens).
KV_META_PREFIX = b"kvmeta/"
_KEY_LEN = len(KV_PREFIX) + 32 + 1 + 2 * BLOCK_KEY_BYTES


def is_kv_key(key: bytes) -> bool:
    """Keys the KV-cache layer owns (blocks and prompt metas)."""
    return key.startswith(KV_PREFIX) or key.startswith(KV_META_PREFIX)


def kv_object_key(ns_digest: bytes, block_key: BlockKey) -> bytes:
    return KV_PREFIX + ns_digest.hex().encode() + b"/" + block_key.hex().encode()


def kv_object_keys(ns_digest: bytes, block_keys: Iterable[BlockKey]) -> list[bytes]:
    """:func:`kv_object_key` of each of ``block_keys`` (the namespace's part made once)."""
    head = KV_PREFIX + ns_digest.hex().encode() + b"/"
    return [head + k.hex().encode() for k in block_keys]


def parse_kv_object_key(key: bytes) -> tuple[bytes, BlockKey] | None:
    """(namespace digest, block key) of a block object's key, or None for any other key."""
    if len(key) != _KEY_LEN or not key.startswith(KV_PREFIX):
        return None
    try:
        digest = bytes.fromhex(key[3:35].decode())
        block = bytes.fromhex(key[36:].decode())
    except ValueError:
        return None
    return digest, BlockKey(block)


def kv_meta_key(ns_digest: bytes, last_block_key: BlockKey) -> bytes:
    return KV_META_PREFIX + ns_digest.hex().encode() + b"/" + last_block_key.hex().encode()


def encode_prompt_meta(namespace_dict: dict[str, object], tokens: np.ndarray) -> bytes:
    return msgpack.packb(
        {"namespace": namespace_dict, "tokens": tokens_to_wire(tokens)}, use_bin_type=True
    )


def decode_prompt_meta(raw: bytes) -> tuple[dict[str, object], np.ndarray]:
    """Raises InvalidRequestError for anything that is not a prompt meta object."""
    try:
        obj = msgpack.unpackb(raw, raw=False)
    except Exception:  # noqa: BLE001 - msgpack raises many types for bad input
        raise InvalidRequestError("prompt meta is not msgpack") from None
    if not isinstance(obj, dict) or not isinstance(obj.get("namespace"), dict):
        raise InvalidRequestError("prompt meta must be a map with a namespace")
    return obj["namespace"], tokens_from_wire(obj.get("tokens"))


def tokens_to_wire(tokens: np.ndarray) -> bytes:
    """Token ids on the wire: little-endian uint32, packed."""
    return np.ascontiguousarray(tokens, dtype="<u4").tobytes()


def tokens_from_wire(raw: object) -> np.ndarray:
    if not isinstance(raw, bytes) or len(raw) % 4:
        raise InvalidRequestError("tokens must be packed little-endian uint32 bytes")
    return np.frombuffer(raw, dtype="<u4")


# --------------------------------------------------------------------------- checksum table
#: Token chunks per (layer, K/V) plane that carry their own checksum (fewer where block_size is
#: not a multiple): a read of the first k tokens of a block reads whole chunks (k rounded up).
CHUNKS_PER_PLANE = 4
_U64 = np.dtype("<u8")
#: Bytes of planes hashed together (whole, then by chunk) while they are in the CPU cache.
HASH_RUN = 256 << 10


def chunks_per_plane(block_size: int) -> int:
    """How many checksummed token chunks each plane of a block has (divides ``block_size``)."""
    for n in range(min(CHUNKS_PER_PLANE, block_size), 0, -1):
        if block_size % n == 0:
            return n
    return 1


def checksum_table_bytes(num_planes: int, block_size: int) -> int:
    """Bytes of a block's checksum table: one xxh3_64 per (plane, chunk), then the seal."""
    return (num_planes * chunks_per_plane(block_size) + 1) * _U64.itemsize


def checksum_table(
    key: bytes, planes: np.ndarray | Sequence[np.ndarray], block_size: int
) -> np.ndarray:
    """The checksum table stored after a block's planes.

    Why a table and not only the object checksum: the object checksum covers the whole block,
    so a read of its first k tokens (the last, partial block of a match) or of one layer (a
    layer-wise load) cannot be checked against it. Each (layer, K/V) plane is cut into
    :func:`chunks_per_plane` token chunks, each with its xxh3_64; the last entry, the *seal*,
    is the xxh3_64 of the object key followed by the other entries, which ties the table to its
    key (bytes of another block found at that place do not pass).

    Args:
        key: the block's object key.
        planes: ``[num_planes, block_size * stride]`` uint8, the block's planes in object order,
            or a sequence of them, each contiguous (e.g. slices of per-layer tensors).
        block_size: tokens per block.

    Returns:
        ``(num_planes * chunks + 1)`` little-endian uint64 checksums.
    """
    table = np.empty(len(planes) * chunks_per_plane(block_size) + 1, dtype=_U64)
    flat = [memoryview(np.ascontiguousarray(p).reshape(-1).view(np.uint8)) for p in planes]
    _fill_table(key, flat, block_size, table, None)
    return table


def seal_block(key: bytes, planes: Sequence[memoryview], block_size: int, table: np.ndarray) -> int:
    """Fill a block's checksum table and return the object checksum, in one pass.

    The same table as :func:`checksum_table`, and the xxh3_64 of the whole object (the planes,
    then the table) that a put sends with it, each byte read from memory once (see
    :func:`_fill_table`; this is the hashing of every block a ``KVCache.store`` puts).

    Args:
        key: the block's object key.
        planes: the block's planes in object order, each a flat ``'B'`` memoryview.
        block_size: tokens per block.
        table: ``(len(planes) * chunks + 1,)`` little-endian uint64, filled here.

    Returns:
        The object checksum.
    """
    whole = xxhash.xxh3_64()
    _fill_table(key, planes, block_size, table, whole)
    whole.update(table)
    return whole.intdigest()


def _fill_table(
    key: bytes,
    planes: Sequence[memoryview],
    block_size: int,
    table: np.ndarray,
    whole: xxhash.xxh3_64 | None,
) -> None:
    """Fill ``table`` from flat plane views of one size (memoryview slices, no numpy per chunk:
    this runs for every block stored), feeding every plane to ``whole`` in order.

    The planes go in runs of about ``HASH_RUN`` bytes: each run's planes are hashed whole, then
    its chunks, while the run is still in the CPU cache, the chunk hashes of a run from one
    ``map``. (Hashing plane by plane, chunks then the whole plane, is slower, most of all for
    many small planes: ``.venv/bin/python bench/profile_kvcache.py --model smollm2`` profiles
    ``KVCache.store``.)"""
    n = chunks_per_plane(block_size)
    h64 = xxhash.xxh3_64_intdigest
    sums: list[int] = []
    if planes:
        size = len(planes[0])
        step = size // n
        offsets = range(0, step * n, step)
        per_run = max(1, HASH_RUN // size)
        for lo in range(0, len(planes), per_run):
            run = planes[lo : lo + per_run]
            if whole is not None:
                for plane in run:
                    whole.update(plane)
            sums += map(h64, [plane[o : o + step] for plane in run for o in offsets])
    table[:-1] = sums
    table[-1] = h64(key + table[:-1].tobytes())


def verify_chunks(
    key: bytes,
    table_bytes: memoryview | bytes | np.ndarray,
    planes: dict[int, np.ndarray],
    block_size: int,
    chunk_bytes: int,
) -> bool:
    """Whether the chunks read match the block's checksum table, and the table its key.

    Args:
        key: the block's object key.
        table_bytes: the checksum table as read from the object.
        planes: plane number -> its leading whole chunks as read (uint8, a multiple of
            ``chunk_bytes`` long).
        block_size: tokens per block.
        chunk_bytes: bytes of one chunk (``block_size // chunks_per_plane * stride``).
    """
    table = np.frombuffer(table_bytes, dtype=_U64)
    n = chunks_per_plane(block_size)
    if xxhash.xxh3_64_intdigest(key + table[:-1].tobytes()) != int(table[-1]):
        return False
    for p, data in planes.items():
        flat = data.reshape(-1)
        if len(flat) % chunk_bytes or len(flat) > n * chunk_bytes:
            return False
        for j in range(len(flat) // chunk_bytes):
            chunk = flat[j * chunk_bytes : (j + 1) * chunk_bytes]
            if xxhash.xxh3_64_intdigest(chunk) != int(table[p * n + j]):
                return False
    return True
