"""The Mooncake API's values (``mooncake.py``): sizes in ``setup``'s config dict as the wheel
reads them, the client name ``get_hostname`` answers, the bytes of a stored tensor (kvstore's own
format), and the error shape of ``get_into_ranges``."""

from __future__ import annotations

import ctypes
import json
import math
import re
import socket
import struct
from collections.abc import Sequence
from typing import Any

from kvstore.errors import InvalidRequestError


# ---------------------------------------------------------------- caller memory
def memory_at(ptr: int, size: int) -> memoryview:
    """A writable byte view of ``size`` bytes at address ``ptr`` (the caller's memory).

    Raises:
        InvalidRequestError: a null or negative address, or a size that is not positive.
    """
    if not isinstance(ptr, int) or not isinstance(size, int) or ptr <= 0 or size <= 0:
        raise InvalidRequestError(f"bad buffer: address {ptr!r}, size {size!r}")
    return memoryview((ctypes.c_ubyte * size).from_address(ptr)).cast("B")


# ---------------------------------------------------------------- setup's config dict
#: Units the wheel's size parser knows (case-insensitive): bytes, KiB, MiB, GiB, TiB.
_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1 << 10, "m": 1 << 20, "mb": 1 << 20}
_UNITS |= {"g": 1 << 30, "gb": 1 << 30, "t": 1 << 40, "tb": 1 << 40}
#: A number as C's strtod reads it (decimal or hex, optional sign and exponent), then a unit.
_SIZE_TEXT = re.compile(
    r"\s*\+?(0[xX](?:[0-9a-fA-F]+\.?[0-9a-fA-F]*|\.[0-9a-fA-F]+)(?:[pP][+-]?\d+)?"
    r"|(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)\s*([kKmMgGtT]?[bB]?)\s*"
)
#: The wheel's segment allocator refuses a global segment below this (setup answers -600).
MIN_GLOBAL_SEGMENT = 16 << 20
#: The wheel's config dict takes a global segment of 0 or at least this many bytes.
MIN_CONFIG_SIZE = 1024
#: The wheel's config dict takes a local buffer of 0 or up to this many bytes.
MAX_LOCAL_BUFFER = 1 << 40
#: Transports the non-CUDA wheel sets up; any other name fails setup with -1.
PROTOCOLS = frozenset({"tcp", "rdma", "efa"})


def config_size(value: Any) -> int | None:
    """A size from setup's config dict, read as the wheel reads it; None when it refuses it.

    The wheel takes the value's text (so ``16 << 20``, ``16.0``, ``"16MB"``, ``"1.5 GB"`` and
    ``"0x10"`` all parse, fractions truncated) with a unit of B, K(B), M(B), G(B) or T(B); it
    refuses ``True``, ``None``, percentages, ``MiB``-style units, signs other than ``+`` and
    text around the number. Sizes of 2**64 or more are refused here (the wheel overflows).
    """
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        return None
    match = _SIZE_TEXT.fullmatch(str(value))
    if match is None:
        return None
    number_text, unit = match.groups()
    try:
        number = (
            float.fromhex(number_text) if number_text[:2] in ("0x", "0X") else float(number_text)
        )
    except (ValueError, OverflowError):
        return None
    size = number * _UNITS[unit.lower()]
    if not math.isfinite(size) or size >= 1 << 64:
        return None
    return int(size)


def named_port(host: str) -> str:
    """``host`` as the wheel names a client: ``host:port``, a free port added when none is given.

    The wheel's port is its transfer engine's listening port; kvstore's clients listen on
    nothing, so the port is one the operating system had free when the store was set up.
    """
    _, sep, port = host.rpartition(":")
    if sep and port.isdigit():
        return host
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("", 0))
        return f"{host}:{probe.getsockname()[1]}"


# ---------------------------------------------------------------- tensors
_TENSOR_MAGIC = b"KVT1"
#: The tensor's bytes start at a multiple of this, so a view of them in a caller's buffer is
#: aligned for every dtype.
_TENSOR_ALIGN = 64
#: The dtypes the wheel's ``put_tensor`` takes (others answer -600), by torch's name.
_TENSOR_DTYPES = (
    "bfloat16", "bool", "float16", "float32", "float64", "float8_e4m3fn", "float8_e5m2",
    "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
)  # fmt: skip


class NotATensor(ValueError):
    """An object that ``get_tensor`` cannot return (not ``put_tensor``'s, or a bad header)."""


def tensor_bytes(tensor: Any) -> bytes:
    """kvstore's tensor format: magic, u32 header length, JSON {dtype, shape} padded with
    spaces to an aligned end, raw bytes.

    A 0-dimensional tensor is stored with shape ``[1]``, as the wheel stores it.

    Raises:
        InvalidRequestError: not a tensor, or a dtype the wheel does not store.
    """
    import torch

    if not isinstance(tensor, torch.Tensor):
        raise InvalidRequestError(f"put_tensor needs a torch.Tensor, got {type(tensor).__name__}")
    dtype = str(tensor.dtype).removeprefix("torch.")
    if dtype not in _TENSOR_DTYPES:
        raise InvalidRequestError(f"put_tensor does not store {tensor.dtype}")
    shape = list(tensor.shape) or [1]
    t = tensor.detach().to("cpu").contiguous().reshape(shape)
    head = json.dumps({"dtype": dtype, "shape": shape}).encode()
    head += b" " * (-(8 + len(head)) % _TENSOR_ALIGN)
    raw = t.view(torch.uint8).numpy().tobytes() if t.numel() else b""
    return _TENSOR_MAGIC + struct.pack("<I", len(head)) + head + raw


def tensor_layout(data: Any) -> tuple[Any, list[int], int]:
    """The dtype, shape and body offset of a ``put_tensor`` object, checked against its size.

    Raises:
        NotATensor: no magic, a header that is not ``{dtype, shape}`` JSON, an unknown dtype,
            a shape with negative or non-integer sizes, or a body that is not exactly the
            shape's bytes (past it, short of it, or not a multiple of the dtype's size).
    """
    import torch

    view = memoryview(data).cast("B")
    if len(view) < 8 or bytes(view[:4]) != _TENSOR_MAGIC:
        raise NotATensor("object was not written by put_tensor")
    (n,) = struct.unpack_from("<I", view, 4)
    if 8 + n > len(view):
        raise NotATensor("tensor header runs past the object")
    try:
        header = json.loads(bytes(view[8 : 8 + n]))
    except ValueError as err:  # bad JSON or bad UTF-8
        raise NotATensor(f"tensor header is not JSON: {err}") from err
    if not isinstance(header, dict):
        raise NotATensor("tensor header is not an object")
    dtype_name, shape = header.get("dtype"), header.get("shape")
    if dtype_name not in _TENSOR_DTYPES:
        raise NotATensor(f"unknown tensor dtype {dtype_name!r}")
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
        raise NotATensor(f"bad tensor shape {shape!r}")
    dtype = getattr(torch, dtype_name)
    body = len(view) - 8 - n
    if body != math.prod(shape) * dtype.itemsize:
        raise NotATensor(f"tensor body of {body} bytes does not hold {shape} x {dtype}")
    return dtype, shape, 8 + n


def tensor_from(data: Any) -> Any:
    """The tensor in a ``put_tensor`` object (its own copy of the bytes).

    Raises:
        NotATensor: as :func:`tensor_layout`.
    """
    import torch

    dtype, shape, start = tensor_layout(data)
    body = bytearray(memoryview(data).cast("B")[start:])
    if not body:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(body, dtype=torch.uint8).view(dtype).reshape(shape)


def tensor_in_place(ptr: int, size: int) -> Any:
    """The tensor of a ``put_tensor`` object held at ``ptr``, viewing the caller's memory.

    Raises:
        NotATensor: as :func:`tensor_layout`.
    """
    import torch

    dtype, shape, start = tensor_layout(memory_at(ptr, size))
    if size == start:
        return torch.empty(shape, dtype=dtype)
    body = memory_at(ptr + start, size - start)
    return torch.frombuffer(body, dtype=torch.uint8).view(dtype).reshape(shape)


# ---------------------------------------------------------------- get_into_ranges
def error_shape(
    num_buffers: int, all_keys: Sequence[Any], all_dst: Sequence[Any], code: int
) -> list[list[list[int]]]:
    """The wheel's answer to ``get_into_ranges`` arguments whose lists disagree in length.

    Per buffer, one list per key it names, with ``code`` once per destination offset given
    for that key (once when none is given); a buffer beyond ``all_keys`` gets ``[[code]]``.
    """
    out: list[list[list[int]]] = []
    for i in range(num_buffers):
        if i >= len(all_keys):
            out.append([[code]])
            continue
        dsts = all_dst[i] if i < len(all_dst) else []
        out.append(
            [[code] * (len(dsts[j]) if j < len(dsts) else 1) for j in range(len(all_keys[i]))]
        )
    return out
