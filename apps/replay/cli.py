"""``kvstore replay TRACE --router URL``: replay a slice of a trace against a live endpoint.

Prints the summary table (and, with ``--simulate``, the simulator's prediction next to the
measurement) and writes into ``--out``: ``results.json`` (configuration, summary, every
request's timings) and PNG plots (latency CDFs, a request timeline, engine load, the TTFT fit).
Bad input (a missing or malformed trace, a bad slice, an endpoint that lists no model) is one
line on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kvstore.errors import InvalidRequestError
from kvstore.routing.slo import SLOClass
from kvstore.sim.trace import TraceRequest, load_trace

from . import report
from .fit import ENGINE_MODELS, CostFit, Prediction, SimShape, fit_cost_model, simulate_slice
from .loadgen import LoadConfig, RequestResult, resolve_model, run_replay
from .stepfit import StepFit, fit_step_model
from .summary import SLO_CLASSES, ReplaySummary, summarize
from .workload import ReplayRequest, ScaleConfig, build_requests, ideal_cached_tokens

DEFAULT_NUM_REQUESTS = 20


def parse_slice(text: str) -> tuple[int, int]:
    """``START:END`` (0-based, END exclusive) as two ints.

    Args:
        text: the flag's value.

    Returns:
        ``(start, end)``.

    Raises:
        InvalidRequestError: for anything but two integers with ``0 <= START < END``.
    """
    parts = text.split(":")
    try:
        if len(parts) != 2:
            raise ValueError
        start, end = int(parts[0] or 0), int(parts[1])
    except ValueError:
        raise InvalidRequestError(f"--slice {text!r}: expected START:END, e.g. 0:20") from None
    if start < 0 or end <= start:
        raise InvalidRequestError(f"--slice {text!r}: need 0 <= START < END")
    return start, end


def load_slice(path: Path, start: int, end: int) -> list[TraceRequest]:
    """Lines ``start`` to ``end`` (exclusive) of a trace, validated up to ``end``.

    Args:
        path: the trace.
        start: first request (0-based).
        end: one past the last.

    Returns:
        The requests.

    Raises:
        InvalidRequestError: for a missing or unreadable file, a malformed line (named), or a
            slice past the end of the trace.
    """
    try:
        requests = load_trace(path, limit=end)
    except OSError as exc:
        raise InvalidRequestError(f"cannot read trace {path}: {exc.strerror or exc}") from None
    if len(requests) < end:
        raise InvalidRequestError(
            f"slice {start}:{end} is past the end of {path} ({len(requests)} requests)"
        )
    return requests[start:end]


def slo_from_args(name: str, ttft_s: float | None, tbt_s: float | None) -> SLOClass:
    """The SLO class named, with either target overridden.

    Args:
        name: a key of ``SLO_CLASSES``.
        ttft_s: a TTFT target in seconds, or None for the class's.
        tbt_s: a TBT target in seconds, or None for the class's.

    Returns:
        The class.

    Raises:
        InvalidRequestError: for an unknown name or a target that is not positive.
    """
    try:
        base = SLO_CLASSES[name]
    except KeyError:
        raise InvalidRequestError(
            f"unknown SLO class {name!r}; known: {', '.join(SLO_CLASSES)}"
        ) from None
    if ttft_s is None and tbt_s is None:
        return base
    return SLOClass(
        "custom",
        base.ttft_s if ttft_s is None else ttft_s,
        base.tbt_s if tbt_s is None else tbt_s,
    )


@dataclass(frozen=True, slots=True)
class ReplayRun:
    """Everything one replay produced.

    Attributes:
        requests: the scaled requests.
        results: what each measured.
        summary: the summary.
        fit: the fitted cost model (None without ``--simulate``).
        prediction: the simulator's prediction (None without ``--simulate``).
        step_fit: the fitted step cost of kv_both engines (None unless simulated with
            ``--engine-model kv_both``).
    """

    requests: list[ReplayRequest]
    results: list[RequestResult]
    summary: ReplaySummary
    fit: CostFit | None
    prediction: Prediction | None
    step_fit: StepFit | None = None


def replay_trace(
    trace: Sequence[TraceRequest],
    scale: ScaleConfig,
    load: LoadConfig,
    slo: SLOClass,
    shape: SimShape | None = None,
) -> ReplayRun:
    """Replay a slice, sum it up, and (with ``shape``) fit and simulate it.

    Args:
        trace: the slice.
        scale: the scaling.
        load: targets, model, concurrency.
        slo: the class requests are judged by.
        shape: the live cluster's shape for the simulator, or None for no simulation.

    Returns:
        The run.

    Raises:
        InvalidRequestError: for an empty slice.
    """
    requests = build_requests(trace, scale)
    ideal = ideal_cached_tokens(requests, scale.block_tokens)
    results = run_replay(requests, scale, load, ideal)
    summary = summarize(results, slo)
    fit = prediction = step_fit = None
    if shape is not None and summary.num_ok:
        fit = fit_cost_model(results, scale.block_tokens, shape.num_prefill)
        if shape.engine_model == "kv_both":
            step_fit = fit_step_model(results)
        step = step_fit.cost if step_fit is not None else None
        prediction = simulate_slice(requests, results, fit.cost, shape, slo, step)
    return ReplayRun(requests, results, summary, fit, prediction, step_fit)


def write_outputs(out: Path, run: ReplayRun, slo: SLOClass, config: dict[str, Any]) -> list[Path]:
    """Write ``results.json`` and the plots into ``out``.

    Args:
        out: the folder (made if missing).
        run: the replay.
        slo: its SLO class.
        config: how it was made (goes into the JSON).

    Returns:
        The files written.
    """
    out.mkdir(parents=True, exist_ok=True)
    paths = [
        report.write_json(
            out / "results.json",
            config,
            run.summary,
            run.results,
            run.prediction,
            run.fit,
            run.step_fit,
        ),
        report.plot_latencies(run.results, slo, out / "latency_cdf.png"),
        report.plot_timeline(run.results, out / "timeline.png"),
        report.plot_engine_load(run.summary, out / "engine_load.png"),
    ]
    if run.fit is not None:
        paths.append(report.plot_fit(run.results, run.fit, out / "ttft_fit.png"))
    return paths


def add_parser(sub: Any) -> None:
    """Register ``replay`` on the ``kvstore`` command's subparsers.

    Args:
        sub: the subparsers object of the ``kvstore`` parser.
    """
    p = sub.add_parser(
        "replay",
        help="replay a Mooncake-format trace against an OpenAI endpoint (router or vLLM)",
        description="Replay a slice of a trace with synthetic prompts that keep its prefix "
        "structure; print TTFT/ITL percentiles, SLO attainment, goodput and hit rate.",
    )
    p.add_argument("trace", type=Path, help="JSONL trace (timestamp, lengths, hash_ids)")
    p.add_argument(
        "--router",
        action="append",
        required=True,
        metavar="URL",
        help="the endpoint; give it twice or more to spread requests round robin yourself",
    )
    p.add_argument("--model", default=None, help="model name (default: the endpoint's first)")
    which = p.add_mutually_exclusive_group()
    which.add_argument(
        "--requests", type=int, default=None, help=f"the first N (default {DEFAULT_NUM_REQUESTS})"
    )
    which.add_argument("--slice", default=None, metavar="START:END", help="requests START..END-1")
    p.add_argument(
        "--time-scale", type=float, default=1.0, help="factor on arrival times (0.5: 2x faster)"
    )
    p.add_argument("--block-tokens", type=int, default=32, help="prompt tokens per hash id")
    p.add_argument(
        "--length-scale",
        type=float,
        default=None,
        help="factor on output lengths (default block-tokens/512)",
    )
    p.add_argument("--max-output", type=int, default=32, help="cap on tokens generated")
    p.add_argument("--max-prompt", type=int, default=2048, help="cap on prompt tokens")
    p.add_argument("--seed", type=int, default=0, help="prompt contents (same structure)")
    p.add_argument("--slo", default="standard", choices=sorted(SLO_CLASSES), help="SLO class")
    p.add_argument("--ttft-slo", type=float, default=None, help="TTFT target, seconds")
    p.add_argument("--tbt-slo", type=float, default=None, help="TBT target, seconds")
    p.add_argument("--concurrency", type=int, default=None, help="most requests in flight")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds one request may take")
    p.add_argument("--out", type=Path, default=Path("replay-out"), help="results and plots")
    sim = p.add_argument_group("simulation (--simulate)")
    sim.add_argument(
        "--simulate", action="store_true", help="fit the cost model and simulate the slice"
    )
    sim.add_argument("--instances", type=int, default=None, help="kv_both engines (P=D=N)")
    sim.add_argument("--prefill", type=int, default=1, help="prefill instances")
    sim.add_argument("--decode", type=int, default=1, help="decode instances")
    sim.add_argument(
        "--policy",
        default="round-robin",
        help="the router's policy (cache-aware, round-robin, least-loaded) or a simulator router",
    )
    sim.add_argument("--pool", action="store_true", help="engines share a kvstore pool")
    sim.add_argument("--max-batch", type=int, default=4, help="engines' --max-num-seqs")
    sim.add_argument(
        "--engine-model",
        choices=ENGINE_MODELS,
        default="pd",
        help="pd: FIFO prefill and separate decode instances (default); kv_both: "
        "--instances continuous-batching engines behind the live router's --policy",
    )
    sim.add_argument(
        "--poll-interval", type=float, default=0.5, help="kv_both: the router's load poll, s"
    )
    sim.add_argument(
        "--max-inflight", type=int, default=4, help="kv_both: the router's slots per engine"
    )
    sim.add_argument(
        "--max-num-batched-tokens", type=int, default=2048, help="kv_both: tokens per step"
    )
    sim.add_argument(
        "--cache-blocks",
        type=int,
        default=None,
        help="kv_both: blocks of each engine's prefix cache (default unlimited)",
    )
    sim.add_argument(
        "--admission-ttft",
        type=float,
        default=None,
        help="kv_both: the router rejects a request predicted past this TTFT, s (its class's)",
    )
    p.set_defaults(func=cmd_replay)


def cmd_replay(args: argparse.Namespace) -> int:
    """Run ``kvstore replay``.

    Args:
        args: the parsed flags.

    Returns:
        0, or 1 when no request was served (bad input raises instead).

    Raises:
        InvalidRequestError: for bad input (the CLI prints it on one line, exit status 2).
    """
    if args.slice is not None:
        start, end = parse_slice(args.slice)
    else:
        num = DEFAULT_NUM_REQUESTS if args.requests is None else args.requests
        if num < 1:
            raise InvalidRequestError(f"--requests must be >= 1, got {num}")
        start, end = 0, num
    slo = slo_from_args(args.slo, args.ttft_slo, args.tbt_slo)
    scale = ScaleConfig(
        block_tokens=args.block_tokens,
        length_scale=args.length_scale,
        max_output_tokens=args.max_output,
        max_prompt_tokens=args.max_prompt,
        time_scale=args.time_scale,
        seed=args.seed,
    )
    shape = None
    if args.simulate:
        num_p = args.instances or args.prefill
        num_d = args.instances or args.decode
        shape = SimShape(
            num_p,
            num_d,
            args.policy,
            args.pool,
            args.max_batch,
            engine_model=args.engine_model,
            poll_interval_s=args.poll_interval,
            max_inflight=args.max_inflight,
            max_num_batched_tokens=args.max_num_batched_tokens,
            cache_blocks=args.cache_blocks,
            admission_ttft_s=args.admission_ttft,
        )
    trace = load_slice(args.trace, start, end)
    targets = tuple(url.rstrip("/") for url in args.router)
    LoadConfig(targets, "check")  # validate the URLs before asking one for its models
    model = args.model or resolve_model(targets[0])
    load = LoadConfig(targets, model, args.concurrency, args.timeout)
    print(
        f"replaying {len(trace)} requests ({args.trace} {start}:{end}) against "
        f"{', '.join(targets)}, model {model}, {scale.block_tokens} tokens per block, "
        f"time scale {scale.time_scale:g}"
    )
    run = replay_trace(trace, scale, load, slo, shape)
    print(report.summary_table(run.summary, slo))
    if run.prediction is not None and run.fit is not None and shape is not None:
        cluster = (
            f"{shape.num_prefill} kv_both engines, policy"
            if shape.engine_model == "kv_both"
            else f"{shape.num_prefill} prefill / {shape.num_decode} decode, router"
        )
        print(f"\nsimulator ({cluster} {shape.sim_router}, cost model fitted from this run):")
        print(report.prediction_table(run.summary, run.prediction, run.fit, run.step_fit))
    config = {
        "trace": str(args.trace),
        "slice": [start, end],
        "targets": list(targets),
        "model": model,
        "scale": asdict(scale),
        "slo": asdict(slo),
        "concurrency": args.concurrency,
        "simulate": asdict(shape) if shape else None,
    }
    paths = write_outputs(args.out, run, slo, config)
    print(f"\nwrote {', '.join(p.name for p in paths)} to {args.out}")
    return 0 if run.summary.num_ok else 1
