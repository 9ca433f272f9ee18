"""SGLang's host KV pools on the CPU, with SGLang's own page code.

``MHATokenToKVPoolHost`` and ``MLATokenToKVPoolHost`` cannot be imported without SGLang's CUDA
stack (their modules pull in ``sglang.srt.configs``, which needs torchvision and transformers),
and building one needs a device pool. So these stand-ins allocate ``kv_buffer`` with the shapes of
SGLang's ``init_kv_buffer`` and take every method a storage backend touches
(``get_page_buffer_meta``, ``get_data_page``, ``get_dummy_flat_data_page``,
``set_from_flat_data_page``, ``k_buffer`` / ``v_buffer``, ...) compiled from the installed
SGLang 0.5.23 source files themselves: the pointer arithmetic under test is SGLang's, not a copy.
"""

from __future__ import annotations
import __future__

import ast
from pathlib import Path
from typing import Any

import sglang
import torch

POOL_HOST = Path(sglang.__file__).parent / "srt" / "mem_cache" / "pool_host"

_MHA_METHODS = (
    "get_page_buffer_meta",
    "get_data_page",
    "get_dummy_flat_data_page",
    "set_from_flat_data_page",
    "get_size_per_token",
    "get_ksize_per_token",
    "k_buffer",
    "v_buffer",
    "get_hybrid_pool_buffer",
)
_MLA_METHODS = (
    "get_page_buffer_meta",
    "get_data_page",
    "get_dummy_flat_data_page",
    "set_from_flat_data_page",
    "_storage_page_index",
)


def sglang_methods(file: Path, class_name: str, names: tuple[str, ...]) -> dict[str, Any]:
    """Compile methods of ``class_name`` from SGLang's source ``file`` (decorators kept).

    Raises:
        LookupError: the class or one of the methods is not in that file (another SGLang).
    """
    tree = ast.parse(file.read_text(), str(file))
    cls = next((n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == class_name), None)
    if cls is None:
        raise LookupError(f"{class_name} not in {file}")
    found = [n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name in names]
    missing = set(names) - {n.name for n in found}
    if missing:
        raise LookupError(f"{class_name} in {file} lacks {sorted(missing)}")
    module = ast.Module(body=found, type_ignores=[])
    flags = __future__.annotations.compiler_flag
    code = compile(module, str(file), "exec", flags=flags, dont_inherit=True)
    namespace: dict[str, Any] = {"torch": torch}
    exec(code, namespace)  # noqa: S102 - SGLang's own installed source
    return {name: namespace[name] for name in names}


class MHAHostPool:
    """SGLang's MHA host pool geometry: ``kv_buffer`` is ``[2, ...]`` (K and V)."""

    def __init__(
        self,
        layout: str,
        size: int = 64,
        page_size: int = 4,
        layer_num: int = 3,
        head_num: int = 2,
        head_dim: int = 8,
        dtype: torch.dtype = torch.bfloat16,
    ) -> None:
        self.layout, self.size, self.page_size = layout, size, page_size
        self.page_num = size // page_size
        self.layer_num, self.head_num, self.head_dim, self.v_head_dim = (
            layer_num,
            head_num,
            head_dim,
            head_dim,
        )
        self.dtype, self.device, self.pin_memory = dtype, "cpu", False
        if layout == "layer_first":  # MHATokenToKVPoolHost.init_kv_buffer
            dims: tuple[int, ...] = (2, layer_num, size, head_num, head_dim)
        elif layout == "page_first":
            dims = (2, size, layer_num, head_num, head_dim)
        elif layout == "page_first_direct":
            dims = (2, self.page_num, layer_num, page_size, head_num, head_dim)
        else:
            raise ValueError(layout)
        self.kv_buffer = torch.zeros(dims, dtype=dtype)


class MLAHostPool:
    """SGLang's MLA host pool geometry: one latent vector per token and layer."""

    def __init__(
        self,
        layout: str,
        size: int = 64,
        page_size: int = 4,
        layer_num: int = 3,
        kv_cache_dim: int = 24,
        dtype: torch.dtype = torch.bfloat16,
    ) -> None:
        self.layout, self.size, self.page_size = layout, size, page_size
        self.page_num = size // page_size
        self.layer_num, self.kv_cache_dim = layer_num, kv_cache_dim
        self.dtype, self.device, self.pin_memory = dtype, "cpu", False
        self.dcp_size, self.logical_page_size, self.logical_size = 1, page_size, size
        if layout == "layer_first":  # MLATokenToKVPoolHost.init_kv_buffer
            dims: tuple[int, ...] = (layer_num, size, 1, kv_cache_dim)
        elif layout == "page_first":
            dims = (size, layer_num, 1, kv_cache_dim)
        elif layout == "page_first_direct":
            dims = (self.page_num, layer_num, page_size, 1, kv_cache_dim)
        else:
            raise ValueError(layout)
        self.kv_buffer = torch.zeros(dims, dtype=dtype)


for _name, _fn in sglang_methods(
    POOL_HOST / "mha.py", "MHATokenToKVPoolHost", _MHA_METHODS
).items():
    setattr(MHAHostPool, _name, _fn)
for _name, _fn in sglang_methods(
    POOL_HOST / "mla.py", "MLATokenToKVPoolHost", _MLA_METHODS
).items():
    setattr(MLAHostPool, _name, _fn)
