"""The cache-aware scheduler (Mooncake's Conductor) and the baselines it is measured against.

A router picks one prefill and one decode instance for a request; what every router shares is
the estimate of what that choice costs:

* TTFT on prefill instance ``p`` = max(queue wait on ``p``, transfer of the cached prefix that
  ``p`` does not hold locally) + prefill of the uncached tokens. The KV is pulled from the pool
  while the request waits in the queue, so the two overlap. Local hits move nothing.
* TBT on decode instance ``d`` = its step time with the request added to everything already
  assigned to it (in flight, waiting or running).

Routers, by name in :data:`ROUTERS`:

* ``round-robin``: the next prefill and the next decode in turn.
* ``least-loaded``: the prefill with the shortest queue, the decode with the fewest requests.
* ``cache-only``: the prefill with the longest local prefix hit (ties: shortest queue), the
  decode with the fewest requests.
* ``conductor``: the prefill with the smallest estimated TTFT, the decode with the smallest
  predicted TBT among those with room for the request's KV under the high watermark. When the
  instance holding the longest local prefix is passed over for a less loaded one, the prefix
  is copied to the chosen instance, which then holds it too: hot prefixes get replicas where
  the load is (``Decision.replicated``).

With ``early_rejection`` a request is rejected at once when the estimate says its TTFT or TBT
target cannot be met, or no decode instance has room for its KV (overload-oriented
scheduling); without it every request is admitted and queues.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from dataclasses import dataclass, field

from kvstore.errors import InvalidRequestError
from kvstore.routing.slo import SLOClass

from .cluster import ClusterState, DecodeInstance, PrefillInstance
from .default_slo import DEFAULT_SLO
from .policies import BlockKey


@dataclass(frozen=True, slots=True)
class ScheduleRequest:
    """What the scheduler needs to know about a request.

    Attributes:
        block_keys: chained keys of the prompt's blocks (prefix-index keys).
        input_length: prompt tokens (>= 1).
        output_length: tokens to generate (>= 1).
        slo_class: name of the request's SLO class.
    """

    block_keys: tuple[BlockKey, ...]
    input_length: int
    output_length: int
    slo_class: str = DEFAULT_SLO.name


@dataclass(frozen=True, slots=True)
class PrefillEstimate:
    """The cost of prefilling one request on one instance.

    Attributes:
        instance_id: the prefill instance.
        local_hit_blocks: leading blocks the instance holds itself.
        cached_blocks: leading blocks available anywhere (local, other instances, pool).
        cached_tokens: tokens whose KV need not be computed.
        transfer_s: time to fetch the cached blocks it lacks.
        queue_wait_s: wait before its queue reaches the request.
        prefill_s: compute time of the uncached tokens.
        ttft_s: estimated time to first token.
    """

    instance_id: int
    local_hit_blocks: int
    cached_blocks: int
    cached_tokens: int
    transfer_s: float
    queue_wait_s: float
    prefill_s: float
    ttft_s: float


@dataclass(frozen=True, slots=True)
class Decision:
    """A router's answer for one request.

    Attributes:
        accepted: False when the request was rejected early.
        reject_reason: why, when rejected.
        prefill: the estimate on the best prefill instance (kept when rejected: it says why).
        decode_id: the chosen decode instance (None when rejected).
        predicted_tbt_s: step time predicted on the chosen decode instance.
        replicated: the prefix was copied away from the instance that held the longest part
            of it, because that instance was the slower choice.
    """

    accepted: bool
    reject_reason: str | None
    prefill: PrefillEstimate | None
    decode_id: int | None
    predicted_tbt_s: float | None
    replicated: bool = False

    def to_dict(self) -> dict[str, object]:
        """The decision as plain JSON-able values (the admin API's response body)."""
        prefill = self.prefill
        return {
            "accepted": self.accepted,
            "reject_reason": self.reject_reason,
            "prefill_instance": prefill.instance_id if prefill and self.accepted else None,
            "decode_instance": self.decode_id,
            "predicted_ttft_s": prefill.ttft_s if prefill else None,
            "predicted_tbt_s": self.predicted_tbt_s,
            "local_hit_blocks": prefill.local_hit_blocks if prefill else None,
            "cached_blocks": prefill.cached_blocks if prefill else None,
            "transfer_s": prefill.transfer_s if prefill else None,
            "queue_wait_s": prefill.queue_wait_s if prefill else None,
            "replicated": self.replicated,
        }


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """Settings of a router.

    Attributes:
        slo_classes: the classes requests may name; the first is the default.
        early_rejection: reject requests whose SLO the estimate says cannot be met.
        kv_high_watermark: fraction of a decode instance's KV memory the scheduler fills
            with reservations (0 < w <= 1).

    Raises:
        InvalidRequestError: on creation, for no classes, duplicate names or a bad watermark.
    """

    slo_classes: tuple[SLOClass, ...] = (DEFAULT_SLO,)
    early_rejection: bool = True
    kv_high_watermark: float = 0.9
    _by_name: dict[str, SLOClass] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.slo_classes:
            raise InvalidRequestError("at least one SLO class is needed")
        by_name = {slo.name: slo for slo in self.slo_classes}
        if len(by_name) != len(self.slo_classes):
            raise InvalidRequestError("SLO class names must be unique")
        if not 0 < self.kv_high_watermark <= 1:
            raise InvalidRequestError(
                f"kv_high_watermark must be in (0, 1], got {self.kv_high_watermark}"
            )
        object.__setattr__(self, "_by_name", by_name)

    def slo(self, name: str) -> SLOClass:
        """The class called ``name``.

        Raises:
            InvalidRequestError: for an unknown class.
        """
        try:
            return self._by_name[name]
        except KeyError:
            known = ", ".join(self._by_name)
            raise InvalidRequestError(f"unknown SLO class {name!r}; known: {known}") from None


def remote_hit_blocks(state: ClusterState, keys: tuple[BlockKey, ...]) -> int:
    """Leading blocks of ``keys`` that some instance can fetch: pool or any local cache.

    Args:
        state: the cluster.
        keys: the request's block keys.

    Returns:
        Blocks (0 when the cluster has no global pool: then nothing is shared).
    """
    if state.pool is None:
        return 0
    best = state.pool.match_prefix(keys)
    for instance in state.prefill:
        if best == len(keys):
            break
        best = max(best, instance.cache.match_prefix(keys))
    return best


def estimate_prefill(
    state: ClusterState,
    instance: PrefillInstance,
    request: ScheduleRequest,
    now_s: float,
    remote_blocks: int,
) -> PrefillEstimate:
    """Estimate TTFT of ``request`` on ``instance``.

    Args:
        state: the cluster.
        instance: the candidate prefill instance.
        request: the request.
        now_s: current time.
        remote_blocks: :func:`remote_hit_blocks` of the request (computed once per request).

    Returns:
        The estimate. At least one token is always computed (the one whose logits give the
        first output token).
    """
    block = state.block_size_tokens
    local = instance.cache.match_prefix(request.block_keys)
    cached_blocks = max(local, remote_blocks)
    cached_tokens = min(cached_blocks * block, request.input_length - 1)
    local_tokens = min(local * block, cached_tokens)
    cost = instance.cost
    transfer = cost.transfer_s(cached_tokens - local_tokens)
    wait = instance.queue_wait_s(now_s)
    prefill = cost.prefill_s(request.input_length - cached_tokens, cached_tokens)
    return PrefillEstimate(
        instance.instance_id,
        local,
        cached_blocks,
        cached_tokens,
        transfer,
        wait,
        prefill,
        max(wait, transfer) + prefill,
    )


def _decode_fits(instance: DecodeInstance, request: ScheduleRequest, watermark: float) -> bool:
    need = request.input_length + request.output_length
    return instance.kv_reserved_tokens + need <= watermark * instance.kv_capacity_tokens


def _decode_tbt(instance: DecodeInstance, request: ScheduleRequest) -> float:
    return instance.predicted_tbt_s(1, request.input_length + request.output_length // 2)


class Router(abc.ABC):
    """Base of all routers: estimates, early rejection and :meth:`commit` are shared.

    Subclasses only pick instances (:meth:`pick_prefill`, :meth:`pick_decode`).

    Args:
        config: SLO classes, early rejection, watermark.
    """

    name = "router"

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config

    @abc.abstractmethod
    def pick_prefill(
        self, state: ClusterState, request: ScheduleRequest, now_s: float, remote: int
    ) -> tuple[PrefillEstimate, int]:
        """Return the chosen prefill's estimate and the best local hit seen (for replication)."""

    @abc.abstractmethod
    def pick_decode(self, state: ClusterState, request: ScheduleRequest) -> DecodeInstance:
        """Return the chosen decode instance."""

    def decide(self, state: ClusterState, request: ScheduleRequest, now_s: float) -> Decision:
        """Choose instances for ``request``. Changes no cluster state (a round-robin router
        only advances its own position).

        Args:
            state: the cluster.
            request: the request.
            now_s: current time.

        Returns:
            The decision (accepted, or rejected early with a reason).

        Raises:
            InvalidRequestError: for an unknown SLO class.
        """
        slo = self.config.slo(request.slo_class)
        remote = remote_hit_blocks(state, request.block_keys)
        estimate, best_local = self.pick_prefill(state, request, now_s, remote)
        replicated = best_local > estimate.local_hit_blocks
        early = self.config.early_rejection
        if early and estimate.ttft_s > slo.ttft_s:
            return Decision(
                False,
                f"predicted TTFT {estimate.ttft_s:.2f}s > SLO {slo.ttft_s:.2f}s",
                estimate,
                None,
                None,
            )
        decode = self.pick_decode(state, request)
        tbt = _decode_tbt(decode, request)
        if early and not _decode_fits(decode, request, self.config.kv_high_watermark):
            return Decision(False, "no decode instance has room for the KV", estimate, None, tbt)
        if early and tbt > slo.tbt_s:
            return Decision(
                False, f"predicted TBT {tbt:.3f}s > SLO {slo.tbt_s:.3f}s", estimate, None, tbt
            )
        return Decision(True, None, estimate, decode.instance_id, tbt, replicated)

    def commit(
        self, state: ClusterState, request: ScheduleRequest, decision: Decision, now_s: float
    ) -> float:
        """Apply an accepted decision: queue the prefill, fill caches, reserve decode KV.

        The request's blocks enter the chosen instance's local cache and the pool when it is
        assigned. Later requests on the same instance run after it (FIFO), so for them this is
        exact; one on another instance may count a block a little before it is computed.

        Args:
            state: the cluster.
            request: the request.
            decision: an accepted decision from :meth:`decide`.
            now_s: current time.

        Returns:
            When prefill ends (the first token's time).
        """
        assert decision.accepted and decision.prefill is not None and decision.decode_id is not None
        estimate = decision.prefill
        instance = state.prefill[estimate.instance_id]
        start = now_s + max(estimate.queue_wait_s, estimate.transfer_s)
        end = start + estimate.prefill_s
        instance.busy_until_s = end
        instance.num_served += 1
        instance.busy_s += estimate.prefill_s
        instance.cache.access(request.block_keys)
        if state.pool is not None:
            state.pool.access(request.block_keys)
        decode = state.decode[decision.decode_id]
        decode.num_assigned += 1
        decode.num_served += 1
        decode.kv_reserved_tokens += request.input_length + request.output_length
        decode.kv_mean_tokens += request.input_length + request.output_length // 2
        return end

    @staticmethod
    def release(state: ClusterState, request: ScheduleRequest, decode_id: int) -> None:
        """Return a finished request's decode reservation.

        Args:
            state: the cluster.
            request: the finished request.
            decode_id: where it ran.
        """
        decode = state.decode[decode_id]
        decode.num_assigned -= 1
        decode.kv_reserved_tokens -= request.input_length + request.output_length
        decode.kv_mean_tokens -= request.input_length + request.output_length // 2
        assert decode.num_assigned >= 0 and decode.kv_reserved_tokens >= 0, "release underflow"


def _least_assigned(state: ClusterState) -> DecodeInstance:
    return min(state.decode, key=lambda d: (d.num_assigned, d.kv_reserved_tokens, d.instance_id))


class RoundRobinRouter(Router):
    name = "round-robin"

    def __init__(self, config: SchedulerConfig) -> None:
        super().__init__(config)
        self._next_prefill = 0
        self._next_decode = 0

    def pick_prefill(
        self, state: ClusterState, request: ScheduleRequest, now_s: float, remote: int
    ) -> tuple[PrefillEstimate, int]:
        instance = state.prefill[self._next_prefill % len(state.prefill)]
        self._next_prefill += 1
        estimate = estimate_prefill(state, instance, request, now_s, remote)
        return estimate, estimate.local_hit_blocks

    def pick_decode(self, state: ClusterState, request: ScheduleRequest) -> DecodeInstance:
        instance = state.decode[self._next_decode % len(state.decode)]
        self._next_decode += 1
        return instance


class LeastLoadedRouter(Router):
    name = "least-loaded"

    def pick_prefill(
        self, state: ClusterState, request: ScheduleRequest, now_s: float, remote: int
    ) -> tuple[PrefillEstimate, int]:
        instance = min(state.prefill, key=lambda p: (p.busy_until_s, p.instance_id))
        estimate = estimate_prefill(state, instance, request, now_s, remote)
        return estimate, estimate.local_hit_blocks

    def pick_decode(self, state: ClusterState, request: ScheduleRequest) -> DecodeInstance:
        return _least_assigned(state)


class CacheOnlyRouter(Router):
    name = "cache-only"

    def pick_prefill(
        self, state: ClusterState, request: ScheduleRequest, now_s: float, remote: int
    ) -> tuple[PrefillEstimate, int]:
        keys = request.block_keys
        instance = min(
            state.prefill,
            key=lambda p: (-p.cache.match_prefix(keys), p.busy_until_s, p.instance_id),
        )
        estimate = estimate_prefill(state, instance, request, now_s, remote)
        return estimate, estimate.local_hit_blocks

    def pick_decode(self, state: ClusterState, request: ScheduleRequest) -> DecodeInstance:
        return _least_assigned(state)


class ConductorRouter(Router):
    name = "conductor"

    def pick_prefill(
        self, state: ClusterState, request: ScheduleRequest, now_s: float, remote: int
    ) -> tuple[PrefillEstimate, int]:
        best: PrefillEstimate | None = None
        best_local = 0
        for instance in state.prefill:
            estimate = estimate_prefill(state, instance, request, now_s, remote)
            best_local = max(best_local, estimate.local_hit_blocks)
            if best is None or estimate.ttft_s < best.ttft_s:
                best = estimate
        assert best is not None, "a cluster has at least one prefill instance"
        return best, best_local

    def pick_decode(self, state: ClusterState, request: ScheduleRequest) -> DecodeInstance:
        watermark = self.config.kv_high_watermark
        fitting = [d for d in state.decode if _decode_fits(d, request, watermark)]
        candidates = fitting or state.decode
        return min(candidates, key=lambda d: (_decode_tbt(d, request), d.instance_id))


#: Routers by name.
ROUTERS: dict[str, Callable[[SchedulerConfig], Router]] = {
    RoundRobinRouter.name: RoundRobinRouter,
    LeastLoadedRouter.name: LeastLoadedRouter,
    CacheOnlyRouter.name: CacheOnlyRouter,
    ConductorRouter.name: ConductorRouter,
}


def make_router(name: str, config: SchedulerConfig | None = None) -> Router:
    """Build a router by name.

    Args:
        name: a key of :data:`ROUTERS`.
        config: its settings (default: :class:`SchedulerConfig` with early rejection).

    Returns:
        A fresh router (round-robin keeps a position, so do not share one between clusters).

    Raises:
        InvalidRequestError: for an unknown name.
    """
    try:
        factory = ROUTERS[name]
    except KeyError:
        known = ", ".join(ROUTERS)
        raise InvalidRequestError(f"unknown scheduler {name!r}; known: {known}") from None
    return factory(config or SchedulerConfig())
