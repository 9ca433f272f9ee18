"""The FP8 (E4M3) codec of kvstore.client.adapters.fp8: per-head scales, saturation instead of
overflow, bad scales refused."""

from __future__ import annotations

import pytest
import torch

from kvstore.client.adapters import fp8 as ref
from kvstore.errors import InvalidRequestError


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
