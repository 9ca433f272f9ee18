"""The router's Prometheus metrics (one registry per application)."""

from __future__ import annotations

from dataclasses import dataclass

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

    @staticmethod
    def create() -> RouterMetrics:
        """A fresh registry with the router's metrics."""
        r = CollectorRegistry()
        p = "kvstore_router_"
        return RouterMetrics(
            registry=r,
            requests=Counter(
                p + "requests",
                "Requests by route, outcome and SLO class",
                ["route", "outcome", "slo_class"],
                registry=r,
            ),
            chosen=Counter(
                p + "chosen", "Steps sent to each engine", ["role", "instance"], registry=r
            ),
            ttft_predicted=Histogram(
                p + "ttft_predicted_seconds",
                "Predicted TTFT of admitted requests",
                ["instance"],
                buckets=_TTFT_BUCKETS,
                registry=r,
            ),
            ttft_measured=Histogram(
                p + "ttft_measured_seconds",
                "Measured TTFT (first streamed chunk)",
                ["instance"],
                buckets=_TTFT_BUCKETS,
                registry=r,
            ),
            prefill_measured=Histogram(
                p + "prefill_measured_seconds",
                "Measured prefill step (P/D, max_tokens=1)",
                ["instance"],
                buckets=_TTFT_BUCKETS,
                registry=r,
            ),
            rejections=Counter(
                p + "rejections", "Requests rejected early", ["slo_class", "reason"], registry=r
            ),
            fallbacks=Counter(
                p + "fallbacks",
                "Steps retried elsewhere after an engine failed",
                ["step", "instance"],
                registry=r,
            ),
            prompt_tokens=Counter(p + "prompt_tokens", "Prompt tokens routed", registry=r),
            cached_tokens=Counter(
                p + "cached_tokens", "Prompt tokens the prefix index reported cached", registry=r
            ),
            lookup_errors=Counter(
                p + "lookup_errors",
                "Prefix-index lookups that failed (counted as misses)",
                registry=r,
            ),
            promoted=Gauge(p + "promoted", "Queued requests promoted so far", registry=r),
            engine_healthy=Gauge(p + "engine_healthy", "Engine answers", ["instance"], registry=r),
            engine_running=Gauge(
                p + "engine_running", "vllm:num_requests_running", ["instance"], registry=r
            ),
            engine_waiting=Gauge(
                p + "engine_waiting", "vllm:num_requests_waiting", ["instance"], registry=r
            ),
            engine_kv_usage=Gauge(
                p + "engine_kv_usage", "vllm:kv_cache_usage_perc", ["instance"], registry=r
            ),
            cost_term=Gauge(
                p + "cost_term",
                "Cost-model terms in use per engine (prior, or least-squares fit of measurements)",
                ["instance", "term"],
                registry=r,
            ),
            pool_view_state=Gauge(
                p + "pool_view_state",
                "State of the router's view of the pool from the KV events (1: current)",
                ["state"],
                registry=r,
            ),
            pool_view_events=Counter(
                p + "pool_view_events",
                "KV events applied to the router's view of the pool",
                ["kind"],
                registry=r,
            ),
            pool_view_resyncs=Counter(
                p + "pool_view_resyncs",
                "Resyncs of the KV event stream (a snapshot was read)",
                ["reason"],
                registry=r,
            ),
            pool_view_fallbacks=Counter(
                p + "pool_view_fallbacks",
                "Requests looked up in the prefix index because the view was not synced",
                registry=r,
            ),
            pool_view_blocks=Gauge(
                p + "pool_view_blocks", "Blocks in the router's view of the pool", registry=r
            ),
            pool_view_seq=Gauge(
                p + "pool_view_seq",
                "Sequence number of the last KV event the view reflects (in the master's epoch)",
                registry=r,
            ),
            pool_answers=Counter(
                p + "pool_answers",
                "Where each request's pool hit came from (events: the view; lookup: kv_match)",
                ["source"],
                registry=r,
            ),
            engine_events=Counter(
                p + "engine_events",
                "vLLM KV events applied to each engine's prefix-cache view (malformed: dropped)",
                ["instance", "kind"],
                registry=r,
            ),
            engine_event_gaps=Counter(
                p + "engine_event_gaps",
                "Gaps in an engine's KV event sequence (its view was cleared)",
                ["instance"],
                registry=r,
            ),
            engine_cached_blocks=Gauge(
                p + "engine_cached_blocks",
                "Blocks of each engine's own prefix cache the router can match",
                ["instance"],
                registry=r,
            ),
            local_cached_tokens=Counter(
                p + "local_cached_tokens",
                "Prompt tokens found in the chosen engine's own prefix cache",
                ["instance"],
                registry=r,
            ),
            policy=Info(
                p + "policy", "The routing policy (--policy) choosing the engines", registry=r
            ),
        )
