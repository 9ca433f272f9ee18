"""The CUDA kernels of ``cuda/sources/*.cu``, compiled at first use with CuPy.

CuPy is imported lazily: importing this module works (and does nothing) on machines without it,
and :func:`available` says whether the kernels can run. Tensors are passed as torch CUDA tensors
and handed to CuPy through DLPack-free raw pointers (``data_ptr``), so no copy is made.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import torch

from kvstore.errors import InvalidRequestError, TransportUnavailableError

KERNEL_DIR = Path(__file__).with_name("sources")  # package data: kvstore.cuda.sources
_THREADS = 256


def available() -> bool:
    """Whether CuPy imports and a CUDA device is visible."""
    try:
        import cupy
    except ImportError:
        return False
    try:
        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # noqa: BLE001 - no driver, no device: not available
        return False


@functools.cache
def _module(name: str) -> Any:
    if not available():
        raise TransportUnavailableError("CUDA kernels need CuPy and a CUDA device")
    import cupy

    source = (KERNEL_DIR / f"{name}.cu").read_text()
    return cupy.RawModule(code=source, options=("--std=c++17", *_include_options()))


def _include_options() -> tuple[str, ...]:
    """``-I`` for the CUDA headers of the ``nvidia-cuda-runtime-cu12`` wheel (``cuda_fp8.h``),
    where no CUDA toolkit is installed; CuPy adds the toolkit's own include folder itself."""
    import importlib.util

    try:
        spec = importlib.util.find_spec("nvidia.cuda_runtime")
    except ModuleNotFoundError:
        return ()
    if spec is None or not spec.submodule_search_locations:
        return ()
    include = Path(next(iter(spec.submodule_search_locations))) / "include"
    return (f"-I{include}",) if (include / "cuda_fp8.h").exists() else ()


def _launch(module: str, kernel: str, n: int, args: tuple[Any, ...]) -> None:
    import cupy

    if n == 0:
        return
    fn = _module(module).get_function(kernel)
    with cupy.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream):
        fn(((n + _THREADS - 1) // _THREADS,), (_THREADS,), args)


def _ptr(t: torch.Tensor) -> Any:
    import cupy

    return cupy.uint64(t.data_ptr())


def _check_cuda(*tensors: torch.Tensor) -> None:
    for t in tensors:
        if not t.is_cuda or not t.is_contiguous():
            raise InvalidRequestError("kernels take contiguous CUDA tensors")


def _row_words(pages: torch.Tensor) -> int:
    row_bytes = pages[0, 0].numel() * pages.element_size()
    if row_bytes % 2:
        raise InvalidRequestError("a token row must be a whole number of 16-bit words")
    return row_bytes // 2


def gather_paged(pages: torch.Tensor, table: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """GPU version of :func:`kvstore.cuda.reference.gather_paged` (same arguments and result)."""
    import cupy

    table = table.to(torch.int32).contiguous()
    _check_cuda(pages, table)
    out = torch.empty((num_tokens, *pages.shape[2:]), dtype=pages.dtype, device=pages.device)
    row = _row_words(pages)
    args = (
        _ptr(pages),
        _ptr(table),
        _ptr(out),
        cupy.int64(num_tokens),
        cupy.int32(pages.shape[1]),
        cupy.int32(row),
    )
    _launch("paged_kv", "gather_paged_kv", num_tokens * row, args)
    return out


def scatter_paged(staging: torch.Tensor, table: torch.Tensor, pages: torch.Tensor) -> None:
    """GPU version of :func:`kvstore.cuda.reference.scatter_paged` (in place)."""
    import cupy

    table = table.to(torch.int32).contiguous()
    _check_cuda(staging, table, pages)
    if tuple(staging.shape[1:]) != tuple(pages.shape[2:]) or staging.dtype != pages.dtype:
        raise InvalidRequestError("staging and pages differ in row shape or dtype")
    row = _row_words(pages)
    n = staging.shape[0]
    args = (
        _ptr(staging),
        _ptr(table),
        _ptr(pages),
        cupy.int64(n),
        cupy.int32(pages.shape[1]),
        cupy.int32(row),
    )
    _launch("paged_kv", "scatter_paged_kv", n * row, args)


def quantize_e4m3(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """GPU version of :func:`kvstore.cuda.reference.quantize_e4m3` (bit-identical result)."""
    import cupy

    x = x.float().contiguous()
    scale = scale.float().contiguous()
    _check_cuda(x, scale)
    q = torch.empty(x.shape, dtype=torch.uint8, device=x.device)
    args = (
        _ptr(x),
        _ptr(scale),
        _ptr(q),
        cupy.int64(x.numel()),
        cupy.int32(x.shape[1]),
        cupy.int32(x.shape[2]),
    )
    _launch("fp8", "quantize_e4m3", x.numel(), args)
    return q.view(torch.float8_e4m3fn)


def dequantize_e4m3(
    q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """GPU version of :func:`kvstore.cuda.reference.dequantize_e4m3`."""
    import cupy

    q = q.contiguous().view(torch.uint8)
    scale = scale.float().contiguous()
    _check_cuda(q, scale)
    y = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    args = (
        _ptr(q),
        _ptr(scale),
        _ptr(y),
        cupy.int64(q.numel()),
        cupy.int32(q.shape[1]),
        cupy.int32(q.shape[2]),
    )
    _launch("fp8", "dequantize_e4m3", q.numel(), args)
    return y.to(dtype)
