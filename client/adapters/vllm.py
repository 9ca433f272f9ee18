"""vLLM KV connector: vLLM instances save prompt KV into the pool and load cached prefixes back.

Use from vLLM 0.32 (``KVConnectorBase_V1``)::

    python -m vllm.entrypoints.openai.api_server --model M --kv-transfer-config \\
      '{"kv_connector":"KVStoreConnector","kv_connector_module_path":"kvstore.client.adapters.vllm",
        "kv_role":"kv_both","kv_connector_extra_config":{"master":"127.0.0.1:7700"}}'

Mapping (see docs/engines/vllm.md):

- One vLLM block is one pool block object: the namespace's block size IS vLLM's ``--block-size``.
  vLLM only accepts block-aligned external hits and reports load failures per block id, so a
  1:1 mapping makes a hit, a load and a failure the same unit, with no splitting or merging of
  objects and one checksum per vLLM block.
- The object keeps kvstore's documented layout (layer-major; per layer K then V, each
  ``[block_size, kv_heads, head_size]``), so any kvstore KV client reads it, whatever layout the
  engine that saved it used. :mod:`.vllm_layouts` sees every layout vLLM registers (per-layer or
  cross-layer, any backend whose K/V placement it knows, MLA, fp8) as strided block views: a save
  is one strided copy per layer and run of blocks, a load one copy per layer and block (no
  per-token Python); a layout it cannot serve is refused at start-up.
- Scheduler: ``get_num_new_matched_tokens`` asks the prefix index once per request (no read
  leases), never offers the prompt's last token, counts only blocks beyond vLLM's local hit.
- A request's ``cache_salt`` (vLLM's ``Request.cache_salt``) puts its lookups, loads and saves in
  a salted namespace (:func:`.vllm_config.salted_namespace`), as vLLM keeps such blocks apart in
  its own prefix cache; requests without one keep the engine's namespace.
- Worker: saves are handed off layer by layer to a background thread as ``save_kv_layer`` comes;
  ``wait_for_save`` waits for what is still in flight (so a producer's answer leaves after its KV
  is in the pool). Loads locate a step's blocks in one master call; blocks in a same-host node's
  shared memory are copied straight from it into vLLM's cache (no staging copy:
  ``Client.read_in_place``), the others come in one batched read; every block is verified by
  checksum; a failed block is reported by ``get_block_ids_with_load_errors`` and
  vLLM recomputes it (the connector sets ``kv_load_failure_policy`` to ``recompute``).
- Where the code goes (vLLM's own seam, as in its ``nixl_connector.py``): this module is the
  thin ``KVConnectorBase_V1`` facade (config, namespace, engine registration, stats);
  :mod:`.vllm_scheduler` the scheduler side, :mod:`.vllm_worker` the worker side,
  :mod:`.vllm_layouts` the map from any registered cache to block views, :mod:`.vllm_pool` the
  pool breaker and the step metadata both sides share, :mod:`.vllm_stats` the counters.
- The pool unreachable: one warning line, a counter (``vllm:kvstore_pool_unavailable``), and vLLM
  recomputes; the connector retries the pool after ``retry_s``.
"""

from __future__ import annotations

import os
import signal
import threading
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)

from kvstore.client.adapters.vllm_config import ConnectorConfig, engine_namespace, kv_dtype_from
from kvstore.client.adapters.vllm_layouts import CacheGeometry
from kvstore.client.adapters.vllm_pool import Counters, Pool, logger
from kvstore.client.adapters.vllm_scheduler import KVStoreConnectorMetadata, KVStoreScheduler
from kvstore.client.adapters.vllm_stats import (
    STAT_NAMES,
    KVStoreConnectorStats,
    KVStorePromMetrics,
)
from kvstore.client.adapters.vllm_worker import KVStoreWorker
from kvstore.client.engine_registry import EngineAnnouncer
from kvstore.errors import InvalidRequestError
from kvstore.keys import Namespace

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request


_TORCH_TO_NS_DTYPE = {
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
    torch.float32: "float32",
}


# ==================================================================== configuration
def kv_dtype_name(vllm_config: VllmConfig) -> str:
    """The namespace dtype of vLLM's KV cache (``--kv-cache-dtype``, ``auto``: the model's).

    Raises:
        InvalidRequestError: a KV dtype the pool's namespaces do not describe.
    """
    dtype = vllm_config.model_config.dtype
    return kv_dtype_from(
        str(vllm_config.cache_config.cache_dtype), _TORCH_TO_NS_DTYPE.get(dtype, str(dtype))
    )


def geometry_for(vllm_config: VllmConfig) -> CacheGeometry:
    """What one layer of this rank's cache holds (KV heads, block size, head size, MLA)."""
    mc = vllm_config.model_config
    mla = bool(mc.use_mla)
    return CacheGeometry(
        num_kv_heads=1 if mla else mc.get_num_kv_heads(vllm_config.parallel_config),
        block_size=vllm_config.cache_config.block_size,
        head_size=mc.get_head_size(),
        mla=mla,
    )


def namespace_for(
    vllm_config: VllmConfig,
    num_layers: int,
    tp_rank: int,
    salt: str | None,
    geometry: CacheGeometry | None = None,
) -> Namespace:
    """The pool namespace of this vLLM instance's KV, derived from vLLM's own config
    (:func:`~kvstore.client.adapters.vllm_config.engine_namespace`, which the router shares).
    Its fields are a pool plane's (:class:`CacheGeometry`): an MLA latent is two half planes.

    Raises:
        InvalidRequestError: a config the namespace cannot describe.
    """
    mc = vllm_config.model_config
    pc = vllm_config.parallel_config
    g = geometry if geometry is not None else geometry_for(vllm_config)
    name = mc.served_model_name
    if isinstance(name, list | tuple):
        name = name[0]
    return engine_namespace(
        served_model=str(name or mc.model),
        revision=mc.revision,
        kv_dtype=kv_dtype_name(vllm_config),
        num_layers=num_layers,
        num_kv_heads=g.plane_heads,
        head_dim=g.plane_dim,
        block_size=g.block_size,
        salt=salt,
        mla=g.mla,
        tp_rank=tp_rank,
        tp_size=pc.tensor_parallel_size,
    )


# ==================================================================== the connector
class KVStoreConnector(KVConnectorBase_V1):
    """vLLM's KV connector onto a kvstore pool (roles ``kv_both``, ``kv_producer``,
    ``kv_consumer``). See the module docstring for the mapping and failure handling.

    Raises:
        InvalidRequestError: a bad ``kv_connector_extra_config`` or a layout it cannot map.
    """

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        ktc = self._kv_transfer_config
        self._cfg = ConnectorConfig.from_extra(ktc.kv_connector_extra_config)
        self._block_size = vllm_config.cache_config.block_size
        self._load_async = self._cfg.load_mode == "async"
        if ktc.kv_load_failure_policy != "recompute":
            # A pool is a cache: a block it lost is recomputed, never a failed request.
            ktc.kv_load_failure_policy = "recompute"
        groups = kv_cache_config.kv_cache_groups if kv_cache_config is not None else []
        if len(groups) != 1:
            raise InvalidRequestError(
                f"kvstore connector: models with {len(groups)} KV cache groups are not supported"
            )
        self._layer_names: list[str] = list(groups[0].layer_names)
        tp_rank = 0
        if role == KVConnectorRole.WORKER:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            tp_rank = get_tensor_model_parallel_rank()
        self._geometry = geometry_for(vllm_config)
        # The scheduler looks up with rank 0's namespace: every rank saves the same blocks.
        self.namespace = namespace_for(
            vllm_config, len(self._layer_names), tp_rank, self._cfg.salt, self._geometry
        )
        self._counters = Counters()
        self._pool = Pool(self._cfg, self.namespace, self._counters)
        self._scheduler: KVStoreScheduler | None = None
        self._worker: KVStoreWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = KVStoreScheduler(
                self._pool, self._counters, self._block_size, ktc.kv_role, self._load_async
            )
        if role == KVConnectorRole.WORKER:
            self._worker = KVStoreWorker(
                self._cfg, self.namespace, self._layer_names, self._pool, self._counters
            )
        # The scheduler side exists once per engine (the workers once per rank): it alone
        # registers the engine, so a router sees one registration per engine.
        self._announcer: EngineAnnouncer | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._announcer = self._start_announcer(vllm_config, ktc.kv_role)
            if self._announcer is not None:
                self._revoke_on_signal()
        logger.info(
            "kvstore connector: role %s, pool %s, namespace %s (block size %d, %s loads)",
            ktc.kv_role,
            self._cfg.master,
            self.namespace.digest.hex()[:16],
            self._block_size,
            self._cfg.load_mode,
        )

    def _start_announcer(self, vllm_config: VllmConfig, kv_role: str) -> EngineAnnouncer | None:
        """Register the engine in etcd (``advertise_url``) from a background thread: etcd
        being down never holds vLLM; the announcer logs once and retries."""
        events = vllm_config.kv_events_config
        endpoint = (
            events.endpoint
            if events is not None and events.enable_kv_cache_events and events.publisher == "zmq"
            else None
        )
        served = vllm_config.model_config.served_model_name
        if isinstance(served, list):
            served = served[0] if served else None
        record = self._cfg.engine_record(kv_role, served, self._block_size, endpoint)
        endpoints = self._cfg.registry_endpoints
        if record is None or endpoints is None:
            return None
        announcer = EngineAnnouncer(
            endpoints,
            record,
            prefix=self._cfg.engines_prefix,
            instance=self._cfg.engine_instance,
            ttl_s=self._cfg.engine_ttl_s,
        )
        logger.info(
            "kvstore connector: registering %s (%s) in etcd under %s",
            record.url,
            record.role,
            self._cfg.engines_prefix,
        )
        return announcer.start()

    def _revoke_on_signal(self) -> None:
        """Revoke the registration on the first SIGTERM / SIGINT, then let vLLM's handler run.

        Why not only in :meth:`shutdown`: vLLM 0.32's engine core resets these signals to their
        default action before it tears down, and its API server signals it again, so a stop
        by signal kills the process before the connectors' ``shutdown`` runs. The revocation
        is bounded (1 s); a later kill leaves the key to its lease.
        """
        if threading.current_thread() is not threading.main_thread():
            return  # only the main thread may install handlers; the lease still expires
        for sig in (signal.SIGTERM, signal.SIGINT):
            previous = signal.getsignal(sig)

            def handler(signum: int, frame: Any, previous: Any = previous) -> None:
                announcer = self._announcer
                if announcer is not None:
                    announcer.stop(timeout=1.0)
                if callable(previous):
                    previous(signum, frame)
                elif previous == signal.SIG_DFL:  # what would have happened without us
                    signal.signal(signum, signal.SIG_DFL)
                    os.kill(os.getpid(), signum)

            signal.signal(sig, handler)

    # ---------------------------------------------------------------- stats
    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats:
        return KVStoreConnectorStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVConnectorPromMetrics:
        return KVStorePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        data = self._counters.take()
        return KVStoreConnectorStats(data=data) if data else None

    # ================================================================ scheduler side
    def _plan(self) -> KVStoreScheduler:
        assert self._scheduler is not None, "a scheduler-side call on a worker-side connector"
        return self._scheduler

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return self._plan().get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        self._plan().update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self._plan().build_connector_meta(scheduler_output)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self._plan().request_finished(request, block_ids)

    # ================================================================ worker side
    def _work(self) -> KVStoreWorker:
        assert self._worker is not None, "a worker-side call on a scheduler-side connector"
        return self._worker

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Map the paged cache of every layer to block views, whatever its layout.

        Raises:
            InvalidRequestError: a layout or backend the connector cannot serve (one line
                naming both), or a size mismatch.
        """
        from vllm.distributed.kv_transfer.kv_connector.utils import get_current_attn_backends

        backends = get_current_attn_backends(self._vllm_config, list(self._layer_names))
        names = sorted({b.get_name() for b in backends})
        if len(names) != 1:
            raise InvalidRequestError(
                f"kvstore connector: layers use attention backends {names}; one expected"
            )
        layout = getattr(self._vllm_config.cache_config, "kv_cache_layout", None)
        self._work().register_kv_caches(kv_caches, names[0], self._geometry, layout)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        """Store the blocks of requests preempted in this step before the forward reuses them
        (``vllm_scheduler``: they resume by loading them)."""
        if isinstance(kv_connector_metadata, KVStoreConnectorMetadata):
            self._work().save_preempted(kv_connector_metadata.preempted)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        self._work().start_load_kv(meta.loads if isinstance(meta, KVStoreConnectorMetadata) else [])

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._work().wait_for_layer_load(layer_name)

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: AttentionMetadata,
        **kwargs: Any,
    ) -> None:
        meta = self._get_connector_metadata()
        saves = meta.saves if isinstance(meta, KVStoreConnectorMetadata) else []
        self._work().save_kv_layer(saves, layer_name)

    def wait_for_save(self) -> None:
        self._work().wait_for_save()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return self._work().get_finished(finished_req_ids)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._work().get_block_ids_with_load_errors()

    def shutdown(self) -> None:
        if self._announcer is not None:  # a clean stop: the registration goes at once
            self._announcer.stop()
            self._announcer = None
        if self._worker is not None:
            self._worker.close()
        self._pool.close()


__all__ = [
    "STAT_NAMES",
    "KVStoreConnector",
    "KVStoreConnectorMetadata",
    "KVStoreConnectorStats",
    "KVStorePromMetrics",
    "KVStoreScheduler",
    "KVStoreWorker",
]
