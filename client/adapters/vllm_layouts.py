"""Any KV cache vLLM registers, seen as block views in the pool's engine-neutral block layout.

vLLM 0.32 registers, per attention layer, a strided view ``[B, H, N, C]`` (blocks, KV heads,
tokens, content) of one backing allocation; ``vllm/v1/kv_cache_layout.py`` names the physical
order of ``[L, B, H, N, C]`` (``LBHNC``, ``LBNHC``, ``LHBNC`` per layer; ``BLHNC``, ``BLNHC``,
``BHLNC`` cross-layer, where one block holds every layer). What the content holds depends on the
attention backend, not on the tensor:

- ``channels``: ``C = 2 * head_size``, K then V per token and head (FlashAttention, FlashInfer,
  FlexAttention, Triton);
- ``tokens``: each ``(block, head)`` page read as ``[2 * N, head_size]``, the K rows then the V
  rows (``CPU_ATTN``); only where ``N`` and ``C`` are contiguous within the page;
- ``latent``: MLA, one latent vector per token (``H = 1``, no K and V). The pool stores it as
  two planes of ``C / 2`` channels, so that an MLA block is an ordinary block object
  (``docs/block-keys.md``, "MLA").

Older allocations (``vllm.utils.torch_utils.create_kv_caches_with_random_flash``, FlashAttention
before 0.32) hand K and V as two tensors ``[B, N, H, D]`` (NHD or HND strides), K and V split on
an outer axis; they are served too.

Every form becomes one strided view per layer, ``[B, 2, N, H, D]`` in the object's order (K then
V, each ``[block_size, heads, head_dim]``), so a save is one strided copy per layer and run of
blocks and a load one copy per layer and block, on whatever device the cache lives. A cache this
module cannot map is refused with one line naming the layout and the backend: never a wrong byte.
Nothing here imports vLLM, so the rules are tested without it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum

import numpy as np
import torch

from kvstore.errors import InvalidRequestError


class KVSplit(StrEnum):
    """Where a backend keeps K and V inside a layer's ``[B, H, N, C]`` view."""

    CHANNELS = "channels"
    TOKENS = "tokens"
    LATENT = "latent"


#: Backends whose kernels were read (vLLM 0.32) and whose content split is known. A backend not
#: here is refused: guessing its split could store or load wrong bytes.
BACKEND_SPLITS: Mapping[str, KVSplit] = {
    "CPU_ATTN": KVSplit.TOKENS,
    "FLASH_ATTN": KVSplit.CHANNELS,
    "FLASHINFER": KVSplit.CHANNELS,
    "FLEX_ATTENTION": KVSplit.CHANNELS,
    "TRITON_ATTN": KVSplit.CHANNELS,
    "ROCM_AITER_UNIFIED_ATTN": KVSplit.CHANNELS,
    "CPU_MLA": KVSplit.LATENT,
    "AMX_MLA": KVSplit.LATENT,
    "FLASHMLA": KVSplit.LATENT,
    "FLASH_ATTN_MLA": KVSplit.LATENT,
    "FLASHINFER_MLA": KVSplit.LATENT,
    "CUTLASS_MLA": KVSplit.LATENT,
    "TRITON_MLA": KVSplit.LATENT,
    "ROCM_AITER_MLA": KVSplit.LATENT,
}

#: Integer types of each element size: numpy has no bfloat16 or fp8, and a copy only moves bits.
_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32}


@dataclass(frozen=True, slots=True)
class CacheGeometry:
    """What one TP rank's cache holds per layer, from vLLM's config.

    Attributes:
        num_kv_heads: KV heads of this rank (1 for MLA).
        block_size: tokens per block.
        head_size: elements per head (the latent width for MLA).
        mla: one latent plane per layer instead of K and V.
    """

    num_kv_heads: int
    block_size: int
    head_size: int
    mla: bool = False

    @property
    def plane_heads(self) -> int:
        """Heads of one pool plane (the namespace's ``num_kv_heads``)."""
        return 1 if self.mla else self.num_kv_heads

    @property
    def plane_dim(self) -> int:
        """Elements per head of one pool plane (the namespace's ``head_dim``)."""
        return self.head_size // 2 if self.mla else self.head_size


def split_for(backend: str, mla: bool) -> KVSplit:
    """The content split of ``backend``.

    Raises:
        InvalidRequestError: a backend whose split is not known, or MLA-ness that disagrees.
    """
    split = BACKEND_SPLITS.get(backend)
    if split is None or (split is KVSplit.LATENT) != mla:
        kind = "an MLA" if mla else "a K/V"
        raise InvalidRequestError(
            f"kvstore connector: attention backend {backend} ({kind} cache) is not supported; "
            f"supported: {', '.join(sorted(BACKEND_SPLITS))}"
        )
    return split


def layout_name(layers: Sequence[torch.Tensor]) -> str:
    """vLLM's name of the physical order of per-layer ``[B, H, N, C]`` views (e.g. ``LBHNC``,
    ``BLHNC``): axes by decreasing stride, the layer stride read from the views' addresses.

    A single layer counts as layer-outermost; a tensor that is not 4-D is named by its rank.
    """
    first = layers[0]
    if first.dim() != 4:
        return f"{first.dim()}-D"
    strides = dict(zip("BHNC", first.stride(), strict=True))
    if len(layers) > 1:
        strides["L"] = (layers[1].data_ptr() - first.data_ptr()) // first.element_size()
    else:
        strides["L"] = first.untyped_storage().nbytes()
    return "".join(sorted(strides, key=lambda a: -strides[a]))


def _refuse(what: str, layout: str, backend: str) -> InvalidRequestError:
    return InvalidRequestError(
        f"kvstore connector: KV cache layout {layout} of backend {backend} is not supported: {what}"
    )


def _from_4d(
    t: torch.Tensor, g: CacheGeometry, split: KVSplit, layout: str, backend: str
) -> torch.Tensor:
    """``[B, H, N, C]`` -> ``[B, 2, N, H, D]`` (a view)."""
    b, h, n, c = t.shape
    if h != g.num_kv_heads or n != g.block_size or t.stride(3) != 1:
        raise _refuse(
            f"shape {tuple(t.shape)} strides {t.stride()}, expected [B, {g.num_kv_heads}, "
            f"{g.block_size}, C] with C contiguous",
            layout,
            backend,
        )
    if split is KVSplit.TOKENS:
        d = g.head_size
        if c != 2 * d or t.stride(2) != c:
            raise _refuse("K and V rows need each (block, head) page contiguous", layout, backend)
        sb, sh = t.stride(0), t.stride(1)
        return t.as_strided((b, 2, n, h, d), (sb, n * d, d, sh, 1))
    d = g.plane_dim
    if c != 2 * d:
        raise _refuse(f"content of {c} elements, expected {2 * d}", layout, backend)
    return t.unflatten(3, (2, d)).permute(0, 3, 2, 1, 4)


def _plane_nhd(t: torch.Tensor, g: CacheGeometry, layout: str, backend: str) -> torch.Tensor:
    """One K or V tensor ``[B, N, H, D]`` (logical NHD, any strides) as it is."""
    want = (g.block_size, g.num_kv_heads, g.head_size)
    if t.dim() != 4 or tuple(t.shape[1:]) != want:
        raise _refuse(
            f"K/V tensor of shape {tuple(t.shape)}, expected [B, {want[0]}, {want[1]}, {want[2]}]",
            layout,
            backend,
        )
    return t


def _from_pair(
    k: torch.Tensor, v: torch.Tensor, g: CacheGeometry, layout: str, backend: str
) -> torch.Tensor:
    """K and V tensors of one layer -> ``[B, 2, N, H, D]`` (a view of their common storage)."""
    k, v = _plane_nhd(k, g, layout, backend), _plane_nhd(v, g, layout, backend)
    gap, size = v.data_ptr() - k.data_ptr(), k.element_size()
    if (
        k.untyped_storage().data_ptr() != v.untyped_storage().data_ptr()
        or k.stride() != v.stride()
        or k.shape != v.shape
        or gap <= 0
        or gap % size
    ):
        raise _refuse("K and V must be two equal views of one allocation", layout, backend)
    sb, sn, sh, sd = k.stride()
    return k.as_strided((k.shape[0], 2, *k.shape[1:]), (sb, gap // size, sn, sh, sd))


@dataclass(frozen=True)
class BlockViews:
    """Every layer of a registered cache as ``[num_blocks, 2, block_size, heads, head_dim]``
    strided views in the pool's object order, and the copies between them and pool objects.

    Attributes:
        layout: vLLM's name of the physical layout (``LBHNC`` ...), for log lines.
        backend: the attention backend's name.
        layers: one view per layer, in the namespace's layer order.
    """

    layout: str
    backend: str
    layers: tuple[torch.Tensor, ...]

    @property
    def num_blocks(self) -> int:
        return self.layers[0].shape[0]

    @property
    def dtype(self) -> torch.dtype:
        return self.layers[0].dtype

    @property
    def device(self) -> torch.device:
        return self.layers[0].device

    @property
    def itemsize(self) -> int:
        return self.layers[0].element_size()

    @property
    def block_nbytes(self) -> int:
        """Bytes of one block of every layer (the object's planes)."""
        return self.layers[0][0].numel() * self.itemsize * len(self.layers)

    def as_int(self) -> tuple[torch.Tensor, ...]:
        """The views retyped as integers of the element size (the bits, for numpy copies)."""
        as_int = _INT_OF_SIZE[self.itemsize]
        return tuple(t.view(as_int) for t in self.layers)

    def gather(
        self,
        layer: int,
        planes: torch.Tensor,
        runs: Sequence[tuple[int, int, int]],
        non_blocking: bool = False,
    ) -> None:
        """Copy blocks of ``layer`` into object rows: ``planes[s : s + n] <- blocks d .. d + n``
        for each run ``(s, d, n)``; ``planes`` is ``[rows, 2, block_size, heads, head_dim]``
        (``non_blocking``: asynchronous where the copy crosses to pinned host memory)."""
        src = self.layers[layer]
        for s, d, n in runs:
            planes[s : s + n].copy_(src[d : d + n], non_blocking=non_blocking)

    def scatter_np(self, dst: Sequence[np.ndarray], block: int, obj: np.ndarray) -> None:
        """Copy one object (``[layers, 2, block_size, heads, head_dim]``, integer-typed) into
        block ``block`` of every layer; ``dst`` is :meth:`host_int_views`."""
        for layer, view in enumerate(dst):
            np.copyto(view[block], obj[layer])

    def host_int_views(self) -> list[np.ndarray]:
        """numpy views of a CPU cache (integer-typed, strided like the cache).

        Raises:
            InvalidRequestError: the cache is not in host memory.
        """
        if self.device.type != "cpu":
            raise InvalidRequestError(f"kvstore connector: no numpy view of a {self.device} cache")
        return [t.numpy() for t in self.as_int()]


def block_views(
    caches: Sequence[torch.Tensor | tuple[torch.Tensor, torch.Tensor]],
    geometry: CacheGeometry,
    backend: str,
    layout: str | None = None,
) -> BlockViews:
    """Map the caches vLLM registered, one entry per layer in layer order, to block views.

    Args:
        caches: per layer, vLLM 0.32's ``[B, H, N, C]`` view, a legacy 5-D tensor with K/V on an
            outer axis of size 2 (``[2, B, N, H, D]`` or ``[B, 2, N, H, D]``), or a ``(K, V)``
            pair of ``[B, N, H, D]`` tensors.
        geometry: what a layer holds on this rank.
        backend: the attention backend's name (``CPU_ATTN``, ``FLASH_ATTN``, ...).
        layout: vLLM's name of the resolved layout, for messages; None: read from the strides
            (where a dimension has size 1 its place is ambiguous, so vLLM's name is better).

    Returns:
        The views; a save or a load through them touches no other byte of the cache.

    Raises:
        InvalidRequestError: a layout, backend or shape this module cannot serve; the message is
            one line naming the layout and the backend.
    """
    if not caches:
        raise InvalidRequestError("kvstore connector: no KV cache registered")
    split = split_for(backend, geometry.mla)
    tensors = [c for c in caches if isinstance(c, torch.Tensor)]
    if layout is None:
        layout = layout_name(tensors) if len(tensors) == len(caches) else "K/V pairs"
    views: list[torch.Tensor] = []
    for cache in caches:
        if isinstance(cache, tuple | list):
            if split is not KVSplit.CHANNELS:
                raise _refuse("separate K and V tensors", layout, backend)
            views.append(_from_pair(cache[0], cache[1], geometry, layout, backend))
        elif cache.dim() == 4:
            views.append(_from_4d(cache, geometry, split, layout, backend))
        elif cache.dim() == 5 and split is KVSplit.CHANNELS:
            if cache.shape[0] == 2 and cache.shape[1] == 2:
                # Two blocks and a K/V axis: which axis is which cannot be told from the shape.
                raise _refuse(f"5-D shape {tuple(cache.shape)} is ambiguous", layout, backend)
            axis = 0 if cache.shape[0] == 2 else 1
            if cache.shape[axis] != 2:
                raise _refuse(f"5-D shape {tuple(cache.shape)} has no K/V axis", layout, backend)
            k, v = cache.select(axis, 0), cache.select(axis, 1)
            views.append(_from_pair(k, v, geometry, layout, backend))
        else:
            raise _refuse(f"{cache.dim()}-D tensor {tuple(cache.shape)}", layout, backend)
    kinds = {(v.dtype, v.device, tuple(v.shape)) for v in views}
    if len(kinds) != 1:
        raise _refuse("layers differ in dtype, device or shape", layout, backend)
    if views[0].element_size() not in _INT_OF_SIZE:
        raise _refuse(f"element size {views[0].element_size()}", layout, backend)
    return BlockViews(layout, backend, tuple(views))
