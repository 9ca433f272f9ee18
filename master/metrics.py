"""The master's Prometheus metrics, in a registry of its own (several masters fit in one process).

Two kinds of figures:

* recorded as they happen, at the RPC edge (``server.dispatch`` calls :meth:`observe`): requests
  per verb and error code, latency histograms per verb, lookup hits and misses per tier; and the
  lag of the master's event loop (``kvstore_loop_lag_seconds``: how late a timer the daemon sets
  every few ms ran, i.e. how long turns of the loop held everyone else);
* read from the service when Prometheus scrapes (:class:`_ServiceCollector`): tier fill, objects,
  nodes alive, pending puts, and the figures other subsystems keep in ``service.stats()``
  (evictions, demotions, promotions, leases, pins, replication backlog) — zero until they exist;
* per tenant (label ``tenant``, ``kvstore_tenant_*``): bytes and quota per tier, objects,
  evictions, demotions, hits, misses and refused puts, read from the service's
  ``TenantQuotas`` at scrape time;
* the process's garbage collector (``kvstore_gc_*``, ``kvstore/gc_policy.py``): collections and the time
  they held the event loop, per generation, and the objects frozen at start-up (process-wide
  figures: every master of a process shows the same).

A tenant's token (admin ``/metrics``, :meth:`MasterMetrics.exposition` with ``tenant``) sees its
own ``kvstore_tenant_*`` series (label ``tenant`` its name) and the cluster facts in
:data:`TENANT_CLUSTER_FAMILIES` (nodes alive, tier capacity and fill: what ``/api/v1/nodes``
shows it anyway), nothing else: requests, lookups, the prefix index's figures and every other
family count all tenants' traffic together, and other tenants' series name them.

Prefix matching: ``kvstore_prefix_match_hit_ratio`` is the master's prefix index's own figure
(tokens hit / tokens asked, over ``kv_match`` and the admin route's token form), with its counters;
the admin route's key-chain form counts blocks in ``kvstore_prefix_chain_*``.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvstore import gc_policy, protocol
from kvstore.errors import ErrorCode
from kvstore.master.rpc_verbs import HANDLERS
from kvstore.master.service import MasterService, ServiceSlot

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

#: Latency buckets in seconds: 50 µs .. 10 s (control verbs are sub-millisecond when healthy).
LATENCY_BUCKETS = (
    0.00005,
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    10.0,
)

#: Loop lag buckets in seconds: 1 ms .. 1 s (a healthy master's loop is never held long).
LOOP_LAG_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)

#: Figures other subsystems keep in ``service.stats()``: (metric, kind, help, candidate paths).
#: The first path present wins; none present reads as zero, so every series exists from the first
#: scrape. Paths follow the tier/lease/replication work's stats (``eviction``, ``replication``).
_STATS_FIGURES: tuple[tuple[str, str, str, tuple[tuple[str, ...], ...]], ...] = (
    (
        "kvstore_leases_held",
        "gauge",
        "Read leases currently held",
        (("num_leases",), ("leases", "num_outstanding")),
    ),
    ("kvstore_pins_held", "gauge", "Objects pinned now", (("num_pins",), ("num_pinned",))),
    (
        "kvstore_replication_backlog",
        "gauge",
        "Objects with fewer replicas than wanted",
        (("replication_backlog",), ("replication", "num_under_replicated")),
    ),
    (
        "kvstore_replication_copies_in_flight",
        "gauge",
        "Replica copies (replication, drain) in flight",
        (("replication", "num_copies_in_flight"),),
    ),
    (
        "kvstore_evictions",
        "counter",
        "Replicas deleted from their last tier by background eviction",
        (("eviction", "num_evictions"),),
    ),
    (
        "kvstore_sync_evictions",
        "counter",
        "Replicas deleted to make room for a put",
        (("eviction", "num_sync_evictions"),),
    ),
    (
        "kvstore_demotions",
        "counter",
        "Replicas moved to a lower tier",
        (("eviction", "num_demotions"),),
    ),
    (
        "kvstore_promotions",
        "counter",
        "Replicas moved to a higher tier",
        (("eviction", "num_promotions"),),
    ),
    ("kvstore_held_frees", "gauge", "Freed extents held for leases", (("num_held_frees",),)),
)
_TIER_COUNTERS = ("evictions", "demotions", "promotions")


#: The families a tenant's token sees besides its own ``kvstore_tenant_*`` series: cluster facts
#: that name no tenant and no key.
TENANT_CLUSTER_FAMILIES = frozenset(
    {"kvstore_nodes_alive", "kvstore_tier_capacity_bytes", "kvstore_tier_used_bytes"}
)
TENANT_FAMILY_PREFIX = "kvstore_tenant_"


def _figure(stats: dict[str, Any], paths: tuple[tuple[str, ...], ...]) -> float:
    for path in paths:
        value: Any = stats
        for part in path:
            value = value.get(part) if isinstance(value, dict) else None
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
    return 0.0


class MasterMetrics:
    """Every metric of one master. Thread-safe (prometheus_client's own locking).

    Args:
        slot: holds the service whose state is read at scrape time (the current term's).
    """

    def __init__(self, slot: ServiceSlot) -> None:
        self.slot = slot
        disable_created_metrics()  # no *_created series: noise for every counter
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter(
            "kvstore_requests",
            "Control-plane requests served, by verb and error code name (OK on success)",
            ["verb", "code"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "kvstore_request_duration_seconds",
            "Time to serve a control-plane request, by verb",
            ["verb"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.loop_lag = Histogram(
            "kvstore_loop_lag_seconds",
            "How late the master's event loop ran a periodic timer (turns that held it)",
            buckets=LOOP_LAG_BUCKETS,
            registry=self.registry,
        )
        self.lookups = Counter(
            "kvstore_tier_lookups",
            "Keys looked up for reading, by tier of the replica served (hit) or tier=none (miss)",
            ["tier", "result"],
            registry=self.registry,
        )
        self.prefix_queries = Counter(
            "kvstore_prefix_chain_queried_keys",
            "Keys asked about in key-chain prefix matches (admin API)",
            registry=self.registry,
        )
        self.prefix_hits = Counter(
            "kvstore_prefix_chain_matched_keys",
            "Leading keys found in key-chain prefix matches (admin API)",
            registry=self.registry,
        )
        self.registry.register(_ServiceCollector(slot))
        self._verbs = frozenset([*HANDLERS, "hello"])
        self._children: dict[tuple[str, int], tuple[Any, Any]] = {}
        # Totals the status page samples (cheap to read, no registry walk).
        self.num_requests = 0
        self.num_hits = 0
        self.num_misses = 0
        self._hits_seen: dict[str, int] = {}
        self._misses_seen = 0
        self._term_hits = slot.service.hits_by_tier

    # ------------------------------------------------------------------ recording
    def observe(self, request: protocol.Request, code: int, result: Any, seconds: float) -> None:
        """Record one served request (called by the RPC edge for every request)."""
        verb = request.verb if request.verb in self._verbs else "unknown"
        children = self._children.get((verb, code))
        if children is None:
            try:
                code_name = ErrorCode(code).name
            except ValueError:
                code_name = "UNKNOWN"
            children = (self.requests.labels(verb, code_name), self.latency.labels(verb))
            self._children[(verb, code)] = children
        children[0].inc()
        children[1].observe(seconds)
        self.num_requests += 1
        if verb in ("get_locations", "kv_match"):
            self._sync_lookups()

    def observe_loop_lag(self, seconds: float) -> None:
        """Record how late the loop ran a timer that was due ``seconds`` ago."""
        self.loop_lag.observe(seconds)

    def _sync_lookups(self) -> None:
        """Carry the service's hit/miss counts (it counts them while answering) into the
        counters: O(tiers) per request, no second look-up of the keys."""
        svc = self.slot.service
        if svc.hits_by_tier is not self._term_hits:
            # A new term's service (an HA master leads again, or steps down): its counts
            # restart from zero, ours go on (a counter never goes down).
            self._term_hits = svc.hits_by_tier
            self._hits_seen.clear()
            self._misses_seen = 0
        for tier, total in svc.hits_by_tier.items():
            delta = total - self._hits_seen.get(tier, 0)
            if delta:
                self.lookups.labels(tier, "hit").inc(delta)
                self._hits_seen[tier] = total
                self.num_hits += delta
        delta = svc.num_misses - self._misses_seen
        if delta:
            self.lookups.labels("none", "miss").inc(delta)
            self._misses_seen = svc.num_misses
            self.num_misses += delta

    def record_prefix_match(self, num_matched: int, num_queried: int) -> None:
        """Count a key-chain match: ``num_matched`` leading keys of ``num_queried`` were stored."""
        self.prefix_queries.inc(num_queried)
        self.prefix_hits.inc(num_matched)

    def exposition(self, tenant: str | None = None) -> bytes:
        """The registry in Prometheus text format.

        Args:
            tenant: None for the operator (every series); a tenant's name for what it may see
                (see the module's docstring).
        """
        if tenant is None:
            return generate_latest(self.registry)
        return generate_latest(_TenantSeries(self.registry, tenant))  # type: ignore[arg-type]


class _TenantSeries:
    """The part of a registry one tenant may see (what ``generate_latest`` reads: ``collect``)."""

    def __init__(self, registry: CollectorRegistry, tenant: str) -> None:
        self.registry = registry
        self.tenant = tenant

    def collect(self) -> Iterator[Metric]:
        for family in self.registry.collect():
            if family.name in TENANT_CLUSTER_FAMILIES:
                yield family
            elif family.name.startswith(TENANT_FAMILY_PREFIX):
                own = copy.copy(family)
                own.samples = [s for s in family.samples if s.labels.get("tenant") == self.tenant]
                yield own


class _ServiceCollector(Collector):
    """Figures read from the service at scrape time.

    NOTE: the service is single-threaded; scrape on the master's event loop, never in a thread.
    """

    def __init__(self, slot: ServiceSlot) -> None:
        self.slot = slot

    def collect(self) -> Iterator[Any]:
        svc: MasterService = self.slot.service
        stats = svc.stats()
        used = GaugeMetricFamily(
            "kvstore_tier_used_bytes", "Bytes allocated in each tier", labels=["tier"]
        )
        capacity = GaugeMetricFamily(
            "kvstore_tier_capacity_bytes", "Bytes each tier can hold", labels=["tier"]
        )
        objects = GaugeMetricFamily(
            "kvstore_tier_objects", "Committed replicas held in each tier", labels=["tier"]
        )
        by_tier: dict[str, list[int]] = {}
        for node in list(svc.nodes.values()):
            for seg in list(node.segments.values()):
                fig = by_tier.setdefault(seg.tier, [0, 0, 0])
                fig[0] += seg.allocator.used_bytes
                fig[1] += seg.allocator.capacity
        tier_stats = stats.get("tiers") if isinstance(stats.get("tiers"), dict) else {}
        if all(
            isinstance(tier_stats.get(t), dict) and "num_replicas" in tier_stats[t] for t in by_tier
        ):
            for tier, fig in by_tier.items():  # the service counts them: no walk over objects
                fig[2] = int(tier_stats[tier]["num_replicas"])
        else:
            tier_of = {
                (n.node_id, s.name): s.tier
                for n in list(svc.nodes.values())
                for s in list(n.segments.values())
            }
            for obj in list(svc.objects.values()):
                for r in obj.replicas:
                    tier = tier_of.get((r.node_id, r.segment))
                    if tier is not None:
                        by_tier[tier][2] += 1
        for tier, (u, c, o) in sorted(by_tier.items()):
            used.add_metric([tier], u)
            capacity.add_metric([tier], c)
            objects.add_metric([tier], o)
        yield used
        yield capacity
        yield objects

        for what in _TIER_COUNTERS:
            family = CounterMetricFamily(
                f"kvstore_tier_{what}", f"Objects {what[:-1]}ed, by tier", labels=["tier"]
            )
            for tier in sorted(set(by_tier) | set(tier_stats)):
                fig = tier_stats.get(tier) or {}
                paths = ((what,), (f"num_{what}",))
                family.add_metric([tier], _figure(fig, paths))
            yield family

        yield _gauge("kvstore_nodes_alive", "Registered, live storage nodes", len(svc.nodes))
        yield _gauge("kvstore_objects", "Committed objects", len(svc.objects))
        yield _gauge("kvstore_pending_puts", "Puts started and not yet committed", len(svc.pending))
        yield _gauge(
            "kvstore_blank_puts",
            "Of the pending puts, blanks: started ahead for clients' next small puts",
            svc.puts.num_blanks,
        )
        yield _gauge(
            "kvstore_object_bytes", "Bytes of committed objects", stats.get("object_bytes", 0)
        )
        if "num_leases" not in stats:
            # Objects under a read lease (``lease_until`` in the future), where objects carry one.
            now = svc.clock()
            # Only hot objects can be leased (master/table.py): no walk over the whole table.
            held = svc.objects.hot_values()
            stats = {
                **stats,
                "num_leases": sum(1 for o in held if o.lease_until > now),
            }
        for name, kind, doc, paths in _STATS_FIGURES:
            make = _gauge if kind == "gauge" else _counter
            yield make(name, doc, _figure(stats, paths))
        yield _counter(
            "kvstore_reclaimed_puts", "Puts reclaimed after their timeout", svc.num_reclaimed
        )
        yield _counter("kvstore_dead_nodes", "Nodes declared dead", svc.num_dead_nodes)
        yield from gc_policy.metric_families()
        prefix = stats.get("prefix") if isinstance(stats.get("prefix"), dict) else {}
        yield _gauge(
            "kvstore_prefix_match_hit_ratio",
            "Prefix index: tokens found / tokens asked, over all matches so far",
            prefix.get("hit_ratio", 0.0),
        )
        yield _counter(
            "kvstore_prefix_match_queries", "Prefix index matches", prefix.get("num_queries", 0)
        )
        yield _counter(
            "kvstore_prefix_match_query_tokens",
            "Tokens asked about in prefix matches",
            prefix.get("num_query_tokens", 0),
        )
        yield _counter(
            "kvstore_prefix_match_hit_tokens",
            "Tokens found cached in prefix matches",
            prefix.get("num_hit_tokens", 0),
        )
        yield _gauge(
            "kvstore_prefix_index_blocks", "Blocks in the prefix index", prefix.get("num_blocks", 0)
        )
        yield from _tenant_families(svc)


#: Per-tenant counters: (metric, help, ``TenantQuotas.describe`` field).
_TENANT_COUNTERS = (
    ("kvstore_tenant_evictions", "Replicas of a tenant deleted by eviction", "num_evictions"),
    ("kvstore_tenant_demotions", "Replicas of a tenant moved to a lower tier", "num_demotions"),
    ("kvstore_tenant_hits", "Keys of a tenant found when located for reading", "num_hits"),
    ("kvstore_tenant_misses", "Keys of a tenant not found when located", "num_misses"),
    (
        "kvstore_tenant_refused_puts",
        "Puts of a tenant refused because its quota could not take them",
        "num_refused_puts",
    ),
    (
        "kvstore_tenant_prompt_tokens",
        "Tokens of a tenant's prompts located for loading (kv_match with locations)",
        "num_prompt_tokens",
    ),
    (
        "kvstore_tenant_prompt_tokens_served",
        "Tokens of a tenant's prompts served from the pool (found when located for loading)",
        "num_served_tokens",
    ),
)


def _tenant_families(svc: MasterService) -> Iterator[Any]:
    """Per tenant (label ``tenant``): bytes and quota per tier, objects, and its counters, from
    the figures ``master/quotas.py`` keeps as replicas come and go (no walk over objects)."""
    used = GaugeMetricFamily(
        "kvstore_tenant_used_bytes",
        "Committed bytes of a tenant in each tier (every replica)",
        labels=["tenant", "tier"],
    )
    quota = GaugeMetricFamily(
        "kvstore_tenant_quota_bytes",
        "A tenant's quota in each tier it has one for",
        labels=["tenant", "tier"],
    )
    objects = GaugeMetricFamily(
        "kvstore_tenant_objects", "Committed objects of a tenant", labels=["tenant"]
    )
    counters = [
        (CounterMetricFamily(name, doc, labels=["tenant"]), field)
        for name, doc, field in _TENANT_COUNTERS
    ]
    for name in svc.quotas.tenants():
        fig = svc.quotas.describe(name)
        for tier, value in sorted(fig["used_bytes"].items()):  # type: ignore[attr-defined]
            used.add_metric([name, tier], value)
        for tier, value in sorted(fig["quotas"].items()):  # type: ignore[attr-defined]
            quota.add_metric([name, tier], value)
        objects.add_metric([name], fig["num_objects"])  # type: ignore[arg-type]
        for family, field in counters:
            family.add_metric([name], fig[field])  # type: ignore[arg-type]
    yield used
    yield quota
    yield objects
    for family, _ in counters:
        yield family


def _gauge(name: str, doc: str, value: Any) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=float(value or 0))


def _counter(name: str, doc: str, value: Any) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, value=float(value or 0))
