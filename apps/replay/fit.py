"""Fit the simulator's cost model to a measured run, then simulate the same slice.

Two least-squares fits over the served requests:

* TTFT = ``prefill_base_s * prefills_ahead + prefill_s_per_token * tokens_ahead``: the
  simulator's FIFO prefill, in which a request waits for every prefill queued before it.
  A request's uncached tokens are its prompt minus its cached tokens (the endpoint's count
  when it gave one, else the trace's ideal); ``prefills_ahead`` and ``tokens_ahead`` count it
  and the requests sent before it to the same engine that had no first token yet when it was
  sent. Fitting TTFT on a request's own tokens alone would put the queueing into the costs,
  and the simulator, which queues on its own, would count it twice. Where the engine of a
  request is unknown, earlier requests still in prefill count ``1 / num_engines`` each. Both
  coefficients are kept non-negative (the best fit with one of them at 0 otherwise).
* TBT = ``decode_base_s + decode_s_per_seq * batch`` where ``batch`` is how many served
  requests were decoding at the middle of this request's decode.

In the TBT fit a slope that comes out negative (too few or too similar points) is dropped and
the base refit as the mean. The attention (token-pair) and KV-size terms of the model are left at 0: the
scaled prompts are short. Then :func:`simulate_slice` runs the slice through
:func:`kvstore.sim.simulator.simulate` with the measured send times as arrivals (so
a ``--concurrency`` limit is in both), on a cluster shaped like the live one.

That is the P/D model (FIFO prefill instances beside decode instances, the default). With
``SimShape(engine_model="kv_both")`` the slice runs instead on ``kv_both`` continuous-batching
engines behind the live router's policy (:mod:`kvstore.sim.kvboth`), with step
costs fitted by :func:`kvstore.replay.stepfit.fit_step_model`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvstore.errors import InvalidRequestError
from kvstore.routing.cost import CostModel
from kvstore.routing.policy import POLICIES
from kvstore.routing.slo import SLOClass
from kvstore.sim.cluster import ClusterConfig
from kvstore.sim.engine import EngineConfig, StepCost
from kvstore.sim.kvboth import KvBothConfig, simulate_kv_both
from kvstore.sim.scheduler import ROUTERS, SchedulerConfig
from kvstore.sim.simulator import SimConfig, SimResult, simulate
from kvstore.sim.trace import TraceRequest
from kvstore.topology import Site

from .loadgen import RequestResult
from .workload import ReplayRequest

#: The router's policies and the simulator's routers that model them.
SIM_ROUTER_FOR_POLICY = {
    "cache-aware": "conductor",
    "round-robin": "round-robin",
    "least-loaded": "least-loaded",
}

#: Engine models :func:`simulate_slice` runs: Mooncake's P/D split, or vLLM kv_both engines.
ENGINE_MODELS = ("pd", "kv_both")

#: Smallest time a fitted prefill or decode step is given (the cost model refuses zero).
_MIN_S = 1e-6


@dataclass(frozen=True, slots=True)
class LinearFit:
    """``y = intercept + slope * x`` and how well it fits.

    Attributes:
        intercept: value at x = 0 (>= 0).
        slope: change per unit of x (>= 0).
        num_points: samples used.
        rmse: root mean squared residual.
    """

    intercept: float
    slope: float
    num_points: int
    rmse: float


def fit_line(xs: Sequence[float], ys: Sequence[float]) -> LinearFit:
    """Least squares of ``ys`` on ``xs`` with a non-negative intercept and slope.

    Args:
        xs: the regressor.
        ys: the measurements (same length).

    Returns:
        The fit; with fewer than two distinct ``xs`` or a negative slope, the slope is 0 and
        the intercept the mean.

    Raises:
        InvalidRequestError: for no points or lengths that differ.
    """
    if len(xs) != len(ys) or not xs:
        raise InvalidRequestError("fit_line needs as many ys as xs, at least one")
    x = np.asarray(xs, dtype=float)
    y = np.asarray(ys, dtype=float)
    slope, intercept = 0.0, float(y.mean())
    if np.unique(x).size >= 2:
        a = np.column_stack([np.ones_like(x), x])
        (c0, c1), *_ = np.linalg.lstsq(a, y, rcond=None)
        if c1 >= 0 and c0 >= 0:
            intercept, slope = float(c0), float(c1)
        elif c1 >= 0:  # negative intercept: through the origin instead
            slope, intercept = float(x @ y / (x @ x)) if x @ x > 0 else 0.0, 0.0
    intercept = max(intercept, 0.0)
    rmse = float(np.sqrt(np.mean((y - (intercept + slope * x)) ** 2)))
    return LinearFit(intercept, slope, int(x.size), rmse)


def uncached_tokens(result: RequestResult) -> int:
    """Prompt tokens the engine had to compute.

    Args:
        result: a served request.

    Returns:
        Its prompt minus its cached tokens (the endpoint's count, else the trace's ideal).
    """
    cached = result.cached_tokens if result.cached_source else result.ideal_cached_tokens
    return max(result.prompt_tokens - (cached or 0), 0)


def queue_ahead(
    results: Sequence[RequestResult], num_engines: int = 1
) -> list[tuple[float, float]]:
    """For each result, the prefills and uncached tokens its first token waited for: its own
    and those of the requests sent before it to its engine that had no first token yet.

    Args:
        results: served requests (with at least one token each).
        num_engines: engines the requests were spread over, for requests whose engine is
            unknown (each earlier one then counts ``1 / num_engines``).

    Returns:
        ``(prefills, tokens)`` per result.
    """
    own = [uncached_tokens(r) for r in results]
    out = []
    for i, r in enumerate(results):
        prefills, tokens = 1.0, float(own[i])
        for j, other in enumerate(results):
            if j == i or not (other.sent_s, j) < (r.sent_s, i):
                continue
            if other.sent_s + other.ttft_s <= r.sent_s:
                continue  # its prefill was done before this one came
            if r.engine is not None and other.engine is not None:
                share = 1.0 if other.engine == r.engine else 0.0
            else:
                share = 1.0 / max(num_engines, 1)
            prefills += share
            tokens += share * own[j]
        out.append((prefills, tokens))
    return out


def fit_queued_prefill(ahead: Sequence[tuple[float, float]], ttfts: Sequence[float]) -> LinearFit:
    """Least squares of ``ttft = base * prefills + per_token * tokens``, both >= 0.

    Args:
        ahead: ``(prefills, tokens)`` per request (see :func:`queue_ahead`).
        ttfts: measured TTFTs, seconds.

    Returns:
        ``intercept`` = base per prefill, ``slope`` = seconds per token.

    Raises:
        InvalidRequestError: for no points or lengths that differ.
    """
    if len(ahead) != len(ttfts) or not ahead:
        raise InvalidRequestError("fit_queued_prefill needs one TTFT per point, at least one")
    a = np.asarray(ahead, dtype=float)
    y = np.asarray(ttfts, dtype=float)
    candidates = []
    coef, *_ = np.linalg.lstsq(a, y, rcond=None)
    if coef[0] >= 0 and coef[1] >= 0:
        candidates.append((float(coef[0]), float(coef[1])))
    for column in (0, 1):  # one coefficient at 0: the other through the origin
        x = a[:, column]
        value = float(x @ y / (x @ x)) if x @ x > 0 else 0.0
        pair = [0.0, 0.0]
        pair[column] = max(value, 0.0)
        candidates.append((pair[0], pair[1]))

    def sse(pair: tuple[float, float]) -> float:
        return float(np.sum((y - a @ np.asarray(pair)) ** 2))

    base, per_token = min(candidates, key=sse)
    rmse = math.sqrt(sse((base, per_token)) / y.size)
    return LinearFit(base, per_token, int(y.size), rmse)


def decode_batch_sizes(results: Sequence[RequestResult]) -> list[int]:
    """For each result, the served requests decoding at the middle of its decode (itself too).

    Args:
        results: served requests (with at least one token each).

    Returns:
        One count per result.
    """
    spans = [(r.sent_s + r.token_times_s[0], r.sent_s + r.token_times_s[-1]) for r in results]
    out = []
    for start, end in spans:
        mid = (start + end) / 2
        out.append(max(1, sum(s <= mid <= e for s, e in spans)))
    return out


@dataclass(frozen=True, slots=True)
class CostFit:
    """The fitted cost model, the two fits behind it, and the engines it assumed."""

    cost: CostModel
    ttft: LinearFit
    tbt: LinearFit
    num_engines: int = 1


def fit_cost_model(
    results: Sequence[RequestResult], block_tokens: int, num_engines: int = 1
) -> CostFit:
    """Fit prefill and decode-step costs to a run (see the module docstring).

    Args:
        results: the run's results (only served ones are used).
        block_tokens: tokens per block.
        num_engines: engines the requests were spread over (for unknown engines).

    Returns:
        The cost model and the fits.

    Raises:
        InvalidRequestError: when no request was served.
    """
    ok = [r for r in results if r.outcome == "ok" and r.token_times_s]
    if not ok:
        raise InvalidRequestError("no request was served: nothing to fit")
    ttft = fit_queued_prefill(queue_ahead(ok, num_engines), [r.ttft_s for r in ok])
    multi = [r for r in ok if len(r.token_times_s) > 1]
    if multi:
        tbt = fit_line(decode_batch_sizes(multi), [r.tbt_s for r in multi])
    else:
        tbt = LinearFit(_MIN_S, 0.0, 0, 0.0)
    cost = CostModel(
        block_size_tokens=block_tokens,
        prefill_base_s=max(ttft.intercept, _MIN_S),
        prefill_s_per_token=ttft.slope,
        prefill_s_per_token_pair=0.0,
        decode_base_s=max(tbt.intercept, _MIN_S),
        decode_s_per_seq=tbt.slope,
        decode_s_per_kv_token=0.0,
        kv_bytes_per_token=0,
        transfer_latency_s=0.0,
    )
    return CostFit(cost, ttft, tbt, num_engines)


@dataclass(frozen=True, slots=True)
class SimShape:
    """The live cluster, as the simulator sees it.

    Attributes:
        num_prefill: prefill instances (kv_both engines count as one of each).
        num_decode: decode instances.
        router: a simulator router (a key of ``ROUTERS``) or a router policy name.
        shared_pool: whether engines share a kvstore pool (else each has only its own cache).
        max_batch_size: most sequences an engine decodes at once (vLLM ``--max-num-seqs``).
        engine_model: ``pd`` (FIFO prefill and separate decode instances) or ``kv_both``
            (``num_prefill`` continuous-batching engines behind the live router's policy,
            which ``router`` then names: cache-aware, round-robin or least-loaded).
        poll_interval_s: kv_both: how often the router reads the engines' load
            (``kvstore router --poll-interval``).
        max_inflight: kv_both: the router's slots per engine (``--max-inflight``).
        max_num_batched_tokens: kv_both: tokens per step (vLLM ``--max-num-batched-tokens``).
        cache_blocks: kv_both: blocks of each engine's prefix cache (its KV cache; None
            unlimited).
        admission_ttft_s: kv_both: the router rejects a request predicted past this TTFT
            (its SLO class's; None admits all).
        prefill_sites: pd: where each prefill instance runs (one
            :class:`~kvstore.topology.Site` each), with ``decode_sites``: each handoff is
            priced by the two instances' distance (``ClusterConfig.handoff_scale``). None:
            every handoff as within one rack (a fitted cost has no transfer term to scale).
        decode_sites: pd: where each decode instance runs, or None.

    Raises:
        InvalidRequestError: on creation, for counts below 1, an unknown engine model or an
            unknown router.
    """

    num_prefill: int = 1
    num_decode: int = 1
    router: str = "round-robin"
    shared_pool: bool = False
    max_batch_size: int = 4
    engine_model: str = "pd"
    poll_interval_s: float = 0.5
    max_inflight: int = 4
    max_num_batched_tokens: int = 2048
    cache_blocks: int | None = None
    admission_ttft_s: float | None = None
    prefill_sites: tuple[Site, ...] | None = None
    decode_sites: tuple[Site, ...] | None = None

    def __post_init__(self) -> None:
        if self.num_prefill < 1 or self.num_decode < 1 or self.max_batch_size < 1:
            raise InvalidRequestError("instance counts and max batch size must be >= 1")
        for label, sites, count in (
            ("prefill_sites", self.prefill_sites, self.num_prefill),
            ("decode_sites", self.decode_sites, self.num_decode),
        ):
            if sites is not None and len(sites) != count:
                raise InvalidRequestError(f"{label} needs {count} sites, got {len(sites)}")
        if self.engine_model not in ENGINE_MODELS:
            known = ", ".join(ENGINE_MODELS)
            raise InvalidRequestError(f"unknown engine model {self.engine_model!r}; known: {known}")
        if self.engine_model == "kv_both":
            if self.router not in POLICIES:
                known = ", ".join(POLICIES)
                raise InvalidRequestError(
                    f"unknown policy {self.router!r} for kv_both engines; known: {known}"
                )
        elif self.sim_router not in ROUTERS:
            known = ", ".join([*SIM_ROUTER_FOR_POLICY, *ROUTERS])
            raise InvalidRequestError(f"unknown router {self.router!r}; known: {known}")

    @property
    def sim_router(self) -> str:
        """The simulator's router name (the live policy itself for kv_both engines)."""
        if self.engine_model == "kv_both":
            return self.router
        return SIM_ROUTER_FOR_POLICY.get(self.router, self.router)


@dataclass(frozen=True, slots=True)
class Prediction:
    """What the simulator predicts for the slice.

    Attributes:
        goodput_rps: requests within the SLO per second of the simulated run.
        mean_ttft_s: mean TTFT of admitted requests.
        slo_attainment: requests within the SLO over all requests.
        hit_rate: reused blocks over blocks of admitted prompts.
        makespan_s: first arrival to last finish.
    """

    goodput_rps: float
    mean_ttft_s: float
    slo_attainment: float
    hit_rate: float
    makespan_s: float


def simulate_slice(
    requests: Sequence[ReplayRequest],
    results: Sequence[RequestResult],
    cost: CostModel,
    shape: SimShape,
    slo: SLOClass,
    step: StepCost | None = None,
) -> Prediction:
    """Run the slice through the simulator with the fitted cost model.

    Args:
        requests: the scaled requests (their blocks and lengths).
        results: the measured results, same order (their send times become arrivals).
        cost: the fitted cost model (the P/D model's; its block size is the blocks').
        shape: the live cluster's shape.
        slo: the class requests are judged by.
        step: the fitted step cost, for ``shape.engine_model == "kv_both"``.

    Returns:
        The prediction.

    Raises:
        InvalidRequestError: for lists of different lengths, an empty slice, or a kv_both
            shape without a step cost.
    """
    if len(requests) != len(results) or not requests:
        raise InvalidRequestError("requests and results must match and not be empty")
    order = sorted(range(len(requests)), key=lambda i: (results[i].sent_s, i))
    t0 = results[order[0]].sent_s
    trace = [
        TraceRequest(
            request_id=requests[i].request_id,
            timestamp_ms=round((results[i].sent_s - t0) * 1000),
            input_length=requests[i].prompt_tokens,
            output_length=requests[i].max_tokens,
            hash_ids=requests[i].hash_ids,
        )
        for i in order
    ]
    return simulate_requests(trace, cost, shape, slo, step)


def simulate_requests(
    trace: Sequence[TraceRequest],
    cost: CostModel,
    shape: SimShape,
    slo: SLOClass,
    step: StepCost | None = None,
) -> Prediction:
    """Run requests already in the replay's units (tokens as sent, arrivals in ms) through the
    simulator: :func:`simulate_slice`'s second half, also for loads no run measured (a
    benchmark's larger cluster).

    Raises:
        InvalidRequestError: a kv_both shape without a step cost.
    """
    if shape.engine_model == "kv_both":
        if step is None:
            raise InvalidRequestError("a kv_both simulation needs a fitted step cost")
        engine = EngineConfig(
            step,
            max_num_seqs=shape.max_batch_size,
            max_num_batched_tokens=shape.max_num_batched_tokens,
            cache_blocks=shape.cache_blocks,
            block_size_tokens=cost.block_size_tokens,
        )
        sim = simulate_kv_both(
            trace,
            KvBothConfig(
                num_engines=shape.num_prefill,
                engine=engine,
                policy=shape.router,
                shared_pool=shape.shared_pool,
                poll_interval_s=shape.poll_interval_s,
                max_inflight=shape.max_inflight,
                admission_ttft_s=shape.admission_ttft_s,
                slo=slo,
            ),
        )
        return _prediction(sim)
    cluster = ClusterConfig(
        num_prefill=shape.num_prefill,
        num_decode=shape.num_decode,
        local_cache_blocks=None,
        pool_blocks=None if shape.shared_pool else 0,
        decode_max_batch_size=shape.max_batch_size,
        cost=cost,
        prefill_sites=shape.prefill_sites,
        decode_sites=shape.decode_sites,
    )
    config = SimConfig(
        cluster=cluster,
        router=shape.sim_router,
        scheduler=SchedulerConfig((slo,), early_rejection=False),
    )
    return _prediction(simulate(trace, config))


def _prediction(sim: SimResult) -> Prediction:
    ttfts = sim.ttft_s[sim.accepted]
    num_met = int(sim.met_slo.sum())
    return Prediction(
        goodput_rps=num_met / sim.makespan_s if sim.makespan_s > 0 else 0.0,
        mean_ttft_s=float(ttfts.mean()) if ttfts.size else math.nan,
        slo_attainment=sim.slo_attainment,
        hit_rate=sim.cache_hit_rate,
        makespan_s=sim.makespan_s,
    )


def relative_error(predicted: float, measured: float) -> float:
    """How far a prediction is from a measurement.

    Args:
        predicted: the simulator's value.
        measured: the run's value.

    Returns:
        ``(predicted - measured) / measured``; NaN when either is not finite or the
        measurement is 0.
    """
    if not math.isfinite(measured) or measured == 0 or not math.isfinite(predicted):
        return math.nan
    return (predicted - measured) / measured
