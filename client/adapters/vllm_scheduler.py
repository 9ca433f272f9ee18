"""The vLLM connector's scheduler side (one per engine): asks the prefix index what the pool
holds, plans each step's loads and saves as :class:`KVStoreConnectorMetadata`.

Preemption: when vLLM preempts a running request for lack of KV room it frees the request's
blocks and later computes it again from its first token. The connector saves the request's
full blocks, prompt and tokens generated so far, before the next forward reuses them
(``preempted``: the worker's ``handle_preemptions`` stores them synchronously), and looks the
request up again when vLLM resumes it, over all its tokens: it resumes by loading its KV from
the pool instead of recomputing it. Every role does this (a decode server is where preemptions
happen); only the blocks the pool may not hold yet are saved.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from kvstore.client.adapters.vllm_pool import (
    Counters,
    Pool,
    Transfer,
    is_unreachable,
    logger,
)
from kvstore.errors import KVStoreError

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request


def _grown(block_ids: list[int], new_ids: Any, resumed: bool) -> list[int]:
    """A running request's blocks after a step: ``new_ids`` (vLLM's per-group tuple, or None)
    added, or all of them for a request vLLM resumed after a preemption."""
    if new_ids is None:
        return block_ids
    if resumed:
        return list(new_ids[0])
    block_ids.extend(new_ids[0])  # (in place: a long answer adds a block every few steps)
    return block_ids


def request_cache_salt(request: Request) -> str | None:
    """The request's vLLM ``cache_salt`` (``Request.cache_salt``; None or empty: none)."""
    return getattr(request, "cache_salt", None) or None


@dataclass
class KVStoreConnectorMetadata(KVConnectorMetadata):
    """What the scheduler tells the workers for one step."""

    loads: list[Transfer] = field(default_factory=list)
    saves: list[Transfer] = field(default_factory=list)
    #: Full blocks of requests vLLM preempted in this step, to store before the forward.
    preempted: list[Transfer] = field(default_factory=list)


@dataclass
class _Running:
    """What a request's preemption needs: the request (its tokens so far), its blocks, the
    tokens whose KV they hold, and the leading blocks the pool holds already."""

    request: Any
    block_ids: list[int] = field(default_factory=list)
    computed: int = 0
    in_pool: int = 0


@dataclass
class _SaveState:
    tokens: np.ndarray
    block_ids: list[int]
    saved: int  # blocks known to be in the pool (looked up or saved by us)
    cache_salt: str | None = None


class KVStoreScheduler:
    """Lookups (once per request, no read leases), the blocks to load after vLLM allocated
    them, and the prompt blocks each step fills that the pool does not hold yet.

    A request with a vLLM ``cache_salt`` is looked up, loaded and saved in its salted namespace
    (:func:`~.vllm_config.salted_namespace`), as vLLM's own prefix cache keeps such blocks
    apart: requests of different salts never share a pool block.

    Args:
        pool: the pool (rank 0's namespace: every rank saves the same blocks).
        counters: where lookups and hits are counted.
        block_size: vLLM's block size (one block is one pool object).
        kv_role: ``kv_both``, ``kv_producer`` or ``kv_consumer``.
        load_async: loads are reported by ``get_finished`` rather than waited for per layer.
    """

    def __init__(
        self, pool: Pool, counters: Counters, block_size: int, kv_role: str, load_async: bool
    ) -> None:
        self._pool = pool
        self._counters = counters
        self._block_size = block_size
        self._can_load = kv_role in ("kv_both", "kv_consumer")
        self._can_save = kv_role in ("kv_both", "kv_producer")
        self._load_async = load_async
        self._hits: dict[str, int] = {}  # req_id -> prompt blocks the pool holds (looked up once)
        self._local: dict[str, int] = {}  # req_id -> tokens vLLM had locally at the lookup
        # req_id -> its cache_salt, from the lookup: vLLM's NewRequestData does not carry it.
        self._salts: dict[str, str | None] = {}
        self._pending_loads: dict[str, Transfer] = {}
        self._saving: dict[str, _SaveState] = {}
        self._running: dict[str, _Running] = {}  # req_id -> what its preemption saves

    def _lookup(self, tokens: np.ndarray, cache_salt: str | None) -> int:
        """Full prompt blocks the pool holds in the request's namespace (one master call, no
        leases); 0 without a pool."""
        kv = self._pool.get(cache_salt)
        if kv is None:
            return 0
        try:
            hit = kv.lookup(tokens)
        except KVStoreError as exc:
            if is_unreachable(exc):
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
        # A new request's tokens are its prompt; a resumed one's, its prompt and its answer
        # so far (saved when it was preempted).
        prompt = list(request.all_token_ids)
        if not prompt:
            return 0, False
        rid = request.request_id
        hit = self._hits.get(rid)
        if hit is None:
            salt = request_cache_salt(request)
            bs = self._block_size
            tokens = np.asarray(prompt[: len(prompt) // bs * bs], dtype=np.uint32)
            hit = self._lookup(tokens, salt) if len(tokens) else 0
            self._hits[rid] = hit
            self._salts[rid] = salt
        self._local[rid] = num_computed_tokens
        running = self._running.setdefault(rid, _Running(request))
        running.in_pool = hit
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
        prompt = list(request.all_token_ids)
        self._pending_loads[rid] = Transfer(
            rid,
            np.asarray(prompt[: end * bs], dtype=np.uint32),
            first,
            block_ids[first:end],
            request_cache_salt(request),
        )

    def _plan_save(
        self, meta: KVStoreConnectorMetadata, rid: str, st: _SaveState, end_token: int
    ) -> None:
        full = min(end_token, len(st.tokens)) // self._block_size
        full = min(full, len(st.block_ids))
        if full > st.saved:
            meta.saves.append(
                Transfer(
                    rid,
                    st.tokens[: full * self._block_size],
                    st.saved,
                    st.block_ids[st.saved : full],
                    st.cache_salt,
                )
            )
            st.saved = full

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        """This step's loads (planned at allocation) and saves (prompt blocks this step fills
        that the pool does not hold yet)."""
        meta = KVStoreConnectorMetadata(loads=list(self._pending_loads.values()))
        self._pending_loads.clear()
        scheduled = scheduler_output.num_scheduled_tokens
        self._plan_preempted(meta, getattr(scheduler_output, "preempted_req_ids", None) or ())
        self._follow_blocks(scheduler_output)
        if not self._can_save:
            return meta
        for new in scheduler_output.scheduled_new_reqs:
            prompt = new.prompt_token_ids
            if not prompt or not new.block_ids:
                continue
            if new.req_id not in self._salts:
                # Never looked up, so its cache_salt is unknown: saving it in the engine's
                # namespace could hand a salted prompt's KV to unsalted requests.
                continue
            st = _SaveState(
                np.asarray(prompt, dtype=np.uint32),
                list(new.block_ids[0]),
                self._hits.get(new.req_id, 0),
                self._salts[new.req_id],
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
            st.block_ids = _grown(st.block_ids, cached.new_block_ids[i], rid in resumed)
            if st.saved * self._block_size >= len(st.tokens) // self._block_size * self._block_size:
                continue
            self._plan_save(meta, rid, st, cached.num_computed_tokens[i] + scheduled.get(rid, 0))
        return meta

    def _plan_preempted(self, meta: KVStoreConnectorMetadata, preempted: Any) -> None:
        """Save the full blocks of each request vLLM just preempted (their KV is intact until
        the next forward), and look it up again when it resumes."""
        bs = self._block_size
        for rid in preempted:
            running = self._running.get(rid)
            self._hits.pop(rid, None)  # its resumption is looked up again, over all its tokens
            self._local.pop(rid, None)
            if running is None:
                continue
            tokens = list(running.request.all_token_ids)
            full = min(running.computed, len(tokens)) // bs
            full = min(full, len(running.block_ids))
            first = min(running.in_pool, full)
            if full > first and self._pool.get() is not None:
                meta.preempted.append(
                    Transfer(
                        rid,
                        np.asarray(tokens[: full * bs], dtype=np.uint32),
                        first,
                        running.block_ids[first:full],
                        self._salts.get(rid),
                    )
                )
            running.block_ids, running.computed = [], 0

    def _follow_blocks(self, scheduler_output: SchedulerOutput) -> None:
        """Each running request's blocks and computed tokens after this step."""
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            running = self._running.get(new.req_id)
            if running is not None and new.block_ids:
                running.block_ids = list(new.block_ids[0])
                running.computed = new.num_computed_tokens + scheduled.get(new.req_id, 0)
        cached = scheduler_output.scheduled_cached_reqs
        resumed = getattr(cached, "resumed_req_ids", set())
        for i, rid in enumerate(cached.req_ids):
            running = self._running.get(rid)
            if running is None:
                continue
            running.block_ids = _grown(running.block_ids, cached.new_block_ids[i], rid in resumed)
            running.computed = cached.num_computed_tokens[i] + scheduled.get(rid, 0)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Forget the request. Saves finish within their step, so no block is held past it."""
        rid = request.request_id
        self._hits.pop(rid, None)
        self._local.pop(rid, None)
        self._salts.pop(rid, None)
        self._saving.pop(rid, None)
        self._pending_loads.pop(rid, None)
        self._running.pop(rid, None)
        return False, None
