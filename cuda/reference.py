"""CPU references (torch) for the kernels in ``cuda/sources``; tests compare the GPU results to these.

Paged KV gather/scatter moves one layer's K (or V) between an engine's paged cache
``[num_pages, page_size, num_kv_heads, head_dim]`` and a contiguous staging buffer
``[num_tokens, num_kv_heads, head_dim]`` following a block table (page ids in token order).

FP8 is E4M3 in its "fn" flavour (no infinities, largest finite 448), with one float32 scale per
head: ``q = e4m3(clamp(x / scale[h], -448, 448))`` rounding to nearest even,
``y = float(q) * scale[h]``.
"""

from __future__ import annotations

import torch

from kvstore.errors import InvalidRequestError

#: Largest finite float8 E4M3 ("fn") value.
E4M3_MAX = 448.0


def _check_table(table: torch.Tensor, num_tokens: int, page_size: int, num_pages: int) -> None:
    if table.dim() != 1 or table.dtype not in (torch.int32, torch.int64):
        raise InvalidRequestError("block table must be a 1-D int32/int64 tensor")
    if num_tokens < 0 or num_tokens > table.numel() * page_size:
        raise InvalidRequestError(
            f"{num_tokens} tokens do not fit {table.numel()} pages of {page_size}"
        )
    used = table[: (num_tokens + page_size - 1) // page_size]
    if used.numel() and (int(used.min()) < 0 or int(used.max()) >= num_pages):
        raise InvalidRequestError(f"block table names a page outside [0, {num_pages})")


def _slots(table: torch.Tensor, num_tokens: int, page_size: int) -> torch.Tensor:
    t = torch.arange(num_tokens, device=table.device)
    return table.long()[t // page_size] * page_size + t % page_size


def gather_paged(pages: torch.Tensor, table: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """Copy ``num_tokens`` tokens out of a paged cache into a new contiguous tensor.

    Args:
        pages: ``[num_pages, page_size, ...]`` one layer's K or V.
        table: page ids in token order.
        num_tokens: tokens to gather (the last page may be partly used).

    Returns:
        ``[num_tokens, ...]``, contiguous, same dtype.

    Raises:
        InvalidRequestError: a table that does not cover the tokens or names a missing page.
    """
    num_pages, page_size = pages.shape[0], pages.shape[1]
    _check_table(table, num_tokens, page_size, num_pages)
    flat = pages.reshape(num_pages * page_size, *pages.shape[2:])
    return flat[_slots(table, num_tokens, page_size)].contiguous()


def scatter_paged(staging: torch.Tensor, table: torch.Tensor, pages: torch.Tensor) -> None:
    """Write ``staging`` ``[num_tokens, ...]`` into a paged cache in place (inverse of gather).

    Raises:
        InvalidRequestError: shapes that disagree, or a bad table.
    """
    num_pages, page_size = pages.shape[0], pages.shape[1]
    if tuple(staging.shape[1:]) != tuple(pages.shape[2:]) or staging.dtype != pages.dtype:
        raise InvalidRequestError("staging and pages differ in row shape or dtype")
    num_tokens = staging.shape[0]
    _check_table(table, num_tokens, page_size, num_pages)
    flat = pages.view(num_pages * page_size, *pages.shape[2:])
    flat[_slots(table, num_tokens, page_size)] = staging


def head_amax(x: torch.Tensor) -> torch.Tensor:
    """Per-head absolute maximum of ``[tokens, heads, head_dim]`` (float32, ``[heads]``)."""
    return x.detach().float().abs().amax(dim=(0, 2))


def scales_from_amax(amax: torch.Tensor, headroom: float = 1.0) -> torch.Tensor:
    """Scales that map ``headroom * amax`` onto the largest E4M3 value (never zero)."""
    return (amax.float() * headroom / E4M3_MAX).clamp_min(torch.finfo(torch.float32).tiny)


def quantize_e4m3(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Quantise ``[tokens, heads, head_dim]`` to float8 E4M3 with one scale per head.

    Values beyond the scale saturate at +-448 * scale (never NaN or inf).

    Returns:
        A ``torch.float8_e4m3fn`` tensor of the same shape.

    Raises:
        InvalidRequestError: ``scale`` is not ``[heads]`` of positive finite values.
    """
    if x.dim() != 3 or scale.shape != (x.shape[1],):
        raise InvalidRequestError(
            f"x must be [tokens, heads, dim] and scale [heads]; got {tuple(x.shape)}, {tuple(scale.shape)}"
        )
    scale = scale.float()
    if not bool(torch.isfinite(scale).all()) or not bool((scale > 0).all()):
        raise InvalidRequestError("scales must be positive and finite")
    y = (x.float() / scale[None, :, None]).clamp(-E4M3_MAX, E4M3_MAX)
    return y.to(torch.float8_e4m3fn)


def dequantize_e4m3(
    q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Inverse of :func:`quantize_e4m3`: ``float(q) * scale[h]``, cast to ``dtype``."""
    return (q.float() * scale.float()[None, :, None]).to(dtype)
