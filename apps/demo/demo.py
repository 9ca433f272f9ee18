"""The disaggregated flow end to end, for ``kvstore demo``.

A prefill worker and a decode worker, each its own process, share KV through the pool. A few
prompts share a long system prefix; for each the table shows the tokens found in the pool, the
time to first token with the pool and with recompute, the bytes moved, and whether the decode
output equals a plain colocated ``generate``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from kvstore.demo.serve import WorkerProcess

SYSTEM_PROMPT = (
    "You are the on-call assistant of a distributed key-value cache for large language model "
    "inference. The cache keeps the attention keys and values of every prompt it has seen in a "
    "pool of memory shared by many machines, so that a later request sharing a prefix does not "
    "recompute it. Answer briefly, cite the component you mean (master, storage node, client), "
    "never guess a configuration value, and prefer commands the operator can paste. Policies: "
    "eviction is least-recently-used per tier; a read verifies a checksum; a miss is always a "
    "correct answer and a wrong hit never is. The operator's cluster runs one master and one "
    "storage node on this machine, with a DRAM arena of a few hundred megabytes. "
)
QUESTIONS = (
    "How do I see how many blocks are cached?",
    "Why did my decode instance recompute the prompt?",
    "What happens when a storage node dies during a load?",
    "Can two models share a block?",
)


def encode(text: str) -> list[int]:
    """Byte-level tokens (the tiny models' vocabulary covers 0..255)."""
    return list(text.encode("utf-8"))


@dataclass(slots=True)
class DemoRow:
    prompt: str
    num_tokens: int
    num_cached: int
    ttft_pool_ms: float
    ttft_recompute_ms: float
    decode_loaded: int
    bytes_moved: int
    equal: bool


def _fmt_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def run_demo(
    master: str,
    *,
    model: str = "small-llama",
    block_size: int = 64,
    max_new_tokens: int = 12,
    fp8: bool = False,
    repeats: int = 1,
    out: object = None,
) -> list[DemoRow]:
    """Run the prompts through prefill and decode worker processes; print and return the rows.

    Args:
        master: the cluster's control address.
        model: a tiny model name (see kvstore.demo.models) or a local model folder.
        block_size: tokens per block.
        max_new_tokens: tokens each decode generates.
        fp8: store KV as FP8 (decode output then is compared, not expected, to be equal).
        repeats: prompt list passes (the second pass is served entirely from the pool).
        out: a file to print to (default stdout).

    Returns:
        One row per prompt.
    """
    import torch

    from kvstore.demo.models import build_model
    from kvstore.demo.workers import colocated_generate

    torch.set_num_threads(1)
    opts = ["--model", model, "--block-size", str(block_size)] + (["--fp8"] if fp8 else [])
    reference = build_model(model)
    rows: list[DemoRow] = []
    started = time.perf_counter()
    with (
        WorkerProcess("prefill", master, opts) as prefill,
        WorkerProcess("decode", master, opts) as decode,
    ):
        print(
            f"prefill worker pid {prefill.proc.pid}, decode worker pid {decode.proc.pid}, "
            f"model {model} (weights {prefill.fields['weights']}), block {block_size}"
            + (", FP8 transfer" if fp8 else ""),
            file=out,
        )
        prompts = [SYSTEM_PROMPT + q for q in QUESTIONS] * repeats
        for i, text in enumerate(prompts):
            tokens = encode(text)
            recompute = prefill.call({"tokens": tokens, "use_pool": False})
            p = prefill.call({"tokens": tokens})
            d = decode.call(
                {
                    "tokens": tokens,
                    "max_new_tokens": max_new_tokens,
                    "first_token": p["first_token"],
                }
            )
            want = colocated_generate(reference, tokens, max_new_tokens)
            rows.append(
                DemoRow(
                    prompt=f"{i + 1}: {text[len(SYSTEM_PROMPT) :][:40]}",
                    num_tokens=len(tokens),
                    num_cached=p["num_cached"],
                    ttft_pool_ms=p["ttft_s"] * 1e3,
                    ttft_recompute_ms=recompute["ttft_s"] * 1e3,
                    decode_loaded=d["num_loaded"],
                    bytes_moved=p["bytes_loaded"] + p["bytes_stored"] + d["bytes_loaded"],
                    equal=d["tokens"] == want,
                )
            )
    print_table(rows, out=out)
    if fp8:
        print(
            "FP8 is lossy: decode output is compared with, not expected to equal, colocated "
            "generation (figures in docs/benchmarks.md)",
            file=out,
        )
    print(f"done in {time.perf_counter() - started:.1f} s", file=out)
    return rows


def print_table(rows: Sequence[DemoRow], out: object = None) -> None:
    """The demo's table, one line per prompt."""
    head = (
        f"{'prompt':<46} {'tokens':>6} {'cached':>6} {'TTFT pool':>10} {'TTFT recompute':>15} "
        f"{'decode loaded':>13} {'bytes moved':>11}  decode == colocated"
    )
    print(head, file=out)
    print("-" * len(head), file=out)
    for r in rows:
        print(
            f"{r.prompt:<46} {r.num_tokens:>6} {r.num_cached:>6} {r.ttft_pool_ms:>8.1f}ms "
            f"{r.ttft_recompute_ms:>13.1f}ms {r.decode_loaded:>13} {_fmt_bytes(r.bytes_moved):>11}  "
            f"{'yes' if r.equal else 'NO'}",
            file=out,
        )
