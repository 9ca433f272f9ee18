"""A discrete-event simulator: replay a trace through a router on a modelled cluster.

Events are request arrivals (in trace order), decode joins (prefill done and the KV moved to
the decode instance) and decode completions. Prefill needs no events of its own: each prefill
instance is a FIFO queue, so a request's prefill start and end are known when it is assigned.

Decode uses continuous batching without simulating every step: between two events the batch
is fixed, so every running sequence advances at one step per ``decode_step_s(batch, kv)``.
Each instance keeps a step counter; a sequence that joins at step ``s`` with ``k`` tokens left
finishes at step ``s + k``. Only the earliest finish needs an event, and the event is redrawn
whenever the batch changes (stale ones carry an old version and are dropped). The KV a
sequence holds is taken as its mean over decoding (prompt + output / 2).

A request's TTFT is prefill end - arrival (the first token comes out of prefill); its TBT is
(finish - first token) / (output_length - 1): the mean gap between the tokens after the first,
which includes any wait for room on the decode instance and the part of the prefill-to-decode
KV transfer that layer-wise streaming does not hide behind prefill. That transfer is the cost
model's (priced within one rack) unless the cluster declares where its instances run
(``ClusterConfig.prefill_sites`` / ``decode_sites``): then it is scaled by the two instances'
distance with the live router's factors (same host: shared memory, far cheaper; another rack or
zone: dearer).
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from kvstore.errors import InternalError, InvalidRequestError

from .cluster import ClusterConfig, ClusterState, DecodeInstance
from .scheduler import Router, SchedulerConfig, ScheduleRequest, make_router
from .trace import TraceRequest

_JOIN = 0
_FINISH = 1
_STEP_EPS = 1e-6


@dataclass(frozen=True, slots=True)
class SimConfig:
    """One simulation run.

    Attributes:
        cluster: instance counts, cache sizes and cost model.
        router: a key of ``ROUTERS``.
        scheduler: SLO classes, early rejection, watermark.
        speedup: arrivals happen ``speedup`` times faster than in the trace (> 0).

    Raises:
        InvalidRequestError: on creation, for a speedup that is not positive.
    """

    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    router: str = "conductor"
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    speedup: float = 1.0

    def __post_init__(self) -> None:
        if not self.speedup > 0:
            raise InvalidRequestError(f"speedup must be > 0, got {self.speedup}")


@dataclass(slots=True)
class _Running:
    """A decode instance's batch as the simulator runs it (the scheduler's view is separate)."""

    instance: DecodeInstance
    steps_done: float = 0.0
    last_time_s: float = 0.0
    step_s: float = 0.0
    kv_used_tokens: int = 0
    kv_mean_tokens: int = 0
    version: int = 0
    finishing: list[tuple[float, int]] = field(default_factory=list)  # (finish step, index)
    waiting: deque[int] = field(default_factory=deque)

    def advance(self, now_s: float) -> None:
        if self.finishing and self.step_s > 0:
            self.steps_done += (now_s - self.last_time_s) / self.step_s
        self.last_time_s = now_s


@dataclass(frozen=True, slots=True)
class SimResult:
    """Per-request outcomes of a run (arrays indexed like the trace) and per-instance load.

    Attributes:
        router: which router ran.
        accepted: admitted (not rejected early).
        ttft_s: time to first token (NaN when rejected).
        tbt_s: mean time between tokens after the first (NaN when rejected; 0 for one token).
        met_slo: accepted and met both SLO targets.
        num_blocks: blocks in each prompt.
        cached_blocks: blocks each accepted prompt reused (0 when rejected).
        local_blocks: of those, blocks the chosen instance held itself.
        prefill_ids: chosen prefill instance (-1 when rejected).
        decode_ids: chosen decode instance (-1 when rejected).
        prefill_busy_s: prefill seconds of work per prefill instance.
        decode_served: requests per decode instance.
        num_replicated: requests whose prefix was copied to a less loaded instance.
        span_s: time from the first to the last arrival.
        makespan_s: time from the first arrival to the last finish.
    """

    router: str
    accepted: np.ndarray
    ttft_s: np.ndarray
    tbt_s: np.ndarray
    met_slo: np.ndarray
    num_blocks: np.ndarray
    cached_blocks: np.ndarray
    local_blocks: np.ndarray
    prefill_ids: np.ndarray
    decode_ids: np.ndarray
    prefill_busy_s: tuple[float, ...]
    decode_served: tuple[int, ...]
    num_replicated: int
    span_s: float
    makespan_s: float

    @property
    def num_requests(self) -> int:
        return int(self.accepted.size)

    @property
    def num_rejected(self) -> int:
        return int(self.num_requests - self.accepted.sum())

    @property
    def slo_attainment(self) -> float:
        """Requests that met the SLO over all requests (rejected ones count as missed)."""
        return float(self.met_slo.mean()) if self.num_requests else 0.0

    @property
    def goodput_rps(self) -> float:
        """Requests that met the SLO per second of arrivals (span at least one second)."""
        return float(self.met_slo.sum()) / max(self.span_s, 1.0)

    @property
    def cache_hit_rate(self) -> float:
        """Reused blocks over blocks of accepted prompts."""
        total = int(self.num_blocks[self.accepted].sum())
        return float(self.cached_blocks.sum()) / total if total else 0.0

    @property
    def local_hit_rate(self) -> float:
        """Blocks reused from the chosen instance's own cache over blocks of accepted prompts."""
        total = int(self.num_blocks[self.accepted].sum())
        return float(self.local_blocks.sum()) / total if total else 0.0

    def percentiles(self, name: str, qs: Sequence[float] = (50, 90, 99)) -> tuple[float, ...]:
        """Percentiles of ``ttft_s`` or ``tbt_s`` over accepted requests (NaN if none)."""
        values = getattr(self, name)[self.accepted]
        if values.size == 0:
            return tuple(float("nan") for _ in qs)
        return tuple(float(v) for v in np.percentile(values, qs))


def to_schedule_request(request: TraceRequest, slo_class: str) -> ScheduleRequest:
    """A trace request as the scheduler sees it."""
    return ScheduleRequest(request.hash_ids, request.input_length, request.output_length, slo_class)


def simulate(requests: Sequence[TraceRequest], config: SimConfig | None = None) -> SimResult:
    """Replay ``requests`` through ``config.router`` on a fresh cluster.

    Deterministic: no randomness, ties broken by instance index, events by sequence number.

    Args:
        requests: the trace, in arrival order.
        config: the run (default :class:`SimConfig`).

    Returns:
        Per-request outcomes and per-instance load.

    Raises:
        InvalidRequestError: for an empty trace, unsorted arrivals, or an unknown router.
    """
    config = config or SimConfig()
    if not requests:
        raise InvalidRequestError("cannot simulate an empty trace")
    router: Router = make_router(config.router, config.scheduler)
    state = ClusterState.build(config.cluster)
    slo_name = config.scheduler.slo_classes[0].name
    slo = config.scheduler.slo_classes[0]
    cost = config.cluster.cost
    n = len(requests)
    accepted = np.zeros(n, dtype=bool)
    ttft = np.full(n, np.nan)
    tbt = np.full(n, np.nan)
    first_token_s = np.zeros(n)
    cached = np.zeros(n, dtype=np.int64)
    local = np.zeros(n, dtype=np.int64)
    prefill_ids = np.full(n, -1, dtype=np.int64)
    decode_ids = np.full(n, -1, dtype=np.int64)
    num_blocks = np.array([len(r.hash_ids) for r in requests], dtype=np.int64)
    sched_requests = [to_schedule_request(r, slo_name) for r in requests]
    runners = [_Running(d) for d in state.decode]
    num_replicated = 0
    last_finish_s = 0.0

    events: list[tuple[float, int, int, int, int]] = []  # (time, seq, kind, a, b)
    seq = 0

    def push(time_s: float, kind: int, a: int, b: int) -> None:
        nonlocal seq
        seq += 1
        heapq.heappush(events, (time_s, seq, kind, a, b))

    def reschedule(runner: _Running, now_s: float) -> None:
        runner.step_s = cost.decode_step_s(len(runner.finishing), runner.kv_mean_tokens)
        runner.version += 1
        if runner.finishing:
            steps_left = max(0.0, runner.finishing[0][0] - runner.steps_done)
            push(
                now_s + steps_left * runner.step_s,
                _FINISH,
                runner.instance.instance_id,
                runner.version,
            )

    def admit(runner: _Running, index: int) -> bool:
        request = requests[index]
        need = request.input_length + request.output_length
        instance = runner.instance
        # NOTE: an idle instance admits any request, even one larger than its memory, so a
        # request can never block its queue for ever.
        if runner.finishing and (
            len(runner.finishing) >= instance.max_batch_size
            or runner.kv_used_tokens + need > instance.kv_capacity_tokens
        ):
            return False
        runner.kv_used_tokens += need
        runner.kv_mean_tokens += request.input_length + request.output_length // 2
        heapq.heappush(runner.finishing, (runner.steps_done + request.output_length - 1, index))
        return True

    def arrive(index: int, now_s: float) -> None:
        nonlocal num_replicated
        request = sched_requests[index]
        decision = router.decide(state, request, now_s)
        if not decision.accepted:
            return
        end_s = router.commit(state, request, decision, now_s)
        estimate = decision.prefill
        assert estimate is not None and decision.decode_id is not None
        accepted[index] = True
        ttft[index] = end_s - now_s
        first_token_s[index] = end_s
        cached[index] = estimate.cached_blocks
        local[index] = min(estimate.local_hit_blocks, estimate.cached_blocks)
        prefill_ids[index] = estimate.instance_id
        decode_ids[index] = decision.decode_id
        num_replicated += decision.replicated
        # KV streams to the decode instance layer by layer while prefill runs (as in Mooncake),
        # so the decode instance has it at prefill end or when the transfer ends, if later;
        # the transfer takes longer the farther apart the two instances stand.
        start_s = end_s - estimate.prefill_s
        handoff_s = cost.transfer_s(request.input_length) * config.cluster.handoff_scale(
            estimate.instance_id, decision.decode_id
        )
        join_s = max(end_s, start_s + handoff_s)
        push(join_s, _JOIN, index, decision.decode_id)

    def join(index: int, decode_id: int, now_s: float) -> None:
        runner = runners[decode_id]
        runner.advance(now_s)
        if runner.waiting or not admit(runner, index):
            runner.waiting.append(index)
            return
        reschedule(runner, now_s)

    def finish(decode_id: int, version: int, now_s: float) -> None:
        nonlocal last_finish_s
        runner = runners[decode_id]
        if version != runner.version:
            return
        runner.advance(now_s)
        while runner.finishing and runner.finishing[0][0] <= runner.steps_done + _STEP_EPS:
            _, index = heapq.heappop(runner.finishing)
            request = requests[index]
            runner.kv_used_tokens -= request.input_length + request.output_length
            runner.kv_mean_tokens -= request.input_length + request.output_length // 2
            tokens_after_first = request.output_length - 1
            tbt[index] = (
                (now_s - first_token_s[index]) / tokens_after_first if tokens_after_first else 0.0
            )
            last_finish_s = max(last_finish_s, now_s)
            router.release(state, sched_requests[index], decode_id)
        while runner.waiting and admit(runner, runner.waiting[0]):
            runner.waiting.popleft()
        reschedule(runner, now_s)

    arrivals_s = [r.timestamp_ms / 1000.0 / config.speedup for r in requests]
    for earlier, later in zip(arrivals_s, arrivals_s[1:], strict=False):
        if later < earlier:
            raise InvalidRequestError("requests must be sorted by timestamp")
    # Bound: one arrival, one join and at most three finish events per request.
    max_steps = 5 * n + 16
    next_arrival = 0
    for _ in range(max_steps):
        if next_arrival < n and (not events or arrivals_s[next_arrival] < events[0][0]):
            arrive(next_arrival, arrivals_s[next_arrival])
            next_arrival += 1
            continue
        if not events:
            break
        now_s, _, kind, a, b = heapq.heappop(events)
        if kind == _JOIN:
            join(a, b, now_s)
        else:
            finish(a, b, now_s)
    else:
        raise InternalError(f"simulation did not finish within {max_steps} events")

    met = accepted & (ttft <= slo.ttft_s) & (tbt <= slo.tbt_s)
    return SimResult(
        router=config.router,
        accepted=accepted,
        ttft_s=ttft,
        tbt_s=tbt,
        met_slo=met,
        num_blocks=num_blocks,
        cached_blocks=cached,
        local_blocks=local,
        prefill_ids=prefill_ids,
        decode_ids=decode_ids,
        prefill_busy_s=tuple(p.busy_s for p in state.prefill),
        decode_served=tuple(d.num_served for d in state.decode),
        num_replicated=num_replicated,
        span_s=arrivals_s[-1] - arrivals_s[0],
        makespan_s=max(last_finish_s, arrivals_s[-1]) - arrivals_s[0],
    )
