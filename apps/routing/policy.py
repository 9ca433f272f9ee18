"""The routing choice, on snapshots of engine load (no I/O, no clock of its own).

The live router (:mod:`kvstore.router`) calls :func:`choose` with what it polls and counts; the
simulator of ``kv_both`` engines (:mod:`kvstore.sim.kvboth`) calls it with what it would have
polled at its virtual time. Both use the same policy objects (:data:`POLICIES`).

Per request (``p`` new tokens of which ``c`` are cached in the pool and ``l`` in an engine's
own prefix cache, ``n = p - max(c, l)`` to compute there):

* predicted TTFT on a prefill (or kv_both) engine = max(queue wait, pool transfer of the
  ``c - l`` cached tokens beyond the engine's own hit, if any) + prefill of ``n`` tokens on top
  of ``max(c, l)`` + one decode step of the batch already running there; in P/D mode the
  decode engine then loads the whole prompt from the pool (one more transfer). The terms are
  the engine's :class:`~.cost.CostTerms`: the router's :class:`~.cost.CostModel`, fitted per
  engine (``kvstore.router.live_fit``), or the simulated engine's own step model.
  On a kv_both engine a request holds its router slot to its last token, so the queue also
  counts the wait for a slot once all are taken. The queue wait is what the router itself
  still has in flight there (its predicted prefill seconds) plus the engine's own waiting
  requests, each costed like this one.
* the decode engine: among those whose KV after this request stays under the high watermark
  (and that have not crossed it since they last fell below the low watermark), the smallest
  predicted time between tokens with the request added to its running batch.
  When the engines declared where they run (``EngineView.site``), each decode engine's time
  also counts the handoff's distance from the prefill engine (seed §4.2): the pool transfer of
  the prompt, scaled by :data:`HANDOFF_SCALE` of that distance less the same-rack scale (so a
  decode engine on the prefill's host gains, one in another rack or zone pays), spread over
  the request's ``max_tokens``; with no sites, or all in one rack, the choice is unchanged.
* early rejection: the predicted TTFT on the chosen engine above the class's target, no decode
  engine with room, or a predicted TBT above the target (the last only once the decode fit rests
  on measurements).

Which prefill (or kv_both) engine is chosen is a :class:`RoutingPolicy`, looked up by name in
:data:`POLICIES`: ``cache-aware`` (the smallest predicted TTFT, the logic above),
``round-robin`` and ``least-loaded`` (baselines). Admission is the same rule for all three, on
the estimate of the engine the policy chose, so a comparison isolates the routing.

NOTE: every tie is broken by the engine's name (the router's engines are URLs; the simulator
names its engines so that name order is index order), so one state gives one choice.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from kvstore.topology import FAR, SAME_HOST, SAME_RACK, SAME_ZONE, Site, distance

from .cost import CostTerms
from .slo import SLOClass

#: Watermarks on a decode engine's KV use (fraction of its KV blocks). The high one is the
#: scheduler package's default (``SchedulerConfig.kv_high_watermark``).
DEFAULT_HIGH_WATERMARK = 0.9
DEFAULT_LOW_WATERMARK = 0.7
#: A KV handoff's time per distance, as a multiple of the cost model's pool transfer (which is
#: priced across nodes of one rack). Same host: shared memory, ~25x faster (seed §3.1); across
#: racks and zones the uplinks are shared and slower.
HANDOFF_SCALE = {SAME_HOST: 0.04, SAME_RACK: 1.0, SAME_ZONE: 2.0, FAR: 4.0}


@dataclass(frozen=True, slots=True)
class EngineView:
    """One engine's load as the router sees it at one moment.

    Attributes:
        name: its URL (the engine's identity in metrics and logs).
        healthy: its last poll succeeded and no request failed on it since.
        num_running: ``vllm:num_requests_running``.
        num_waiting: ``vllm:num_requests_waiting``.
        kv_usage: ``vllm:kv_cache_usage_perc`` (0..1).
        kv_capacity_tokens: KV blocks x block size (0: unknown).
        router_inflight: requests the router has on it now (any step).
        router_prefill_s: predicted prefill seconds of the router's requests there that have
            not had their first token yet.
        router_reserved_tokens: KV tokens the router's requests there will hold at the end.
        above_high: crossed the high watermark and not yet back under the low one.
        cost: its cost terms (the router: a prior, or fitted; the simulator: its step model).
        decode_fitted: whether ``cost``'s decode terms come from measurements.
        local_cached_tokens: leading prompt tokens of the request at hand in the engine's own
            prefix cache (whole blocks, at most the prompt less its last token; 0: unknown).
        slots: the router's slots on the engine (``--max-inflight``; 0: unbounded).
        router_queued: the router's requests waiting for one of them.
        site: where the engine runs (``kvstore.topology``; None: not declared).
    """

    name: str
    healthy: bool
    num_running: int
    num_waiting: int
    kv_usage: float
    kv_capacity_tokens: int
    router_inflight: int
    router_prefill_s: float
    router_reserved_tokens: int
    above_high: bool
    cost: CostTerms
    decode_fitted: bool = False
    local_cached_tokens: int = 0
    slots: int = 0
    router_queued: int = 0
    site: Site | None = None


@dataclass(frozen=True, slots=True)
class RequestShape:
    """What the choice needs to know about a request.

    Attributes:
        prompt_tokens: tokens of the prompt (>= 1).
        cached_tokens: leading prompt tokens whose KV the pool holds.
        max_tokens: tokens it may generate.
    """

    prompt_tokens: int
    cached_tokens: int
    max_tokens: int

    @property
    def uncached_tokens(self) -> int:
        """Tokens to compute: at least the last one (its logits give the first token)."""
        return max(self.prompt_tokens - self.cached_tokens, 1)


@dataclass(frozen=True, slots=True)
class TTFTEstimate:
    """Predicted time to first token of one request on one engine.

    Attributes:
        engine: the engine's name.
        queue_s: wait before its prefill starts.
        transfer_s: pool -> engine transfer of the cached tokens (overlaps the wait).
        prefill_s: compute of the uncached tokens.
        handoff_s: P/D only: the decode engine loading the prompt from the pool.
        ttft_s: the sum that matters.
        cached_tokens: prompt tokens not computed there (its own cache, then the pool).
        local_tokens: of them, those in the engine's own prefix cache.
    """

    engine: str
    queue_s: float
    transfer_s: float
    prefill_s: float
    handoff_s: float
    ttft_s: float
    cached_tokens: int = 0
    local_tokens: int = 0


@dataclass(frozen=True, slots=True)
class Choice:
    """The router's answer for one request.

    Attributes:
        accepted: False when rejected early (or when no engine is healthy).
        reason: why, when not accepted.
        retry_after_s: a hint for a rejected client (whole seconds, >= 1).
        prefill: the estimate on the chosen prefill (or kv_both) engine.
        decode: the chosen decode engine (P/D), or None.
        predicted_tbt_s: step time predicted on the decode engine (or the kv_both engine).
    """

    accepted: bool
    reason: str | None
    retry_after_s: int
    prefill: TTFTEstimate | None
    decode: str | None
    predicted_tbt_s: float | None


def slot_wait_s(
    slots: int, inflight: int, queued: int, answer_tokens: int, full_step_s: float
) -> float:
    """Predicted wait for one of an engine's router slots: zero while one is free, else the
    slot releases needed before this request's turn, each a ``1/slots`` share of one answer's
    decode in a full batch (``slots`` answers finish in the time of one).

    Args:
        slots: the engine's router slots (``--max-inflight``; 0: unbounded).
        inflight: the router's requests holding a slot there.
        queued: the router's requests queued for one there.
        answer_tokens: tokens one answer generates (this request's ``max_tokens``, standing
            in for those ahead of it).
        full_step_s: one decode step of a batch of ``slots`` sequences.

    Returns:
        Seconds.
    """
    ahead = inflight + queued - slots + 1
    if slots <= 0 or ahead <= 0:
        return 0.0
    return ahead * max(answer_tokens, 1) * full_step_s / slots


def estimate_ttft(view: EngineView, request: RequestShape, handoff: bool) -> TTFTEstimate:
    """Predict TTFT of ``request`` on ``view``.

    Args:
        view: the engine.
        request: the request.
        handoff: P/D: add the decode engine's load of the prompt from the pool.

    Returns:
        The estimate. Without ``handoff`` its queue includes the wait for one of the router's
        slots there when all are taken (:func:`slot_wait_s`: the answers ahead must finish).
    """
    cost = view.cost
    # The engine's own cache is free; the pool's tokens beyond it are loaded (the connector is
    # asked for what follows the engine's local hit). The last prompt token is always computed.
    local = min(view.local_cached_tokens, request.prompt_tokens - 1)
    pool = request.cached_tokens
    n = max(request.prompt_tokens - max(local, pool), 1)
    c = request.prompt_tokens - n
    prefill = cost.prefill_s(n, c)
    slot_wait = (
        0.0  # P/D: the prefill step holds its slot only for the prefill, counted in the queue
        if handoff
        else slot_wait_s(
            view.slots,
            view.router_inflight,
            view.router_queued,
            request.max_tokens,
            cost.decode_step_s(view.slots, 0),
        )
    )
    queue = view.router_prefill_s + view.num_waiting * prefill + slot_wait
    transfer = cost.transfer_s(max(0, min(pool, c) - local)) if pool > local else 0.0
    step = cost.decode_step_s(view.num_running, 0) if view.num_running else 0.0
    handoff_s = cost.transfer_s(request.prompt_tokens) if handoff else 0.0
    ttft = max(queue, transfer) + prefill + step + handoff_s
    return TTFTEstimate(view.name, queue, transfer, prefill, handoff_s, ttft, c, max(local, 0))


def watermark_state(above_high: bool, kv_usage: float, high: float, low: float) -> bool:
    """The high/low watermark rule with hysteresis: an engine at or over ``high`` takes no new
    requests until its use falls to ``low`` or under.

    Args:
        above_high: the engine's state so far.
        kv_usage: its KV use now (0..1).
        high: the high watermark.
        low: the low watermark (<= ``high``).

    Returns:
        The new state.
    """
    if kv_usage >= high:
        return True
    if kv_usage <= low:
        return False
    return above_high


def kv_room(view: EngineView, request: RequestShape, high: float) -> bool:
    """Whether the request's KV (prompt + answer) fits on ``view`` under the high watermark,
    counting what the router has already sent there. An engine of unknown capacity has room.

    Args:
        view: the engine.
        request: the request.
        high: the high watermark.

    Returns:
        True when it fits.
    """
    if view.above_high:
        return False
    if view.kv_capacity_tokens <= 0:
        return True
    need = request.prompt_tokens + request.max_tokens + view.router_reserved_tokens
    return view.kv_usage + need / view.kv_capacity_tokens <= high


def predicted_tbt(view: EngineView, request: RequestShape) -> float:
    """Time between tokens on ``view`` once ``request`` joins its running batch.

    Args:
        view: the engine.
        request: the request.

    Returns:
        Seconds.
    """
    batch = max(view.num_running, view.router_inflight) + 1
    return view.cost.decode_step_s(batch, 0)


class RoutingPolicy(Protocol):
    """Picks the prefill (or kv_both) engine among the admissible ones.

    Attributes:
        name: the policy's name (``--policy``, metrics, headers).
    """

    name: str

    def pick(self, candidates: list[EngineView], estimates: list[TTFTEstimate]) -> int:
        """The index of the chosen engine.

        Args:
            candidates: healthy engines with room, in the router's order (never empty).
            estimates: the predicted TTFT on each, same order.

        Returns:
            An index into ``candidates``.
        """
        ...


class CacheAware:
    """The smallest predicted TTFT (queue, transfer of the pool's hit, uncached prefill); ties by
    name."""

    name = "cache-aware"

    def pick(self, candidates: list[EngineView], estimates: list[TTFTEstimate]) -> int:
        """See :class:`RoutingPolicy`."""
        return min(range(len(estimates)), key=lambda i: (estimates[i].ttft_s, estimates[i].engine))


class RoundRobin:
    """Cycles over the healthy engines, blind to caches and load.

    NOTE: one counter for the router's life; an engine left out (unhealthy, no room) is skipped
    and the cycle goes on over the others, in the order of their names.
    """

    name = "round-robin"

    def __init__(self) -> None:
        self._turn = itertools.count()

    def pick(self, candidates: list[EngineView], estimates: list[TTFTEstimate]) -> int:
        """See :class:`RoutingPolicy`."""
        order = sorted(range(len(candidates)), key=lambda i: candidates[i].name)
        return order[next(self._turn) % len(order)]


class LeastLoaded:
    """The fewest requests on the engine by its own ``/metrics`` (running + waiting, as last
    polled); ties by fewer requests of the router's in flight there, then by name. Blind to
    caches, and to the requests queued in the router."""

    name = "least-loaded"

    def pick(self, candidates: list[EngineView], estimates: list[TTFTEstimate]) -> int:
        """See :class:`RoutingPolicy`."""
        return min(
            range(len(candidates)),
            key=lambda i: (
                candidates[i].num_running + candidates[i].num_waiting,
                candidates[i].router_inflight,
                candidates[i].name,
            ),
        )


#: Routing policies by name (``kvstore router --policy``); each call makes a fresh one.
POLICIES: dict[str, Callable[[], RoutingPolicy]] = {
    CacheAware.name: CacheAware,
    RoundRobin.name: RoundRobin,
    LeastLoaded.name: LeastLoaded,
}
DEFAULT_POLICY = CacheAware.name
_CACHE_AWARE = CacheAware()


def choose(
    request: RequestShape,
    slo: SLOClass,
    prefill: list[EngineView],
    decode: list[EngineView] | None,
    *,
    high: float = DEFAULT_HIGH_WATERMARK,
    early_rejection: bool = True,
    policy: RoutingPolicy | None = None,
) -> Choice:
    """Choose engines for a request.

    Args:
        request: the request.
        slo: its class.
        prefill: the prefill engines (P/D), or the kv_both engines.
        decode: the decode engines (P/D), or None for kv_both (one engine does both).
        high: the high watermark on decode KV use.
        early_rejection: reject when the prediction says the class's target cannot be met.
        policy: picks the prefill (kv_both) engine; None: cache-aware. The decode engine (P/D)
            is chosen by predicted TBT whatever the policy.

    Returns:
        The choice. Not accepted with ``retry_after_s`` when rejected; not accepted when no
        engine is healthy (reason says so).
    """
    candidates = [v for v in prefill if v.healthy]
    pool = [v for v in decode if v.healthy] if decode is not None else []
    # Fallbacks by choice: with no healthy decode engine the prefill engine does the whole
    # request; with no healthy prefill engine a decode engine does.
    handoff = bool(candidates and pool)
    if not candidates:
        candidates = pool
    if not candidates:
        return Choice(False, "no engine is healthy", 5, None, None, None)
    if not handoff:  # one engine does both steps: it must also have room for the KV
        roomy = [v for v in candidates if kv_room(v, request, high)]
        if roomy:
            candidates = roomy
        elif early_rejection:
            return Choice(False, "no engine has room for the KV", 1, None, None, None)
    estimates = [estimate_ttft(v, request, handoff) for v in candidates]
    best = estimates[(policy or _CACHE_AWARE).pick(candidates, estimates)]
    if early_rejection and best.ttft_s > slo.ttft_s:
        return _ttft_rejection(best, slo)
    if not handoff:
        by_name = {v.name: v for v in candidates}
        return Choice(True, None, 0, best, None, predicted_tbt(by_name[best.engine], request))
    source = next(v.site for v in candidates if v.name == best.engine)
    return _choose_decode(request, slo, best, pool, high, early_rejection, source)


def handoff_penalty_s(source: Site | None, decode: EngineView, request: RequestShape) -> float:
    """What the distance between the prefill engine (at ``source``) and ``decode`` adds to the
    handoff of ``request``'s prompt, beyond a handoff within one rack (negative on one host);
    0 where either site is unknown."""
    if source is None or decode.site is None:
        return 0.0
    scale = HANDOFF_SCALE[distance(source, decode.site)] - HANDOFF_SCALE[SAME_RACK]
    return scale * decode.cost.transfer_s(request.prompt_tokens) if scale else 0.0


def _ttft_rejection(best: TTFTEstimate, slo: SLOClass) -> Choice:
    """The early rejection of a request predicted past its class's TTFT target; the retry
    hint is the queue ahead when there is one (it drains), else the excess."""
    over = best.ttft_s - slo.ttft_s
    return Choice(
        False,
        f"predicted TTFT {best.ttft_s:.3f}s > SLO {slo.name} {slo.ttft_s:.3f}s",
        max(1, math.ceil(min(over, best.queue_s) if best.queue_s > 0 else over)),
        best,
        None,
        None,
    )


def _choose_decode(
    request: RequestShape,
    slo: SLOClass,
    best: TTFTEstimate,
    pool: list[EngineView],
    high: float,
    early_rejection: bool,
    source: Site | None = None,
) -> Choice:
    """P/D: the decode engine with room and the smallest predicted TBT (ties by name), for a
    request whose prefill goes to ``best`` (at ``source``: its handoff's distance counts, see
    :func:`handoff_penalty_s`)."""
    roomy = [v for v in pool if kv_room(v, request, high)]
    if not roomy:
        if early_rejection:
            return Choice(False, "no decode engine has room for the KV", 1, best, None, None)
        roomy = pool
    per_token = 1 / max(request.max_tokens, 1)
    target = min(
        roomy,
        key=lambda v: (
            predicted_tbt(v, request) + handoff_penalty_s(source, v, request) * per_token,
            v.name,
        ),
    )
    tbt = predicted_tbt(target, request)
    if early_rejection and target.decode_fitted and tbt > slo.tbt_s:
        return Choice(
            False, f"predicted TBT {tbt:.3f}s > SLO {slo.name} {slo.tbt_s:.3f}s", 1, best, None, tbt
        )
    return Choice(True, None, 0, best, target.name, tbt)
