"""vLLM KV connector: vLLM instances save prompt KV into the pool and load cached prefixes back.

Use from vLLM 0.32 (``KVConnectorBase_V1``)::

    python -m vllm.entrypoints.openai.api_server --model M --kv-transfer-config \\
      '{"kv_connector":"KVStoreConnector","kv_connector_module_path":"kvstore.client.adapters.vllm",
        "kv_role":"kv_both","kv_connector_extra_config":{"master":"127.0.0.1:7700"}}'

Mapping (see docs/adapters.md, "vLLM"):

- One vLLM block is one pool block object: the namespace's block size IS vLLM's ``--block-size``.
  vLLM only accepts block-aligned external hits and reports load failures per block id, so a
  1:1 mapping makes a hit, a load and a failure the same unit, with no splitting or merging of
  objects and one checksum per vLLM block.
- The object keeps kvstore's documented layout (layer-major; per layer K then V, each
  ``[block_size, kv_heads, head_size]``), so any kvstore KV client reads it. vLLM's CPU cache is
  ``[num_blocks, kv_heads, 2 * block_size, head_size]`` (per head K rows then V rows): a save is
  one strided tensor copy per layer and run of blocks, a load one transposing copy per layer and
  block (no per-token Python).
- Scheduler: ``get_num_new_matched_tokens`` asks the prefix index once per request (no read
  leases), never offers the prompt's last token, counts only blocks beyond vLLM's local hit.
- Worker: saves are handed off layer by layer to a background thread as ``save_kv_layer`` comes;
  ``wait_for_save`` waits for what is still in flight (so a producer's answer leaves after its KV
  is in the pool). Loads locate a step's blocks in one master call; blocks in a same-host node's
  shared memory are copied straight from it into vLLM's cache (no staging copy:
  ``Client.read_in_place``), the others come in one batched read; every block is verified by
  checksum; a failed block is reported by ``get_block_ids_with_load_errors`` and
  vLLM recomputes it (the connector sets ``kv_load_failure_policy`` to ``recompute``).
- The pool unreachable: one warning line, a counter (``vllm:kvstore_pool_unavailable``), and vLLM
  recomputes; the connector retries the pool after ``retry_s``.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
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
from vllm.logger import init_logger

from kvstore import auth
from kvstore.client.adapters.vllm_config import ConnectorConfig, engine_namespace, kv_dtype_from
from kvstore.client.adapters.vllm_layouts import BlockViews, CacheGeometry, block_views
from kvstore.client.client import Client
from kvstore.client.inplace import InPlaceReads
from kvstore.client.kvcache import KVCache
from kvstore.client.reads import LocatedRead
from kvstore.engine_registry import EngineAnnouncer
from kvstore.errors import (
    InvalidRequestError,
    KVStoreError,
    KVTimeoutError,
    MasterUnavailableError,
    NodeUnavailableError,
    UnauthenticatedError,
)
from kvstore.keys import DTYPE_BYTES, Namespace
from kvstore.kvblocks import checksum_table_bytes
from kvstore.types import ObjectInfo

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

# Under "vllm." so that vLLM's logging config (level, format, process prefix) applies to our lines.
logger = init_logger("vllm.kvstore_connector")

#: Staging kept between steps up to this size (larger steps allocate their own).
MAX_KEPT_STAGING = 512 << 20

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


# ==================================================================== counters
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


class _Counters:
    """Thread-safe counters, taken (and zeroed) by each ``get_kv_connector_stats``."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._data: dict[str, float] = {}
        self.totals: dict[str, float] = {}

    def add(self, **values: float) -> None:
        with self._lock:
            for k, v in values.items():
                self._data[k] = self._data.get(k, 0) + v
                self.totals[k] = self.totals.get(k, 0) + v

    def take(self) -> KVStoreConnectorStats | None:
        with self._lock:
            data, self._data = self._data, {}
        return KVStoreConnectorStats(data=data) if any(data.values()) else None


# ==================================================================== the pool, with a breaker
_UNREACHABLE = (KVStoreError, OSError)


class _Pool:
    """The client and KV view, connected lazily; while the pool is unreachable, ``get`` says so
    at once (no call waits on a dead pool) and is retried after ``retry_s``.

    One warning line when the pool goes, one info line when it comes back.
    """

    def __init__(self, cfg: ConnectorConfig, namespace: Namespace, counters: _Counters) -> None:
        self.cfg = cfg
        self.namespace = namespace
        self._counters = counters
        self._lock = threading.Lock()
        self._kv: KVCache | None = None
        self._down_until = 0.0
        self._down = False

    def get(self) -> KVCache | None:
        """The KV view, or None while the pool is unreachable (the caller recomputes)."""
        with self._lock:
            if self._kv is not None:
                return self._kv
            if time.monotonic() < self._down_until:
                return None
        try:
            token = auth.load_token(self.cfg.token_file)
            client = Client.connect(self.cfg.master, timeout=self.cfg.timeout_s, token=token)
        except _UNREACHABLE as exc:
            self.failed(exc)
            return None
        kv = KVCache(client, self.namespace)
        with self._lock:
            if self._kv is None:
                self._kv, kv = kv, None  # type: ignore[assignment]
            was_down, self._down = self._down, False
            current = self._kv
        if kv is not None:  # another thread connected meanwhile
            kv.close()
            kv.client.close()
        if was_down:
            logger.info("kvstore: pool at %s reachable again", self.cfg.master)
        return current

    def failed(self, exc: BaseException) -> None:
        """Record that a pool call failed for want of the pool: serve without it for a while."""
        self._counters.add(pool_unavailable=1)
        with self._lock:
            kv, self._kv = self._kv, None
            first = not self._down
            self._down = True
            self._down_until = time.monotonic() + self.cfg.retry_s
        if kv is not None:
            kv.close()
            kv.client.close()
        if first:
            logger.warning(
                "kvstore: pool at %s unreachable (%s: %s); vLLM keeps serving by recomputing, "
                "retrying the pool every %.0fs",
                self.cfg.master,
                type(exc).__name__,
                exc,
                self.cfg.retry_s,
            )

    def close(self) -> None:
        with self._lock:
            kv, self._kv = self._kv, None
        if kv is not None:
            kv.close()
            kv.client.close()


def _is_unreachable(err: BaseException) -> bool:
    return isinstance(
        err,
        MasterUnavailableError
        | KVTimeoutError
        | NodeUnavailableError
        | UnauthenticatedError
        | OSError,
    )


# ==================================================================== metadata


def _runs(src: Iterable[int], dst: Iterable[int]) -> list[tuple[int, int, int]]:
    """``(src start, dst start, length)`` of the stretches where both indices go up by one.

    Why: one strided ``copy_`` of a run of blocks moves KV between the staging rows and vLLM's
    paged cache 2-3x faster than an ``index_put`` of the same blocks (which materialises the
    permuted source first), and vLLM hands out a prompt's blocks mostly in consecutive runs.
    """
    runs: list[list[int]] = []
    for s, d in zip(src, dst, strict=True):
        if runs and s == runs[-1][0] + runs[-1][2] and d == runs[-1][1] + runs[-1][2]:
            runs[-1][2] += 1
        else:
            runs.append([s, d, 1])
    return [(s, d, n) for s, d, n in runs]


@dataclass
class _Transfer:
    """Blocks ``first .. first + len(block_ids)`` of a prompt, to load or save.

    ``tokens`` is the prompt up to the end of the last of them (the keys chain over it).
    """

    req_id: str
    tokens: np.ndarray
    first: int
    block_ids: list[int]


@dataclass
class _Loaded:
    """One load's blocks on their way into vLLM's cache (see ``KVStoreConnector._read``).

    ``planes[i]``: block ``block_ids[i]``'s KV, typed (``KVStoreConnector._typed``), a view of a
    staging row or of the node's shared memory; None: not (yet) read, or failed.
    ``in_place``: block index -> its index in ``inplace``, for the blocks read in place.
    ``infos``: the answers whose read leases this load holds until it is done.
    """

    block_ids: list[int]
    planes: list[np.ndarray | None]
    started: float
    client: Client | None = None
    infos: list[ObjectInfo] = field(default_factory=list)
    inplace: InPlaceReads | None = None
    in_place: dict[int, int] = field(default_factory=dict)
    read_s: float = 0.0
    copy_s: float = 0.0


@dataclass
class KVStoreConnectorMetadata(KVConnectorMetadata):
    """What the scheduler tells the workers for one step."""

    loads: list[_Transfer] = field(default_factory=list)
    saves: list[_Transfer] = field(default_factory=list)


@dataclass
class _SaveState:
    tokens: np.ndarray
    block_ids: list[int]
    saved: int  # blocks known to be in the pool (looked up or saved by us)


# ==================================================================== worker side
class KVStoreWorker:
    """The connector's worker side (one per TP rank): the registered cache as block views,
    layer-wise or asynchronous loads, saves handed off layer by layer. Knows no vLLM config,
    so tests drive it on caches allocated by vLLM's own helpers.

    Args:
        cfg: the connector's extra config.
        namespace: this rank's namespace.
        layer_names: the attention layers, in order.
        pool: the pool (shared with the facade's counters).
        counters: where loads and saves are counted.
    """

    def __init__(
        self,
        cfg: ConnectorConfig,
        namespace: Namespace,
        layer_names: list[str],
        pool: _Pool,
        counters: _Counters,
    ) -> None:
        self.namespace = namespace
        self._block_size = namespace.block_size
        self._layer_names = list(layer_names)
        self._load_async = cfg.load_mode == "async"
        self._pool = pool
        self._counters = counters
        self._views: BlockViews | None = None  # set by register_kv_caches
        self._kv_np: list[np.ndarray] = []  # per layer, integer-typed, for host caches
        self._layer_index: dict[str, int] = {}
        self._io = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvstore-io")
        self._saver = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvstore-save")
        self._lock = threading.Lock()
        self._load_errors: set[int] = set()
        self._recving: dict[str, tuple[Future[set[int]], _Transfer]] = {}
        self._sync_read: Future[set[int]] | None = None
        self._layer_ready: list[threading.Event] = []
        self._save_staging: torch.Tensor | None = None
        self._save_runs: list[tuple[int, int, int]] = []
        self._save_futures: list[Future[None]] = []

    def register_kv_caches(
        self, kv_caches: Mapping[str, Any], backend: str, geometry: CacheGeometry
    ) -> None:
        """Map each layer's paged cache to block views (:mod:`.vllm_layouts`).

        Args:
            kv_caches: what vLLM registers, by layer name (any layout of ``vllm_layouts``).
            backend: the attention backend's name.
            geometry: what one layer holds on this rank.

        Raises:
            InvalidRequestError: a layout, backend, dtype or size this connector cannot serve
                (one line naming the layout and the backend).
        """
        ns = self.namespace
        names = [n for n in self._layer_names if n in kv_caches]
        if len(names) != ns.num_layers:
            raise InvalidRequestError(
                f"kvstore connector: {len(names)} KV layers registered, {ns.num_layers} expected"
            )
        views = block_views([kv_caches[n] for n in names], geometry, backend)
        if views.itemsize != DTYPE_BYTES[ns.dtype]:
            raise InvalidRequestError(
                f"kvstore connector: KV cache layout {views.layout} of backend {backend} holds "
                f"{views.dtype} elements; the namespace says {ns.dtype}"
            )
        self._views = views
        self._layer_index = {n: i for i, n in enumerate(names)}
        self._dtype = views.dtype
        self._itemsize = views.itemsize
        self._int_views = views.as_int()
        self._np_dtype = self._int_views[0].numpy().dtype if views.device.type == "cpu" else None
        # Loads into a host cache copy with numpy (see _copy); a device cache takes torch copies.
        self._kv_np = views.host_int_views() if views.device.type == "cpu" else []
        self._obj_shape = (ns.num_layers, 2, ns.block_size, ns.num_kv_heads, ns.head_dim)
        self._block_nbytes = views.block_nbytes
        # One staging row is one whole pool object: the planes, then the block's checksum table
        # (kvstore.kvblocks), so reads and saves move objects without another copy.
        self._object_nbytes = self._block_nbytes + checksum_table_bytes(
            2 * ns.num_layers, ns.block_size
        )
        self._bufs: dict[str, torch.Tensor] = {}
        logger.info(
            "kvstore connector: KV cache layout %s of backend %s, %s on %s",
            views.layout,
            backend,
            views.dtype,
            views.device,
        )

    def _staging(self, num_blocks: int, kind: str) -> torch.Tensor:
        """Staging rows ``[num_blocks, object bytes]`` (uint8) for ``kind`` (``load``/``save``):
        each row one whole pool object; :meth:`_planes` is its typed view of the KV.

        Reused between steps, already faulted in: a fresh 50 MB tensor per step cost as much
        as the pool read itself (page faults). One per kind is enough: loads run one at a time
        on the io thread, saves one step at a time. Steps larger than ``MAX_KEPT_STAGING``
        bytes get a tensor of their own.
        """
        buf = self._bufs.get(kind)
        nbytes = num_blocks * self._object_nbytes
        if buf is not None and len(buf) >= num_blocks:
            return buf[:num_blocks]
        if nbytes > MAX_KEPT_STAGING:
            return torch.empty((num_blocks, self._object_nbytes), dtype=torch.uint8)
        # zeros, not empty: every page is touched (faulted) once, here, not in each step.
        buf = torch.zeros(
            (max(num_blocks, 2 * (len(buf) if buf is not None else 0)), self._object_nbytes),
            dtype=torch.uint8,
        )
        self._bufs[kind] = buf
        return buf[:num_blocks]

    def _planes(self, rows: torch.Tensor) -> torch.Tensor:
        """The KV of staging rows, typed: ``[n, layers, 2, block_size, heads, head]`` (a view)."""
        return rows[:, : self._block_nbytes].view(self._dtype).view(len(rows), *self._obj_shape)

    # ---------------------------------------------------------------- loads
    def _read(self, loads: list[_Transfer]) -> _Loaded:
        """Locate the blocks of ``loads`` (one master call, read leases taken); those in a
        same-host node's shared memory stay there, to be copied straight into vLLM's cache
        (:mod:`kvstore.client.inplace`), the others are read into staging rows (one batched
        read, verified by checksum). Never raises: whatever goes wrong is a failed block,
        which vLLM recomputes."""
        block_ids = [b for t in loads for b in t.block_ids]
        loaded = _Loaded(block_ids, [None] * len(block_ids), time.perf_counter())
        try:
            self._read_into(loads, loaded)
        except Exception as exc:  # noqa: BLE001 - the forward must go on: recompute instead
            logger.warning(
                "kvstore: load failed (%s: %s); vLLM recomputes", type(exc).__name__, exc
            )
            loaded.planes = [None] * len(block_ids)
            loaded.in_place = {}
        return loaded

    def _read_into(self, loads: list[_Transfer], loaded: _Loaded) -> None:
        kv = self._pool.get()
        if kv is None:
            return
        keys: list[bytes] = []
        for t in loads:
            keys.extend(kv.block_object_keys(t.tokens)[t.first : t.first + len(t.block_ids)])
        try:
            answers = kv.client.batch_locate(keys)
        except _UNREACHABLE as exc:
            if _is_unreachable(exc):
                self._pool.failed(exc)
            else:
                logger.warning("kvstore: load failed (%s); vLLM recomputes", exc)
            return
        loaded.client = kv.client
        # A block's own error (evicted, its node gone, checksum) fails that block only: the
        # pool as a whole stays in use (other nodes may hold the next prompt's blocks).
        loaded.infos = [a for a in answers if isinstance(a, ObjectInfo)]
        found = [
            (i, a)
            for i, a in enumerate(answers)
            if isinstance(a, ObjectInfo) and a.size == self._object_nbytes
        ]
        loaded.inplace = kv.client.read_in_place([a for _, a in found])
        rest: list[tuple[int, ObjectInfo]] = []
        for j, (i, info) in enumerate(found):
            if loaded.inplace.mapped(j):
                loaded.in_place[i] = j
            else:
                rest.append((i, info))
        if rest:
            rows = self._staging(len(rest), "load").numpy()
            reads = [
                LocatedRead(info, memoryview(row))
                for (_, info), row in zip(rest, rows, strict=False)
            ]
            kv.client.batch_read_located(reads)
            for (i, _), rd, row in zip(rest, reads, rows, strict=False):
                if rd.result == self._object_nbytes:
                    loaded.planes[i] = self._typed(row)
        loaded.read_s = time.perf_counter() - loaded.started

    def _typed(self, obj: Any) -> np.ndarray:
        """The KV of one pool object (its bytes), typed: ``[layers, 2, block_size, heads,
        head]`` in an integer type of the cache's element size (numpy has no bfloat16; the
        copy moves bits), a view."""
        flat = np.frombuffer(obj, dtype=self._np_dtype, count=self._block_nbytes // self._itemsize)
        return flat.reshape(self._obj_shape)

    def _copy(self, loaded: _Loaded) -> None:
        """Copy the loaded blocks into vLLM's paged cache, block by block, every layer of a
        block at once: a block read in place is checked (checksum) just before, so its bytes
        are copied while still in cache from the check. Per layer, one transposing copy,
        object ``[2, bs, heads, head]`` -> the cache's strided block view, with numpy: for
        these 24 KiB copies torch's per-call cost made a 2K prompt's copy 13 ms against 7 ms
        (SmolLM2, measured apart)."""
        t0 = time.perf_counter()
        inplace, kv_np = loaded.inplace, self._kv_np
        for i, block in enumerate(loaded.block_ids):
            planes = loaded.planes[i]
            j = loaded.in_place.get(i)
            if j is not None and inplace is not None:
                view = inplace.view(j)
                planes = loaded.planes[i] = self._typed(view) if view is not None else None
            if planes is None:
                continue
            if kv_np:
                for layer, dst in enumerate(kv_np):
                    np.copyto(dst[block], planes[layer])
            else:
                for layer, dev in enumerate(self._int_views):
                    dev[block].copy_(torch.from_numpy(planes[layer]))
        loaded.copy_s += time.perf_counter() - t0

    def _finish(self, loaded: _Loaded) -> set[int]:
        """After the copies: drop the blocks read in place if their grants ran out meanwhile,
        give the leases back, count; returns the ids of the blocks that failed."""
        inplace = loaded.inplace
        if inplace is not None:
            if not inplace.intact():  # a copy may have raced a reuse of the space
                for i in loaded.in_place:
                    loaded.planes[i] = None
            inplace.close()
        if loaded.client is not None and loaded.infos:
            loaded.client.release_leases(loaded.infos)
        failed = {b for p, b in zip(loaded.planes, loaded.block_ids, strict=True) if p is None}
        good = len(loaded.block_ids) - len(failed)
        in_place = sum(1 for i in loaded.in_place if loaded.planes[i] is not None)
        loaded.planes = []  # (views of released memory: never kept)
        self._counters.add(
            loaded_tokens=good * self._block_size,
            loaded_bytes=good * self._object_nbytes,
            loaded_in_place_bytes=in_place * self._object_nbytes,
            load_seconds=loaded.read_s + loaded.copy_s,
            copy_seconds=loaded.copy_s,
            load_errors=len(failed),
        )
        if failed and loaded.client is not None:
            logger.warning(
                "kvstore: %d of %d blocks failed to load; vLLM recomputes them",
                len(failed),
                len(loaded.block_ids),
            )
        return failed

    def _load_now(self, loads: list[_Transfer]) -> set[int]:
        loaded = self._read(loads)
        try:
            self._copy(loaded)
        finally:
            failed = self._finish(loaded)
        return failed

    def start_load_kv(self, meta: KVConnectorMetadata | None) -> None:
        """Start this step's loads on the io thread: in ``layer`` mode one load for all of
        them while the step starts, the forward's ``wait_for_layer_load`` waiting for it; in
        ``async`` mode one load per request, reported by ``get_finished``.

        Why the layer-mode load sets every layer's event at once, after its copy, rather than
        each layer's as it is copied: the copy goes block by block, so that a block read in
        place is copied while still in cache from its checksum (one pass over memory, not
        two; the whole load of a 2K-token prompt is then ~20 ms here), and with the copy done
        in one go the forward never shares a core with it."""
        if not isinstance(meta, KVStoreConnectorMetadata) or not meta.loads:
            return
        if self._load_async:
            for t in meta.loads:
                self._recving[t.req_id] = (self._io.submit(self._load_now, [t]), t)
            return
        self._layer_ready = [threading.Event() for _ in self._views.layers]
        self._sync_read = self._io.submit(self._load_layerwise, meta.loads, self._layer_ready)

    def _load_layerwise(self, loads: list[_Transfer], ready: list[threading.Event]) -> set[int]:
        """:meth:`_load_now`, setting every layer's event when the copy is done, or when it
        failed (the forward never waits on a load that died: its blocks are reported
        instead)."""
        failed = {b for t in loads for b in t.block_ids}
        try:
            failed = self._load_now(loads)
        except Exception as exc:  # noqa: BLE001 - recomputed, never raised into the forward
            logger.warning(
                "kvstore: load failed (%s: %s); vLLM recomputes", type(exc).__name__, exc
            )
        finally:
            for event in ready:
                event.set()
        return failed

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Wait until the layer's loaded blocks are in the paged cache (bounded by the pool
        calls' own timeouts: the io thread sets every event whatever happens)."""
        if self._sync_read is None:
            return
        layer = self._layer_index.get(layer_name)
        if layer is not None:
            self._layer_ready[layer].wait()

    def _finish_sync_load(self) -> None:
        """At the end of the step: the load is over; collect its failed blocks."""
        if self._sync_read is None:
            return
        failed = self._sync_read.result()
        self._sync_read = None
        with self._lock:
            self._load_errors |= failed

    # ---------------------------------------------------------------- saves
    def save_kv_layer(self, meta: KVConnectorMetadata | None, layer_name: str) -> None:
        """Hand this layer's new prompt blocks to the save thread (the forward goes on)."""
        if not isinstance(meta, KVStoreConnectorMetadata) or not meta.saves:
            return
        layer = self._layer_index.get(layer_name)
        if layer is None:
            return
        if self._save_staging is None:
            ids = [b for t in meta.saves for b in t.block_ids]
            self._save_staging = self._staging(len(ids), "save")
            self._save_runs = _runs(range(len(ids)), ids)
        staging, runs = self._save_staging, self._save_runs
        planes = self._planes(staging)
        views = self._views

        def gather() -> None:
            # The staging was made inside the forward's inference mode: only inference mode may
            # write it.
            with torch.inference_mode():
                views.gather(layer, planes[:, layer], runs)

        gathers = self._save_futures
        gathers.append(self._saver.submit(gather))
        if layer == len(self._views.layers) - 1:
            pending = list(gathers)

            def put() -> None:
                for f in pending:
                    f.result()  # a gather that failed: store nothing (its rows are garbage)
                self._put(meta.saves, staging)

            gathers.append(self._saver.submit(put))

    def _put(self, saves: list[_Transfer], staging: torch.Tensor) -> None:
        kv = self._pool.get()
        if kv is None:
            return
        t0 = time.perf_counter()
        rows = staging.numpy()  # whole object rows: put_blocks writes their checksum tables
        pos = saves_done = 0
        try:
            for t in saves:
                n = len(t.block_ids)
                kv.put_blocks(t.tokens, t.first, rows[pos : pos + n])
                pos += n
                saves_done += n
        except KVStoreError as exc:
            if _is_unreachable(exc):
                self._pool.failed(exc)
            else:
                logger.warning("kvstore: save failed (%s); those blocks stay uncached", exc)
        except OSError as exc:
            self._pool.failed(exc)
        self._counters.add(
            saved_tokens=saves_done * self._block_size,
            saved_bytes=saves_done * kv.block_nbytes,
            save_seconds=time.perf_counter() - t0,
        )

    def wait_for_save(self) -> None:
        """Wait for this step's saves still in flight (their source blocks may be reused once
        the step is over)."""
        self._finish_sync_load()
        futures, self._save_futures = self._save_futures, []
        for f in futures:
            try:
                f.result()
            except Exception as exc:  # noqa: BLE001 - a failed save is a future miss, not an error
                logger.warning("kvstore: save failed (%s: %s)", type(exc).__name__, exc)
        self._save_staging = None
        self._save_runs = []

    # ---------------------------------------------------------------- completion, errors
    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Requests whose asynchronous load is over (intact or not: failures are reported as
        block errors in the same step)."""
        if not self._recving:
            return None, None
        done: set[str] = set()
        for rid, (fut, transfer) in list(self._recving.items()):
            if fut.done():
                del self._recving[rid]
                try:
                    failed = fut.result()
                except Exception as exc:  # noqa: BLE001 - reported as errors, recomputed
                    logger.warning("kvstore: load failed (%s: %s)", type(exc).__name__, exc)
                    failed = set(transfer.block_ids)
                with self._lock:
                    self._load_errors |= failed
                done.add(rid)
        return None, done or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Blocks whose load failed since the last call; vLLM recomputes them."""
        with self._lock:
            errors, self._load_errors = self._load_errors, set()
        return errors

    def close(self) -> None:
        """Finish the io and save threads."""
        self._io.shutdown(wait=True)
        self._saver.shutdown(wait=True)


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
        self._can_load = ktc.kv_role in ("kv_both", "kv_consumer")
        self._can_save = ktc.kv_role in ("kv_both", "kv_producer")
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
        self._counters = _Counters()
        self._pool = _Pool(self._cfg, self.namespace, self._counters)
        # scheduler side
        self._hits: dict[str, int] = {}  # req_id -> prompt blocks the pool holds (looked up once)
        self._local: dict[str, int] = {}  # req_id -> tokens vLLM had locally at the lookup
        self._pending_loads: dict[str, _Transfer] = {}
        self._saving: dict[str, _SaveState] = {}
        self._worker: KVStoreWorker | None = None
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
        return self._counters.take()

    # ================================================================ scheduler side
    def _lookup(self, tokens: np.ndarray) -> int:
        """Full prompt blocks the pool holds (one master call, no leases); 0 without a pool."""
        kv = self._pool.get()
        if kv is None:
            return 0
        try:
            hit = kv.lookup(tokens)
        except KVStoreError as exc:
            if _is_unreachable(exc):
                self._pool.failed(exc)
            else:
                logger.warning("kvstore: lookup failed (%s); recomputing", exc)
            return 0
        except OSError as exc:
            self._pool.failed(exc)
            return 0
        self._counters.add(lookups=1)
        return hit // self._block_size

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """Tokens the pool can add beyond vLLM's ``num_computed_tokens`` (block-aligned, never
        the prompt's last token), and whether they load asynchronously."""
        if not (self._can_load or self._can_save):
            return 0, False
        prompt = request.prompt_token_ids
        if not prompt:
            return 0, False
        rid = request.request_id
        hit = self._hits.get(rid)
        if hit is None:
            bs = self._block_size
            tokens = np.asarray(prompt[: len(prompt) // bs * bs], dtype=np.uint32)
            hit = self._lookup(tokens) if len(tokens) else 0
            self._hits[rid] = hit
        self._local[rid] = num_computed_tokens
        if not self._can_load:
            return 0, False
        offer = min(hit, (len(prompt) - 1) // self._block_size) * self._block_size
        ext = offer - num_computed_tokens
        if ext <= 0:
            return 0, False
        self._counters.add(hit_tokens=ext)
        return ext, self._load_async

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        """Plan the load of the blocks vLLM allocated for the pool's tokens."""
        if num_external_tokens <= 0:
            return
        rid = request.request_id
        local = self._local.get(rid, 0)
        bs = self._block_size
        first, end = local // bs, (local + num_external_tokens) // bs
        block_ids = list(blocks.get_block_ids()[0])
        prompt = request.prompt_token_ids or []
        self._pending_loads[rid] = _Transfer(
            rid, np.asarray(prompt[: end * bs], dtype=np.uint32), first, block_ids[first:end]
        )

    def _plan_save(
        self, meta: KVStoreConnectorMetadata, rid: str, st: _SaveState, end_token: int
    ) -> None:
        full = min(end_token, len(st.tokens)) // self._block_size
        full = min(full, len(st.block_ids))
        if full > st.saved:
            meta.saves.append(
                _Transfer(
                    rid,
                    st.tokens[: full * self._block_size],
                    st.saved,
                    st.block_ids[st.saved : full],
                )
            )
            st.saved = full

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        """This step's loads (planned at allocation) and saves (prompt blocks this step fills
        that the pool does not hold yet)."""
        meta = KVStoreConnectorMetadata(loads=list(self._pending_loads.values()))
        self._pending_loads.clear()
        if not self._can_save:
            return meta
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            prompt = new.prompt_token_ids
            if not prompt or not new.block_ids:
                continue
            st = _SaveState(
                np.asarray(prompt, dtype=np.uint32),
                list(new.block_ids[0]),
                self._hits.get(new.req_id, 0),
            )
            self._saving[new.req_id] = st
            self._plan_save(
                meta, new.req_id, st, new.num_computed_tokens + scheduled.get(new.req_id, 0)
            )
        cached = scheduler_output.scheduled_cached_reqs
        resumed = getattr(cached, "resumed_req_ids", set())
        for i, rid in enumerate(cached.req_ids):
            st = self._saving.get(rid)
            if st is None:
                continue
            new_ids = cached.new_block_ids[i]
            if new_ids is not None:
                if rid in resumed:
                    st.block_ids = list(new_ids[0])
                else:
                    st.block_ids.extend(new_ids[0])
            if st.saved * self._block_size >= len(st.tokens) // self._block_size * self._block_size:
                continue
            self._plan_save(meta, rid, st, cached.num_computed_tokens[i] + scheduled.get(rid, 0))
        return meta

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Forget the request. Saves finish within their step, so no block is held past it."""
        rid = request.request_id
        self._hits.pop(rid, None)
        self._local.pop(rid, None)
        self._saving.pop(rid, None)
        self._pending_loads.pop(rid, None)
        return False, None

    # ================================================================ worker side
    def _work(self) -> KVStoreWorker:
        assert self._worker is not None, "a worker-side call on the scheduler-side connector"
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
        self._work().register_kv_caches(kv_caches, names[0], self._geometry)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        self._work().start_load_kv(self._get_connector_metadata())

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._work().wait_for_layer_load(layer_name)

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: AttentionMetadata,
        **kwargs: Any,
    ) -> None:
        self._work().save_kv_layer(self._get_connector_metadata(), layer_name)

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
