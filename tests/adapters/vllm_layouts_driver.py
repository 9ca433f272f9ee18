"""Drives the vLLM connector's worker side on caches that vLLM itself allocates, in the vLLM
virtualenv (``python -m tests.adapters.vllm_layouts_driver '<json list of cases>'``); prints one
JSON line, a result per case.

A case saves a prompt's blocks from a source cache into a real pool, then loads them into a
destination cache of another layout (other block ids), and reports whether every loaded block
equals its source bit for bit and every other destination block kept its bytes. Both caches come
from vLLM's own code: ``allocate_kv_cache`` (what the model runner calls, with the layout's
strides from ``compute_layout_strides``) or ``create_kv_caches_with_random_flash`` (K and V on
an outer axis). "Equal" is judged through each backend's own reading of its cache (the split
its kernels do), not through the connector's views.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch
from vllm.utils.torch_utils import create_kv_caches_with_random_flash
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    MLAAttentionSpec,
    compute_layout_strides,
)
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.worker.utils import allocate_kv_cache

from kvstore.client import Client
from kvstore.client.adapters.vllm_config import ConnectorConfig, engine_namespace
from kvstore.client.adapters.vllm_layouts import CacheGeometry
from kvstore.client.adapters.vllm_pool import Counters, Pool, Transfer
from kvstore.client.adapters.vllm_worker import KVStoreWorker
from kvstore.client.kvcache import KVCache
from kvstore.errors import InvalidRequestError
from kvstore.keys import Namespace

NUM_LAYERS = 3
NUM_BLOCKS = 12
BLOCK_SIZE = 16
NUM_KV_HEADS = 2
HEAD_SIZE = 64
MLA_LATENT = 576
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "fp8": torch.uint8}
NS_DTYPES = {"bfloat16": "bfloat16", "float16": "float16", "fp8": "float8_e4m3"}


def layer_names() -> list[str]:
    return [f"model.layers.{i}.self_attn.attn" for i in range(NUM_LAYERS)]


def geometry(case: dict[str, Any]) -> CacheGeometry:
    if case.get("mla"):
        return CacheGeometry(1, BLOCK_SIZE, MLA_LATENT, mla=True)
    return CacheGeometry(NUM_KV_HEADS, BLOCK_SIZE, HEAD_SIZE)


def namespace(case: dict[str, Any]) -> Namespace:
    g = geometry(case)
    return engine_namespace(
        served_model="tiny-layouts",
        revision=None,
        kv_dtype=NS_DTYPES[case["dtype"]],
        num_layers=NUM_LAYERS,
        num_kv_heads=g.plane_heads,
        head_dim=g.plane_dim,
        block_size=BLOCK_SIZE,
        salt=None,
        tp_rank=case.get("tp_rank", 0),
        tp_size=case.get("tp_size", 1),
        mla=g.mla,
    )


def allocate(case: dict[str, Any], seed: int) -> dict[str, Any]:
    """The caches of ``case`` as vLLM's worker would register them, filled with seeded bits."""
    names = layer_names()
    if case["form"] == "pair":
        keys, values = create_kv_caches_with_random_flash(
            NUM_BLOCKS,
            BLOCK_SIZE,
            NUM_LAYERS,
            NUM_KV_HEADS,
            HEAD_SIZE,
            "auto",
            DTYPES[case["dtype"]],
            seed=seed,
            device="cpu",
            cache_layout=case["layout"],
        )
        return {n: (k, v) for n, k, v in zip(names, keys, values, strict=True)}
    g = geometry(case)
    dtype = DTYPES[case["dtype"]]
    spec_cls = MLAAttentionSpec if g.mla else FullAttentionSpec
    spec = spec_cls(
        block_size=BLOCK_SIZE, num_kv_heads=g.num_kv_heads, head_size=g.head_size, dtype=dtype
    )
    layout = KVCacheLayout[case["layout"]]
    layer_stride, block_stride, *_ = compute_layout_strides(spec, NUM_BLOCKS, NUM_LAYERS, layout)
    size = spec.page_size_bytes * NUM_BLOCKS * NUM_LAYERS
    config = KVCacheConfig(
        num_blocks=NUM_BLOCKS,
        kv_cache_tensors=[KVCacheTensor(size, names, layer_stride, block_stride)],
        kv_cache_groups=[KVCacheGroupSpec(names, spec)],
    )
    caches = allocate_kv_cache(config, torch.device("cpu"), layout)
    gen = torch.Generator().manual_seed(seed)
    as_int = {1: torch.uint8, 2: torch.int16}[caches[names[0]].element_size()]
    for n in names:
        view = caches[n].view(as_int)
        info = torch.iinfo(as_int)
        view.copy_(torch.randint(info.min, info.max, view.shape, generator=gen, dtype=as_int))
    return caches


def planes_as_backend_reads(case: dict[str, Any], cache: Any) -> list[torch.Tensor]:
    """One layer's planes as its backend's kernels read them (``vllm/v1/attention/backends``),
    as integers: K and V ``[B, N, H, D]``, or the MLA latent ``[B, N, C]``."""
    if case["form"] == "pair":
        k, v = cache
        planes = [k, v]
    elif case.get("mla"):
        planes = [cache[:, 0]]
    elif case["backend"] == "CPU_ATTN":  # cpu_attn.py: view [B, H, 2N, D], chunk(2, dim=2)
        b, h, n, _ = cache.shape
        k, v = cache.view((b, h, n * 2, -1)).chunk(2, dim=2)
        planes = [k.transpose(1, 2), v.transpose(1, 2)]
    else:  # flash_attn.py: kv_cache.transpose(1, 2).split(head_size, dim=-1)
        k, v = cache.transpose(1, 2).split(HEAD_SIZE, dim=-1)
        planes = [k, v]
    as_int = {1: torch.uint8, 2: torch.int16}[planes[0].element_size()]
    return [p.view(as_int) for p in planes]


def make_worker(master: str, case: dict[str, Any], caches: dict[str, Any]) -> KVStoreWorker:
    cfg = ConnectorConfig.from_extra({"master": master})
    ns = namespace(case)
    counters = Counters()
    worker = KVStoreWorker(cfg, ns, layer_names(), Pool(cfg, ns, counters), counters)
    worker.register_kv_caches(caches, case["backend"], geometry(case))
    return worker


def corrupt(master: str, case: dict[str, Any], tokens: np.ndarray, block: int) -> None:
    """Flip bytes of one stored block in its node's shared-memory arena, behind the store."""
    with Client.connect(master) as c:
        kv = KVCache(c, namespace(case))
        info = c.locate(kv.block_object_keys(tokens)[block])
        kv.close()
    loc = info.locations[0]
    arena = Path("/dev/shm") / f"kvstore-{loc.node_id}.arena"
    with open(arena, "r+b") as f:
        f.seek(loc.grant.offset + 100)
        raw = bytearray(f.read(32))
        f.seek(loc.grant.offset + 100)
        f.write(bytes(b ^ 0x5A for b in raw))


def run(spec: dict[str, Any]) -> dict[str, Any]:
    master, src_case, dst_case = spec["master"], spec["src"], spec["dst"]
    num = spec.get("num_blocks", 4)
    tokens = np.arange(spec.get("token_base", 1000), dtype=np.uint32)[: num * BLOCK_SIZE]
    tokens = (tokens * 7 + spec.get("seed", 0)) % 50000
    src_ids, dst_ids = [5, 6, 2, 9][:num], [1, 8, 9, 3][:num]
    src = allocate(src_case, seed=spec.get("seed", 0))
    dst = allocate(dst_case, seed=spec.get("seed", 0) + 1)
    names = layer_names()
    # Registered first: a layout the connector refuses is refused before anything moves.
    loader = make_worker(master, dst_case, dst)
    before = {n: [p.clone() for p in planes_as_backend_reads(dst_case, dst[n])] for n in names}

    saver = make_worker(master, src_case, src)
    saves = [Transfer("r", tokens, 0, src_ids)]
    with torch.inference_mode():
        for n in names:
            saver.save_kv_layer(saves, n)
    saver.wait_for_save()
    saver.close()
    if spec.get("corrupt") is not None:
        corrupt(master, src_case, tokens, spec["corrupt"])

    loader.start_load_kv([Transfer("r", tokens, 0, dst_ids)])
    for n in names:
        loader.wait_for_layer_load(n)
    loader.wait_for_save()
    failed = sorted(loader.get_block_ids_with_load_errors())
    loader.close()

    exact, untouched = [], True
    for n in names:
        want = planes_as_backend_reads(src_case, src[n])
        got = planes_as_backend_reads(dst_case, dst[n])
        if len(want) == 1 or len(got) == 1:  # MLA: the latent, whole
            want, got = [torch.cat(want, dim=-1)], [torch.cat(got, dim=-1)]
        for s, d in zip(src_ids, dst_ids, strict=True):
            if d in failed:
                continue
            exact.append(all(torch.equal(w[s], g[d]) for w, g in zip(want, got, strict=True)))
        kept = [b for b in range(NUM_BLOCKS) if b not in dst_ids or b in failed]
        now = planes_as_backend_reads(dst_case, dst[n])
        for old, new in zip(before[n], now, strict=True):
            untouched &= all(torch.equal(old[b], new[b]) for b in kept)
    views = loader._views
    return {
        "failed": failed,
        "exact": bool(exact) and all(exact),
        "num_exact": sum(exact),
        "untouched": bool(untouched),
        "dst_layout": views.layout if views is not None else None,
    }


def run_or_refuse(spec: dict[str, Any]) -> dict[str, Any]:
    """:func:`run`, or the one line a refused layout got."""
    try:
        return run(spec)
    except InvalidRequestError as exc:
        return {"refused": str(exc)}


if __name__ == "__main__":
    results = [run_or_refuse(spec) for spec in json.loads(sys.argv[1])]
    print("RESULTS " + json.dumps(results), flush=True)
