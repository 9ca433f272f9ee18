"""The vLLM connector's worker side (one per TP rank): the registered cache as block views
(:mod:`.vllm_layouts`), layer-wise or asynchronous loads, saves handed off layer by layer.

It imports nothing of vLLM: the facade (:mod:`kvstore.client.adapters.vllm`) gives it the
namespace, the layer names, the backend, the geometry and each step's transfers, so tests drive it
on caches vLLM's own helpers allocate, and it runs where vLLM is absent.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from kvstore.client.adapters.vllm_config import ConnectorConfig
from kvstore.client.adapters.vllm_device import DeviceCopies
from kvstore.client.adapters.vllm_layouts import BlockViews, CacheGeometry, block_views
from kvstore.client.adapters.vllm_pool import (
    UNREACHABLE,
    Counters,
    Pool,
    Transfer,
    is_unreachable,
    logger,
)
from kvstore.client.client import Client
from kvstore.client.inplace import InPlaceReads
from kvstore.client.reads import LocatedRead
from kvstore.errors import InvalidRequestError, KVStoreError
from kvstore.keys import DTYPE_BYTES, Namespace
from kvstore.kvblocks import checksum_table_bytes
from kvstore.types import ObjectInfo

#: Staging kept between steps up to this size (larger steps allocate their own).
MAX_KEPT_STAGING = 512 << 20


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
class _Loaded:
    """One load's blocks on their way into vLLM's cache (see ``KVStoreWorker._read``).

    ``planes[i]``: block ``block_ids[i]``'s KV, typed (``KVStoreWorker._typed``), a view of a
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
    rows: torch.Tensor | None = None  # the staging rows read into (a GPU cache copies from them)
    row_of: dict[int, int] = field(default_factory=dict)  # block index -> its row in ``rows``


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
        pool: Pool,
        counters: Counters,
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
        self._recving: dict[str, tuple[Future[set[int]], Transfer]] = {}
        self._sync_read: Future[set[int]] | None = None
        self._layer_ready: list[threading.Event] = []
        self._save_staging: torch.Tensor | None = None
        self._save_runs: list[tuple[int, int, int]] = []
        self._save_futures: list[Future[None]] = []

    def register_kv_caches(
        self,
        kv_caches: Mapping[str, Any],
        backend: str,
        geometry: CacheGeometry,
        layout: str | None = None,
    ) -> None:
        """Map each layer's paged cache to block views (:mod:`.vllm_layouts`).

        Args:
            kv_caches: what vLLM registers, by layer name (any layout of ``vllm_layouts``).
            backend: the attention backend's name.
            geometry: what one layer holds on this rank.
            layout: vLLM's name of the resolved layout (for messages), if known.

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
        views = block_views([kv_caches[n] for n in names], geometry, backend, layout)
        if views.itemsize != DTYPE_BYTES[ns.dtype]:
            raise InvalidRequestError(
                f"kvstore connector: KV cache layout {views.layout} of backend {backend} holds "
                f"{views.dtype} elements; the namespace says {ns.dtype}"
            )
        self._views = views
        self._layer_index = {n: i for i, n in enumerate(names)}
        self._dtype = views.dtype
        self._itemsize = views.itemsize
        # numpy's integer type of the element size: objects are checked and copied as bits.
        self._np_dtype = torch.empty(0, dtype=views.as_int()[0].dtype).numpy().dtype
        # Loads into a host cache copy with numpy (see _copy); a GPU cache goes through
        # vllm_device's streams (see _copy_to_device).
        self._kv_np = views.host_int_views() if views.device.type == "cpu" else []
        self._obj_shape = (ns.num_layers, 2, ns.block_size, ns.num_kv_heads, ns.head_dim)
        self._block_nbytes = views.block_nbytes
        # One staging row is one whole pool object: the planes, then the block's checksum table
        # (kvstore.kvblocks), so reads and saves move objects without another copy.
        self._object_nbytes = self._block_nbytes + checksum_table_bytes(
            2 * ns.num_layers, ns.block_size
        )
        self._bufs: dict[str, torch.Tensor] = {}
        self._copies = DeviceCopies(views.device)
        self._layer_events: list[Any] = [None] * len(views.layers)
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
            return self._copies.host_buffer((num_blocks, self._object_nbytes))
        # zeros, not empty: every page is touched (faulted) once, here, not in each step.
        buf = self._copies.host_buffer(
            (max(num_blocks, 2 * (len(buf) if buf is not None else 0)), self._object_nbytes)
        )
        self._bufs[kind] = buf
        return buf[:num_blocks]

    def _planes(self, rows: torch.Tensor) -> torch.Tensor:
        """The KV of staging rows, typed: ``[n, layers, 2, block_size, heads, head]`` (a view)."""
        return rows[:, : self._block_nbytes].view(self._dtype).view(len(rows), *self._obj_shape)

    # ---------------------------------------------------------------- loads
    def _read(self, loads: list[Transfer]) -> _Loaded:
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

    def _read_into(self, loads: list[Transfer], loaded: _Loaded) -> None:
        kv = self._pool.get()
        if kv is None:
            return
        # Each transfer's keys in its request's namespace (a cache_salt's, or the engine's);
        # ``at[k]``: the block index of ``keys[k]`` (a salt without a view: its blocks fail).
        keys: list[bytes] = []
        at: list[int] = []
        pos = 0
        for t in loads:
            view = kv if t.cache_salt is None else self._pool.get(t.cache_salt)
            if view is not None:
                keys.extend(view.block_object_keys(t.tokens)[t.first : t.first + len(t.block_ids)])
                at.extend(range(pos, pos + len(t.block_ids)))
            pos += len(t.block_ids)
        if not keys:
            return
        try:
            answers = kv.client.batch_locate(keys)
        except UNREACHABLE as exc:
            if is_unreachable(exc):
                self._pool.failed(exc)
            else:
                logger.warning("kvstore: load failed (%s); vLLM recomputes", exc)
            return
        loaded.client = kv.client
        # A block's own error (evicted, its node gone, checksum) fails that block only: the
        # pool as a whole stays in use (other nodes may hold the next prompt's blocks).
        loaded.infos = [a for a in answers if isinstance(a, ObjectInfo)]
        found = [
            (at[k], a)
            for k, a in enumerate(answers)
            if isinstance(a, ObjectInfo) and a.size == self._object_nbytes
        ]
        rest: list[tuple[int, ObjectInfo]] = []
        if self._copies.on_gpu:  # a GPU copies from pinned staging, never from shared memory
            rest = found
        else:
            loaded.inplace = kv.client.read_in_place([a for _, a in found])
            for j, (i, info) in enumerate(found):
                if loaded.inplace.mapped(j):
                    loaded.in_place[i] = j
                else:
                    rest.append((i, info))
        if rest:
            loaded.rows = self._staging(len(rest), "load")
            loaded.row_of = {i: k for k, (i, _) in enumerate(rest)}
            rows = loaded.rows.numpy()
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

    def _copy(self, loaded: _Loaded, ready: list[threading.Event] | None = None) -> None:
        """Copy the loaded blocks into vLLM's paged cache, block by block, every layer of a
        block at once: a block read in place is checked (checksum) just before, so its bytes
        are copied while still in cache from the check. Per layer, one transposing copy,
        object ``[2, bs, heads, head]`` -> the cache's strided block view, with numpy: for
        these 24 KiB copies torch's per-call cost made a 2K prompt's copy 13 ms against 7 ms
        (SmolLM2, measured apart). A GPU cache: :meth:`_copy_to_device`."""
        t0 = time.perf_counter()
        if self._copies.on_gpu:
            self._copy_to_device(loaded, ready)
            loaded.copy_s += time.perf_counter() - t0
            return
        inplace, kv_np = loaded.inplace, self._kv_np
        for i, block in enumerate(loaded.block_ids):
            planes = loaded.planes[i]
            j = loaded.in_place.get(i)
            if j is not None and inplace is not None:
                view = inplace.view(j)
                planes = loaded.planes[i] = self._typed(view) if view is not None else None
            if planes is None:
                continue
            for layer, dst in enumerate(kv_np):
                np.copyto(dst[block], planes[layer])
        loaded.copy_s += time.perf_counter() - t0

    def _copy_to_device(self, loaded: _Loaded, ready: list[threading.Event] | None) -> None:
        """The GPU load: per layer, the good rows to the device and into their blocks on the
        side stream, that layer's event recorded and its ``ready`` set at once (the forward's
        stream waits on the event, not the host); then the host waits for the copies before
        the staging may be reused."""
        good = [
            (loaded.row_of[i], block)
            for i, block in enumerate(loaded.block_ids)
            if loaded.planes[i] is not None
        ]
        planes = self._planes(loaded.rows) if loaded.rows is not None and good else None
        for layer in range(len(self._views.layers)):
            if planes is not None:
                self._layer_events[layer] = self._copies.load_layer(
                    self._views, layer, planes[:, layer], good
                )
            if ready is not None:
                ready[layer].set()
        self._copies.drain()

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

    def _load_now(
        self, loads: list[Transfer], ready: list[threading.Event] | None = None
    ) -> set[int]:
        loaded = self._read(loads)
        try:
            self._copy(loaded, ready)
        finally:
            failed = self._finish(loaded)
        return failed

    def start_load_kv(self, loads: list[Transfer]) -> None:
        """Start this step's loads on the io thread: in ``layer`` mode one load for all of
        them while the step starts, the forward's ``wait_for_layer_load`` waiting for it; in
        ``async`` mode one load per request, reported by ``get_finished``.

        Why the layer-mode load sets every layer's event at once, after its copy, rather than
        each layer's as it is copied: the copy goes block by block, so that a block read in
        place is copied while still in cache from its checksum (one pass over memory, not
        two; the whole load of a 2K-token prompt is then ~20 ms here), and with the copy done
        in one go the forward never shares a core with it."""
        if not loads:
            return
        if self._load_async:
            for t in loads:
                self._recving[t.req_id] = (self._io.submit(self._load_now, [t]), t)
            return
        self._layer_ready = [threading.Event() for _ in self._views.layers]
        self._layer_events = [None] * len(self._views.layers)
        self._sync_read = self._io.submit(self._load_layerwise, loads, self._layer_ready)

    def _load_layerwise(self, loads: list[Transfer], ready: list[threading.Event]) -> set[int]:
        """:meth:`_load_now`, setting every layer's event when the copy is done, or when it
        failed (the forward never waits on a load that died: its blocks are reported
        instead)."""
        failed = {b for t in loads for b in t.block_ids}
        try:
            failed = self._load_now(loads, ready)
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
            self._copies.wait(self._layer_events[layer])

    def _finish_sync_load(self) -> None:
        """At the end of the step: the load is over; collect its failed blocks."""
        if self._sync_read is None:
            return
        failed = self._sync_read.result()
        self._sync_read = None
        with self._lock:
            self._load_errors |= failed

    # ---------------------------------------------------------------- saves
    def save_kv_layer(self, saves: list[Transfer], layer_name: str) -> None:
        """Hand this layer's new prompt blocks to the save thread (the forward goes on)."""
        if not saves:
            return
        layer = self._layer_index.get(layer_name)
        if layer is None:
            return
        if self._save_staging is None:
            ids = [b for t in saves for b in t.block_ids]
            self._save_staging = self._staging(len(ids), "save")
            self._save_runs = _runs(range(len(ids)), ids)
        staging, runs = self._save_staging, self._save_runs
        planes = self._planes(staging)
        # On a GPU the copy is queued now, behind the forward's writes; the saver thread only
        # waits for it. On the CPU the saver thread does the copy.
        gathered = self._copies.start_save(self._views, layer, planes[:, layer], runs)
        gathers = self._save_futures
        gathers.append(self._saver.submit(gathered))
        if layer == len(self._views.layers) - 1:
            pending = list(gathers)

            def put() -> None:
                for f in pending:
                    f.result()  # a gather that failed: store nothing (its rows are garbage)
                self._put(saves, staging)

            gathers.append(self._saver.submit(put))

    def save_preempted(self, saves: list[Transfer]) -> None:
        """Store the full blocks of requests vLLM just preempted, before this step's forward
        may overwrite them (they are free once this returns), so that each resumes by loading
        them. Synchronous: a preemption is rare, and its blocks are worth a pause of the step
        (``.venv/bin/python bench/bench_pd.py --parts preemption`` serves an overload resuming
        by loading and by recomputing). A failure leaves them to be recomputed."""
        ids = [b for t in saves for b in t.block_ids]
        if not ids or self._views is None:
            return
        staging = self._staging(len(ids), "preempted")
        runs = _runs(range(len(ids)), ids)
        planes = self._planes(staging)
        try:
            for layer in range(len(self._views.layers)):
                self._copies.start_save(self._views, layer, planes[:, layer], runs)()
        except Exception as exc:  # noqa: BLE001 - a preempted request is then recomputed
            logger.warning(
                "kvstore: saving preempted blocks failed (%s: %s)", type(exc).__name__, exc
            )
            return
        self._put(saves, staging)
        self._counters.add(preempted_saved_tokens=len(ids) * self._block_size)

    def _put(self, saves: list[Transfer], staging: torch.Tensor) -> None:
        kv = self._pool.get()
        if kv is None:
            return
        t0 = time.perf_counter()
        rows = staging.numpy()  # whole object rows: put_blocks writes their checksum tables
        pos = saves_done = 0
        try:
            for t in saves:
                n = len(t.block_ids)
                view = kv if t.cache_salt is None else self._pool.get(t.cache_salt)
                if view is not None:  # (no view for its salt: those blocks stay uncached)
                    view.put_blocks(t.tokens, t.first, rows[pos : pos + n])
                    saves_done += n
                pos += n
        except KVStoreError as exc:
            if is_unreachable(exc):
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
