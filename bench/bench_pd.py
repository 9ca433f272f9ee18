"""The case for disaggregation on real vLLM: colocated serving against prefill/decode through the
pool, on the same two cores, the same model and the same requests.

Three set-ups, each behind ``kvstore router`` (one engine pinned to each core):

* ``colocated``: two vLLM servers, no connector, vLLM's default scheduling (chunked prefill as
  vLLM configures it on the CPU);
* ``colocated+pool``: the same two servers as ``kv_both`` with the kvstore connector (prefix
  reuse across both through the pool);
* ``pd``: one prefill server (``kv_producer``) and one decode server (``kv_consumer``) through
  the pool.

The workload has the interference the claim is about: a steady stream of chats (a short prompt
after a shared system prompt, a long streamed answer) and long prompts (documents of 2-4K tokens,
a few documents asked about again and again, a short answer) arriving among them at a rate each
load sets. Arrivals are a trace in Mooncake's format (written with ``--out``), replayed by
``kvstore replay``'s load generator (streamed, so every token's time is seen), the same trace for
every set-up at one load.

Per set-up and load: TTFT p50/p99, ITL p50/p99/max (every gap between two tokens, pooled),
tokens/s, and goodput (requests meeting both the TTFT and the TBT target, DistServe's definition,
a request's TBT being its mean gap after the first token) per second; beside them the
simulator's prediction for the same run (its cost model fitted from that run). Then the
simulator alone, with the costs fitted here, for larger clusters at the same load per engine:
where, if anywhere, P/D wins.

A second part, decode overload: one engine whose KV cache holds two of the requests in flight,
so vLLM preempts the third (recompute mode). With the connector the preempted request's blocks
go to the pool as it is preempted and it resumes by loading them; without, it computes them
again. Same requests, both ways: preemptions, the time to serve them all, and each request's
latency.

Usage: ``.venv/bin/python bench/bench_pd.py [--parts pd,preemption] [--loads 0.05,0.1,0.2]
[--duration 60] [--chat-rate 0.5] [--setups colocated,colocated+pool,pd] [--out DIR]
[--markdown]``; needs the vLLM virtualenv and the model (tests/adapters/vllm_servers.py).
Nothing is asserted.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import json
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import markdown  # noqa: E402
from kvstore.cli.embedded import EmbeddedCluster  # noqa: E402
from kvstore.demo.vllm_server import VLLMServer  # noqa: E402
from kvstore.replay.cli import ReplayRun, replay_trace  # noqa: E402
from kvstore.replay.fit import SimShape, simulate_requests  # noqa: E402
from kvstore.replay.loadgen import LoadConfig  # noqa: E402
from kvstore.replay.workload import ScaleConfig, build_requests  # noqa: E402
from kvstore.router.config import RouterConfig  # noqa: E402
from kvstore.routing.slo import SLOClass  # noqa: E402
from kvstore.sim.report import format_table  # noqa: E402
from kvstore.sim.trace import MOONCAKE_BLOCK_SIZE, TraceRequest  # noqa: E402
from tests.adapters.vllm_servers import (  # noqa: E402
    RouterProcess,
    kv_config,
    missing_engine,
    model_dir,
    vllm_python,
)
from tests.adapters.vllm_servers import VLLMServer as TestServer  # noqa: E402

BLOCK_TOKENS = 32
MAX_NUM_SEQS = 8
MAX_MODEL_LEN = 4096
#: Prompt tokens at most (the context less the longest answer).
MAX_PROMPT_TOKENS = MAX_MODEL_LEN - 256
#: Each engine's KV cache in blocks: vLLM logs "CPU KV cache size: 46,592 tokens" for SmolLM2
#: with VLLM_CPU_KVCACHE_SPACE=1 (GiB).
ENGINE_CACHE_BLOCKS = 46_592 // BLOCK_TOKENS
#: Hash ids: the chats' shared system prompt; documents from DOC_BASE; unique ids after.
SYSTEM_ID, DOC_BASE, UNIQUE_BASE = 1, 1_000_000, 10_000_000


@dataclasses.dataclass(frozen=True)
class Setup:
    """One way to serve: its engines' roles and connector, and the simulator's shape."""

    name: str
    label: str
    roles: tuple[str, str]  # per core: "none" (no connector), "kv_both", "kv_producer", ...

    def shape(self) -> SimShape:
        if self.name == "pd":
            return SimShape(1, 1, "round-robin", shared_pool=True, max_batch_size=MAX_NUM_SEQS)
        router = {f.name: f.default for f in dataclasses.fields(RouterConfig)}  # its defaults
        return SimShape(
            2,
            2,
            "cache-aware",
            shared_pool=self.name == "colocated+pool",
            max_batch_size=MAX_NUM_SEQS,
            engine_model="kv_both",
            poll_interval_s=router["poll_s"],
            max_inflight=router["max_inflight"],
            cache_blocks=ENGINE_CACHE_BLOCKS,
        )


SETUPS = {
    s.name: s
    for s in (
        Setup("colocated", "colocated: 2 x vLLM, no pool", ("none", "none")),
        Setup("colocated+pool", "colocated + pool: 2 x kv_both", ("kv_both", "kv_both")),
        Setup("pd", "P/D: 1 prefill + 1 decode via the pool", ("kv_producer", "kv_consumer")),
    )
}


@dataclasses.dataclass(frozen=True)
class Workload:
    """The requests of one load (arrival rates per second, lengths in tokens)."""

    long_rate: float
    chat_rate: float
    duration_s: float
    chat_prompt_blocks: int = 4
    chat_output: int = 96
    long_tokens: tuple[int, int] = (2048, 3584)
    long_output: int = 8
    num_docs: int = 4

    def trace(self, seed: int) -> list[TraceRequest]:
        """The load as a trace (Mooncake's units: ``input_length`` in tokens of 512-token
        hash blocks, scaled to ``BLOCK_TOKENS`` a block by the replay)."""
        rng = np.random.default_rng(seed)
        unique = iter(range(UNIQUE_BASE, UNIQUE_BASE + 1_000_000))
        doc_blocks = rng.integers(
            self.long_tokens[0] // BLOCK_TOKENS,
            self.long_tokens[1] // BLOCK_TOKENS + 1,
            self.num_docs,
        )
        arrivals: list[tuple[float, list[int], int]] = []
        t = 0.0
        while self.chat_rate > 0 and t < self.duration_s:
            ids = [SYSTEM_ID, *(next(unique) for _ in range(self.chat_prompt_blocks - 1))]
            arrivals.append((t, ids, self.chat_output))
            t += rng.uniform(0.8, 1.2) / self.chat_rate
        t = rng.exponential(1 / self.long_rate) if self.long_rate > 0 else self.duration_s
        while t < self.duration_s:
            doc = int(rng.integers(self.num_docs))
            ids = [DOC_BASE + doc * 10_000 + k for k in range(int(doc_blocks[doc]))]
            arrivals.append((t, [*ids, next(unique)], self.long_output))
            t += rng.exponential(1 / self.long_rate)
        arrivals.sort(key=lambda a: a[0])
        return [
            TraceRequest(i, round(at * 1000), len(ids) * MOONCAKE_BLOCK_SIZE, out, tuple(ids))
            for i, (at, ids, out) in enumerate(arrivals)
        ]


def scale_config(seed: int) -> ScaleConfig:
    return ScaleConfig(
        block_tokens=BLOCK_TOKENS,
        length_scale=1.0,
        max_output_tokens=256,
        max_prompt_tokens=MAX_PROMPT_TOKENS,
        time_scale=1.0,
        seed=seed,
    )


def start_engines(tmp: Path, setup: Setup, master: str) -> list[VLLMServer]:
    servers = []
    for cpu, role in enumerate(setup.roles):
        kv = None if role == "none" else json.dumps(kv_config(role, master))
        servers.append(
            VLLMServer(
                model_dir(),
                f"{setup.name}-{role}-{cpu}",
                tmp / f"{setup.name}-{cpu}.log",
                kv_config=kv,
                cpu_core=cpu,
                python=str(vllm_python()),
                block_size=BLOCK_TOKENS,
                max_model_len=MAX_MODEL_LEN,
                # A decode server recomputes nothing a pool hit covers: its own prefix cache
                # stays on, as vLLM's default, in every set-up.
                env={"TOKENIZERS_PARALLELISM": "false"},
                extra_args=["--max-num-seqs", str(MAX_NUM_SEQS)],
            )
        )
    for s in servers:
        s.wait_ready()
    return servers


def start_router(tmp: Path, setup: Setup, master: str, urls: list[str]) -> RouterProcess:
    if setup.name == "pd":
        roles = {"prefill": (urls[0],), "decode": (urls[1],)}
    else:
        roles = {"both": tuple(urls)}
    router = RouterProcess(tmp / f"router-{setup.name}.log", master, **roles)
    router.wait_ready()
    router.post(  # the router loads the tokenizer on its first request: not in the run
        "/v1/completions",
        {"model": "smollm2", "prompt": list(range(20, 28)), "max_tokens": 1, "temperature": 0},
    )
    return router


@dataclasses.dataclass
class Row:
    setup: Setup
    load: Workload
    run: ReplayRun


def itl_max_s(run: ReplayRun) -> float:
    gaps = [g for r in run.results if r.outcome == "ok" for g in r.itl_s]
    return max(gaps) if gaps else float("nan")


def measure(args: argparse.Namespace, slo: SLOClass, tmp: Path) -> list[Row]:
    loads = [Workload(r, args.chat_rate, args.duration) for r in args.loads]
    rows: list[Row] = []
    for name in args.setups:
        setup = SETUPS[name]
        started = time.monotonic()
        with EmbeddedCluster(str(tmp / f"pool-{name}"), "4GiB") as cluster:
            engines = start_engines(tmp, setup, cluster.address)
            router = None
            try:
                router = start_router(tmp, setup, cluster.address, [e.url for e in engines])
                print(f"{setup.label}: up in {time.monotonic() - started:.0f} s", flush=True)
                for i, load in enumerate(loads):
                    trace = load.trace(seed=i + 1)
                    if args.out is not None and name == args.setups[0]:
                        write_trace(args.out / f"trace-{load.long_rate:g}.jsonl", trace)
                    target = LoadConfig((router.url,), "smollm2", timeout_s=600)
                    t0 = time.monotonic()
                    run = replay_trace(trace, scale_config(100 + i), target, slo, setup.shape())
                    print(
                        f"  long prompts {load.long_rate:g}/s: {run.summary.num_ok}/"
                        f"{run.summary.num_requests} served in {time.monotonic() - t0:.0f} s",
                        flush=True,
                    )
                    rows.append(Row(setup, load, run))
            finally:
                if router is not None:
                    router.stop()
                for e in engines:
                    e.stop()
    return rows


def write_trace(path: Path, trace: Sequence[TraceRequest]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for r in trace:
            f.write(
                json.dumps(
                    {
                        "timestamp": r.timestamp_ms,
                        "input_length": r.input_length,
                        "output_length": r.output_length,
                        "hash_ids": list(r.hash_ids),
                    }
                )
                + "\n"
            )


def measured_table(rows: list[Row], slo: SLOClass) -> str:
    out = []
    for row in rows:
        s, p = row.run.summary, row.run.prediction
        out.append(
            [
                f"{row.load.long_rate:g}",
                row.setup.label,
                f"{s.num_ok}/{s.num_requests}",
                s.ttft_s[0] * 1e3,
                s.ttft_s[2] * 1e3,
                s.itl_s[0] * 1e3,
                s.itl_s[2] * 1e3,
                itl_max_s(row.run) * 1e3,
                s.throughput_tokens_s,
                s.goodput_rps,
                p.goodput_rps if p is not None else float("nan"),
                f"{s.slo_attainment:.0%}",
                f"{s.hit_rate:.0%}",
            ]
        )
    return format_table(
        [
            "long/s",
            "set-up",
            "served",
            "TTFT p50 ms",
            "TTFT p99 ms",
            "ITL p50 ms",
            "ITL p99 ms",
            "ITL max ms",
            "tokens/s",
            "goodput r/s",
            "sim goodput r/s",
            "met SLO",
            "hit rate",
        ],
        out,
    )


def verdict(rows: list[Row]) -> list[str]:
    """Per load: P/D's goodput against the better colocated set-up's."""
    lines = []
    for rate in sorted({r.load.long_rate for r in rows}):
        at = {r.setup.name: r.run.summary for r in rows if r.load.long_rate == rate}
        if "pd" not in at or len(at) < 2:
            continue
        best_name, best = max(
            ((n, s) for n, s in at.items() if n != "pd"), key=lambda ns: ns[1].goodput_rps
        )
        pd = at["pd"]
        ratio = pd.goodput_rps / best.goodput_rps if best.goodput_rps else float("inf")
        lines.append(
            f"long prompts {rate:g}/s: P/D goodput {pd.goodput_rps:.3f} r/s vs {best_name} "
            f"{best.goodput_rps:.3f} r/s ({ratio:.2f}x); ITL p99 {pd.itl_s[2] * 1e3:.0f} vs "
            f"{best.itl_s[2] * 1e3:.0f} ms; TTFT p99 {pd.ttft_s[2] * 1e3:.0f} vs "
            f"{best.ttft_s[2] * 1e3:.0f} ms"
        )
    return lines


def at_scale(rows: list[Row], slo: SLOClass, factors: Sequence[int]) -> str | None:
    """The simulator alone, with each set-up's costs fitted here, for ``k`` times the engines
    and ``k`` times the load (the heaviest load run): colocated + pool on ``2k`` engines
    against ``k`` prefill and ``k`` decode."""
    rate = max(r.load.long_rate for r in rows)
    fitted = {r.setup.name: r.run for r in rows if r.load.long_rate == rate}
    both, pd = fitted.get("colocated+pool"), fitted.get("pd")
    if both is None or pd is None or both.step_fit is None or pd.fit is None:
        return None
    load = next(r.load for r in rows if r.load.long_rate == rate)
    out = []
    for k in factors:
        bigger = dataclasses.replace(
            load, long_rate=load.long_rate * k, chat_rate=load.chat_rate * k, num_docs=4 * k
        )
        requests = build_requests(bigger.trace(seed=7), scale_config(7))
        trace = [
            TraceRequest(
                r.request_id, round(r.arrival_s * 1000), r.prompt_tokens, r.max_tokens, r.hash_ids
            )
            for r in requests
        ]
        shape_both = dataclasses.replace(
            SETUPS["colocated+pool"].shape(), num_prefill=2 * k, num_decode=2 * k
        )
        shape_pd = dataclasses.replace(SETUPS["pd"].shape(), num_prefill=k, num_decode=k)
        p_both = simulate_requests(trace, both.fit.cost, shape_both, slo, both.step_fit.cost)
        p_pd = simulate_requests(trace, pd.fit.cost, shape_pd, slo)
        ratio = p_pd.goodput_rps / p_both.goodput_rps if p_both.goodput_rps else float("inf")
        out.append(
            [
                f"{2 * k}",
                f"{bigger.long_rate:g} + {bigger.chat_rate:g}",
                p_both.goodput_rps,
                f"{p_both.slo_attainment:.0%}",
                p_pd.goodput_rps,
                f"{p_pd.slo_attainment:.0%}",
                f"{ratio:.2f}x",
            ]
        )
    return format_table(
        [
            "engines",
            "long + chat /s",
            "colocated+pool goodput",
            "met",
            "P/D goodput",
            "met",
            "P/D / colocated",
        ],
        out,
    )


#: The overloaded engine's KV cache (blocks of BLOCK_TOKENS: two prompts and a few blocks; the
#: answers outgrow it) and the requests sent at once.
PREEMPT_CACHE_BLOCKS, PREEMPT_REQUESTS, PREEMPT_ANSWER = 67, 6, 128
#: Prompt tokens of each: a resume then recomputes (or loads) a long prefill.
PREEMPT_PROMPT = 1000


def preemption(tmp: Path) -> str:
    """The overload, with the connector and without: preemptions, run time, latencies."""
    rng = np.random.default_rng(5)
    prompts = [rng.integers(1000, 40_000, PREEMPT_PROMPT).tolist() for _ in range(PREEMPT_REQUESTS)]
    rows = []
    with EmbeddedCluster(str(tmp / "pool-preempt"), "1GiB") as cluster:
        for label, role in (("pool: resume by loading", "kv_both"), ("recompute", None)):
            kv = None if role is None else kv_config(role, cluster.address)
            server = TestServer(
                tmp / f"preempt-{role}.log",
                kv,
                cpu=0,
                block_size=BLOCK_TOKENS,
                prefix_caching=False,
                max_model_len=(PREEMPT_CACHE_BLOCKS - 2) * BLOCK_TOKENS,  # (one block held back)
                extra_args=["--num-gpu-blocks-override", str(PREEMPT_CACHE_BLOCKS)],
            )
            try:
                server.wait_ready()
                before = server.metrics()

                def one(prompt: list[int], server: TestServer = server) -> float:
                    t0 = time.perf_counter()
                    server.complete(prompt, PREEMPT_ANSWER)
                    return time.perf_counter() - t0

                t0 = time.perf_counter()
                with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
                    latencies = sorted(pool.map(one, prompts))
                wall = time.perf_counter() - t0
                after = server.metrics()
            finally:
                server.stop()
            delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
            rows.append(
                [
                    label,
                    int(delta.get("vllm:num_preemptions", 0)),
                    int(delta.get("vllm:kvstore_preempted_saved_tokens", 0)),
                    int(delta.get("vllm:kvstore_loaded_tokens", 0)),
                    wall,
                    float(np.mean(latencies)),
                    latencies[-1],
                    PREEMPT_REQUESTS * PREEMPT_ANSWER / wall,
                ]
            )
    head = (
        f"Decode overload: {PREEMPT_REQUESTS} requests at once ({PREEMPT_PROMPT}-token prompts, "
        f"{PREEMPT_ANSWER} tokens back) on one engine whose KV cache holds "
        f"{PREEMPT_CACHE_BLOCKS} blocks of {BLOCK_TOKENS} tokens (vLLM's own prefix cache off); "
        "vLLM preempts in recompute mode."
    )
    table = format_table(
        [
            "resume",
            "preemptions",
            "tokens saved at preemption",
            "tokens loaded",
            "run s",
            "mean latency s",
            "max latency s",
            "tokens/s",
        ],
        rows,
    )
    return head + "\n\n" + table


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--loads",
        type=lambda s: [float(x) for x in s.split(",")],
        default=[0.05, 0.1, 0.2],
        help="long prompts per second, one run per value",
    )
    parser.add_argument("--chat-rate", type=float, default=0.5, help="chats per second")
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals a load")
    parser.add_argument(
        "--setups",
        type=lambda s: s.split(","),
        default=list(SETUPS),
        help=f"comma-separated, of {', '.join(SETUPS)}",
    )
    parser.add_argument("--ttft", type=float, default=3.0, help="TTFT target, seconds")
    parser.add_argument("--tbt", type=float, default=0.1, help="TBT (ITL) target, seconds")
    parser.add_argument("--scale", default="1,2,4,8", help="simulated cluster factors")
    parser.add_argument(
        "--parts",
        type=lambda s: s.split(","),
        default=["pd", "preemption"],
        help="pd (the three set-ups), preemption (decode overload), or both",
    )
    parser.add_argument("--out", type=Path, default=None, help="keep logs and traces here")
    parser.add_argument("--markdown", action="store_true", help="write into docs/benchmarks.md")
    args = parser.parse_args()
    unknown = [s for s in args.setups if s not in SETUPS]
    if unknown:
        parser.error(f"unknown set-ups {unknown}; known: {', '.join(SETUPS)}")
    reason = missing_engine()
    if reason:
        print(f"skipped: {reason}")
        return 0
    slo = SLOClass("pd-bench", ttft_s=args.ttft, tbt_s=args.tbt)
    tmp_dir = tempfile.TemporaryDirectory(prefix="bench-pd-")
    tmp = args.out or Path(tmp_dir.name)
    tmp.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    parts: list[str] = []
    if "pd" in args.parts:
        parts += pd_part(args, slo, tmp)
    if "preemption" in args.parts:
        parts.append(preemption(tmp))
    for part in parts:
        print(f"\n{part}")
    if args.markdown:
        parts.append(
            f"{time.monotonic() - started:.0f} s in all; load average {os.getloadavg()[0]:.1f}."
        )
        markdown.write_table("pd", "\n\n".join(parts))
    tmp_dir.cleanup()
    return 0


def pd_part(args: argparse.Namespace, slo: SLOClass, tmp: Path) -> list[str]:
    """The three set-ups at every load, the verdict, and the simulator at scale."""
    rows = measure(args, slo, tmp)
    head = (
        f"2 cores, SmolLM2-135M (bf16, vLLM-CPU, max {MAX_NUM_SEQS} seqs, block {BLOCK_TOKENS}, "
        f"one engine per core); {args.duration:g} s of arrivals a load: chats at "
        f"{args.chat_rate:g}/s (a {4 * BLOCK_TOKENS}-token prompt after a shared system prompt, "
        f"96 tokens streamed back) and long prompts (2-3.5K tokens, 4 documents asked about "
        f"again and again, 8 tokens back) at the rate in the first column. Goodput: requests "
        f"within TTFT {slo.ttft_s:g} s and TBT {slo.tbt_s * 1e3:g} ms (mean gap after the "
        f"first token) per second. sim: the simulator on the same run, its costs fitted from it."
    )
    parts = [head, measured_table(rows, slo), *verdict(rows)]
    scaled = at_scale(rows, slo, [int(k) for k in args.scale.split(",")])
    if scaled is not None:
        parts += [
            "The simulator alone, costs fitted above (the heaviest load), k times the engines "
            "and the load:",
            scaled,
        ]
    return parts


if __name__ == "__main__":
    sys.exit(main())
