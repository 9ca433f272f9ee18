"""KVCache.store and KVCache.load of whole prompts, timed and profiled (cProfile) in the client.

One embedded cluster (``kvstore up``: master and node processes), one lease-read client (TCP, or
shared memory with ``--shm``), a :class:`KVCache` in Llama-3-8B's shape (32 layers, 8 KV heads,
head size 128, float16, 64-token blocks: 8 MiB a block; ``--model smollm2``: SmolLM2-135M's, 30
layers, 3 KV heads, head size 64: 1.4 MiB a block); after ``--warmup`` prompts stored and
loaded, ``--prompts`` distinct prompts of ``--tokens`` tokens are stored, then loaded, each
verified. Prints ms per prompt and GB/s for each, then the top of each profile by own time.

Usage: ``.venv/bin/python bench/profile_kvcache.py [--shm] [--model llama3|smollm2] [--prompts 8]
[--tokens 512] [--no-profile] [--markdown]`` (``--markdown``: also write the timings into
docs/benchmarks.md, see bench/markdown.py; the profiles stay on the terminal).
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import markdown  # noqa: E402
from kvstore.cli.embedded import EmbeddedCluster  # noqa: E402
from kvstore.client import Client, KVCache, Namespace  # noqa: E402

#: (layers, KV heads, head size) of each model's KV; blocks of 64 tokens.
SHAPES = {"llama3": (32, 8, 128), "smollm2": (30, 3, 64)}
BLOCK = 64


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shm", action="store_true", help="read and write through shared memory")
    ap.add_argument("--model", choices=sorted(SHAPES), default="llama3", help="the KV's shape")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=512, help="a multiple of 64")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--top", type=int, default=12, help="profile lines to print")
    ap.add_argument(
        "--no-profile", action="store_true", help="time only (cProfile inflates per-call costs)"
    )
    ap.add_argument("--markdown", action="store_true", help="write into docs/benchmarks.md")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    LAYERS, HEADS, DIM = SHAPES[args.model]  # noqa: N806

    def tensor() -> np.ndarray:
        shape = (args.tokens, HEADS, DIM)
        return rng.standard_normal(shape, dtype=np.float32).astype(np.float16)

    layers = [(tensor(), tensor()) for _ in range(LAYERS)]
    out = [(np.empty_like(k), np.empty_like(v)) for k, v in layers]
    nbytes = 2 * LAYERS * args.tokens * HEADS * DIM * 2

    def prompt(i: int) -> np.ndarray:
        return np.random.default_rng(i).integers(0, 50_000, args.tokens)

    extra = ["--shm"] if args.shm else []
    with (
        tempfile.TemporaryDirectory() as data,
        EmbeddedCluster(data, "4GiB", extra) as cluster,
    ):
        cluster.wait_warm(60)
        with Client.connect(cluster.address, shm=args.shm, lease_reads=True) as client:
            kv = KVCache(client, Namespace("bench", "float16", LAYERS, HEADS, DIM, BLOCK))
            for i in range(args.warmup):
                kv.store(prompt(1_000_000 + i), layers)
                kv.load(prompt(1_000_000 + i), out)
            profiles = []
            rows = []
            for name, step in (("store", kv.store), ("load", kv.load)):
                profile = cProfile.Profile()
                t0 = time.perf_counter()
                if not args.no_profile:
                    profile.enable()
                for i in range(args.prompts):
                    if step(prompt(i), layers if name == "store" else out) != args.tokens:
                        raise SystemExit(f"{name} of prompt {i} did not cover it")
                profile.disable()
                each = (time.perf_counter() - t0) / args.prompts
                print(f"{name}: {each * 1e3:.1f} ms a prompt ({nbytes / each / 1e9:.2f} GB/s)")
                rows.append((f"KVCache.{name}", f"{each * 1e3:.1f}", f"{nbytes / each / 1e9:.2f}"))
                if not args.no_profile:
                    profiles.append((name, profile))
            for (k, v), (k2, v2) in zip(layers, out, strict=True):
                if not (np.array_equal(k, k2) and np.array_equal(v, v2)):
                    raise SystemExit("load returned other KV")
    for name, profile in profiles:
        print(f"\n{name}, by own time:")
        pstats.Stats(profile).sort_stats("tottime").print_stats(args.top)
    if args.markdown:
        note = (
            f"{args.prompts} distinct {args.tokens}-token prompts in {args.model}'s shape "
            f"({LAYERS} layers, {HEADS} KV heads, head size {DIM}, float16, {BLOCK}-token blocks; "
            f"{nbytes / 2**20:.1f} MiB a prompt), {'shared memory' if args.shm else 'TCP'}, "
            f"lease reads, each verified; "
            + (
                "no profiler"
                if args.no_profile
                else "timed with cProfile on, which slows each call"
            )
            + f"; load average {os.getloadavg()[0]:.1f}."
        )
        table = markdown.table(["step", "ms a prompt", "GB/s"], rows)
        markdown.write_table("profile-kvcache", f"{table}\n\n{note}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
