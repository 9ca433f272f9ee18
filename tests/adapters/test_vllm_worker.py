"""The vLLM connector's worker side without vLLM, on the CPU and (``gpu``) on a CUDA cache: blocks
saved from a cache in one layout into a real pool (a master and a node, real processes) load into
a cache of another layout bit for bit, layer by layer or asynchronously, every other block left as
it was. The caches are per-layer ``[B, H, N, C]`` views of one allocation, strided as vLLM 0.32
lays out each of its layouts (``test_vllm_layouts.py`` runs the same on caches vLLM allocates
itself); this file needs no vLLM, so it is what a GPU machine without vLLM runs.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from kvstore.client.adapters.vllm_config import ConnectorConfig, engine_namespace
from kvstore.client.adapters.vllm_layouts import CacheGeometry
from kvstore.client.adapters.vllm_pool import Counters, Pool, Transfer
from kvstore.client.adapters.vllm_worker import KVStoreWorker
from tests.support import Cluster, start_master

L, B, H, N, D = 3, 10, 2, 16, 64
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(L)]
SRC_IDS, DST_IDS = [5, 6, 2, 9], [1, 8, 9, 3]
DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=[
            pytest.mark.gpu,
            pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"),
        ],
    ),
]


@pytest.fixture(scope="module")
def master(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    cluster = Cluster(Path(tmp_path_factory.mktemp("vllm-worker")), start_master())
    try:
        cluster.add_node("256MiB")
        yield cluster.address
    finally:
        cluster.stop()


def _caches(order: str, device: str, seed: int, c: int, dtype: torch.dtype) -> dict:
    """Per-layer ``[B, H, N, C]`` views of one allocation in physical ``order``, seeded bits."""
    sizes = dict(zip("LBHNC", (L, B, 1 if c != 2 * D else H, N, c), strict=True))
    as_int = torch.uint8 if dtype == torch.uint8 else torch.int16
    info = torch.iinfo(as_int)
    gen = torch.Generator().manual_seed(seed)
    shape = tuple(sizes[a] for a in order)
    raw = torch.randint(info.min, info.max, shape, generator=gen, dtype=as_int).view(dtype)
    logical = raw.to(device).permute(*(order.index(a) for a in "LBHNC"))
    return {name: logical[i] for i, name in enumerate(NAMES)}


def _reads(backend: str, cache: torch.Tensor) -> list[torch.Tensor]:
    """A layer's planes as the backend's kernels read them, as integers."""
    if backend == "CPU_ATTN":
        k, v = cache.contiguous().view(B, H, 2 * N, D).chunk(2, dim=2)
        planes = [k.transpose(1, 2), v.transpose(1, 2)]
    elif backend == "FLASHMLA":
        planes = [cache[:, 0]]
    else:
        planes = list(cache.transpose(1, 2).split(D, dim=-1))
    as_int = torch.uint8 if cache.element_size() == 1 else torch.int16
    return [p.view(as_int).cpu() for p in planes]


def _worker(master: str, geo: CacheGeometry, dtype: str, load_mode: str) -> KVStoreWorker:
    cfg = ConnectorConfig.from_extra({"master": master, "load_mode": load_mode})
    ns = engine_namespace(
        served_model="tiny-worker",
        revision=None,
        kv_dtype=dtype,
        num_layers=L,
        num_kv_heads=geo.plane_heads,
        head_dim=geo.plane_dim,
        block_size=N,
        salt=None,
        mla=geo.mla,
    )
    counters = Counters()
    return KVStoreWorker(cfg, ns, NAMES, Pool(cfg, ns, counters), counters)


CASES = [
    # (source layout, source backend, destination layout, destination backend, dtype, load mode)
    ("LBHNC", "CPU_ATTN", "BLNHC", "FLASH_ATTN", "bfloat16", "layer"),
    ("LBNHC", "FLASH_ATTN", "BHLNC", "CPU_ATTN", "bfloat16", "async"),
    ("BLHNC", "FLASHINFER", "LHBNC", "FLASHINFER", "float8_e4m3", "layer"),
    ("LHBNC", "FLASHMLA", "BLNHC", "FLASHMLA", "bfloat16", "async"),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("src", "src_backend", "dst", "dst_backend", "dtype", "mode"), CASES)
def test_blocks_saved_in_one_layout_load_bit_exact_into_another(
    master: str,
    device: str,
    src: str,
    src_backend: str,
    dst: str,
    dst_backend: str,
    dtype: str,
    mode: str,
) -> None:
    mla = src_backend == "FLASHMLA"
    geo = CacheGeometry(1, N, 576, mla=True) if mla else CacheGeometry(H, N, D)
    torch_dtype = torch.uint8 if dtype == "float8_e4m3" else torch.bfloat16
    c = 576 if mla else 2 * D
    seed = sum(map(ord, src + dst + dtype + device + mode))  # distinct prompts per case
    source = _caches(src, device, 1, c, torch_dtype)
    target = _caches(dst, device, 2, c, torch_dtype)
    before = {n: _reads(dst_backend, target[n]) for n in NAMES}
    tokens = (np.arange(len(SRC_IDS) * N, dtype=np.uint32) * 13 + seed * 977) % 40000

    saver = _worker(master, geo, dtype, mode)
    saver.register_kv_caches(source, src_backend, geo)
    saves = [Transfer("r", tokens, 0, SRC_IDS)]
    with torch.inference_mode():
        for n in NAMES:
            saver.save_kv_layer(saves, n)
    saver.wait_for_save()
    saver.close()

    loader = _worker(master, geo, dtype, mode)
    loader.register_kv_caches(target, dst_backend, geo)
    loader.start_load_kv([Transfer("r", tokens, 0, DST_IDS)])
    if mode == "layer":
        for n in NAMES:
            loader.wait_for_layer_load(n)
        loader.wait_for_save()
    else:
        # What vLLM polls step after step; here the load's own future is awaited first (it ends
        # within the pool calls' timeouts), so one poll must report it.
        for future, _ in list(loader._recving.values()):
            future.result()
        assert loader.get_finished(set()) == (None, {"r"})
    if device == "cuda":
        torch.cuda.synchronize()
    assert loader.get_block_ids_with_load_errors() == set()
    loader.close()

    for n in NAMES:
        want, got = _reads(src_backend, source[n]), _reads(dst_backend, target[n])
        for s, d in zip(SRC_IDS, DST_IDS, strict=True):
            assert all(torch.equal(w[s], g[d]) for w, g in zip(want, got, strict=True)), (n, s)
        for old, new in zip(before[n], got, strict=True):
            for b in range(B):
                if b not in DST_IDS:
                    assert torch.equal(old[b], new[b]), f"block {b} of {n} changed"
