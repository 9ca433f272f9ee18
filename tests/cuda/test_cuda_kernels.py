"""The CUDA kernels against their CPU references (needs CuPy and a GPU; skipped elsewhere)."""

from __future__ import annotations

import pytest
import torch

from kvstore.cuda import kernels
from kvstore.cuda import reference as ref

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not kernels.available(), reason="needs CuPy and a CUDA GPU"),
]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("num_tokens", [1, 16, 1000])
def test_gather_and_scatter_match_the_reference(dtype: torch.dtype, num_tokens: int) -> None:
    g = torch.Generator().manual_seed(0)
    pages = torch.randn(80, 16, 8, 128, generator=g).to(dtype)
    table = torch.randperm(80, generator=g)[: (num_tokens + 15) // 16].to(torch.int32)
    expect = ref.gather_paged(pages, table, num_tokens)
    got = kernels.gather_paged(pages.cuda(), table.cuda(), num_tokens)
    assert torch.equal(got.cpu(), expect)
    target = torch.zeros_like(pages)
    ref.scatter_paged(expect, table, target)
    target_gpu = torch.zeros_like(pages).cuda()
    kernels.scatter_paged(got, table.cuda(), target_gpu)
    assert torch.equal(target_gpu.cpu(), target)


def test_fp8_kernels_are_bit_identical_to_the_reference() -> None:
    g = torch.Generator().manual_seed(2)
    x = torch.randn(512, 8, 128, generator=g) * 3
    x[0, 0, 0] = 1e6  # saturates
    scale = ref.scales_from_amax(ref.head_amax(x) / 4)
    q_ref = ref.quantize_e4m3(x, scale)
    q_gpu = kernels.quantize_e4m3(x.cuda(), scale.cuda())
    assert torch.equal(q_gpu.cpu().view(torch.uint8), q_ref.view(torch.uint8))
    y_ref = ref.dequantize_e4m3(q_ref, scale)
    y_gpu = kernels.dequantize_e4m3(q_gpu, scale.cuda())
    assert torch.equal(y_gpu.cpu(), y_ref)
