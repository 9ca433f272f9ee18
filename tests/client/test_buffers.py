"""Users' buffers as flat byte views (kvstore.client.buffers.as_bytes_view): no copy, the same bytes,
and a clear InvalidRequestError for what cannot be one."""

from __future__ import annotations

import array
from typing import Any

import numpy as np
import pytest

from kvstore.client.buffers import as_bytes_view
from kvstore.errors import InvalidRequestError


@pytest.mark.parametrize(
    "make",
    [
        lambda: b"abcdef",
        lambda: bytearray(b"abcdef"),
        lambda: memoryview(b"abcdef"),
        lambda: np.arange(6, dtype=np.uint8),
        lambda: np.arange(6, dtype=np.float32).reshape(2, 3),
        lambda: np.zeros((2, 2, 2), dtype=np.float16),
        lambda: array.array("I", [1, 2, 3]),
        lambda: b"",
    ],
    ids=["bytes", "bytearray", "memoryview", "u8", "f32-2d", "f16-3d", "array", "empty"],
)
def test_a_buffer_becomes_a_flat_byte_view_of_the_same_bytes(make: Any) -> None:
    obj = make()
    view = as_bytes_view(obj)
    assert view.format == "B" and view.ndim == 1
    assert view.nbytes == memoryview(obj).nbytes
    assert view.tobytes() == memoryview(obj).tobytes()


def test_a_writable_view_writes_through_to_the_callers_buffer() -> None:
    dest = np.zeros((2, 4), dtype=np.int16)
    view = as_bytes_view(dest, writable=True)
    view[:] = bytes(range(16))
    assert dest.tobytes() == bytes(range(16)), "no copy: the caller's array holds the bytes"


@pytest.mark.parametrize(
    ("make", "writable"),
    [
        (lambda: "text", False),
        (lambda: 12, False),
        (lambda: [1, 2], False),
        (lambda: np.arange(12, dtype=np.uint8).reshape(3, 4)[:, ::2], False),  # strided
        (lambda: np.arange(12, dtype=np.uint8).reshape(3, 4).T, False),  # Fortran order
        (lambda: memoryview(b"abc")[::2], False),
        (lambda: b"read only", True),
        (lambda: np.frombuffer(b"abcd", dtype=np.uint8), True),
    ],
    ids=["str", "int", "list", "strided", "transposed", "sliced-view", "bytes", "ro-array"],
)
def test_what_cannot_be_a_flat_view_is_refused(make: Any, writable: bool) -> None:
    with pytest.raises(InvalidRequestError):
        as_bytes_view(make(), writable=writable)


def test_cpu_tensors_are_viewed_without_a_copy() -> None:
    torch = pytest.importorskip("torch")
    t = torch.arange(8, dtype=torch.float32)
    view = as_bytes_view(t, writable=True)
    assert view.nbytes == 32
    view[4:8] = np.float32(5.0).tobytes()
    assert t[1].item() == 5.0 and t[2].item() == 2.0
    with pytest.raises(InvalidRequestError):
        as_bytes_view(torch.arange(8).reshape(2, 4).t())
