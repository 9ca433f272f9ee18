"""The kernel sources compile with NVRTC (no GPU needed; skipped where NVRTC is not installed).

``pip install nvidia-cuda-nvrtc-cu12 nvidia-cuda-runtime-cu12`` brings NVRTC and the CUDA headers
(``cuda_fp8.h``); on a machine with a GPU, tests/cuda/test_cuda_kernels.py runs them for real.
"""

from __future__ import annotations

import ctypes
import importlib.util
from pathlib import Path

import pytest

from kvstore.cuda.kernels import KERNEL_DIR


def _nvidia_dir(package: str) -> Path | None:
    try:
        spec = importlib.util.find_spec(f"nvidia.{package}")
    except ModuleNotFoundError:
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def _nvrtc() -> tuple[ctypes.CDLL, Path] | None:
    nvrtc, runtime = _nvidia_dir("cuda_nvrtc"), _nvidia_dir("cuda_runtime")
    if nvrtc is None or runtime is None:
        return None
    libs = sorted((nvrtc / "lib").glob("libnvrtc.so.*"))
    if not libs:
        return None
    return ctypes.CDLL(str(libs[0])), runtime / "include"


NVRTC = _nvrtc()


@pytest.mark.skipif(NVRTC is None, reason="NVRTC not installed (pip nvidia-cuda-nvrtc-cu12)")
@pytest.mark.parametrize("source", sorted(p.name for p in KERNEL_DIR.glob("*.cu")))
def test_kernel_source_compiles_to_ptx(source: str) -> None:
    assert NVRTC is not None
    lib, include = NVRTC
    prog = ctypes.c_void_p()
    code = (KERNEL_DIR / source).read_bytes()
    assert lib.nvrtcCreateProgram(ctypes.byref(prog), code, source.encode(), 0, None, None) == 0
    opts = [f"-I{include}".encode(), b"--std=c++17", b"--gpu-architecture=compute_90"]
    rc = lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
    size = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetProgramLog(prog, log)
    lib.nvrtcDestroyProgram(ctypes.byref(prog))
    assert rc == 0, log.value.decode()
