"""What the Mooncake wheel's binding takes and gives back, for ``mooncake.py``: its error codes
and the map to them from kvstore's; its ``ReplicateConfig`` and ``BufferHandle`` values; its
argument conversions (bytes-like values, unsigned 64-bit integers, key text); and the steps of
``get_into_ranges`` that need no cluster (its nested arguments, its plan, the copy of one range).

Kept apart from the store class so that the class holds only what each verb does with a cluster;
``kvstore.client.compat.mooncake`` re-exports the public names, which users import from there.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from typing import Any

from kvstore.client.compat.mooncake_values import error_shape, memory_at
from kvstore.errors import ErrorCode, KVStoreError

#: Per buffer, per key, per range: the shape of ``get_into_ranges``'s offsets, sizes and answers.
Ranges = list[list[list[int]]]


class ErrorCodes:
    """Mooncake's error codes (mooncake-store ``types.h``) that this layer answers with."""

    OK = 0
    INTERNAL_ERROR = -1
    NO_AVAILABLE_HANDLE = -200
    INVALID_PARAMS = -600
    INVALID_READ = -701
    REPLICA_IS_NOT_READY = -703
    OBJECT_NOT_FOUND = -704
    OBJECT_ALREADY_EXISTS = -705
    OBJECT_HAS_LEASE = -706
    TRANSFER_FAIL = -800
    RPC_FAIL = -900


CODE_FOR = {
    ErrorCode.KEY_NOT_FOUND: ErrorCodes.OBJECT_NOT_FOUND,
    ErrorCode.INVALID_REQUEST: ErrorCodes.INVALID_PARAMS,
    ErrorCode.OUT_OF_RANGE: ErrorCodes.INVALID_PARAMS,
    ErrorCode.NO_SPACE: ErrorCodes.NO_AVAILABLE_HANDLE,
    ErrorCode.OBJECT_BUSY: ErrorCodes.REPLICA_IS_NOT_READY,
    ErrorCode.OBJECT_EXISTS: ErrorCodes.OBJECT_ALREADY_EXISTS,
    ErrorCode.CHECKSUM_MISMATCH: ErrorCodes.INVALID_READ,
    ErrorCode.NODE_UNAVAILABLE: ErrorCodes.TRANSFER_FAIL,
    ErrorCode.NODE_NOT_FOUND: ErrorCodes.TRANSFER_FAIL,
    ErrorCode.GRANT_INVALID: ErrorCodes.TRANSFER_FAIL,
    ErrorCode.TRANSPORT_UNAVAILABLE: ErrorCodes.TRANSFER_FAIL,
    ErrorCode.TIMEOUT: ErrorCodes.RPC_FAIL,
    ErrorCode.MASTER_UNAVAILABLE: ErrorCodes.RPC_FAIL,
    ErrorCode.NOT_LEADER: ErrorCodes.RPC_FAIL,
    ErrorCode.ETCD_UNAVAILABLE: ErrorCodes.RPC_FAIL,
}


def error_code(err: BaseException) -> int:
    """The Mooncake code for a kvstore error (anything unexpected is INTERNAL_ERROR)."""
    if isinstance(err, KVStoreError):
        return CODE_FOR.get(err.code, ErrorCodes.INTERNAL_ERROR)
    return ErrorCodes.INTERNAL_ERROR


class ReplicateConfig:
    """Mooncake's per-put replication settings. kvstore honours ``replica_num`` (copies on
    distinct nodes); the placement and pin fields are kept for programs that set them."""

    def __init__(self) -> None:
        self.replica_num = 1
        self.nof_replica_num = 0
        self.dfs_replica_num = 0
        self.with_soft_pin = False
        self.with_hard_pin = False
        self.soft_pin_ttl_ms = 0
        self.preferred_segment = ""
        self.preferred_segments: list[str] = []
        self.preferred_nof_segments: list[str] = []
        self.prefer_alloc_in_same_node = False
        self.group_ids: list[str] = []

    def __repr__(self) -> str:
        return f"ReplicateConfig: {{ replica_num: {self.replica_num} }}"


class BufferHandle(bytearray):
    """What ``get_buffer`` returns: the object's bytes, with Mooncake's ``ptr()`` / ``size()``.

    A bytearray, so ``memoryview(handle)`` and ``bytes(handle)`` work as with Mooncake's."""

    def ptr(self) -> int:
        """Address of the first byte (valid while the handle lives and is not resized)."""
        if not self:
            return 0
        return ctypes.addressof((ctypes.c_char * len(self)).from_buffer(self))

    def size(self) -> int:
        """Bytes held."""
        return len(self)


def bytes_like(value: Any, what: str) -> memoryview:
    """``value`` as bytes, as the wheel's ``Buffer`` arguments take it.

    Raises:
        TypeError: not a bytes-like object (the wheel's binding raises the same).
    """
    try:
        return memoryview(value).cast("B")
    except (TypeError, ValueError) as err:
        raise TypeError(
            f"{what}: a bytes-like object is required, not {type(value).__name__!r}"
        ) from err


def u64(value: Any, what: str) -> int:
    """An unsigned 64-bit integer argument, converted as the wheel's binding converts it.

    Raises:
        TypeError: not an integer in [0, 2**64).
    """
    if isinstance(value, int):
        number = int(value)
    elif hasattr(value, "__index__"):  # numpy integers
        number = value.__index__()
    else:
        raise TypeError(f"{what}: incompatible function arguments ({type(value).__name__})")
    if not 0 <= number < 1 << 64:
        raise TypeError(f"{what}: incompatible function arguments ({number} is not a uint64)")
    return number


def key_text(key: Any) -> Any:
    """A key as the wheel reads it: ``bytes`` are decoded as UTF-8, the rest left as is."""
    if isinstance(key, bytes):
        try:
            return key.decode("utf-8")
        except UnicodeDecodeError:
            return None
    return key


def range_arguments(
    buffer_ptrs: Any, all_keys: Any, all_dst_offsets: Any, all_src_offsets: Any, all_sizes: Any
) -> tuple[list[int], list[list[Any]], Ranges, Ranges, Ranges]:
    """``get_into_ranges``'s arguments converted as the wheel's binding converts them: the buffer
    addresses, the keys as text, and the destination offsets, source offsets and sizes.

    Raises:
        TypeError: an offset, size or address that is not an unsigned 64-bit integer, or a key
            that is not text (the wheel's binding raises the same, before reading anything).
    """
    ptrs = [u64(p, "get_into_ranges(): buffer_ptrs") for p in buffer_ptrs]
    keys = [[key_text(k) for k in ks] for ks in all_keys]
    if any(not isinstance(k, str) for ks in keys for k in ks):
        raise TypeError("get_into_ranges(): incompatible function arguments (keys)")
    nested = [
        [[[u64(x, f"get_into_ranges(): {name}") for x in r] for r in per_key]
         for per_key in lists]
        for name, lists in (
            ("dst offsets", all_dst_offsets),
            ("src offsets", all_src_offsets),
            ("sizes", all_sizes),
        )
    ]  # fmt: skip
    dst, src, sizes = nested
    return ptrs, keys, dst, src, sizes


def plan_ranges(
    ptrs: list[int],
    keys: list[list[Any]],
    dst: Ranges,
    src: Ranges,
    sizes: Ranges,
    registered_end: Callable[[int], int | None],
) -> tuple[Ranges, list[tuple[int, int, int]]]:
    """``get_into_ranges``'s answer before any read, and the ranges left to fill.

    The answer has -600 where a buffer's or a key's lists disagree in length or the buffer is not
    inside a registered one (``registered_end`` gives None), so those ranges are never read, and
    0 elsewhere; the second list holds the ``(buffer, key, range)`` triples to fill from objects.
    """
    bad = ErrorCodes.INVALID_PARAMS
    out: Ranges = []
    wanted: list[tuple[int, int, int]] = []
    for i, ptr in enumerate(ptrs):
        if not len(keys[i]) == len(dst[i]) == len(src[i]) == len(sizes[i]):
            out.append(error_shape(1, [keys[i]], [dst[i]], bad)[0])
            continue
        end = registered_end(ptr)
        per_key: list[list[int]] = []
        for j in range(len(keys[i])):
            if not len(dst[i][j]) == len(src[i][j]) == len(sizes[i][j]) or end is None:
                per_key.append([bad] * len(dst[i][j]))
            else:
                per_key.append([0] * len(dst[i][j]))
                wanted.extend((i, j, r) for r in range(len(dst[i][j])))
        out.append(per_key)
    return out, wanted


def copy_range(
    data: Any, ptr: int, dst: int, src: int, n: int, registered_end: Callable[[int], int | None]
) -> int:
    """Copy ``n`` bytes from offset ``src`` of ``data`` to ``ptr + dst``: the count, or -600 for
    a range past the registered buffer or past the object.

    The buffer's end is looked up again for each range so that a range is checked against the
    registration as it stands when it is copied.
    """
    start = ptr + dst
    if start + n > registered_end(ptr) or src + n > len(data):  # type: ignore[operator]
        return ErrorCodes.INVALID_PARAMS
    if n > 0:
        memory_at(start, n)[:] = data[src : src + n]
        return n
    return 0
