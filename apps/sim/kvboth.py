"""``kv_both`` engines behind the live router: a discrete-event simulator of what it sees and does.

The P/D simulator (:mod:`.simulator`) models Mooncake's split: FIFO prefill instances beside
separate decode instances. A vLLM ``kv_both`` engine is one continuous-batching loop
(:mod:`.engine`), and ``kvstore router`` in front of such engines decides with what it can see.
This module puts the two together:

* **Router slots.** The router chooses an engine when a request arrives, then holds it in that
  engine's queue until one of the engine's ``max_inflight`` slots is free (``kvstore router
  --max-inflight``); a request with a slot reaches the engine ``request_overhead_s`` later.
* **What the policies see.** The router's own policy objects and choice
  (:mod:`kvstore.routing.policy`, by name in its ``POLICIES``) run on engine views
  (:func:`engine_view`) built from:

  - the engines' ``num_requests_running`` / ``num_requests_waiting`` **as last polled**: the
    router reads ``/metrics`` every ``poll_interval_s`` (0.5 s), so the values are those at
    the latest multiple of the interval (plus ``poll_phase_s``), not the current ones;
  - exactly: its own requests in flight per engine (holding a slot) and queued for one, the
    predicted prefill seconds of its requests there without a first token yet (queued ones
    included), each engine's own prefix cache (followed through vLLM's KV events,
    milliseconds behind) and the pool (through the master's KV events).

* **Policies.** As the router's: ``round-robin`` cycles over the engines; ``least-loaded``
  takes the fewest polled running + waiting, ties by fewer of the router's in flight (blind to
  the requests queued in the router: a burst between two polls all goes to the engine that
  looked emptier); ``cache-aware`` takes the smallest predicted TTFT
  (``kvstore.routing.policy.estimate_ttft``). Ties go by name, and the engines are named so
  that name order is index order (:func:`engine_names`). The estimate's costs are the engine
  model's own (:class:`StepCostTerms`: a router whose fit is exact).
* **Admission.** With ``admission_ttft_s`` a request whose estimate on the chosen engine
  exceeds it is rejected (the router's early rejection for the request's class; 10 s for
  ``standard``), whatever the policy.

TTFT is arrival -> first token, TBT (last - first token) / (output - 1); goodput counts the
requests within ``slo``.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import math
from collections import deque
from collections.abc import Callable
from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass, field

import numpy as np

from kvstore.errors import InternalError, InvalidRequestError
from kvstore.routing.cost import CostTerms
from kvstore.routing.policy import POLICIES, EngineView, RequestShape, choose
from kvstore.routing.slo import SLOClass

from .default_slo import DEFAULT_SLO
from .engine import EngineConfig, EngineRequest, KvBothEngine, StepCost
from .policies import BlockCache
from .simulator import SimResult
from .trace import TraceRequest

_REACH = 0
_STEP_END = 1


@dataclass(frozen=True, slots=True)
class StepCostTerms:
    """An engine's :class:`~.engine.StepCost` in the terms the routing estimate reads
    (:class:`kvstore.routing.cost.CostTerms`): the simulated router's fit is exact.

    Attributes:
        step: the engine's step cost.
    """

    step: StepCost

    def prefill_s(self, new_tokens: int, cached_tokens: int = 0) -> float:
        """A prefill alone on an idle engine (one step; the cached tokens cost nothing)."""
        return self.step.prefill_s(new_tokens)

    def decode_step_s(self, batch_size: int, kv_tokens: int) -> float:
        """One step of ``batch_size`` decoding sequences (the KV they hold costs nothing)."""
        return self.step.step_s(batch_size, 0)

    def transfer_s(self, tokens: int) -> float:
        """Loading ``tokens`` tokens from the pool."""
        return tokens * self.step.load_s_per_token if tokens > 0 else 0.0


def engine_names(num_engines: int) -> list[str]:
    """The simulated engines' names, whose order is their index order (every routing tie goes
    by name, :mod:`kvstore.routing.policy`).

    Args:
        num_engines: engines (>= 1).

    Returns:
        ``engine-0`` .. ``engine-N``, zero-padded to one width.
    """
    width = len(str(num_engines - 1))
    return [f"engine-{i:0{width}d}" for i in range(num_engines)]


def engine_view(
    name: str,
    cost: CostTerms,
    polled: tuple[int, int],
    inflight: int,
    queued: int,
    prefill_s: float,
    local_tokens: int,
    slots: int,
) -> EngineView:
    """One simulated engine as the live router would see it.

    Args:
        name: its name (:func:`engine_names`).
        cost: its cost terms (:class:`StepCostTerms`).
        polled: its (running, waiting) at the last poll.
        inflight: the router's requests holding a slot there.
        queued: the router's requests waiting for one of its slots.
        prefill_s: predicted prefill seconds of the router's requests there without a first
            token yet (queued ones included).
        local_tokens: the request's prompt tokens in its own prefix cache.
        slots: its router slots (``max_inflight``).

    Returns:
        The view: always healthy, KV room not modelled (capacity unknown).
    """
    running, waiting = polled
    return EngineView(
        name=name,
        healthy=True,
        num_running=running,
        num_waiting=waiting,
        kv_usage=0.0,
        kv_capacity_tokens=0,
        router_inflight=inflight,
        router_prefill_s=prefill_s,
        router_reserved_tokens=0,
        above_high=False,
        cost=cost,
        local_cached_tokens=local_tokens,
        slots=slots,
        router_queued=queued,
    )


@dataclass(frozen=True, slots=True)
class KvBothConfig:
    """A run of :func:`simulate_kv_both`.

    Attributes:
        num_engines: kv_both engines (>= 1).
        engine: each engine's sizes and step cost.
        policy: a key of :data:`kvstore.routing.policy.POLICIES`.
        shared_pool: the engines share a kvstore pool (unlimited); else only own caches hit.
        poll_interval_s: how often the router reads the engines' load (> 0).
        poll_phase_s: when, within the interval, the polls happen (>= 0).
        max_inflight: router slots per engine (>= 1).
        admission_ttft_s: reject a request whose predicted TTFT exceeds this (None: admit all).
        slo: the class goodput is judged by.
        speedup: arrivals happen ``speedup`` times faster than in the trace (> 0).

    Raises:
        InvalidRequestError: on creation, for a bad count, interval, policy or speedup.
    """

    num_engines: int = 2
    engine: EngineConfig = field(default_factory=EngineConfig)
    policy: str = "cache-aware"
    shared_pool: bool = True
    poll_interval_s: float = 0.5
    poll_phase_s: float = 0.0
    max_inflight: int = 4
    admission_ttft_s: float | None = None
    slo: SLOClass = DEFAULT_SLO
    speedup: float = 1.0

    def __post_init__(self) -> None:
        if self.num_engines < 1 or self.max_inflight < 1:
            raise InvalidRequestError("num_engines and max_inflight must be >= 1")
        if not self.poll_interval_s > 0 or not self.poll_phase_s >= 0:
            raise InvalidRequestError("poll_interval_s must be > 0 and poll_phase_s >= 0")
        if self.policy not in POLICIES:
            known = ", ".join(POLICIES)
            raise InvalidRequestError(f"unknown policy {self.policy!r}; known: {known}")
        if not self.speedup > 0:
            raise InvalidRequestError(f"speedup must be > 0, got {self.speedup}")
        if self.admission_ttft_s is not None and not self.admission_ttft_s > 0:
            raise InvalidRequestError("admission_ttft_s must be > 0 or None")


class _LoadHistory:
    """An engine's (running, waiting) over time, so that a poll can be read back later.

    NOTE: appended in time order only; several entries at one time are allowed, the last wins.
    """

    def __init__(self) -> None:
        self.times: list[float] = [-math.inf]
        self.values: list[tuple[int, int]] = [(0, 0)]

    def record(self, now_s: float, engine: KvBothEngine) -> None:
        value = (len(engine.running), len(engine.waiting))
        if value != self.values[-1]:
            self.times.append(now_s)
            self.values.append(value)

    def at(self, time_s: float) -> tuple[int, int]:
        return self.values[bisect.bisect_right(self.times, time_s) - 1]


def last_poll_s(now_s: float, interval_s: float, phase_s: float = 0.0) -> float:
    """The latest poll at or before ``now_s`` (polls at ``phase + k * interval``, k >= 0).

    Args:
        now_s: the time.
        interval_s: the poll interval (> 0).
        phase_s: the first poll's time.

    Returns:
        Its time (``-inf`` before the first poll: nothing polled yet reads as idle).
    """
    if now_s < phase_s:
        return -math.inf
    return phase_s + math.floor((now_s - phase_s) / interval_s + 1e-9) * interval_s


def simulate_kv_both(
    requests: SequenceOf[TraceRequest],
    config: KvBothConfig | None = None,
    on_token: Callable[[int, float], None] | None = None,
) -> SimResult:
    """Replay ``requests`` through the live router's policy onto ``kv_both`` engines.

    Deterministic: ties by engine name (index order), events by sequence number; an arrival is handled
    before an event at the same time.

    Args:
        requests: the trace, in arrival order (``hash_ids`` are block keys of
            ``config.engine.block_size_tokens`` tokens).
        config: the run (default :class:`KvBothConfig`).
        on_token: called with (request index, time) for every token emitted, in time order.

    Returns:
        Per-request outcomes (``prefill_ids`` and ``decode_ids`` are both the engine) and
        per-engine busy seconds (``prefill_busy_s``) and requests (``decode_served``).

    Raises:
        InvalidRequestError: for an empty or unsorted trace.
    """
    config = config or KvBothConfig()
    if not requests:
        raise InvalidRequestError("cannot simulate an empty trace")
    arrivals_s = [r.timestamp_ms / 1000.0 / config.speedup for r in requests]
    if any(b < a for a, b in itertools.pairwise(arrivals_s)):
        raise InvalidRequestError("requests must be sorted by timestamp")
    cost = config.engine.cost
    block = config.engine.block_size_tokens
    pool = BlockCache(None, "lru") if config.shared_pool else None
    engines = [KvBothEngine(config.engine, pool) for _ in range(config.num_engines)]
    history = [_LoadHistory() for _ in engines]
    policy = POLICIES[config.policy]()
    terms = StepCostTerms(cost)
    names = engine_names(len(engines))
    ids = {name: e for e, name in enumerate(names)}
    # The router's early rejection, on the admission target (TBT is not judged on kv_both).
    admission = (
        config.slo
        if config.admission_ttft_s is None
        else SLOClass(config.slo.name, config.admission_ttft_s, config.slo.tbt_s)
    )
    inflight = [0] * len(engines)
    pending: list[deque[int]] = [deque() for _ in engines]
    router_prefill_s = [0.0] * len(engines)
    served = [0] * len(engines)

    n = len(requests)
    accepted = np.zeros(n, dtype=bool)
    ttft = np.full(n, np.nan)
    tbt = np.full(n, np.nan)
    first_token_s = np.zeros(n)
    predicted_prefill_s = np.zeros(n)
    cached = np.zeros(n, dtype=np.int64)
    local = np.zeros(n, dtype=np.int64)
    engine_ids = np.full(n, -1, dtype=np.int64)
    num_blocks = np.array([len(r.hash_ids) for r in requests], dtype=np.int64)
    last_finish_s = 0.0

    events: list[tuple[float, int, int, int]] = []  # (time, seq, kind, payload)
    counter = itertools.count()

    def push(time_s: float, kind: int, payload: int) -> None:
        heapq.heappush(events, (time_s, next(counter), kind, payload))

    def send(index: int, engine_id: int, now_s: float) -> None:
        inflight[engine_id] += 1
        push(now_s + cost.request_overhead_s, _REACH, index)

    def start(engine_id: int, now_s: float) -> None:
        engine = engines[engine_id]
        plan = engine.start_step()
        history[engine_id].record(now_s, engine)
        if plan is not None:
            push(now_s + plan.duration_s, _STEP_END, engine_id)

    def views(request: TraceRequest, now_s: float) -> list[EngineView]:
        keys = tuple(request.hash_ids)
        polled = last_poll_s(now_s, config.poll_interval_s, config.poll_phase_s)
        return [
            engine_view(
                names[e],
                terms,
                history[e].at(polled),
                inflight[e],
                len(pending[e]),
                router_prefill_s[e],
                engine.local_hit_tokens(keys, request.input_length),
                config.max_inflight,
            )
            for e, engine in enumerate(engines)
        ]

    def arrive(index: int, now_s: float) -> None:
        request = requests[index]
        # The pool is shared: its hit is the same from every engine.
        pool_tokens = engines[0].pool_hit_tokens(tuple(request.hash_ids), request.input_length)
        shape = RequestShape(request.input_length, pool_tokens, request.output_length)
        choice = choose(
            shape,
            admission,
            views(request, now_s),
            None,
            early_rejection=config.admission_ttft_s is not None,
            policy=policy,
        )
        if not choice.accepted:
            return
        assert choice.prefill is not None
        engine_id = ids[choice.prefill.engine]
        accepted[index] = True
        engine_ids[index] = engine_id
        served[engine_id] += 1
        predicted_prefill_s[index] = choice.prefill.prefill_s
        router_prefill_s[engine_id] += choice.prefill.prefill_s
        if inflight[engine_id] < config.max_inflight:
            send(index, engine_id, now_s)
        else:
            pending[engine_id].append(index)

    def reach(index: int, now_s: float) -> None:
        request = requests[index]
        engine_id = int(engine_ids[index])
        engine = engines[engine_id]
        engine.add(
            EngineRequest(
                index, tuple(request.hash_ids), request.input_length, request.output_length
            )
        )
        history[engine_id].record(now_s, engine)
        if not engine.busy:
            start(engine_id, now_s)

    def step_end(engine_id: int, now_s: float) -> None:
        nonlocal last_finish_s
        engine = engines[engine_id]
        plan = engine.plan
        first, finished = engine.end_step()
        if on_token is not None and plan is not None:
            for item in (*plan.decode, *first):
                on_token(item.index, now_s)
        for item in first:
            i = item.index
            ttft[i] = now_s - arrivals_s[i]
            first_token_s[i] = now_s
            cached[i] = item.cached_tokens // block
            local[i] = item.local_tokens // block
            router_prefill_s[engine_id] = max(
                0.0, router_prefill_s[engine_id] - predicted_prefill_s[i]
            )
        for item in finished:
            i = item.index
            after_first = item.output_tokens - 1
            tbt[i] = (now_s - first_token_s[i]) / after_first if after_first else 0.0
            last_finish_s = max(last_finish_s, now_s)
            inflight[engine_id] -= 1
            if pending[engine_id]:
                send(pending[engine_id].popleft(), engine_id, now_s)
        start(engine_id, now_s)

    budget = config.engine.max_num_batched_tokens
    max_events = 16 + sum(
        2 + r.output_length + math.ceil(r.input_length / budget) for r in requests
    )
    next_arrival = 0
    for _ in range(max_events):
        if next_arrival < n and (not events or arrivals_s[next_arrival] <= events[0][0]):
            arrive(next_arrival, arrivals_s[next_arrival])
            next_arrival += 1
            continue
        if not events:
            break
        now_s, _, kind, payload = heapq.heappop(events)
        if kind == _REACH:
            reach(payload, now_s)
        else:
            step_end(payload, now_s)
    else:
        raise InternalError(f"simulation did not finish within {max_events} events")

    slo = config.slo
    met = accepted & (ttft <= slo.ttft_s) & (tbt <= slo.tbt_s)
    return SimResult(
        router=config.policy,
        accepted=accepted,
        ttft_s=ttft,
        tbt_s=tbt,
        met_slo=met,
        num_blocks=num_blocks,
        cached_blocks=cached,
        local_blocks=local,
        prefill_ids=engine_ids,
        decode_ids=engine_ids.copy(),
        prefill_busy_s=tuple(e.busy_s for e in engines),
        decode_served=tuple(served),
        num_replicated=0,
        span_s=arrivals_s[-1] - arrivals_s[0],
        makespan_s=max(last_finish_s, arrivals_s[-1]) - arrivals_s[0],
    )
