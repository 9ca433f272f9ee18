"""Benchmark of the radix prefix index: match latency, insert rate, bytes of index per block.

Run::

    .venv/bin/python bench/bench_radix.py                   # 1M+ blocks, 128K vocab (~1-2 min)
    .venv/bin/python bench/bench_radix.py --vocab 32000     # 16-bit tokens
    .venv/bin/python bench/bench_radix.py --blocks 200000   # quicker
    .venv/bin/python bench/bench_radix.py --suffix-blocks 2 # short unique suffixes (node-heavy)
    .venv/bin/python bench/bench_radix.py --markdown        # also write docs/benchmarks.md

Workload (block_size 64): shared system prompts, multi-turn conversations that extend them (each
turn re-inserts the whole prompt, as ``put_end`` would), and 16 long documents of 128K tokens.
Match queries are 128K-token prompts: a stored document in full, and documents diverging at a
random token (so the last block matches partially). Memory is the growth of tracemalloc's traced
memory while the index is built again under tracemalloc (a second pass: tracing slows Python
down, so rates and latencies come from the first, untraced pass); the workload's own data is
released before measuring.

With ``--suffix-blocks N`` the conversations are replaced by prompts that add only N unique
blocks after a shared system prompt, so almost every prompt makes a tree node of N blocks: the
per-node cost of the index dominates.
Targets: match p99 <= 2 ms, <= 200 B of index per block.

``--markdown`` also writes the table into docs/benchmarks.md (see bench/markdown.py): the region
``radix``, or ``radix-suffix`` with ``--suffix-blocks``.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import os
import sys
import time
import tracemalloc
from pathlib import Path

import numpy as np

sys.path.append(str(Path(__file__).resolve().parents[1]))  # for bench.markdown

from bench import markdown  # noqa: E402
from kvstore.keys import Namespace, block_keys  # noqa: E402
from kvstore.master.radix import RadixIndex  # noqa: E402

LONG_TOKENS = 128 * 1024
NUM_LONG_DOCS = 16


def _doc(seed: int, vocab: int) -> np.ndarray:
    return np.random.default_rng(1_000_000 + seed).integers(0, vocab, LONG_TOKENS, dtype=np.uint32)


def build(
    index: RadixIndex,
    ns: Namespace,
    target_blocks: int,
    vocab: int,
    seed: int,
    suffix_blocks: int = 0,
) -> tuple[int, float, int]:
    """Fill ``index`` with at least ``target_blocks`` blocks.

    Returns:
        (blocks newly indexed, seconds spent inside ``index.insert``, blocks submitted).
    """
    rng = np.random.default_rng(seed)
    bs = ns.block_size
    systems = [
        rng.integers(0, vocab, int(rng.integers(16, 48)) * bs, dtype=np.uint32) for _ in range(50)
    ]
    inserted = processed = 0
    insert_s = 0.0
    value = 0

    def put(tokens: np.ndarray) -> None:
        nonlocal inserted, insert_s, processed, value
        tokens = tokens[: len(tokens) - len(tokens) % bs]
        keys = block_keys(ns, tokens)
        values = np.arange(value, value + len(keys))
        value += len(keys)
        t0 = time.perf_counter()
        inserted += index.insert(ns, tokens, keys, values)
        insert_s += time.perf_counter() - t0
        processed += len(keys)

    for d in range(NUM_LONG_DOCS):
        put(_doc(d, vocab))
    for _ in range(10_000_000):  # bounded; stops at target_blocks
        if inserted >= target_blocks:
            break
        if suffix_blocks:
            system = systems[int(rng.integers(len(systems)))]
            suffix = rng.integers(0, vocab, suffix_blocks * bs, dtype=np.uint32)
            put(np.concatenate([system, suffix]))
            continue
        prompt = np.concatenate(
            [
                systems[int(rng.integers(len(systems)))],
                rng.integers(0, vocab, int(rng.integers(512, 8192)), dtype=np.uint32),
            ]
        )
        put(prompt)
        for _turn in range(int(rng.integers(0, 4))):
            prompt = np.concatenate(
                [prompt, rng.integers(0, vocab, int(rng.integers(256, 2048)), dtype=np.uint32)]
            )
            put(prompt)
    return inserted, insert_s, processed


def bench_match(
    index: RadixIndex, ns: Namespace, vocab: int, seed: int, rounds: int
) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed + 1)
    docs = [_doc(d, vocab) for d in range(NUM_LONG_DOCS)]
    out: dict[str, list[float]] = {"full hit": [], "diverging": [], "miss": []}
    for r in range(rounds):
        doc = docs[r % NUM_LONG_DOCS]
        diverging = doc.copy()
        cut = int(rng.integers(LONG_TOKENS // 2, LONG_TOKENS))
        diverging[cut] = (diverging[cut] + 1) % vocab
        miss = rng.integers(0, vocab, LONG_TOKENS, dtype=np.uint32)
        for name, q, expect in (
            ("full hit", doc, LONG_TOKENS),
            ("diverging", diverging, cut),
            ("miss", miss, None),
        ):
            t0 = time.perf_counter()
            m = index.match(ns, q)
            out[name].append(time.perf_counter() - t0)
            assert expect is None or m.num_tokens == expect, (name, m.num_tokens, expect)
    return {k: np.array(v) * 1e3 for k, v in out.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--blocks", type=int, default=1_000_000)
    parser.add_argument("--vocab", type=int, default=128_256)
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--evict", type=int, default=100_000, help="leaf blocks to evict")
    parser.add_argument(
        "--suffix-blocks",
        type=int,
        default=0,
        help="prompts = a shared system prompt + this many unique blocks (0: conversations)",
    )
    parser.add_argument("--markdown", action="store_true", help="write into docs/benchmarks.md")
    args = parser.parse_args()
    ns = Namespace("bench/llama-8b", "bfloat16", 32, 8, 128, block_size=64)

    # Pass 1, untraced: insert rate and match latency.
    index = RadixIndex()
    t0 = time.perf_counter()
    inserted, insert_s, processed = build(
        index, ns, args.blocks, args.vocab, args.seed, args.suffix_blocks
    )
    build_s = time.perf_counter() - t0
    lat = bench_match(index, ns, args.vocab, args.seed, args.rounds)
    blocks = index.num_blocks()
    nodes = index.num_nodes()
    estimate = index.memory_bytes()
    t0 = time.perf_counter()
    for digest, key in itertools.islice(index.evictable(ns.digest), args.evict):
        index.remove(digest, key, cascade=False)
    evict_s = time.perf_counter() - t0
    assert index.num_blocks() == blocks - args.evict
    del index
    gc.collect()

    # Pass 2, same workload under tracemalloc (which slows Python down): index memory.
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    index = RadixIndex()
    build(index, ns, args.blocks, args.vocab, args.seed, args.suffix_blocks)
    gc.collect()
    index_bytes = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    assert index.num_blocks() == blocks

    rows = [
        ("blocks indexed", f"{blocks:,}", "≥ 1,000,000"),
        (
            "workload",
            f"suffix {args.suffix_blocks} blocks" if args.suffix_blocks else "conversations",
            "",
        ),
        ("tree nodes", f"{nodes:,}", ""),
        (
            "vocab (bits stored per token)",
            f"{args.vocab:,} ({max(16, (args.vocab - 1).bit_length())})",
            "",
        ),
    ]
    for name, ms in lat.items():
        rows.append(
            (
                f"match 128K tokens, {name}: p50 / p99",
                f"{np.percentile(ms, 50):.3f} / {np.percentile(ms, 99):.3f} ms",
                "≤ 2 ms",
            )
        )
    rows += [
        ("insert rate, new blocks", f"{inserted / insert_s:,.0f} blocks/s", ""),
        (
            "insert rate, blocks submitted (incl. already indexed)",
            f"{processed / insert_s:,.0f} blocks/s",
            "",
        ),
        ("build wall time (hashing keys + insert)", f"{build_s:.1f} s", ""),
        (
            f"leaf-first eviction ({args.evict:,} blocks)",
            f"{args.evict / evict_s:,.0f} blocks/s",
            "",
        ),
        ("index bytes / block (tracemalloc)", f"{index_bytes / blocks:.1f} B", "≤ 200 B"),
        ("index bytes / block (memory_bytes() estimate)", f"{estimate / blocks:.1f} B", "≤ 200 B"),
    ]
    width = max(len(r[0]) for r in rows)
    vwidth = max(len(r[1]) for r in rows)
    print(f"{'metric':<{width}}  {'value':>{vwidth}}  target")
    print(f"{'-' * width}  {'-' * vwidth}  ------")
    for name, value, target in rows:
        print(f"{name:<{width}}  {value:>{vwidth}}  {target}")
    if args.markdown:
        note = (
            f"In process, block size {ns.block_size}, {args.rounds} match rounds, seed "
            f"{args.seed}; load average {os.getloadavg()[0]:.1f}."
        )
        table = markdown.table(
            ["metric", "value", "target"], [(n, v, t or "-") for n, v, t in rows]
        )
        region = "radix-suffix" if args.suffix_blocks else "radix"
        markdown.write_table(region, f"{table}\n\n{note}")


if __name__ == "__main__":
    main()
