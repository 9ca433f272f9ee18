"""SGLang HiCache's third tier on kvstore: ``KVStoreHiCacheStorage``, a ``HiCacheStorage``.

Written against ``sglang==0.5.23``. SGLang loads it through its dynamic storage backend::

    python -m sglang.launch_server ... --enable-hierarchical-cache \\
        --hicache-storage-backend dynamic \\
        --hicache-storage-backend-extra-config '{"backend_name": "kvstore",
            "module_path": "kvstore.client.adapters.sglang",
            "class_name": "KVStoreHiCacheStorage", "interface_v1": 1,
            "master": "10.0.0.5:7700"}'

and constructs it as ``cls(storage_config, kwargs)``. ``extra_config`` keys read here:
``master`` (``HOST:PORT`` or ``etcd://...``; default ``$KVSTORE_MASTER``), ``token`` (default
``$KVSTORE_TOKEN`` / ``$KVSTORE_TOKEN_FILE``), ``salt`` (tenant isolation), ``replicas`` (copies
per page, default 1), ``timeout`` (seconds per network wait). ``interface_v1`` is SGLang's own
switch: with it, SGLang calls the zero-copy ``batch_get_v1`` / ``batch_set_v1`` against the host
memory pool; without it, the tensor-based ``batch_get`` / ``batch_set``.

Keys are SGLang's page hashes under a namespace prefix made of the model name, tp rank and size
(left out for MLA models, whose KV is the same on every rank: one copy), pp / attention-cp /
dcp shards, the page layout and the salt. A page is one object, written whole. Its bytes are
the host pool's flat data page (``get_data_page(i, flat=True)``): the v1 path stores the pool's
zero-copy regions of a page (``get_page_buffer_meta``) in buffer-then-address order, which is
that same order for SGLang's MHA and MLA pools in ``layer_first``, ``page_first`` and
``page_first_direct``, so pages written by either path read back through the other. A page
that is one region (``page_first``-style MLA) is written and read in place; a page of several
regions (``layer_first``: one per layer, K and V) is gathered into one object on write and read
into a scratch buffer and scattered on read.

A page that cannot be read whole (missing, a dead node, a different size) is a miss: nothing
partial is reported as a hit.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import xxhash
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
    PoolHitPolicy,
    PoolName,
    PoolTransfer,
    PoolTransferResult,
)

from kvstore.client.client import Client
from kvstore.env import Env
from kvstore.errors import InvalidRequestError, KVStoreError

log = logging.getLogger(__name__)

#: The SGLang release this backend is written and tested against.
SUPPORTED_SGLANG = "0.5.23"

_REMOVE_BATCH = 1000


@dataclass
class _Metrics:
    """SGLang's ``StorageMetrics`` fields (used where its module cannot be imported)."""

    prefetch_pgs: list[int] = field(default_factory=list)
    backup_pgs: list[int] = field(default_factory=list)
    prefetch_bandwidth: list[float] = field(default_factory=list)
    backup_bandwidth: list[float] = field(default_factory=list)


def _flat_bytes(tensor: torch.Tensor, writable: bool) -> np.ndarray:
    """A uint8 numpy view of a contiguous CPU tensor's bytes (no copy).

    Raises:
        InvalidRequestError: not a tensor, not on the CPU, or not contiguous.
    """
    if not isinstance(tensor, torch.Tensor):
        raise InvalidRequestError(f"expected a torch.Tensor, got {type(tensor).__name__}")
    if tensor.device.type != "cpu":
        raise InvalidRequestError(f"HiCache host tensors live on the CPU, got {tensor.device}")
    if not tensor.is_contiguous():
        if writable:
            raise InvalidRequestError("target tensor must be contiguous")
        tensor = tensor.contiguous()
    return tensor.reshape(-1).view(torch.uint8).numpy()


class KVStoreHiCacheStorage(HiCacheStorage):
    """HiCache storage on a kvstore cluster (see the module docstring).

    Args:
        storage_config: SGLang's ``HiCacheStorageConfig`` (its ``extra_config`` names the
            cluster).
        kwargs: what SGLang's dynamic loader passes on (unused).

    Raises:
        InvalidRequestError: a malformed ``extra_config`` (bad types, no master address).
        MasterUnavailableError, UnauthenticatedError: the cluster cannot be reached or refuses.
    """

    def __init__(
        self, storage_config: HiCacheStorageConfig, kwargs: dict[str, Any] | None = None
    ) -> None:
        if not isinstance(storage_config, HiCacheStorageConfig):
            raise InvalidRequestError("storage_config must be SGLang's HiCacheStorageConfig")
        extra = storage_config.extra_config or {}
        if not isinstance(extra, dict):
            raise InvalidRequestError("extra_config must be a dict")
        master = extra.get("master") or Env.read().master
        if not isinstance(master, str) or not master:
            raise InvalidRequestError(
                "KVStoreHiCacheStorage needs extra_config['master'] (HOST:PORT or etcd://...)"
                " or $KVSTORE_MASTER"
            )
        token = extra.get("token")
        salt = extra.get("salt")
        replicas = extra.get("replicas", 1)
        timeout = extra.get("timeout", 30.0)
        if token is not None and not isinstance(token, str):
            raise InvalidRequestError("extra_config['token'] must be a string")
        if salt is not None and (not isinstance(salt, str) or not salt):
            raise InvalidRequestError("extra_config['salt'] must be a non-empty string")
        if not isinstance(replicas, int) or isinstance(replicas, bool) or replicas < 1:
            raise InvalidRequestError("extra_config['replicas'] must be an int >= 1")
        if not isinstance(timeout, int | float) or isinstance(timeout, bool) or timeout <= 0:
            raise InvalidRequestError("extra_config['timeout'] must be a positive number")
        self.storage_config = storage_config
        self.replicas = replicas
        self.enable_storage_metrics = bool(storage_config.enable_storage_metrics)
        self.prefix = self._namespace_prefix(storage_config, salt)
        self.mem_pool_host: Any = None
        self.registered_pools: dict[Any, Any] = {}
        self._regions: list[tuple[int, int, np.ndarray]] = []  # (address, nbytes, bytes view)
        self._metrics = _Metrics()
        self.client = Client.connect(master, timeout=float(timeout), token=token, lease_reads=True)

    @staticmethod
    def _namespace_prefix(cfg: HiCacheStorageConfig, salt: str | None) -> str:
        """Which pages may be shared: same model, same shard of the KV, same page layout."""
        scope: dict[str, Any] = {
            "model": "-".join(cfg.model_name.split("/")) if cfg.model_name else "",
            "layout": "page_first" if cfg.is_page_first_layout else "layer_first",
            "salt": salt,
        }
        if not cfg.is_mla_model:  # MLA's KV is replicated on every tp rank: one copy
            scope["tp"] = [cfg.tp_rank, cfg.tp_size]
        if cfg.pp_size > 1:
            scope["pp"] = [cfg.pp_rank, cfg.pp_size]
        if cfg.attn_cp_size > 1:
            scope["cp"] = [cfg.attn_cp_rank, cfg.attn_cp_size]
        if cfg.dcp_size > 1:
            scope["dcp"] = [cfg.tp_size, cfg.dcp_rank, cfg.dcp_size, cfg.logical_page_size]
        digest = xxhash.xxh3_64_hexdigest(json.dumps(scope, sort_keys=True).encode())
        return f"sglang/{digest}/"

    # ------------------------------------------------------------ keys
    def _key(self, key: str) -> str:
        if not isinstance(key, str) or not key:
            raise InvalidRequestError(f"a HiCache key must be a non-empty str, got {key!r}")
        return self.prefix + key

    def _keys(self, keys: Sequence[str]) -> list[str]:
        if isinstance(keys, str | bytes) or not isinstance(keys, Sequence):
            raise InvalidRequestError("keys must be a list of str")
        return [self._key(k) for k in keys]

    # ------------------------------------------------------------ host pools
    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Remember the host KV pool whose pages ``batch_get_v1`` / ``batch_set_v1`` move."""
        super().register_mem_pool_host(mem_pool_host)
        self._add_regions(mem_pool_host)

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        """Remember a named host pool for the v2 pool-transfer calls."""
        super().register_mem_host_pool_v2(host_pool, host_pool_name)
        self._add_regions(host_pool)

    def _add_regions(self, pool: Any) -> None:
        get = getattr(pool, "get_hybrid_pool_buffer", None)
        buffers = get() if callable(get) else [getattr(pool, "kv_buffer", None)]
        for buf in buffers:
            if buf is None or not isinstance(buf, torch.Tensor) or buf.device.type != "cpu":
                continue
            addr = buf.data_ptr()
            if any(a == addr for a, _, _ in self._regions):
                continue
            self._regions.append((addr, buf.numel() * buf.element_size(), _flat_bytes(buf, True)))

    def _region(self, ptr: int, size: int) -> tuple[int, int, memoryview]:
        """(buffer index, offset, view) of ``size`` bytes at ``ptr`` inside a registered pool.

        Raises:
            InvalidRequestError: the range is not inside any registered host buffer.
        """
        for i, (addr, nbytes, view) in enumerate(self._regions):
            off = int(ptr) - addr
            if off >= 0 and off + int(size) <= nbytes and size > 0:
                return i, off, memoryview(view[off : off + int(size)])
        raise InvalidRequestError(f"{size} bytes at {ptr:#x} are outside the registered host pool")

    def _page_regions(self, pool: Any, n_keys: int, host_indices: Any) -> list[list[memoryview]]:
        """Per page, its zero-copy regions in the stored order (buffer, then offset)."""
        if pool is None:
            raise InvalidRequestError("no host memory pool registered")
        if not isinstance(host_indices, torch.Tensor):
            raise InvalidRequestError("host_indices must be a torch.Tensor")
        page = int(getattr(pool, "page_size", 1) or 1)
        if host_indices.numel() != n_keys * page:
            raise InvalidRequestError(
                f"{n_keys} keys need {n_keys * page} host indices, got {host_indices.numel()}"
            )
        if n_keys == 0:
            return []
        ptrs, sizes = pool.get_page_buffer_meta(host_indices)
        flat_p, flat_s = list(ptrs), list(sizes)
        if flat_p and isinstance(flat_p[0], list | tuple):  # one list per key already
            per_p, per_s = flat_p, flat_s
        else:
            if len(flat_p) % n_keys:
                raise InvalidRequestError("host pool pointers do not divide into the pages")
            n = len(flat_p) // n_keys
            per_p = [flat_p[i * n : (i + 1) * n] for i in range(n_keys)]
            per_s = [flat_s[i * n : (i + 1) * n] for i in range(n_keys)]
        out = []
        for ps, ss in zip(per_p, per_s, strict=True):
            regions = sorted(
                (self._region(p, s) for p, s in zip(ps, ss, strict=True)),
                key=lambda r: (r[0], r[1]),
            )
            out.append([v for _, _, v in regions])
        return out

    # ------------------------------------------------------------ v1: zero copy with the pool
    def batch_get_v1(
        self,
        keys: list[str],
        host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        """Read pages straight into the registered host pool; per key whether it was read whole."""
        if self._logical_only(self.mem_pool_host):
            return [True] * len(keys)
        return self._get_pages(self.mem_pool_host, self._keys(keys), host_indices)

    def batch_set_v1(
        self,
        keys: list[str],
        host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        """Write pages from the registered host pool; stored pages count as written."""
        if self._logical_only(self.mem_pool_host):
            return [True] * len(keys)
        return self._set_pages(self.mem_pool_host, self._keys(keys), host_indices)

    @staticmethod
    def _logical_only(pool: Any) -> bool:
        """A hybrid model's KV anchor pool that holds no bytes (its v2 side pools carry the data),
        answered as SGLang's Mooncake backend does: every page "moved"."""
        return pool is not None and hasattr(pool, "kv_buffer") and pool.kv_buffer is None

    def _get_pages(self, pool: Any, wire: list[str], host_indices: Any) -> list[bool]:
        pages = self._page_regions(pool, len(wire), host_indices)
        if not wire:
            return []
        started = time.perf_counter()
        sizes = [sum(len(v) for v in regions) for regions in pages]
        scratch = np.empty(
            sum(s for s, r in zip(sizes, pages, strict=True) if len(r) > 1), np.uint8
        )
        dests: list[Any] = []
        pos = 0
        for size, regions in zip(sizes, pages, strict=True):
            if len(regions) == 1:
                dests.append(regions[0])
            else:
                dests.append(memoryview(scratch[pos : pos + size]))
                pos += size
        try:
            got = self.client.batch_get_into(wire, dests)
        except KVStoreError as err:
            log.warning("kvstore batch_get_into failed: %s", err)
            return [False] * len(wire)
        ok = [isinstance(n, int) and n == size for n, size in zip(got, sizes, strict=True)]
        for hit, regions, dest in zip(ok, pages, dests, strict=True):
            if hit and len(regions) > 1:
                at = 0
                for v in regions:
                    v[:] = dest[at : at + len(v)]
                    at += len(v)
        self._record(
            self._metrics.prefetch_pgs, self._metrics.prefetch_bandwidth, ok, sizes, started
        )
        return ok

    def _set_pages(self, pool: Any, wire: list[str], host_indices: Any) -> list[bool]:
        pages = self._page_regions(pool, len(wire), host_indices)
        if not wire:
            return []
        started = time.perf_counter()
        try:
            stored = self.client.batch_exists(wire)
        except KVStoreError as err:
            log.warning("kvstore exists failed: %s", err)
            return [False] * len(wire)
        todo = [i for i, s in enumerate(stored) if not s]
        ok = [bool(s) for s in stored]
        if todo:
            values = [pages[i][0] if len(pages[i]) == 1 else b"".join(pages[i]) for i in todo]
            try:
                errs = self.client.batch_put(
                    [wire[i] for i in todo], values, replicas=self.replicas
                )
            except KVStoreError as err:
                log.warning("kvstore batch_put failed: %s", err)
                errs = [err] * len(todo)
            for i, err in zip(todo, errs, strict=True):
                ok[i] = err is None
        sizes = [sum(len(v) for v in regions) for regions in pages]
        self._record(self._metrics.backup_pgs, self._metrics.backup_bandwidth, ok, sizes, started)
        return ok

    def _record(
        self, pgs: list[int], bw: list[float], ok: list[bool], sizes: list[int], started: float
    ) -> None:
        if not self.enable_storage_metrics:
            return
        took = max(time.perf_counter() - started, 1e-9)
        pgs.append(len(ok))
        bw.append(sum(s for s, h in zip(sizes, ok, strict=True) if h) / took / (1 << 30))

    # ------------------------------------------------------------ tensor forms
    def get(
        self,
        key: str,
        target_location: Any | None = None,
        target_sizes: Any | None = None,
    ) -> torch.Tensor | None:
        """Read one page into ``target_location`` (a tensor of the page's size) and return it;
        None on a miss. Without a target, a new uint8 tensor of the page's bytes."""
        return self.batch_get([key], None if target_location is None else [target_location])[0]

    def batch_get(
        self,
        keys: list[str],
        target_locations: Any | None = None,
        target_sizes: Any | None = None,
    ) -> list[torch.Tensor | None]:
        """Per key its target tensor filled, or None for a miss (or a page of another size)."""
        wire = self._keys(keys)
        if target_locations is None:
            try:
                got = self.client.batch_get(wire)
            except KVStoreError as err:
                log.warning("kvstore batch_get failed: %s", err)
                return [None] * len(wire)
            return [
                None
                if isinstance(g, KVStoreError)
                else torch.frombuffer(bytearray(g), dtype=torch.uint8)
                for g in got
            ]
        targets = list(target_locations)
        if len(targets) != len(wire):
            raise InvalidRequestError("keys and target_locations differ in length")
        views = [_flat_bytes(t, writable=True) for t in targets]
        try:
            got = self.client.batch_get_into(wire, views)
        except KVStoreError as err:
            log.warning("kvstore batch_get_into failed: %s", err)
            return [None] * len(wire)
        return [
            t if isinstance(n, int) and n == v.nbytes else None
            for t, v, n in zip(targets, views, got, strict=True)
        ]

    def set(
        self,
        key: str,
        value: Any | None = None,
        target_location: Any | None = None,
        target_sizes: Any | None = None,
    ) -> bool:
        """Store one page (a tensor); True when stored or already there."""
        return self.batch_set([key], [value])

    def batch_set(
        self,
        keys: list[str],
        values: Any | None = None,
        target_locations: Any | None = None,
        target_sizes: Any | None = None,
    ) -> bool:
        """Store pages (tensors); True when every one is stored (or already was)."""
        wire = self._keys(keys)
        vals = list(values) if values is not None else []
        if len(vals) != len(wire):
            raise InvalidRequestError("keys and values differ in length")
        views = [_flat_bytes(v, writable=False) for v in vals]
        if not wire:
            return True
        try:
            stored = self.client.batch_exists(wire)
            todo = [i for i, s in enumerate(stored) if not s]
            if not todo:
                return True
            errs = self.client.batch_put(
                [wire[i] for i in todo], [views[i] for i in todo], replicas=self.replicas
            )
        except KVStoreError as err:
            log.warning("kvstore batch_set failed: %s", err)
            return False
        return all(e is None for e in errs)

    # ------------------------------------------------------------ existence
    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def batch_exists(
        self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> int:
        """How many keys from the start are stored (one master call)."""
        wire = self._keys(keys)
        if not wire:
            return 0
        try:
            found = self.client.batch_exists(wire)
        except KVStoreError as err:
            log.warning("kvstore exists failed: %s", err)
            return 0
        return next((i for i, f in enumerate(found) if not f), len(found))

    # ------------------------------------------------------------ v2: named pools
    def _pool_key(self, name: Any, key: str) -> str:
        """HiCacheFile's naming: KV pages under their hash, other pools with a suffix."""
        return key if name == PoolName.KV else f"{key}.{name}"

    def batch_exists_v2(
        self,
        keys: list[str],
        pool_transfers: list[PoolTransfer] | None = None,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> PoolTransferResult:
        """SGLang's per-pool prefix rules (``all_pages`` / ``trailing_pages``), one master call."""
        transfers = list(pool_transfers or [])
        names = [t.name for t in transfers]
        wire = self._keys(keys)
        ask = list(wire) + [self._key(self._pool_key(n, k)) for n in names for k in keys]
        try:
            found = self.client.batch_exists(ask) if ask else []
        except KVStoreError as err:
            log.warning("kvstore exists failed: %s", err)
            return PoolTransferResult.empty()
        n = len(keys)
        kv_pages = next((i for i in range(n) if not found[i]), n)
        hit_count: dict[str, int] = {PoolName.KV: kv_pages} if kv_pages else {}
        restorable = list(range(1, kv_pages + 1))
        for j, transfer in enumerate(transfers):
            if not restorable:
                break
            has = found[n * (j + 1) : n * (j + 2)]
            if transfer.hit_policy == PoolHitPolicy.ALL_PAGES:
                boundary = next((i for i in range(kv_pages) if not has[i]), kv_pages)
                pool_ok = set(range(1, boundary + 1))
            elif transfer.hit_policy == PoolHitPolicy.TRAILING_PAGES:
                trailing = max(1, len(transfer.keys) if transfer.keys else 1)
                pool_ok = {
                    p
                    for p in range(1, kv_pages + 1)
                    if all(has[i] for i in range(max(0, p - trailing), p))
                }
                boundary = max(pool_ok, default=0)
            else:
                raise InvalidRequestError(f"unsupported pool hit policy {transfer.hit_policy}")
            if boundary:
                hit_count[transfer.name] = boundary
            restorable = [p for p in restorable if p in pool_ok]
        return PoolTransferResult(restorable[-1] if restorable else 0, hit_count, restorable)

    def _transfer_pages(self, transfers: list[PoolTransfer], write: bool) -> dict[str, list[bool]]:
        results: dict[str, list[bool]] = {}
        for t in transfers:
            pool = self.registered_pools.get(t.name)
            keys = list(t.keys or [])
            if pool is None:
                raise InvalidRequestError(f"no host pool registered under {t.name!r}")
            wire = self._keys([self._pool_key(t.name, k) for k in keys])
            try:
                op = self._set_pages if write else self._get_pages
                results[t.name] = op(pool, wire, t.host_indices)
            except InvalidRequestError as err:
                log.error("%s for pool %s: %s", "write" if write else "read", t.name, err)
                results[t.name] = [False] * len(keys)
        return results

    def batch_get_v2(
        self,
        transfers: list[PoolTransfer],
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> dict[str, list[bool]]:
        """Read each transfer's pages into its named host pool; per pool, per key success."""
        return self._transfer_pages(list(transfers), write=False)

    def batch_set_v2(
        self,
        transfers: list[PoolTransfer],
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> dict[str, list[bool]]:
        """Write each transfer's pages from its named host pool; per pool, per key success."""
        return self._transfer_pages(list(transfers), write=True)

    # ------------------------------------------------------------ the rest
    def clear(self) -> bool:
        """Remove every page of this backend's namespace (other namespaces are untouched)."""
        try:
            keys = self.client.list_keys(self.prefix)
            for start in range(0, len(keys), _REMOVE_BATCH):
                self.client.batch_remove(keys[start : start + _REMOVE_BATCH])
        except KVStoreError as err:
            log.error("kvstore clear failed: %s", err)
            return False
        return True

    def get_stats(self) -> Any:
        """SGLang's ``StorageMetrics`` since the last call (None with metrics off)."""
        if not self.enable_storage_metrics:
            return None
        try:
            from sglang.srt.observability.metrics_collector import StorageMetrics
        except ImportError:  # its module pulls in transformers; the fields are the same
            StorageMetrics = _Metrics  # noqa: N806
        m, self._metrics = self._metrics, _Metrics()
        return StorageMetrics(
            prefetch_pgs=m.prefetch_pgs,
            backup_pgs=m.backup_pgs,
            prefetch_bandwidth=m.prefetch_bandwidth,
            backup_bandwidth=m.backup_bandwidth,
        )

    def close(self) -> None:
        """Disconnect from the cluster (SGLang calls this on detach)."""
        self.client.close()
