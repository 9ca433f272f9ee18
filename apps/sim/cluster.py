"""What the scheduler sees: prefill and decode instances, the global pool, and their sizes."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvstore.errors import InvalidRequestError
from kvstore.routing.cost import CostModel
from kvstore.routing.policy import HANDOFF_SCALE
from kvstore.topology import SAME_RACK, Site, distance

from .policies import POLICIES, BlockCache


@dataclass(slots=True)
class PrefillInstance:
    """A prefill instance: a FIFO queue of prefills and a local cache of blocks.

    Attributes:
        instance_id: index in :attr:`ClusterState.prefill`.
        cost: its cost model.
        cache: blocks it holds locally (reusing them costs no transfer).
        busy_until_s: when the work already queued on it ends.
        num_served: requests assigned to it so far.
        busy_s: prefill seconds assigned to it so far (for per-instance load).
    """

    instance_id: int
    cost: CostModel
    cache: BlockCache
    busy_until_s: float = 0.0
    num_served: int = 0
    busy_s: float = 0.0

    def queue_wait_s(self, now_s: float) -> float:
        """Seconds a prefill submitted at ``now_s`` waits before it starts."""
        return max(0.0, self.busy_until_s - now_s)


@dataclass(slots=True)
class DecodeInstance:
    """A decode instance with continuous batching and a fixed KV memory.

    The scheduler reserves a request's KV here when it assigns the request (before prefill has
    run), so requests in flight count against memory and batch size: that is the prediction
    that early rejection relies on.

    Attributes:
        instance_id: index in :attr:`ClusterState.decode`.
        cost: its cost model.
        kv_capacity_tokens: KV memory, in tokens.
        max_batch_size: most sequences in one step.
        num_assigned: requests assigned and not finished (in flight, waiting or running).
        kv_reserved_tokens: KV reserved by those requests (prompt + output, at the end).
        kv_mean_tokens: their mean KV over decoding (prompt + output / 2), for step times.
        num_served: requests assigned to it so far.
    """

    instance_id: int
    cost: CostModel
    kv_capacity_tokens: int
    max_batch_size: int
    num_assigned: int = 0
    kv_reserved_tokens: int = 0
    kv_mean_tokens: int = 0
    num_served: int = 0

    def predicted_tbt_s(self, extra_seqs: int = 0, extra_mean_tokens: int = 0) -> float:
        """Step time once ``extra_seqs`` more sequences join the requests already assigned."""
        batch = min(self.num_assigned + extra_seqs, self.max_batch_size)
        return self.cost.decode_step_s(batch, self.kv_mean_tokens + extra_mean_tokens)


@dataclass(frozen=True, slots=True)
class ClusterConfig:
    """Sizes of a simulated cluster.

    Attributes:
        num_prefill: prefill instances (>= 1).
        num_decode: decode instances (>= 1).
        local_cache_blocks: blocks each prefill instance holds locally (``None`` unlimited);
            the default is 3M tokens of 512-token blocks, Mooncake's per-node cache.
        pool_blocks: blocks the global pool holds (``None`` unlimited; 0 disables the pool,
            so that only local caches hit: "a cache per instance"). The default is 4 x 3M
            tokens: Mooncake's pool is the DRAM of the prefill nodes, 3M tokens each.
        cache_policy: eviction policy of every cache (a key of ``POLICIES``).
        decode_kv_capacity_tokens: KV memory of each decode instance, in tokens.
        decode_max_batch_size: most sequences in one decode step.
        cost: the cost model of every instance.
        prefill_sites: where each prefill instance runs (:class:`~kvstore.topology.Site`, one
            per instance), with ``decode_sites``: the prefill-to-decode handoff is then priced
            by their distance (:meth:`handoff_scale`). None (the default): every handoff
            costs the cost model's transfer, as within one rack.
        decode_sites: where each decode instance runs (one per instance), or None.

    Raises:
        InvalidRequestError: on creation, for counts below 1, negative sizes, an unknown
            policy, or sites that do not number the instances.
    """

    num_prefill: int = 4
    num_decode: int = 4
    local_cache_blocks: int | None = 5_860
    pool_blocks: int | None = 23_440
    cache_policy: str = "lru"
    decode_kv_capacity_tokens: int = 1_500_000
    decode_max_batch_size: int = 128
    cost: CostModel = field(default_factory=CostModel)
    prefill_sites: tuple[Site, ...] | None = None
    decode_sites: tuple[Site, ...] | None = None

    def __post_init__(self) -> None:
        if self.num_prefill < 1 or self.num_decode < 1:
            raise InvalidRequestError("a cluster needs at least one prefill and one decode")
        for label, value in (
            ("local_cache_blocks", self.local_cache_blocks),
            ("pool_blocks", self.pool_blocks),
        ):
            if value is not None and value < 0:
                raise InvalidRequestError(f"{label} must be >= 0 or None, got {value}")
        if self.cache_policy not in POLICIES:
            raise InvalidRequestError(f"unknown cache policy {self.cache_policy!r}")
        if self.decode_kv_capacity_tokens < 1 or self.decode_max_batch_size < 1:
            raise InvalidRequestError("decode KV capacity and batch size must be >= 1")
        for label, sites, count in (
            ("prefill_sites", self.prefill_sites, self.num_prefill),
            ("decode_sites", self.decode_sites, self.num_decode),
        ):
            if sites is not None and len(sites) != count:
                raise InvalidRequestError(f"{label} needs {count} sites, got {len(sites)}")

    def handoff_scale(self, prefill_id: int, decode_id: int) -> float:
        """The prefill-to-decode handoff's time as a multiple of the cost model's transfer
        (priced within one rack): the live router's factor for the two instances' distance
        (:data:`kvstore.routing.policy.HANDOFF_SCALE`, over its same-rack one), 1 where
        either side has no sites."""
        if self.prefill_sites is None or self.decode_sites is None:
            return 1.0
        far = distance(self.prefill_sites[prefill_id], self.decode_sites[decode_id])
        return HANDOFF_SCALE[far] / HANDOFF_SCALE[SAME_RACK]


@dataclass(slots=True)
class ClusterState:
    """Everything the scheduler reads. ``pool`` is ``None`` when there is no global pool.

    Mooncake's pool is the DRAM of all prefill nodes, so a block held by any instance's local
    cache can also be fetched by another instance (at transfer cost); ``pool`` adds a shared
    store of its own on top.
    """

    prefill: list[PrefillInstance]
    decode: list[DecodeInstance]
    pool: BlockCache | None
    block_size_tokens: int

    @staticmethod
    def build(config: ClusterConfig) -> ClusterState:
        """Build an idle cluster with empty caches.

        Args:
            config: sizes and cost model.

        Returns:
            A fresh state.
        """
        prefill = [
            PrefillInstance(
                i, config.cost, BlockCache(config.local_cache_blocks, config.cache_policy)
            )
            for i in range(config.num_prefill)
        ]
        decode = [
            DecodeInstance(
                i, config.cost, config.decode_kv_capacity_tokens, config.decode_max_batch_size
            )
            for i in range(config.num_decode)
        ]
        pool = (
            None if config.pool_blocks == 0 else BlockCache(config.pool_blocks, config.cache_policy)
        )
        return ClusterState(prefill, decode, pool, config.cost.block_size_tokens)
