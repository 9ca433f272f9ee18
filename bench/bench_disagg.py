"""Disaggregated prefill/decode with a real (small, random-weight) model through the pool.

Starts an embedded cluster (``kvstore up``: master + one storage node, separate processes; the
workers here talk to it over TCP) and prints three tables:

1. Prefill TTFT with the pool vs recompute as the cached share of the prompt grows (0-100%), for
   prompt lengths up to a few thousand tokens; with a batched prefix load and with the layer-wise
   pipelined load (layer i computed while layer i+1 is in flight), and how much of the load time
   the pipeline hides.
2. Decode side: loading a whole prompt's KV (batched vs layer by layer) before the first step.
3. 16-bit vs FP8 (E4M3) transfer: bytes moved, load time, TTFT.

The model runs in bfloat16 by default (CPU float16 matmuls are very slow; the bytes are those of
FP16). Usage: ``.venv/bin/python bench/bench_disagg.py [--lengths 512,1024,2048,4096]
[--markdown]`` (``--markdown``: also write the tables into docs/benchmarks.md, see
bench/markdown.py).
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.append(str(Path(__file__).resolve().parents[1]))  # for bench.markdown

from bench import markdown  # noqa: E402
from kvstore.cli.embedded import EmbeddedCluster  # noqa: E402
from kvstore.client import Client, KVCache  # noqa: E402
from kvstore.client.adapters.fp8 import calibrate  # noqa: E402
from kvstore.demo import hf  # noqa: E402
from kvstore.demo.models import build_model  # noqa: E402
from kvstore.demo.workers import DecodeWorker, PrefillWorker  # noqa: E402

SHARES = (0.0, 0.25, 0.5, 0.75, 1.0)
BLOCK = 64


def start_cluster(data_dir: str, dram: str) -> tuple[subprocess.Popen[str], str]:
    """An embedded cluster (``kvstore up``) in a child process, and its control address."""
    cluster = EmbeddedCluster(data_dir, dram)
    return cluster.proc, cluster.address


class Prompts:
    """Fresh random prompts: every call gives tokens no earlier prompt shares (seeded)."""

    def __init__(self, seed: int = 0) -> None:
        self.gen = torch.Generator().manual_seed(seed)

    def __call__(self, n: int) -> list[int]:
        return torch.randint(0, 256, (n,), generator=self.gen).tolist()


def ms(x: float) -> str:
    return f"{x * 1e3:9.1f}"


#: A table for the page: its title, its column names, its rows (cells as printed, unpadded).
Table = tuple[str, list[str], list[list[str]]]


def median_of(reps: int, fn) -> object:
    runs = [fn() for _ in range(reps)]
    return sorted(runs, key=lambda r: r.ttft_s)[len(runs) // 2]


def ttft_table(prefill: PrefillWorker, prompts: Prompts, lengths: list[int], reps: int) -> Table:
    title = "Prefill TTFT: pool vs recompute, by cached share of the prompt"
    head = ["tokens", "cached", "recompute ms", "pool ms", "pipelined ms", "speedup", "load ms"]
    head += ["hidden", "MiB loaded"]
    rows: list[list[str]] = []
    print(f"\n## {title}")
    print(
        f"{'tokens':>6} {'cached':>7} {'recompute ms':>12} {'pool ms':>9} {'pipelined ms':>12} "
        f"{'speedup':>7} {'load ms':>9} {'hidden':>6} {'MiB loaded':>10}"
    )
    for length in lengths:
        for share in SHARES:
            prefix = prompts(int(length * share) // BLOCK * BLOCK if share < 1 else length)
            if prefix:
                prefill.prefill(prefix, pipelined=False)  # puts the shared prefix in the pool

            def fresh() -> list[int]:
                return prefix + prompts(length - len(prefix)) if len(prefix) < length else prefix

            recompute = median_of(reps, lambda: prefill.prefill(fresh(), use_pool=False))
            batched = median_of(reps, lambda: prefill.prefill(fresh(), pipelined=False))
            piped = median_of(reps, lambda: prefill.prefill(fresh(), pipelined=True))
            # Measured inside the pipelined run: the share of the loader's time during which
            # the model was computing rather than waiting for a layer.
            hidden = 1 - piped.load_exposed_s / piped.load_s if piped.num_cached else 0.0
            print(
                f"{length:>6} {piped.num_cached / length:>6.0%} {ms(recompute.ttft_s):>12} "
                f"{ms(batched.ttft_s)} {ms(piped.ttft_s):>12} "
                f"{recompute.ttft_s / piped.ttft_s:>6.1f}x {ms(batched.load_s)} "
                f"{max(hidden, 0.0):>6.0%} {piped.bytes_loaded / 2**20:>10.1f}"
            )
            rows.append(
                [
                    f"{length}",
                    f"{piped.num_cached / length:.0%}",
                    ms(recompute.ttft_s).strip(),
                    ms(batched.ttft_s).strip(),
                    ms(piped.ttft_s).strip(),
                    f"{recompute.ttft_s / piped.ttft_s:.1f}x",
                    ms(batched.load_s).strip(),
                    f"{max(hidden, 0.0):.0%}",
                    f"{piped.bytes_loaded / 2**20:.1f}",
                ]
            )
    return title, head, rows


def decode_table(
    prefill: PrefillWorker, decode: DecodeWorker, prompts: Prompts, lengths: list[int], reps: int
) -> Table:
    title = "Decode: the whole prompt's KV from the pool, then the first step"
    head = ["tokens", "batched ms", "pipelined ms", "load ms", "MiB"]
    rows: list[list[str]] = []
    print(f"\n## {title}")
    print(f"{'tokens':>6} {'batched ms':>10} {'pipelined ms':>12} {'load ms':>9} {'MiB':>7}")
    for length in lengths:
        tokens = prompts(length)
        first = prefill.prefill(tokens).first_token
        b = median_of(reps, lambda: decode.generate(tokens, 2, first_token=first, pipelined=False))
        p = median_of(reps, lambda: decode.generate(tokens, 2, first_token=first, pipelined=True))
        print(
            f"{length:>6} {ms(b.ttft_s):>10} {ms(p.ttft_s):>12} {ms(b.load_s)} "
            f"{b.bytes_loaded / 2**20:>7.1f}"
        )
        rows.append(
            [
                f"{length}",
                ms(b.ttft_s).strip(),
                ms(p.ttft_s).strip(),
                ms(b.load_s).strip(),
                f"{b.bytes_loaded / 2**20:.1f}",
            ]
        )
    return title, head, rows


def fp8_table(model, client: Client, prompts: Prompts, lengths: list[int], reps: int) -> Table:
    title = "16-bit vs FP8 (E4M3) transfer, prefill with 100% and 50% of the prompt cached"
    head = ["tokens", "cached", "format", "MiB loaded", "load ms", "TTFT ms", "same 1st token"]
    rows: list[list[str]] = []
    print(f"\n## {title}")
    print(
        f"{'tokens':>6} {'cached':>7} {'format':>8} {'MiB loaded':>10} {'load ms':>9} "
        f"{'TTFT ms':>9} {'same 1st token':>16}"
    )
    scales = calibrate(model)
    ns16 = hf.namespace_for(model, "bench", block_size=BLOCK)
    ns8 = hf.namespace_for(model, scales.model_name("bench"), block_size=BLOCK, kv_dtype=hf.FP8)
    workers = {
        "16-bit": PrefillWorker(model, KVCache(client, ns16)),
        "fp8": PrefillWorker(model, KVCache(client, ns8), fp8_scales=scales),
    }
    for length in lengths:
        for share in (1.0, 0.5):
            prefix = prompts(length if share == 1.0 else length // 2 // BLOCK * BLOCK)
            firsts: dict[str, list[int]] = {}
            # A fresh suffix per run: a run stores its new blocks, which the next must not hit.
            # The namespaces differ, so both formats see the same prompts, each fresh.
            suffixes = [prompts(length - len(prefix)) for _ in range(reps)]
            for name, worker in workers.items():
                worker.prefill(prefix, pipelined=False)
                runs = [worker.prefill(prefix + sfx, pipelined=False) for sfx in suffixes]
                r = sorted(runs, key=lambda x: x.ttft_s)[len(runs) // 2]
                firsts[name] = [x.first_token for x in runs]
                same = (
                    ""
                    if name == "16-bit"
                    else f"{sum(a == b for a, b in zip(firsts[name], firsts['16-bit'], strict=True))}/{reps}"
                )
                print(
                    f"{length:>6} {r.num_cached / length:>6.0%} {name:>8} "
                    f"{r.bytes_loaded / 2**20:>10.2f} {ms(r.load_s)} {ms(r.ttft_s)} {same:>16}"
                )
                rows.append(
                    [
                        f"{length}",
                        f"{r.num_cached / length:.0%}",
                        name,
                        f"{r.bytes_loaded / 2**20:.2f}",
                        ms(r.load_s).strip(),
                        ms(r.ttft_s).strip(),
                        same or "-",
                    ]
                )
    return title, head, rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="small-llama")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    ap.add_argument("--lengths", default="512,1024,2048,4096")
    ap.add_argument("--reps", type=int, default=3, help="runs per cell (the median is shown)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dram", default="2GiB")
    ap.add_argument("--tables", default="ttft,decode,fp8", help="which tables to print")
    ap.add_argument("--markdown", action="store_true", help="write into docs/benchmarks.md")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    lengths = [int(x) for x in args.lengths.split(",")]
    model = build_model(
        args.model, dtype=hf.NAME_TO_DTYPE[args.dtype], max_context=max(lengths) + 64
    )
    shape = hf.model_shape(model)
    with tempfile.TemporaryDirectory(prefix="kvstore-bench-") as data_dir:
        up, address = start_cluster(data_dir, args.dram)
        try:
            client = Client.connect(address)
            kv = KVCache(client, hf.namespace_for(model, "bench", block_size=BLOCK))
            setup = (
                f"model {args.model} {args.dtype}: {shape.num_layers} layers, {shape.num_kv_heads} "
                f"KV heads x {shape.head_dim}, {kv.namespace.block_size}-token blocks; "
                f"{args.threads} CPU thread(s)"
            )
            print(f"{setup}; cluster {address} (node in its own process, TCP)")
            prompts = Prompts()
            hf.forward(model, prompts(256), None)  # warm-up
            prefill, decode = PrefillWorker(model, kv), DecodeWorker(model, kv)
            started = time.perf_counter()
            tables = args.tables.split(",")
            done: list[Table] = []
            if "ttft" in tables:
                done.append(ttft_table(prefill, prompts, lengths, args.reps))
            if "decode" in tables:
                done.append(decode_table(prefill, decode, prompts, lengths, args.reps))
            if "fp8" in tables:
                done.append(fp8_table(model, client, prompts, lengths[-2:], args.reps))
            took = time.perf_counter() - started
            print(f"\n({took:.0f} s)")
            if args.markdown:
                parts = [
                    f"{setup}; the pool `kvstore up` over TCP (node in its own process); median "
                    f"of {args.reps} runs a cell; {took:.0f} s; "
                    f"load average {os.getloadavg()[0]:.1f}."
                ]
                for title, head, rows in done:
                    parts += [f"**{title}**", markdown.table(head, rows)]
                markdown.write_table("disagg", "\n\n".join(parts))
            kv.close()
            client.close()
        finally:
            os.kill(up.pid, signal.SIGTERM)
            up.wait(timeout=30)


if __name__ == "__main__":
    main()
