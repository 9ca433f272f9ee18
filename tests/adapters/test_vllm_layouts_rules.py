"""The layout rules of :mod:`kvstore.client.adapters.vllm_layouts` without vLLM (torch only):
how a cache's strides name its layout, where each backend's K and V land in a block view, and
what is refused. ``test_vllm_layouts.py`` runs the same module on caches vLLM allocates."""

from __future__ import annotations

import pytest
import torch

from kvstore.client.adapters.vllm_layouts import (
    CacheGeometry,
    KVSplit,
    block_views,
    layout_name,
    split_for,
)
from kvstore.errors import InvalidRequestError

B, H, N, D, L = 5, 2, 4, 8, 3
GEO = CacheGeometry(num_kv_heads=H, block_size=N, head_size=D)


def _caches(order: str, c: int = 2 * D) -> list[torch.Tensor]:
    """Per-layer ``[B, H, N, C]`` views of one allocation whose physical order is ``order``
    (a permutation of ``LBHNC``), filled with distinct values."""
    sizes = dict(zip("LBHNC", (L, B, H, N, c), strict=True))
    raw = torch.arange(L * B * H * N * c, dtype=torch.int16).view(*(sizes[a] for a in order))
    logical = raw.permute(*(order.index(a) for a in "LBHNC"))
    return [logical[i] for i in range(L)]


@pytest.mark.parametrize("order", ["LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC"])
def test_a_layout_is_named_from_strides(order: str) -> None:
    assert layout_name(_caches(order)) == order


@pytest.mark.parametrize("order", ["LBHNC", "LBNHC", "BLNHC", "BHLNC"])
def test_channels_split_puts_k_then_v_of_each_token(order: str) -> None:
    caches = _caches(order)
    views = block_views(caches, GEO, "FLASH_ATTN")
    for layer, cache in enumerate(caches):
        k, v = cache.transpose(1, 2).split(D, dim=-1)  # as FlashAttention reads it
        assert torch.equal(views.layers[layer][:, 0], k)
        assert torch.equal(views.layers[layer][:, 1], v)


@pytest.mark.parametrize("order", ["LBHNC", "LHBNC", "BLHNC", "BHLNC"])
def test_tokens_split_puts_k_rows_then_v_rows(order: str) -> None:
    caches = _caches(order)
    views = block_views(caches, GEO, "CPU_ATTN")
    for layer, cache in enumerate(caches):
        page = cache.contiguous().view(B, H, 2 * N, D)  # as CPU_ATTN reads it
        k, v = page.chunk(2, dim=2)
        assert torch.equal(views.layers[layer][:, 0], k.transpose(1, 2))
        assert torch.equal(views.layers[layer][:, 1], v.transpose(1, 2))


def test_an_mla_latent_is_two_half_planes() -> None:
    geo = CacheGeometry(num_kv_heads=1, block_size=N, head_size=2 * D, mla=True)
    sizes = (L, B, 1, N, 2 * D)
    caches = list(torch.arange(torch.Size(sizes).numel(), dtype=torch.int16).view(sizes))
    views = block_views(caches, geo, "CPU_MLA")
    joined = torch.cat([views.layers[0][:, 0], views.layers[0][:, 1]], dim=-1)
    assert torch.equal(joined[:, :, 0], caches[0][:, 0])


def test_gather_copies_runs_of_blocks() -> None:
    caches = _caches("BLHNC")
    views = block_views(caches, GEO, "FLASHINFER")
    rows = torch.zeros((3, 2, N, H, D), dtype=torch.int16)
    views.gather(1, rows, [(0, 4, 1), (1, 0, 2)])
    assert torch.equal(rows[0], views.layers[1][4]) and torch.equal(rows[2], views.layers[1][1])


@pytest.mark.parametrize(
    ("caches", "backend", "geo", "words"),
    [
        (_caches("LBNHC"), "CPU_ATTN", GEO, "layout LBNHC of backend CPU_ATTN"),
        (_caches("LBHNC"), "B12X", GEO, "attention backend B12X"),
        (_caches("LBHNC"), "CPU_MLA", GEO, "attention backend CPU_MLA"),
        (_caches("LBHNC", c=3 * D), "FLASH_ATTN", GEO, "layout LBHNC of backend FLASH_ATTN"),
    ],
)
def test_what_it_cannot_serve_is_refused_in_one_line(
    caches: list[torch.Tensor], backend: str, geo: CacheGeometry, words: str
) -> None:
    with pytest.raises(InvalidRequestError) as err:
        block_views(caches, geo, backend)
    assert words in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("kv_axis", [0, 1])
def test_a_legacy_5d_cache_splits_k_and_v_on_its_outer_axis(kv_axis: int) -> None:
    shape = [B, N, H, D]
    shape.insert(kv_axis, 2)
    caches = [torch.arange(torch.Size(shape).numel(), dtype=torch.int16).view(shape)] * L
    views = block_views(caches, GEO, "FLASH_ATTN")
    assert torch.equal(views.layers[0][:, 1], caches[0].select(kv_axis, 1))


def test_a_5d_cache_of_two_blocks_is_ambiguous_and_refused() -> None:
    caches = [torch.zeros((2, 2, N, H, D), dtype=torch.int16)] * L
    with pytest.raises(InvalidRequestError, match="ambiguous"):
        block_views(caches, GEO, "FLASH_ATTN")


def test_mla_backends_serve_only_mla() -> None:
    assert split_for("FLASHMLA", mla=True) is KVSplit.LATENT
    with pytest.raises(InvalidRequestError):
        split_for("FLASH_ATTN", mla=True)
