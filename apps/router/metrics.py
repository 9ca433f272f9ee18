"""The router's Prometheus metrics (one registry per application)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info

_TTFT_BUCKETS = (0.05, 0.1, 0.2, 0.3, 0.5, 1, 2, 5, 10, 30, 60, 120)


@dataclass(frozen=True, slots=True)
class RouterMetrics:
    """Every metric the router exports."""

    registry: CollectorRegistry
    requests: Counter
    chosen: Counter
    ttft_predicted: Histogram
    ttft_measured: Histogram
    prefill_measured: Histogram
    rejections: Counter
    fallbacks: Counter
    prompt_tokens: Counter
    cached_tokens: Counter
    lookup_errors: Counter
    promoted: Gauge
    engine_healthy: Gauge
    engine_running: Gauge
    engine_waiting: Gauge
    engine_kv_usage: Gauge
    cost_term: Gauge
    pool_view_state: Gauge
    pool_view_events: Counter
    pool_view_resyncs: Counter
    pool_view_fallbacks: Counter
    pool_view_blocks: Gauge
    pool_view_seq: Gauge
    pool_answers: Counter
    engine_events: Counter
    engine_event_gaps: Counter
    engine_cached_blocks: Gauge
    local_cached_tokens: Counter
    policy: Info
    engine_info: Gauge
    discovery_up: Gauge
    discovery_changes: Counter

    @staticmethod
    def create() -> RouterMetrics:
        """A fresh registry with the router's metrics."""
        r = CollectorRegistry()

        def metric(kind: Any, name: str, doc: str, labels: Sequence[str] = (), **kw: Any) -> Any:
            return kind("kvstore_router_" + name, doc, labels, registry=r, **kw)

        return RouterMetrics(
            registry=r,
            requests=metric(
                Counter,
                "requests",
                "Requests by route, outcome and SLO class",
                ["route", "outcome", "slo_class"],
            ),
            chosen=metric(Counter, "chosen", "Steps sent to each engine", ["role", "instance"]),
            ttft_predicted=metric(
                Histogram,
                "ttft_predicted_seconds",
                "Predicted TTFT of admitted requests",
                ["instance"],
                buckets=_TTFT_BUCKETS,
            ),
            ttft_measured=metric(
                Histogram,
                "ttft_measured_seconds",
                "Measured TTFT (first streamed chunk)",
                ["instance"],
                buckets=_TTFT_BUCKETS,
            ),
            prefill_measured=metric(
                Histogram,
                "prefill_measured_seconds",
                "Measured prefill step (P/D, max_tokens=1)",
                ["instance"],
                buckets=_TTFT_BUCKETS,
            ),
            rejections=metric(
                Counter, "rejections", "Requests rejected early", ["slo_class", "reason"]
            ),
            fallbacks=metric(
                Counter,
                "fallbacks",
                "Steps retried elsewhere after an engine failed",
                ["step", "instance"],
            ),
            prompt_tokens=metric(Counter, "prompt_tokens", "Prompt tokens routed"),
            cached_tokens=metric(
                Counter, "cached_tokens", "Prompt tokens the prefix index reported cached"
            ),
            lookup_errors=metric(
                Counter, "lookup_errors", "Prefix-index lookups that failed (counted as misses)"
            ),
            promoted=metric(Gauge, "promoted", "Queued requests promoted so far"),
            engine_healthy=metric(Gauge, "engine_healthy", "Engine answers", ["instance"]),
            engine_running=metric(
                Gauge, "engine_running", "vllm:num_requests_running", ["instance"]
            ),
            engine_waiting=metric(
                Gauge, "engine_waiting", "vllm:num_requests_waiting", ["instance"]
            ),
            engine_kv_usage=metric(
                Gauge, "engine_kv_usage", "vllm:kv_cache_usage_perc", ["instance"]
            ),
            cost_term=metric(
                Gauge,
                "cost_term",
                "Cost-model terms in use per engine (prior, or least-squares fit of measurements)",
                ["instance", "term"],
            ),
            pool_view_state=metric(
                Gauge,
                "pool_view_state",
                "State of the router's view of the pool from the KV events (1: current)",
                ["state"],
            ),
            pool_view_events=metric(
                Counter,
                "pool_view_events",
                "KV events applied to the router's view of the pool",
                ["kind"],
            ),
            pool_view_resyncs=metric(
                Counter,
                "pool_view_resyncs",
                "Resyncs of the KV event stream (a snapshot was read)",
                ["reason"],
            ),
            pool_view_fallbacks=metric(
                Counter,
                "pool_view_fallbacks",
                "Requests looked up in the prefix index because the view was not synced",
            ),
            pool_view_blocks=metric(
                Gauge, "pool_view_blocks", "Blocks in the router's view of the pool"
            ),
            pool_view_seq=metric(
                Gauge,
                "pool_view_seq",
                "Sequence number of the last KV event the view reflects (in the master's epoch)",
            ),
            pool_answers=metric(
                Counter,
                "pool_answers",
                "Where each request's pool hit came from (events: the view; lookup: kv_match)",
                ["source"],
            ),
            engine_events=metric(
                Counter,
                "engine_events",
                "vLLM KV events applied to each engine's prefix-cache view (malformed: dropped)",
                ["instance", "kind"],
            ),
            engine_event_gaps=metric(
                Counter,
                "engine_event_gaps",
                "Gaps in an engine's KV event sequence (its view was cleared)",
                ["instance"],
            ),
            engine_cached_blocks=metric(
                Gauge,
                "engine_cached_blocks",
                "Blocks of each engine's own prefix cache the router can match",
                ["instance"],
            ),
            local_cached_tokens=metric(
                Counter,
                "local_cached_tokens",
                "Prompt tokens found in the chosen engine's own prefix cache",
                ["instance"],
            ),
            policy=metric(Info, "policy", "The routing policy (--policy) choosing the engines"),
            engine_info=metric(
                Gauge,
                "engine_info",
                "The engine set: 1 per engine, its role and where the router learned of it",
                ["instance", "role", "source"],
            ),
            discovery_up=metric(
                Gauge, "discovery_up", "1 while the etcd engine registry is watched (--discover)"
            ),
            discovery_changes=metric(
                Counter,
                "discovery_changes",
                "Engine registry changes seen: added, removed, ignored (invalid), resynced",
                ["kind"],
            ),
        )
