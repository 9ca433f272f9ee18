"""Routing policies under a replayed trace: real vLLM engines sharing a kvstore pool.

One run starts the pool (``kvstore up``: embedded master and one storage node, ``--shm``), two
vLLM engines with the kvstore connector as ``kv_both`` (SmolLM2-135M-Instruct, bf16, each
pinned to one core, prefix caching on, publishing their KV events), and then, for each policy in
``cache-aware, round-robin, least-loaded``, ``kvstore router --engine URL --engine-events
URL=tcp://... ... --policy P --master ADDR`` when that command exists (the router sees each
engine's own prefix cache as well as the pool; the baselines ignore both),
and replays the same trace slice through it with ``kvstore replay``'s machinery. Each policy
gets its own prompt seed: the same prefix structure with new tokens, so no run reuses the KV
of the one before. Without ``kvstore router`` it says so and replays once against the two
engines directly, spreading requests round robin itself (a baseline without a router).

Admission: every router rejects early (HTTP 429) a request whose predicted TTFT on the engine
its policy chose is past the SLO the run is judged by (``--slo``: the router is given it as its
default class; ``--admission router`` leaves it its own ``standard`` class, 10 s), so the first
three rows differ only in the choice of engine. With ``--plain-baselines`` (the default)
round-robin and least-loaded run again as plain routers do, without early rejection: every
request is queued and served, however late.

It prints one table (served, requests within the SLO, run seconds, goodput, TTFT p50/p90, hit
rate, with the simulator's prediction of goodput and mean TTFT from a cost model fitted to that
run, and their relative errors), cache-aware's gain over the best baseline of each kind, and the
simulator's prediction for every row from the first run's fit. The simulator runs the
engines as they are (``--engine-model kv_both``, the default): two continuous-batching
engines, each step's cost fitted from the run's token times, behind the same policy with what
the live router sees (load polled every 0.5 s, its 4 slots per engine, each engine's prefix
cache of 1456 blocks and the pool, the same admission or none);
``--engine-model pd`` gives the P/D model instead (FIFO prefill beside separate decode).
Engines report their cached prompt tokens (``--enable-prompt-tokens-details``), so the hit
rate is measured unless the router sends its own. Nothing is asserted about times.

Usage: ``.venv/bin/python bench/bench_router.py [--start 0] [--requests 24] [--time-scale 1.0]
[--max-output 16] [--slo standard] [--admission slo|router] [--no-plain-baselines]
[--engine-model kv_both|pd] [--out DIR] [--markdown]`` (needs ``.venv-vllm`` and the model, see
tests/adapters/vllm_servers.py; ``--markdown``: also write the tables into docs/benchmarks.md,
see bench/markdown.py).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import markdown  # noqa: E402
from kvstore.cli.embedded import EmbeddedCluster  # noqa: E402
from kvstore.demo.vllm_server import VLLMServer, free_port  # noqa: E402
from kvstore.replay.cli import (  # noqa: E402
    ReplayRun,
    load_slice,
    replay_trace,
    slo_from_args,
    write_outputs,
)
from kvstore.replay.fit import (  # noqa: E402
    ENGINE_MODELS,
    SimShape,
    relative_error,
    simulate_slice,
)
from kvstore.replay.loadgen import LoadConfig  # noqa: E402
from kvstore.replay.summary import SLO_CLASSES  # noqa: E402
from kvstore.replay.workload import ScaleConfig  # noqa: E402
from kvstore.router.app import RouterConfig  # noqa: E402
from kvstore.router.slo_classes import DEFAULT_CLASSES  # noqa: E402
from kvstore.sim.default_slo import SLOClass  # noqa: E402
from kvstore.sim.report import format_table  # noqa: E402
from kvstore.sim.trace import TraceRequest  # noqa: E402
from tests.adapters.vllm_servers import (  # noqa: E402
    kv_config,
    missing_engine,
    model_dir,
    vllm_python,
)

POLICIES = ("cache-aware", "round-robin", "least-loaded")
TRACE = Path("/work/shared/data/traces/conversation_trace.jsonl")
MAX_NUM_SEQS = 4
ROUTER_START_S = 120.0
#: Each engine's KV cache in 32-token blocks: vLLM logs "CPU KV cache size: 46,592 tokens" for
#: SmolLM2 with VLLM_CPU_KVCACHE_SPACE=1 (GiB).
ENGINE_CACHE_BLOCKS = 46_592 // 32
#: The router's own ``standard`` class (10 s TTFT): its admission with ``--admission router``.
ROUTER_CLASS = next(c for c in DEFAULT_CLASSES if c.name == "standard")


@dataclasses.dataclass(frozen=True)
class Plan:
    """One replay: its label, the simulator's policy, the router's ``--policy`` (None: the
    router's default) and whether the router rejects early."""

    label: str
    policy: str
    router_policy: str | None
    early_rejection: bool = True

    @property
    def slug(self) -> str:
        """Its name in file names: the policy, ``-plain`` without early rejection."""
        return (self.router_policy or "default") + ("" if self.early_rejection else "-plain")


def sim_shape(policy: str, engine_model: str, admission_ttft_s: float | None) -> SimShape:
    """The live cluster as the simulator runs it (``admission_ttft_s`` None: no early
    rejection)."""
    if engine_model == "pd":
        return SimShape(2, 2, policy, shared_pool=True, max_batch_size=MAX_NUM_SEQS)
    router = {f.name: f.default for f in dataclasses.fields(RouterConfig)}  # its defaults
    return SimShape(
        2,
        2,
        policy,
        shared_pool=True,
        max_batch_size=MAX_NUM_SEQS,
        engine_model="kv_both",
        poll_interval_s=router["poll_s"],
        max_inflight=router["max_inflight"],
        cache_blocks=ENGINE_CACHE_BLOCKS,
        admission_ttft_s=admission_ttft_s,
    )


def error_text(predicted: float, measured: float) -> str:
    """A relative error as ``+12%`` (``n/a`` when undefined)."""
    error = relative_error(predicted, measured)
    return f"{error:+.0%}" if error == error else "n/a"


def router_help() -> str | None:
    """``kvstore router --help``, or None when this checkout has no ``kvstore router``."""
    proc = subprocess.run(
        [sys.executable, "-m", "kvstore", "router", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    return proc.stdout if proc.returncode == 0 else None


def start_engine(tmp: Path, name: str, master: str, cpu: int, events_port: int) -> VLLMServer:
    """A kv_both engine with the connector, pinned to ``cpu``, reporting cached tokens and
    publishing its own prefix cache's KV events on ``events_port``."""
    events = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://*:{events_port}",
    }
    return VLLMServer(
        model_dir(),
        name,
        tmp / f"{name}.log",
        kv_config=json.dumps(kv_config("kv_both", master)),
        cpu_core=cpu,
        python=str(vllm_python()),
        block_size=32,
        env={"TOKENIZERS_PARALLELISM": "false"},
        extra_args=[
            "--max-num-seqs",
            str(MAX_NUM_SEQS),
            "--enable-prompt-tokens-details",
            "--kv-events-config",
            json.dumps(events),
        ],
    )


class Router:
    """``kvstore router`` as a child process in front of the engines."""

    def __init__(
        self,
        tmp: Path,
        plan: Plan,
        engines: dict[str, int],
        master: str,
        events: bool,
        slo_config: Path | None,
    ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = tmp / f"router-{plan.slug}.log"
        self.log = open(self.log_path, "ab")  # noqa: SIM115 (closed in stop)
        cmd = [sys.executable, "-m", "kvstore", "router", "--master", master]
        if plan.router_policy is not None:
            cmd += ["--policy", plan.router_policy]
        if not plan.early_rejection:
            cmd += ["--no-early-rejection"]
        if slo_config is not None:
            cmd += ["--slo-config", str(slo_config)]
        for url, port in engines.items():
            cmd += ["--engine", url]
            if events:  # the engine's own prefix cache, from its vLLM KV events
                cmd += ["--engine-events", f"{url}=tcp://127.0.0.1:{port}"]
        cmd += ["--port", str(self.port)]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout: float = ROUTER_START_S) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"kvstore router exited with {self.proc.returncode} (log {self.log_path})"
                )
            with (
                contextlib.suppress(urllib.error.URLError, OSError),
                urllib.request.urlopen(f"{self.url}/v1/models", timeout=5) as resp,
            ):
                if resp.status == 200:
                    return
            time.sleep(0.5)  # polling a state, bounded by the deadline
        raise RuntimeError(f"kvstore router not ready after {timeout:.0f} s")

    def warm_up(self, timeout: float = ROUTER_START_S) -> None:
        """One short request through the router before the replay: the router loads the
        model's tokenizer on its first request (a second or more on these cores), which would
        otherwise land on the first requests of the trace, and no engine-side model has it.
        Its prompt (token ids 1..8) shares no block with the trace's."""
        body = json.dumps(
            {"model": "smollm2", "prompt": list(range(1, 9)), "max_tokens": 1, "temperature": 0}
        ).encode()
        request = urllib.request.Request(
            f"{self.url}/v1/completions", body, {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=timeout) as resp:
            resp.read()

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=20)
        self.log.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", type=Path, default=TRACE)
    parser.add_argument("--start", type=int, default=0, help="first request of the slice")
    parser.add_argument("--requests", type=int, default=24)
    parser.add_argument("--time-scale", type=float, default=1.0)
    parser.add_argument("--max-output", type=int, default=16)
    parser.add_argument("--max-prompt", type=int, default=1024)
    parser.add_argument("--slo", default="standard", choices=sorted(SLO_CLASSES))
    parser.add_argument(
        "--engine-model",
        choices=ENGINE_MODELS,
        default="kv_both",
        help="the simulator's engines: kv_both (as run here) or pd",
    )
    parser.add_argument(
        "--admission",
        choices=("slo", "router"),
        default="slo",
        help="the router rejects early by the SLO the run is judged by (slo: its default class "
        "is --slo's targets) or by its own default class (router: standard, 10 s)",
    )
    parser.add_argument(
        "--plain-baselines",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also run round-robin and least-loaded as plain routers do (no early rejection)",
    )
    parser.add_argument(
        "--out", type=Path, default=None, help="keep logs, results.json and plots here"
    )
    parser.add_argument("--markdown", action="store_true", help="write into docs/benchmarks.md")
    args = parser.parse_args()
    reason = missing_engine()
    if reason:
        print(f"skipped: {reason}")
        return 0
    trace = load_slice(args.trace, args.start, args.start + args.requests)
    slo = slo_from_args(args.slo, None, None)
    help_text = router_help()
    has_router = help_text is not None
    has_policy = help_text is not None and "--policy" in help_text
    if not has_router:
        print(
            "`kvstore router` is not available here: replaying against the engines directly, "
            "round robin from the replay tool (a baseline without a router)"
        )
    elif not has_policy:
        print("`kvstore router` takes no --policy here: one run with its own policy")
    tmp_dir = tempfile.TemporaryDirectory(prefix="bench-router-")
    tmp = args.out or Path(tmp_dir.name)
    tmp.mkdir(parents=True, exist_ok=True)
    runs: list[tuple[Plan, ReplayRun]] = []
    slo_config = None
    if args.admission == "slo":  # the router's default class: the targets the run is judged by
        slo_config = tmp / "slo.json"
        classes = [{"name": slo.name, "ttft_s": slo.ttft_s, "tbt_s": slo.tbt_s}]
        slo_config.write_text(json.dumps({"classes": classes, "default_class": slo.name}))

    def admission(plan: Plan) -> float | None:
        if not plan.early_rejection:
            return None
        return slo.ttft_s if slo_config is not None else ROUTER_CLASS.ttft_s

    started = time.monotonic()
    with EmbeddedCluster(str(tmp / "pool"), "2GiB", extra=["--shm"]) as cluster:
        ports = [free_port(), free_port()]
        engines = [start_engine(tmp, f"engine{i}", cluster.address, i, ports[i]) for i in range(2)]
        try:
            for engine in engines:
                engine.wait_ready()
            urls = [e.url for e in engines]
            print(
                f"pool {cluster.address}, engines {', '.join(urls)} "
                f"(up in {time.monotonic() - started:.0f} s)"
            )
            plans = [Plan(p, p, p) for p in POLICIES]
            if args.plain_baselines:
                plans += [Plan(f"{p} (plain)", p, p, False) for p in POLICIES[1:]]
            if not has_policy:
                plans = [
                    Plan("router (its default)", "cache-aware", None)
                    if has_router
                    else Plan("round-robin (client)", "round-robin", None, False)
                ]
            for seed, plan in enumerate(plans):
                scale = ScaleConfig(
                    block_tokens=32,
                    max_output_tokens=args.max_output,
                    max_prompt_tokens=args.max_prompt,
                    time_scale=args.time_scale,
                    seed=seed + 1,
                )
                shape = sim_shape(plan.policy, args.engine_model, admission(plan))
                router = None
                if has_router:
                    events = help_text is not None and "--engine-events" in help_text
                    router = Router(
                        tmp,
                        plan,
                        dict(zip(urls, ports, strict=True)),
                        cluster.address,
                        events,
                        slo_config,
                    )
                try:
                    if router is not None:
                        router.wait_ready()
                        router.warm_up()
                        targets = (router.url,)
                    else:
                        targets = tuple(urls)
                    load = LoadConfig(targets, "smollm2", timeout_s=600)
                    t0 = time.monotonic()
                    run = replay_trace(trace, scale, load, slo, shape)
                    print(
                        f"{plan.label}: {run.summary.num_ok}/{run.summary.num_requests} served "
                        f"in {time.monotonic() - t0:.0f} s"
                    )
                    runs.append((plan, run))
                    if args.out is not None:
                        config = {"policy": plan.label, "targets": list(targets), "seed": seed + 1}
                        write_outputs(args.out / plan.slug, run, slo, config)
                finally:
                    if router is not None:
                        router.stop()
        finally:
            for engine in engines:
                engine.stop()
    parts = print_tables(runs, trace, slo, args, admission)
    tmp_dir.cleanup()
    if args.markdown:
        parts.append(
            f"{time.monotonic() - started:.0f} s in all; load average {os.getloadavg()[0]:.1f}."
        )
        markdown.write_table("router", "\n\n".join(parts))
    return 0


def print_tables(
    runs: list[tuple[Plan, ReplayRun]],
    trace: list[TraceRequest],
    slo: SLOClass,
    args: argparse.Namespace,
    admission: Callable[[Plan], float | None],
) -> list[str]:
    """The policy table, then every policy simulated with the first run's fitted costs.

    Returns:
        What it printed, paragraph by paragraph (its tables are Markdown already), for the page.
    """
    parts: list[str] = []
    parts.append(
        f"{len(trace)} requests of {args.trace.name} (from {args.start}), time scale {args.time_scale:g}, "
        f"2 kv_both engines (SmolLM2-135M, CPU, max {MAX_NUM_SEQS} seqs), SLO {slo.name} "
        f"(TTFT {slo.ttft_s:g} s, TBT {slo.tbt_s:g} s); the router rejects early by "
        + (
            "that SLO"
            if args.admission == "slo"
            else f"its own class (TTFT {ROUTER_CLASS.ttft_s:g} s)"
        )
        + " except the plain rows"
    )
    print(f"\n{parts[-1]}")
    rows = []
    for plan, run in runs:
        label = plan.label
        s, p = run.summary, run.prediction
        sim_goodput = p.goodput_rps if p else float("nan")
        sim_ttft = p.mean_ttft_s if p else float("nan")
        rows.append(
            [
                label,
                f"{s.num_ok}/{s.num_requests}",
                s.num_met,
                s.duration_s,
                s.goodput_rps,
                sim_goodput,
                error_text(sim_goodput, s.goodput_rps),
                s.ttft_s[0] * 1e3,
                s.ttft_s[1] * 1e3,
                s.mean_ttft_s * 1e3,
                sim_ttft * 1e3,
                error_text(sim_ttft, s.mean_ttft_s),
                s.itl_s[0] * 1e3,
                f"{s.hit_rate:.0%} ({s.hit_rate_source})",
                f"{s.ideal_hit_rate:.0%}",
                " ".join(f"{n}" for n in s.engine_load.values()) or "-",
            ]
        )
    parts.append(
        format_table(
            [
                "policy",
                "served",
                "met SLO",
                "run s",
                "goodput r/s",
                "sim goodput",
                "error",
                "TTFT p50 ms",
                "TTFT p90 ms",
                "mean TTFT ms",
                "sim mean TTFT",
                "error",
                "ITL p50 ms",
                "hit rate",
                "ideal hit",
                "per engine",
            ],
            rows,
        )
    )
    print(parts[-1])
    parts += print_gains(runs)
    fits = []
    for plan, run in runs:
        if run.step_fit is not None:
            label = plan.label
            c, f = run.step_fit.cost, run.step_fit
            fits.append(
                f"{label}: step = {c.step_base_s * 1e3:.1f} ms + {c.decode_s_per_seq * 1e3:.2f} "
                f"ms x decoding + {c.prefill_s_per_token * 1e3:.3f} ms x prefill tokens, "
                f"overhead {c.request_overhead_s * 1e3:.0f} ms (rmse {f.rmse * 1e3:.0f} ms, "
                f"{f.num_gap_rows} gaps, {f.num_ttft_rows} idle TTFTs)"
            )
            print(fits[-1])
    parts += fits
    fitted = next((r for _, r in runs if r.fit is not None), None)
    if fitted is None or fitted.fit is None:
        return parts
    parts.append("simulator, every policy, cost model fitted from the first run:")
    print(f"\n{parts[-1]}")
    sim_rows = []
    step = fitted.step_fit.cost if fitted.step_fit is not None else None
    for plan, _ in runs:
        shape = sim_shape(plan.policy, args.engine_model, admission(plan))
        p = simulate_slice(fitted.requests, fitted.results, fitted.fit.cost, shape, slo, step)
        sim_rows.append(
            [
                plan.label,
                shape.sim_router,
                p.goodput_rps,
                p.mean_ttft_s * 1e3,
                p.slo_attainment,
                p.hit_rate,
            ]
        )
    parts.append(
        format_table(
            ["policy", "sim router", "goodput r/s", "mean TTFT ms", "SLO met", "hit rate"], sim_rows
        )
    )
    print(parts[-1])
    return parts


def print_gains(runs: list[tuple[Plan, ReplayRun]]) -> list[str]:
    """Cache-aware against the best baseline: given the same early rejection, and as plain
    routers run (goodput, and requests within the SLO). Returns the lines it printed."""
    lines: list[str] = []
    ours = next((r for p, r in runs if p.policy == "cache-aware" and p.early_rejection), None)
    if ours is None:
        return lines
    for plain in (False, True):
        rivals = [
            (p.label, r)
            for p, r in runs
            if p.policy != "cache-aware" and p.early_rejection != plain
        ]
        if not rivals:
            continue
        label, best = max(rivals, key=lambda lr: lr[1].summary.goodput_rps)
        goodput = (
            ours.summary.goodput_rps / best.summary.goodput_rps
            if best.summary.goodput_rps
            else float("inf")
        )
        met = ours.summary.num_met / best.summary.num_met if best.summary.num_met else float("inf")
        lines.append(
            f"cache-aware vs the best {'plain ' if plain else ''}baseline ({label}): "
            f"goodput {goodput:.2f}x, requests within the SLO {met:.2f}x"
        )
        print(lines[-1])
    return lines


if __name__ == "__main__":
    sys.exit(main())
