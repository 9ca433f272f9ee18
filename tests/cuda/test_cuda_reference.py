"""CPU references of the CUDA kernels: paged gather/scatter and FP8 E4M3 with per-head scales."""

from __future__ import annotations

import pytest
import torch

from kvstore.cuda import reference as ref
from kvstore.errors import InvalidRequestError


def paged(num_pages: int = 7, page_size: int = 4, heads: int = 2, dim: int = 8) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.randn(num_pages, page_size, heads, dim, generator=g).to(torch.float16)


@pytest.mark.parametrize("num_tokens", [0, 1, 4, 9, 12])
def test_gather_follows_the_block_table_token_by_token(num_tokens: int) -> None:
    pages = paged()
    table = torch.tensor([5, 0, 3], dtype=torch.int32)
    out = ref.gather_paged(pages, table, num_tokens)
    assert out.shape == (num_tokens, 2, 8) and out.is_contiguous()
    for t in range(num_tokens):  # the naive definition, token by token
        assert torch.equal(out[t], pages[int(table[t // 4]), t % 4])


def test_scatter_is_the_inverse_of_gather_and_touches_nothing_else() -> None:
    pages = paged()
    table = torch.tensor([6, 2, 1], dtype=torch.int64)
    staging = ref.gather_paged(pages, table, 10)
    target = torch.zeros_like(pages)
    ref.scatter_paged(staging, table, target)
    assert torch.equal(ref.gather_paged(target, table, 10), staging)
    untouched = [p for p in range(7) if p not in (6, 2, 1)]
    assert not target[untouched].any()
    assert not target[1, 2:].any(), "slots past the last token stay as they were"


@pytest.mark.parametrize(
    ("table", "num_tokens"),
    [([0, 1], 9), ([0, 7], 8), ([-1], 1), ([[0]], 1)],
    ids=["too-few-pages", "page-out-of-range", "negative-page", "2-d-table"],
)
def test_bad_block_tables_are_refused(table: list, num_tokens: int) -> None:
    with pytest.raises(InvalidRequestError):
        ref.gather_paged(paged(), torch.tensor(table, dtype=torch.int32), num_tokens)


def test_fp8_round_trip_error_is_bounded_per_element() -> None:
    """E4M3 keeps 3 mantissa bits: relative error <= 2**-4 for values in the normal range."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(256, 4, 32, generator=g) * torch.tensor([0.1, 1.0, 10.0, 300.0])[None, :, None]
    scale = ref.scales_from_amax(ref.head_amax(x))
    y = ref.dequantize_e4m3(ref.quantize_e4m3(x, scale), scale)
    normal = x.abs() >= scale[None, :, None] * 2**-6  # E4M3's smallest normal, scaled
    rel = ((y - x).abs() / x.abs())[normal]
    assert float(rel.max()) <= 2**-4 + 1e-7
    # Subnormals: absolute error at most half the subnormal step (2**-9), scaled.
    assert bool(((y - x).abs() <= scale[None, :, None] * 2**-10 + 1e-12)[~normal].all())
    assert ref.quantize_e4m3(x, scale).dtype == torch.float8_e4m3fn


def test_fp8_saturates_instead_of_overflowing() -> None:
    x = torch.tensor([[[1000.0, -1000.0, 1.0]]])
    q = ref.quantize_e4m3(x, torch.tensor([1.0]))
    assert q.float().tolist() == [[[448.0, -448.0, 1.0]]]


@pytest.mark.parametrize("scale", [[0.0], [-1.0], [float("nan")], [1.0, 1.0]])
def test_fp8_refuses_bad_scales(scale: list[float]) -> None:
    with pytest.raises(InvalidRequestError):
        ref.quantize_e4m3(torch.ones(2, 1, 4), torch.tensor(scale))
