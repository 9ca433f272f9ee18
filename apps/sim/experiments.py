"""The experiments the issue asks for, shared by the CLI and ``bench/bench_scheduler.py``."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from kvstore.errors import InvalidRequestError

from .cluster import ClusterConfig
from .policies import POLICIES, HitStats
from .replay import replay_per_instance, replay_pool
from .scheduler import ROUTERS, SchedulerConfig
from .simulator import SimConfig, SimResult, simulate
from .trace import TraceRequest

#: Capacities of the hit-rate table, in blocks (None = unlimited).
CAPACITIES: tuple[int | None, ...] = (1_000, 2_000, 5_000, 10_000, 20_000, 50_000, 100_000, None)

#: Mooncake's per-node cache of 3M tokens, in 512-token blocks.
MOONCAKE_NODE_BLOCKS = 5_860

#: The baselines, then ours.
BASELINES = ("round-robin", "least-loaded", "cache-only")
OURS = "conductor"


def hit_rate_grid(
    requests: Sequence[TraceRequest],
    policies: Sequence[str] = tuple(POLICIES),
    capacities: Sequence[int | None] = CAPACITIES,
) -> dict[tuple[str, int | None], HitStats]:
    """Replay one shared cache for every (policy, capacity).

    Args:
        requests: the trace.
        policies: policy names.
        capacities: capacities in blocks (None = unlimited; replayed once, it is the same for
            every policy).

    Returns:
        Hit stats keyed by (policy, capacity).
    """
    grid: dict[tuple[str, int | None], HitStats] = {}
    unlimited: HitStats | None = None
    for capacity in capacities:
        for policy in policies:
            if capacity is None:
                unlimited = unlimited or replay_pool(requests, None, policy)
                grid[(policy, None)] = unlimited
            else:
                grid[(policy, capacity)] = replay_pool(requests, capacity, policy)
    return grid


def pool_vs_local_rows(
    requests: Sequence[TraceRequest],
    nums_instances: Sequence[int] = (4, 8, 16),
    capacity_each: int = MOONCAKE_NODE_BLOCKS,
    policy: str = "lru",
) -> list[list[object]]:
    """Hit rate of N private caches against one pool of N x the capacity.

    Args:
        requests: the trace.
        nums_instances: instance counts to try.
        capacity_each: blocks per instance.
        policy: eviction policy.

    Returns:
        Rows: instances, per-instance (round-robin), per-instance (cache-aware), global pool,
        pool / round-robin, pool / cache-aware.
    """
    rows: list[list[object]] = []
    for num in nums_instances:
        rr = replay_per_instance(requests, num, capacity_each, policy, "round-robin").hit_rate
        aware = replay_per_instance(requests, num, capacity_each, policy, "cache-aware").hit_rate
        pool = replay_pool(requests, num * capacity_each, policy).hit_rate
        rows.append(
            [
                num,
                rr,
                aware,
                pool,
                pool / rr if rr else float("nan"),
                pool / aware if aware else float("nan"),
            ]
        )
    return rows


POOL_VS_LOCAL_HEADERS = (
    "instances",
    "per-instance RR",
    "per-instance cache-aware",
    "global pool",
    "pool / RR",
    "pool / aware",
)


def run_routers(
    requests: Sequence[TraceRequest],
    cluster: ClusterConfig,
    scheduler: SchedulerConfig | None = None,
    speedup: float = 1.0,
    routers: Sequence[str] = tuple(ROUTERS),
    with_ablation: bool = False,
) -> list[tuple[str, SimResult]]:
    """Simulate every router on the same cluster.

    Baselines run as they are (no early rejection); ours runs with ``scheduler`` as given.
    With ``with_ablation`` every router also runs with the other setting of early rejection,
    labelled ``+reject`` / ``-reject``, to show where the gain comes from.

    Args:
        requests: the trace.
        cluster: sizes and cost model.
        scheduler: SLO classes and watermark (default :class:`SchedulerConfig`).
        speedup: arrival-rate multiplier.
        routers: router names.
        with_ablation: also run the other early-rejection setting.

    Returns:
        (label, result) pairs, in ``routers`` order.
    """
    scheduler = scheduler or SchedulerConfig()
    runs: list[tuple[str, SimResult]] = []
    for name in routers:
        native = name == OURS and scheduler.early_rejection
        settings = [native] + ([not native] if with_ablation else [])
        for reject in settings:
            label = name if reject == native else f"{name} {'+' if reject else '-'}reject"
            config = SimConfig(
                cluster, name, replace(scheduler, early_rejection=reject), speedup=speedup
            )
            runs.append((label, simulate(requests, config)))
    return runs


def best_baseline(runs: Sequence[tuple[str, SimResult]]) -> tuple[str, SimResult]:
    """The baseline (as it is, no ablation label) with the highest goodput.

    Args:
        runs: output of :func:`run_routers`.

    Returns:
        Its (label, result).

    Raises:
        InvalidRequestError: when ``runs`` holds no baseline.
    """
    baselines = [(label, r) for label, r in runs if label in BASELINES]
    if not baselines:
        raise InvalidRequestError("no baseline among the runs")
    return max(baselines, key=lambda pair: pair[1].goodput_rps)
