"""The vLLM connector's counters: summed per side, reported through vLLM's KV-transfer stats
and on its ``/metrics`` as ``vllm:kvstore_<name>``."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig


#: Counter names (``vllm:kvstore_<name>`` in Prometheus, also in vLLM's "KV Transfer metrics").
STAT_NAMES = (
    "lookups",
    "hit_tokens",
    "loaded_tokens",
    "loaded_bytes",
    "loaded_in_place_bytes",
    "load_seconds",
    "copy_seconds",
    "load_errors",
    "saved_tokens",
    "saved_bytes",
    "save_seconds",
    "pool_unavailable",
    "preempted_saved_tokens",
)


class KVStoreConnectorStats(KVConnectorStats):
    """Sums since the last report; worker and scheduler figures add up."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for k, v in other.data.items():
            self.data[k] = self.data.get(k, 0) + v
        return self

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {k: self.data[k] for k in STAT_NAMES if k in self.data}
        secs, nbytes = self.data.get("load_seconds", 0), self.data.get("loaded_bytes", 0)
        if secs:
            out["load_MBps"] = round(nbytes / secs / 1e6, 1)
        return out

    def is_empty(self) -> bool:
        return not any(self.data.values())


class KVStorePromMetrics(KVConnectorPromMetrics):
    """The counters on vLLM's ``/metrics``: ``vllm:kvstore_loaded_tokens_total`` and so on."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        from vllm.v1.metrics.utils import create_metric_per_engine

        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        docs = {
            "lookups": "Prefix-index lookups made by the kvstore connector",
            "hit_tokens": "Prompt tokens the pool offered beyond vLLM's local cache",
            "loaded_tokens": "Tokens of KV loaded from the kvstore pool",
            "loaded_bytes": "Bytes of KV loaded from the kvstore pool",
            "loaded_in_place_bytes": (
                "Of loaded_bytes, those copied straight from a same-host node's shared memory"
            ),
            "load_seconds": "Seconds spent loading KV from the kvstore pool (read and copy)",
            "copy_seconds": "Of load_seconds, the copy into vLLM's paged cache",
            "load_errors": "Blocks that failed to load (lost, corrupt, node down): recomputed",
            "saved_tokens": "Tokens of KV saved into the kvstore pool",
            "saved_bytes": "Bytes of KV saved into the kvstore pool",
            "save_seconds": "Seconds spent saving KV into the kvstore pool",
            "pool_unavailable": "Pool calls that failed because the pool could not be reached",
            "preempted_saved_tokens": (
                "Tokens of KV saved when vLLM preempted their request (it resumes by loading them)"
            ),
        }
        self._counters = {
            name: create_metric_per_engine(
                self._counter_cls(
                    name=f"vllm:kvstore_{name}", documentation=doc, labelnames=labelnames
                ),
                per_engine_labelvalues,
            )
            for name, doc in docs.items()
        }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name, value in transfer_stats_data.items():
            per_engine = self._counters.get(name)
            if per_engine is not None and value:
                per_engine[engine_idx].inc(value)
