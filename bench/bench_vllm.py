"""vLLM with the kvstore connector on the CPU: save and load GB/s per KV-cache layout, and TTFT
under real vLLM servers with and without the pool.

Two parts (``--part layouts``, ``--part ttft``; both by default):

**layouts** (no vLLM needed; about a minute). The connector's worker side
(``client/adapters/vllm_worker.py``, ``KVStoreWorker``) on a cache in each layout vLLM 0.32
registers: ``LBHNC`` (the CPU backend, ``CPU_ATTN``), ``LBNHC`` (FlexAttention), ``BLHNC``
(FlashInfer), ``BLNHC``, ``BHLNC``, ``LHBNC`` (FlashAttention) and an MLA latent cache
(``CPU_MLA``), allocated as ``tests/adapters/test_vllm_worker.py`` does: one allocation in the
layout's physical order, per-layer ``[B, H, N, C]`` views. SmolLM2-135M's shape (30 layers, 3 KV
heads, head 64, bf16; MLA: a 576-wide latent), block size 32, a ``--layout-tokens`` prompt whose
blocks are one run of consecutive block ids. Against a real ``kvstore up --shm`` on this host:

- a save is every layer's ``save_kv_layer``, then ``wait_for_save`` (the gather into staging,
  the checksums, one batched put with the prompt's index entry);
- a load is ``start_load_kv``, every layer's ``wait_for_layer_load`` and ``wait_for_save``
  (locate, the read or the in-place map of shared memory, the checks, the copy into the cache's
  blocks), checked bit for bit afterwards;
- in the same run, the pool's raw ``batch_put`` / ``batch_get_into`` of as many object bytes
  (fresh keys, contiguous host rows) set the reference (target: the connector at >= 0.8x raw).

Each cell is the best of ``--repeat``; every save is a new prompt, so none finds its blocks
stored already. ``--profile LAYOUT``: one more save and load of that layout under cProfile (the
worker's io and save threads, where the work is), top entries printed.

**ttft** (needs ``.venv-vllm`` and the converted model, see tests/adapters/vllm_servers.py). One
table: time to first token at prompts of 512, 1K and 2K tokens with 0%, 50% and 100% of the
prompt cached beforehand, for

- ``recompute``: vLLM without a connector, prefix caching off;
- ``vllm-prefix``: vLLM's own prefix cache hit in the same process (the limit: nothing moves);
- ``kvstore``: the kvstore connector, ``kv_both``, on a second instance (another server stored
  the prefix), with layer-wise loads (``load_mode: layer``, the default) and ``kvstore-async``
  with ``load_mode: async``;
- ``example-disk``: vLLM's ``ExampleConnector`` (safetensors files; it only hits a whole prompt
  it stored, so a 50% prefix is a miss for it);
- ``pd``: the P/D path end to end: prefill (``max_tokens=1``) on one server, then the request
  on another that loads the prompt from the pool; the sum of both.

Then the connector's load bandwidth (locate, read, copy into vLLM's cache, from its counters)
against the pool's raw ``batch_get_into`` of the same blocks, and the ratios against the
targets (TTFT of the largest prompt 100% cached: <= 1.15x vLLM's own prefix hit). With the
pool's node on this host (``--shm``), the connector copies blocks straight from the node's
shared memory into vLLM's cache (the share "in place"), checking each block's checksum just
before its copy: its "before the copy" figure is then little more than the master's answer, and
the checks count in the copy. Each server is pinned to one core (``VLLM_CPU_OMP_THREADS_BIND``).
Every TTFT uses fresh random token ids, so no other cache helps.

Usage: ``.venv/bin/python bench/bench_vllm.py [--part layouts|ttft] [--repeat 3]
[--profile LBHNC] [--lengths 512,1024,2048] [--shares 0,0.5,1] [--ttft-repeat 1] [--markdown]``
(``--markdown``: write the tables into docs/benchmarks.md, see bench/markdown.py).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import markdown  # noqa: E402
from kvstore.cli.embedded import EmbeddedCluster  # noqa: E402
from kvstore.client import Client, KVCache  # noqa: E402
from kvstore.client.adapters.vllm_config import ConnectorConfig, engine_namespace  # noqa: E402
from kvstore.client.adapters.vllm_layouts import CacheGeometry, block_views  # noqa: E402
from kvstore.client.adapters.vllm_pool import Counters, Pool, Transfer  # noqa: E402
from kvstore.client.adapters.vllm_worker import KVStoreWorker  # noqa: E402
from kvstore.keys import Namespace  # noqa: E402
from tests.adapters.vllm_servers import (  # noqa: E402
    VLLMServer,
    kv_config,
    missing_engine,
    model_dir,
)

BS = 32
WARM_TOKENS = BS  # the reader's warm-up prompt: one block, nothing loaded
SHARES = (0.0, 0.5, 1.0)
COLUMNS = ("recompute", "vllm-prefix", "kvstore", "kvstore-async", "example-disk", "pd")


# ==================================================================== part 1: layouts
#: SmolLM2-135M's attention shape (what the TTFT part serves), bf16; MLA: a DeepSeek-V2-style
#: latent (kv_lora_rank 512 + rope 64), one plane per layer.
LAYOUT_LAYERS, LAYOUT_KV_HEADS, LAYOUT_HEAD, MLA_LATENT = 30, 3, 64, 576
#: row -> (physical order of the logical [L, B, H, N, C], the backend that registers it).
LAYOUTS: dict[str, tuple[str, str]] = {
    "LBHNC": ("LBHNC", "CPU_ATTN"),
    "LBNHC": ("LBNHC", "FLEX_ATTENTION"),
    "BLHNC": ("BLHNC", "FLASHINFER"),
    "BLNHC": ("BLNHC", "FLASH_ATTN"),
    "BHLNC": ("BHLNC", "FLASH_ATTN"),
    "LHBNC": ("LHBNC", "FLASH_ATTN"),
    "MLA": ("LBHNC", "CPU_MLA"),
}
LAYER_NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(LAYOUT_LAYERS)]


def layout_geometry(row: str) -> CacheGeometry:
    if row == "MLA":
        return CacheGeometry(1, BS, MLA_LATENT, mla=True)
    return CacheGeometry(LAYOUT_KV_HEADS, BS, LAYOUT_HEAD)


def allocate(order: str, geo: CacheGeometry, num_blocks: int, seed: int) -> dict[str, torch.Tensor]:
    """Per-layer ``[B, H, N, C]`` views of one bf16 allocation in physical ``order``, random
    bits (as tests/adapters/test_vllm_worker.py allocates vLLM 0.32's layouts)."""
    c = geo.head_size if geo.mla else 2 * geo.head_size
    sizes = dict(zip("LBHNC", (LAYOUT_LAYERS, num_blocks, geo.num_kv_heads, BS, c), strict=True))
    gen = torch.Generator().manual_seed(seed)
    shape = tuple(sizes[a] for a in order)
    raw = torch.randint(-(1 << 15), 1 << 15, shape, generator=gen, dtype=torch.int16)
    logical = raw.view(torch.bfloat16).permute(*(order.index(a) for a in "LBHNC"))
    return {name: logical[i] for i, name in enumerate(LAYER_NAMES)}


def layout_namespace(geo: CacheGeometry) -> Namespace:
    return engine_namespace(
        served_model="bench-layouts",
        revision=None,
        kv_dtype="bfloat16",
        num_layers=LAYOUT_LAYERS,
        num_kv_heads=geo.plane_heads,
        head_dim=geo.plane_dim,
        block_size=BS,
        salt=None,
        mla=geo.mla,
    )


@dataclass
class Side:
    """One engine's connector worker side on its own cache (a producer or a consumer)."""

    worker: KVStoreWorker
    counters: Counters
    caches: dict[str, torch.Tensor]
    views: tuple[torch.Tensor, ...]  # per layer [B, 2, N, H, D], integer-typed (the bits)

    @classmethod
    def start(cls, address: str, row: str, num_blocks: int, seed: int) -> Side:
        order, backend = LAYOUTS[row]
        geo = layout_geometry(row)
        caches = allocate(order, geo, num_blocks, seed)
        cfg = ConnectorConfig.from_extra({"master": address, "load_mode": "layer"})
        ns = layout_namespace(geo)
        counters = Counters()
        worker = KVStoreWorker(cfg, ns, LAYER_NAMES, Pool(cfg, ns, counters), counters)
        worker.register_kv_caches(caches, backend, geo, order)
        views = block_views([caches[n] for n in LAYER_NAMES], geo, backend, order).as_int()
        return cls(worker, counters, caches, views)

    def save(self, tokens: np.ndarray, block_ids: list[int]) -> float:
        """Seconds of one save as vLLM drives it: each layer's ``save_kv_layer`` as the forward
        passes it, then ``wait_for_save`` at the end of the step."""
        saves = [Transfer("bench", tokens, 0, block_ids)]
        before = self.counters.totals.get("saved_tokens", 0)
        t0 = time.perf_counter()
        with torch.inference_mode():
            for name in LAYER_NAMES:
                self.worker.save_kv_layer(saves, name)
        self.worker.wait_for_save()
        took = time.perf_counter() - t0
        saved = self.counters.totals.get("saved_tokens", 0) - before
        assert saved == len(block_ids) * BS, f"saved {saved} tokens of {len(block_ids) * BS}"
        return took

    def load(self, tokens: np.ndarray, block_ids: list[int]) -> float:
        """Seconds of one layer-wise load as vLLM drives it: ``start_load_kv``, each layer's
        ``wait_for_layer_load``, ``wait_for_save`` (which collects the load's outcome)."""
        t0 = time.perf_counter()
        self.worker.start_load_kv([Transfer("bench", tokens, 0, block_ids)])
        for name in LAYER_NAMES:
            self.worker.wait_for_layer_load(name)
        self.worker.wait_for_save()
        took = time.perf_counter() - t0
        failed = self.worker.get_block_ids_with_load_errors()
        assert not failed, f"blocks {sorted(failed)} failed to load"
        return took

    def clear(self, block_ids: list[int]) -> None:
        for view in self.views:
            view[block_ids] = 0

    def close(self) -> None:
        self.worker.close()


def profiled(executor: ThreadPoolExecutor, prof: cProfile.Profile) -> None:
    """Run whatever ``executor`` is given next under ``prof``: cProfile sees the thread that
    enables it only, and the worker's loads and saves run on its io and save threads (one
    thread each, so ``prof`` is never enabled twice at once)."""
    submit = executor.submit

    def wrapped(fn: Callable[..., object], /, *args: object, **kwargs: object) -> object:
        def run() -> object:
            prof.enable()
            try:
                return fn(*args, **kwargs)
            finally:
                prof.disable()

        return submit(run)

    executor.submit = wrapped  # type: ignore[method-assign]


def top(prof: cProfile.Profile, num: int = 22) -> str:
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(num)
    body = out.getvalue()
    return body[body.find("   ncalls") :].rstrip()


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def measure_layout(
    address: str, row: str, num_tokens: int, repeat: int, profile: bool
) -> dict[str, float]:
    """Best GB/s of the connector's save and load of one prompt in layout ``row``, and of the
    pool's raw batch_put / batch_get_into of as many object bytes, alternating, in one run."""
    num_blocks = num_tokens // BS
    src_ids = list(range(8, 8 + num_blocks))  # one run, as vLLM hands out a fresh prompt's
    dst_ids = list(range(16, 16 + num_blocks))  # another run: the consumer's own blocks
    cache_blocks = 16 + num_blocks + 8
    producer = Side.start(address, row, cache_blocks, seed=1)
    consumer = Side.start(address, row, cache_blocks, seed=2)
    rng = np.random.default_rng(sum(map(ord, row)))
    best_s = {"save": float("inf"), "load": float("inf"), "put": float("inf"), "get": float("inf")}
    with Client.connect(address) as c:
        kv = KVCache(c, layout_namespace(layout_geometry(row)))
        nbytes = num_blocks * kv.object_nbytes
        rows = rng.integers(0, 256, (num_blocks, kv.object_nbytes), dtype=np.uint8)
        out = np.empty_like(rows)
        try:
            for rep in range(repeat + 1 + int(profile)):  # the first: warm-up, not counted
                keys = [f"bench/layouts/{row}/{rep}/{i}" for i in range(num_blocks)]
                t0 = time.perf_counter()
                assert all(r is None for r in c.batch_put(keys, list(rows)))
                put_s = time.perf_counter() - t0
                t0 = time.perf_counter()
                got = c.batch_get_into(keys, list(out))
                get_s = time.perf_counter() - t0
                assert got == [kv.object_nbytes] * num_blocks and np.array_equal(out, rows)
                c.batch_remove(keys)

                tokens = rng.integers(1000, 40000, num_tokens).astype(np.uint32)
                consumer.clear(dst_ids)
                profs = (cProfile.Profile(), cProfile.Profile())
                if rep == repeat + 1:  # the profiled round: not counted either
                    profiled(producer.worker._saver, profs[0])
                    profiled(consumer.worker._io, profs[1])
                save_s = producer.save(tokens, src_ids)
                load_s = consumer.load(tokens, dst_ids)
                for src, dst in zip(producer.views, consumer.views, strict=True):
                    assert torch.equal(src[src_ids], dst[dst_ids]), f"{row}: loaded bytes differ"
                c.batch_remove(kv.block_object_keys(tokens))
                if rep == repeat + 1:
                    print(f"\n{row}: one save, cProfile of the save thread (tottime)")
                    print(top(profs[0]))
                    print(f"\n{row}: one load, cProfile of the io thread (tottime)")
                    print(top(profs[1]))
                elif rep:
                    for k, v in (
                        ("save", save_s),
                        ("load", load_s),
                        ("put", put_s),
                        ("get", get_s),
                    ):
                        best_s[k] = min(best_s[k], v)
        finally:
            kv.close()
            producer.close()
            consumer.close()
    return {k: gbps(nbytes, v) for k, v in best_s.items()} | {"MB": nbytes / 1e6}


def run_layouts(args: argparse.Namespace) -> str:
    """Part 1; returns its table (Markdown) and the note under it."""
    rows = [r for r in args.layouts.split(",") if r]
    unknown = set(rows) - LAYOUTS.keys() | ({args.profile} - LAYOUTS.keys() - {None})
    if unknown:
        raise SystemExit(f"bench_vllm: unknown layouts {sorted(unknown)}; known: {list(LAYOUTS)}")
    results: dict[str, dict[str, float]] = {}
    with (
        tempfile.TemporaryDirectory(prefix="bench-vllm-layouts-") as tmp,
        EmbeddedCluster(tmp, "2GiB", extra=["--shm"]) as cluster,
    ):
        cluster.wait_warm()
        for row in rows:
            results[row] = measure_layout(
                cluster.address, row, args.layout_tokens, args.repeat, row == args.profile
            )
            r = results[row]
            print(
                f"{row:>6}: save {r['save']:.2f} GB/s ({r['save'] / r['put']:.2f}x raw), load "
                f"{r['load']:.2f} GB/s ({r['load'] / r['get']:.2f}x raw)",
                flush=True,
            )
    head = [
        "layout",
        "backend",
        "MB a prompt",
        "save GB/s",
        "raw batch_put GB/s",
        "save / raw",
        "load GB/s",
        "raw batch_get_into GB/s",
        "load / raw",
    ]
    body = [
        [
            row,
            LAYOUTS[row][1],
            f"{r['MB']:.1f}",
            f"{r['save']:.2f}",
            f"{r['put']:.2f}",
            f"{r['save'] / r['put']:.2f}x",
            f"{r['load']:.2f}",
            f"{r['get']:.2f}",
            f"{r['load'] / r['get']:.2f}x",
        ]
        for row, r in results.items()
    ]
    load = os.getloadavg()
    note = (
        f"A {args.layout_tokens}-token prompt in SmolLM2-135M's shape ({LAYOUT_LAYERS} layers, "
        f"{LAYOUT_KV_HEADS} KV heads, head {LAYOUT_HEAD}, bf16; MLA: a {MLA_LATENT}-wide latent), "
        f"block size {BS}, through the connector's worker side and `kvstore up --shm` on this "
        f"host; raw: the pool's batch_put / batch_get_into of as many object bytes in the same "
        f"run; best of {args.repeat}; target >= 0.8x raw; load average {load[0]:.1f}."
    )
    return f"{markdown.table(head, body)}\n\n{note}"


# ==================================================================== part 2: TTFT


class Prompts:
    """Fresh random token ids (seeded): no two measurements share a prefix by accident."""

    def __init__(self) -> None:
        self._rng = np.random.default_rng(7)

    def new(self, n: int) -> list[int]:
        return [int(t) for t in self._rng.integers(1000, 40000, n)]


def ttft(server: VLLMServer, prompt: list[int]) -> float:
    return server.ttft(prompt) * 1e3


def best(fn, repeat: int) -> float:
    return min(fn() for _ in range(repeat))


def measure_same_process(
    server: VLLMServer, prompts: Prompts, n: int, share: float, repeat: int
) -> float:
    """The prefix computed by this very server, then the prompt (its own cache, or a miss)."""

    def once() -> float:
        p = prompts.new(n)
        cut = int(n * share) // BS * BS
        if cut:
            server.complete(p[:cut] if cut < n else p, max_tokens=1)
        return ttft(server, p)

    return best(once, repeat)


def measure_second_instance(
    writer: VLLMServer, reader: VLLMServer, prompts: Prompts, n: int, share: float, repeat: int
) -> float:
    """The prefix computed (and saved) by ``writer``; the prompt served by ``reader``.

    The reader serves a short fresh prompt (one block, nothing to load) just before the timed
    one, as the rows measured within one server have that server busy just before (it
    computed the prefix itself): an engine left idle through the writer's whole prefill
    starts its next step slower, whatever its connector."""

    def once() -> float:
        p = prompts.new(n)
        cut = int(n * share) // BS * BS
        if cut:
            writer.complete(p[:cut] if cut < n else p, max_tokens=1)
        reader.complete(prompts.new(WARM_TOKENS), max_tokens=1)
        return ttft(reader, p)

    return best(once, repeat)


def measure_pd(
    prefill: VLLMServer, decode: VLLMServer, prompts: Prompts, n: int, share: float, repeat: int
) -> float:
    """P holds (and the pool holds) the cached share; then the two-step request, end to end."""

    def once() -> float:
        p = prompts.new(n)
        cut = int(n * share) // BS * BS
        if cut:
            prefill.complete(p[:cut] if cut < n else p, max_tokens=1)
        t0 = time.perf_counter()
        prefill.complete(p, max_tokens=1)
        decode.complete(p, max_tokens=1)
        return (time.perf_counter() - t0) * 1e3

    return best(once, repeat)


def namespace() -> Namespace:
    import json

    cfg = json.loads((model_dir() / "config.json").read_text())
    return Namespace(
        model="smollm2",
        dtype="bfloat16",
        num_layers=cfg["num_hidden_layers"],
        num_kv_heads=cfg.get("num_key_value_heads", cfg["num_attention_heads"]),
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"],
        block_size=BS,
    )


def raw_bandwidth(address: str, prompt: list[int], repeat: int = 5) -> tuple[float, int]:
    """The pool's raw batch_get_into of a prompt's blocks (shm, same host): best MB/s, bytes."""
    with Client.connect(address) as c:
        kv = KVCache(c, namespace())
        keys = kv.block_object_keys(prompt)[: (len(prompt) - 1) // BS]
        bufs = np.empty((len(keys), kv.object_nbytes), dtype=np.uint8)
        rows = list(bufs)
        best_s = float("inf")
        for _ in range(repeat):
            t0 = time.perf_counter()
            res = c.batch_get_into(keys, rows)
            best_s = min(best_s, time.perf_counter() - t0)
            assert all(r == kv.object_nbytes for r in res), res
        kv.close()
    return bufs.nbytes / best_s / 1e6, bufs.nbytes


def connector_bandwidth(server: VLLMServer, since: dict[str, float]) -> tuple[float, float, float]:
    """The connector's load bandwidth from its counters: (MB/s before the copy: locate, and
    reads into staging of blocks not in place; MB/s end to end, with the copy into vLLM's paged
    cache; the share of the bytes copied in place from shared memory)."""
    m = server.metrics()

    def delta(name: str) -> float:
        return m.get(f"vllm:kvstore_{name}", 0.0) - since.get(f"vllm:kvstore_{name}", 0.0)

    nbytes, secs, copy = delta("loaded_bytes"), delta("load_seconds"), delta("copy_seconds")
    read = secs - copy
    in_place = delta("loaded_in_place_bytes") / nbytes if nbytes else 0.0
    return (
        nbytes / read / 1e6 if read > 0 else 0.0,
        nbytes / secs / 1e6 if secs else 0.0,
        in_place,
    )


def run_ttft(args: argparse.Namespace) -> str:
    """Part 2 (real vLLM servers); returns its table (Markdown) and the lines under it."""
    lengths = [int(x) for x in args.lengths.split(",")]
    shares = [float(x) for x in args.shares.split(",")]
    prompts = Prompts()
    table: dict[tuple[int, float], dict[str, float]] = {(n, s): {} for n in lengths for s in shares}
    t_start = time.monotonic()
    tmp = Path(tempfile.mkdtemp(prefix="bench-vllm-"))
    extra: dict[str, float] = {}
    with EmbeddedCluster(str(tmp / "pool"), "2GiB", extra=["--shm"]) as cluster:
        cluster.wait_warm()
        addr = cluster.address
        servers: list[VLLMServer] = []

        def start(name: str, kv: dict | None, cpu: int, prefix: bool = True) -> VLLMServer:
            s = VLLMServer(tmp / f"{name}.log", kv, cpu=cpu, prefix_caching=prefix)
            servers.append(s)
            return s

        def stop(*ss: VLLMServer) -> None:
            for s in ss:
                s.stop()
                servers.remove(s)

        try:
            # 1. no connector: recompute, and vLLM's own prefix cache.
            rec, own = start("recompute", None, 0, prefix=False), start("prefix", None, 1)
            rec.wait_ready(), own.wait_ready()
            for n in lengths:
                ttft(rec, prompts.new(n)), ttft(own, prompts.new(n))  # warm-up per shape
                r = best(lambda: ttft(rec, prompts.new(n)), args.ttft_repeat)
                for s in shares:
                    table[(n, s)]["recompute"] = r
                    table[(n, s)]["vllm-prefix"] = measure_same_process(
                        own, prompts, n, s, args.ttft_repeat
                    )
            stop(rec, own)
            print(f"[{time.monotonic() - t_start:.0f}s] recompute and vLLM prefix done", flush=True)

            # 2. kvstore kv_both: A stores, B (a second instance) loads; the P/D path A -> B.
            a = start("a", kv_config("kv_both", addr), 1)
            b = start("b", kv_config("kv_both", addr, load_mode="layer"), 0)
            a.wait_ready(), b.wait_ready()
            for n in lengths:
                measure_second_instance(a, b, prompts, n, 1.0, 1)  # warm-up
            since = b.metrics()
            for n in lengths:
                for s in shares:
                    table[(n, s)]["kvstore"] = measure_second_instance(
                        a, b, prompts, n, s, args.ttft_repeat
                    )
            extra["connector_MBps"] = connector_bandwidth(b, since)
            for n in lengths:
                for s in shares:
                    table[(n, s)]["pd"] = measure_pd(a, b, prompts, n, s, args.ttft_repeat)
            big = prompts.new(max(lengths))
            a.complete(big, max_tokens=1)
            extra["raw_MBps"], extra["raw_bytes"] = raw_bandwidth(addr, big)
            stop(b)
            print(f"[{time.monotonic() - t_start:.0f}s] kvstore (layer) and P/D done", flush=True)

            # 3. kvstore with async loads; vLLM's ExampleConnector (disk, prefix caching off so
            # that a repeat is served by the connector, not by vLLM's cache).
            b2 = start("b_async", kv_config("kv_both", addr, load_mode="async"), 0)
            ex_cfg = {
                "kv_connector": "ExampleConnector",
                "kv_role": "kv_both",
                "kv_connector_extra_config": {"shared_storage_path": str(tmp / "example")},
            }
            b2.wait_ready()
            for n in lengths:
                measure_second_instance(a, b2, prompts, n, 1.0, 1)  # warm-up
            since = b2.metrics()
            for n in lengths:
                for s in shares:
                    table[(n, s)]["kvstore-async"] = measure_second_instance(
                        a, b2, prompts, n, s, args.ttft_repeat
                    )
            extra["connector_async_MBps"] = connector_bandwidth(b2, since)
            stop(a, b2)
            ex = start("example", ex_cfg, 0, prefix=False)
            ex.wait_ready()
            for n in lengths:
                ttft(ex, prompts.new(n))  # warm-up
                for s in shares:
                    table[(n, s)]["example-disk"] = measure_same_process(
                        ex, prompts, n, s, args.ttft_repeat
                    )
            stop(ex)
        finally:
            for s in list(servers):
                s.stop()

    load = os.getloadavg()
    head = ["prompt", "cached", *COLUMNS]
    rows = [
        [n, f"{s:.0%}", *(f"{table[(n, s)].get(c, float('nan')):.0f}" for c in COLUMNS)]
        for n in lengths
        for s in shares
    ]
    lines = [
        f"TTFT in ms, SmolLM2-135M-Instruct bf16 on the CPU, vLLM 0.32, block size {BS}, one "
        f"core per server, the pool `kvstore up --shm` on this host; best of {args.ttft_repeat}; "
        f"load average {load[0]:.1f}.",
        "recompute: no connector, no prefix cache. vllm-prefix: same-process prefix hit. "
        "kvstore(-async): kv_both, a second instance loads (layer-wise / async loads). "
        "example-disk: ExampleConnector (whole-prompt hits only). pd: prefill on one server "
        "then the request on another, end to end.",
    ]
    raw = extra["raw_MBps"]
    read, e2e, in_place = extra["connector_MBps"]
    read_a, e2e_a, in_place_a = extra["connector_async_MBps"]
    lines.append(
        f"Load bandwidth (MB/s): raw batch_get_into {raw:.0f} ({extra['raw_bytes'] / 1e6:.1f} MB "
        f"of blocks); connector before the copy {read:.0f} (layer) / {read_a:.0f} (async); end "
        f"to end into vLLM's cache {e2e:.0f} / {e2e_a:.0f} = {e2e / raw:.2f}x raw (target >= "
        f"0.8x); copied in place from shared memory {in_place:.0%} / {in_place_a:.0%}."
    )
    n = max(lengths)
    if 1.0 in shares:
        row = table[(n, 1.0)]
        kv = row["kvstore"]  # the default load mode
        lines.append(
            f"{n} tokens, 100% cached: kvstore (layer-wise, the default) {kv:.0f} ms "
            f"(async {row['kvstore-async']:.0f}) = {kv / row['vllm-prefix']:.2f}x vLLM's "
            f"own prefix hit (target <= 1.15x), {row['recompute'] / kv:.1f}x faster than "
            f"recompute (target >= 5x), {row['example-disk'] / kv:.2f}x faster than "
            f"ExampleConnector (target > 1)."
        )
    print(f"[{time.monotonic() - t_start:.0f}s] TTFT done", flush=True)
    return markdown.table(head, rows) + "\n\n" + "\n\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--part", choices=("layouts", "ttft", "all"), default="all")
    ap.add_argument("--repeat", type=int, default=3, help="layouts: runs per cell (best kept)")
    ap.add_argument("--ttft-repeat", type=int, default=1, help="TTFT: runs per cell (best kept)")
    ap.add_argument("--layouts", default=",".join(LAYOUTS), help="layout rows to measure")
    ap.add_argument("--layout-tokens", type=int, default=2048, help="prompt of the layout rows")
    ap.add_argument("--profile", default=None, help="a layout to profile one save and load of")
    ap.add_argument("--lengths", default="512,1024,2048", help="TTFT prompt lengths")
    ap.add_argument("--shares", default=",".join(map(str, SHARES)), help="TTFT cached shares")
    ap.add_argument("--markdown", action="store_true", help="write into docs/benchmarks.md")
    args = ap.parse_args()
    if args.part in ("layouts", "all"):
        text = run_layouts(args)
        print(f"\n{text}\n", flush=True)
        if args.markdown:
            markdown.write_table("vllm-layouts", text)
    if args.part in ("ttft", "all"):
        why = missing_engine()
        if why:
            print(f"bench_vllm: cannot run the TTFT part: {why}")
            return 2
        text = run_ttft(args)
        print(f"\n{text}\n", flush=True)
        if args.markdown:
            markdown.write_table("vllm-ttft", text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
