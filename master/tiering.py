"""The tier manager: placement across tiers, watermark eviction, demotion and promotion.

Mechanism here, policy in :mod:`kvstore.eviction` (which only ranks candidates). It acts on the
owners of the master's state (``membership``, ``table``, ``space``, ``puts``, ``tasks``), never on
the service: frees go through ``Space``, pending writes are read from ``Puts``, and two-phase puts
get their placement from :meth:`TierManager.placer` (so they need not import this module).

- **Placement**: a put goes to the fastest tier with room (HBM, then DRAM, then NVMe), on k
  distinct nodes. When no node has room, the put evicts synchronously: on a node, from its last
  tier first (delete victims ranked by the policy, unpinned before soft-pinned) until the object
  fits, and lands there. ``NoSpaceError`` only when what is left is leased, hard-pinned, moving
  or being written, and the message says which.
- **Background eviction** (``tick``): a segment above its high watermark is brought down to its
  low watermark. Victims are demoted one tier down on the same node (a ``move`` task: the node
  copies, the master switches the replica when the node reports success, and frees the old space
  only once no lease covers it), or further down when that tier is full and a lower one has
  room (a full NVMe over the shared tier); from the last tier they are deleted.
- **Promotion**: an object read ``promote_after_hits`` times while it lives only below DRAM is
  moved up one tier when that tier has room under its high watermark (and, for a tenant's
  object, under the tenant's quota there).
- **Tenant quotas** (``quotas.py``): a tenant's put that would take it over its quota in the
  tier it is placed in first frees the tenant's own coldest objects there (demoted one tier
  down on their node where that tier has room, else deleted), never another's, and is refused
  ``NoSpaceError`` naming the tenant and tier when that cannot make room. Eviction for anyone
  takes victims from tenants over their quota in the tier first, then from objects of no tenant
  or of tenants without a quota there, and from tenants within their quota last: a quota is a
  share the tenant keeps under another tenant's churn.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvstore.errors import InvalidRequestError, NoSpaceError
from kvstore.eviction import make_policy
from kvstore.master.leases import PIN_HARD, PIN_NONE, PIN_SOFT
from kvstore.master.locality import Locality, NearPlacer
from kvstore.master.membership import Membership, Node, Segment
from kvstore.master.prefix import PrefixIndex
from kvstore.master.puts import Place, Puts
from kvstore.master.quotas import NEUTRAL, TENANT_END, TenantQuotas
from kvstore.master.space import Space
from kvstore.master.table import ObjectMeta, ObjectTable, Replica
from kvstore.master.tasks import PURPOSE_DEMOTE, PURPOSE_PROMOTE, TASK_GRACE_S, Task, TaskBook
from kvstore.placement import Homes
from kvstore.tenants import owner_of
from kvstore.topology import Site
from kvstore.types import TIER_DRAM, TIER_ORDER, TIER_RANK

log = logging.getLogger(__name__)

__all__ = [
    "Candidates",
    "TierConfig",
    "TierManager",
    "ordered_segments",
]
#: Most victims one segment considers per tick.
MAX_VICTIMS_PER_TICK = 4096


@dataclass(frozen=True, slots=True)
class TierConfig:
    """Tier policy settings. Validated on creation.

    Attributes:
        high_watermark, low_watermark: fractions of a segment's capacity; crossing the high one
            starts eviction down to the low one. ``0 < low < high <= 1``.
        tier_watermarks: per-tier overrides, ``((tier, high, low), ...)``.
        eviction_policy: a name in ``EVICTION_POLICIES``.
        lease_s: how long a read lease (and its read grant) lasts.
        lease_grace_s: extra hold on freed space past a lease, for clock skew.
        promote_after_hits: reads of an NVMe-only object before it moves up (0: never).
        task_timeout_s: a node task not reported done by then is abandoned.
        max_tasks_per_heartbeat: tasks handed to a node per heartbeat reply.
        max_task_bytes_per_heartbeat: bytes those tasks may move (past the first task).
        max_pin_ttl_s: the longest pin.
    """

    high_watermark: float = 0.90
    low_watermark: float = 0.80
    tier_watermarks: tuple[tuple[str, float, float], ...] = ()
    eviction_policy: str = "lru"
    lease_s: float = 5.0
    lease_grace_s: float = 0.25
    promote_after_hits: int = 3
    task_timeout_s: float = 30.0
    max_tasks_per_heartbeat: int = 256
    max_task_bytes_per_heartbeat: int = 64 << 20
    max_pin_ttl_s: float = 86400.0

    def __post_init__(self) -> None:
        _check_marks("default", self.high_watermark, self.low_watermark)
        for entry in self.tier_watermarks:
            if not isinstance(entry, tuple | list) or len(entry) != 3:
                raise InvalidRequestError("tier_watermarks entries must be (tier, high, low)")
            tier, high, low = entry
            if tier not in TIER_RANK:
                raise InvalidRequestError(f"unknown tier {tier!r} in tier_watermarks")
            _check_marks(tier, high, low)
        make_policy(self.eviction_policy)
        for name in ("lease_s", "task_timeout_s", "max_pin_ttl_s"):
            if not getattr(self, name) > 0:
                raise InvalidRequestError(f"{name} must be > 0")
        if self.lease_grace_s < 0:
            raise InvalidRequestError("lease_grace_s must be >= 0")
        if not isinstance(self.promote_after_hits, int) or self.promote_after_hits < 0:
            raise InvalidRequestError("promote_after_hits must be an integer >= 0")
        if self.max_tasks_per_heartbeat <= 0 or self.max_task_bytes_per_heartbeat <= 0:
            raise InvalidRequestError("per-heartbeat task limits must be > 0")

    def marks(self, tier: str) -> tuple[float, float]:
        """``(high, low)`` for a tier."""
        for t, high, low in self.tier_watermarks:
            if t == tier:
                return high, low
        return self.high_watermark, self.low_watermark


def _short(seg: Segment, size: int) -> bool:
    """Whether ``seg`` has no free extent for ``size`` bytes now."""
    return seg.allocator.largest_free < seg.allocator.reserved_size(size)


def _check_marks(tier: str, high: object, low: object) -> None:
    ok = (
        isinstance(high, int | float)
        and isinstance(low, int | float)
        and not isinstance(high, bool)
        and not isinstance(low, bool)
        and 0 < low < high <= 1
    )
    if not ok:
        raise InvalidRequestError(
            f"watermarks of {tier} must satisfy 0 < low < high <= 1, got high={high!r} low={low!r}"
        )


#: A run of objects of one size in a put batch is allocated together on one node until that
#: node's segment has this many bytes less free than a rival's (see :meth:`TierManager.run_length`):
#: objects this large or larger alternate between equally free nodes one by one.
RUN_BYTES = 16 << 10


@dataclass(slots=True)
class Candidates:
    """Where a batch of new objects may go (see :meth:`TierManager.candidates`)."""

    nodes: list[Node]
    segments: list[list[Segment]]  # per node, fastest tier first
    largest: int  # the largest segment's capacity


def ordered_segments(node: Node) -> list[Segment]:
    """A node's segments, fastest tier first."""
    return sorted(node.segments.values(), key=lambda s: TIER_RANK.get(s.tier, len(TIER_ORDER)))


class TierManager:
    """Placement, eviction and moves between tiers, acting on the master's owners.

    The service calls it from its single thread.

    Args:
        config: the tier policy.
        membership: the nodes and their segments.
        objects: the object table (victims are ranked from it).
        space: frees what eviction and finished moves give up.
        puts: the pending puts (their space is neither evictable nor free).
        tasks: where moves are queued for the nodes.
        prefix: told when an indexed block moves between tiers.
        clock: monotonic seconds.
        wall_ms: wall-clock milliseconds (task deadlines the nodes check).
    """

    def __init__(
        self,
        config: TierConfig,
        membership: Membership,
        objects: ObjectTable,
        space: Space,
        puts: Puts,
        tasks: TaskBook,
        prefix: PrefixIndex,
        clock: Callable[[], float],
        wall_ms: Callable[[], int],
    ) -> None:
        self.config = config
        self.membership = membership
        self.objects = objects
        self.space = space
        self.puts = puts
        self.tasks = tasks
        self.prefix = prefix
        self.clock = clock
        self.wall_ms = wall_ms
        self.policy = make_policy(config.eviction_policy)
        #: The nodes' sites: placement near the writer, replicas apart (master/locality.py).
        self.locality = Locality(membership)
        #: Tenant quotas and usage (the space's: it counts what comes and goes).
        self.quotas: TenantQuotas = space.quotas
        self.num_demotions = 0
        self.num_promotions = 0
        self.num_evictions = 0  # replicas deleted from their last tier (background)
        self.num_sync_evictions = 0  # replicas deleted to make room for a put
        self.num_moves_failed = 0

    # ================================================================ candidates
    def pin_of(self, obj: ObjectMeta, now: float) -> int:
        return obj.pin if obj.pin != PIN_NONE and obj.pin_until > now else PIN_NONE

    def victims(
        self, node: Node, seg: Segment, now: float, limit: int = MAX_VICTIMS_PER_TICK
    ) -> list[tuple[ObjectMeta, Replica]]:
        """Evictable replicas in ``seg``, best victim first: unpinned, then soft-pinned."""
        plain: list[ObjectMeta] = []
        soft: list[ObjectMeta] = []
        offset_of: dict[int, int] = {}
        objects = self.objects
        for off, key in seg.holding.items():
            # Looked at, not taken: ranking a segment makes no ObjectMeta of its cold objects.
            obj = objects.peek(key)
            if obj is None or obj.busy or obj.lease_until > now:
                continue
            pin = self.pin_of(obj, now)
            if pin == PIN_HARD:
                continue
            (soft if pin == PIN_SOFT else plain).append(obj)
            offset_of[id(obj)] = off
        ranked = self._rank(plain, limit, seg.tier)
        if len(ranked) < limit:
            ranked += self._rank(soft, limit - len(ranked), seg.tier)
        out: list[tuple[ObjectMeta, Replica]] = []
        for seen in ranked:
            off = offset_of[id(seen)]
            obj = objects[seen.key]  # the table's own record of a victim
            for r in obj.replicas:
                if r.node_id == node.node_id and r.segment == seg.name and r.offset == off:
                    out.append((obj, r))
                    break
        return out

    def _rank(self, objs: list[ObjectMeta], limit: int, tier: str) -> list[ObjectMeta]:
        """The policy's ranking of ``objs`` (victims in ``tier``), tenants over their quota
        there first and tenants within it last (see the module docstring); with no quota set
        anywhere, the policy's ranking alone."""
        quotas = self.quotas
        if not quotas.limited:
            return self.policy.rank(objs, limit)
        standing = quotas.standing(tier)
        classes: tuple[list[ObjectMeta], ...] = ([], [], [])
        for obj in objs:
            key = obj.key
            tenant = owner_of(key) if key < TENANT_END else None
            classes[standing.get(tenant, NEUTRAL) if tenant is not None else NEUTRAL].append(obj)
        ranked: list[ObjectMeta] = []
        for group in classes:
            if len(ranked) >= limit:
                break
            ranked += self.policy.rank(group, limit - len(ranked))
        return ranked

    # ================================================================ placement
    def candidates(self, excluded: set[str]) -> Candidates:
        """The nodes that can take a new object now (not excluded, draining or retired), each
        with its segments fastest tier first; computed once per batch and passed to
        :meth:`place` for each of its keys (membership does not change within a batch)."""
        nodes = [
            n
            for n in self.membership.nodes.values()
            if n.node_id not in excluded and not n.draining and not n.retired
        ]
        largest = max((s.allocator.capacity for n in nodes for s in n.segments.values()), default=0)
        return Candidates(nodes, [ordered_segments(n) for n in nodes], largest)

    def placer(self, excluded: set[str], at: Site | None = None) -> Place:
        """Placement for one batch of puts: :meth:`place` over the candidates of ``excluded``,
        computed once (membership does not change within a batch), and how many of the
        batch's next objects of that size may follow the first there (:meth:`run_length`).
        ``at``: the writer's site (near it first, replicas apart: ``locality.NearPlacer``)."""
        cands = self.candidates(excluded)
        near = self.locality.placer(at, lambda tier: self.config.marks(tier)[0])
        refused: dict[tuple[str, str], NoSpaceError] = {}  # (tenant, tier): once per batch
        # Keys go to their home node first (kvstore.placement) unless the writer's site asks
        # for another place; with one node there is nothing to choose.
        homes = Homes([n.node_id for n in cands.nodes]) if near is None else None
        if homes is not None and len(homes) < 2:
            homes = None
        at_home = {n.node_id: i for i, n in enumerate(cands.nodes)} if homes is not None else {}

        def place(
            size: int,
            num_replicas: int,
            count: int = 1,
            tenant: str | None = None,
            home: str | None = None,
        ) -> tuple[list[tuple[Segment, Node]], int]:
            limited = tenant if tenant is not None and tenant in self.quotas.limited else None
            if limited is not None and not self._fits_without_eviction(size, num_replicas, cands):
                # The cluster is full: placement will evict for this put. The tenant frees its
                # own first (or is refused) in the tier it would land in, so that nobody
                # else's object goes for a put its quota refuses.
                self.admit(limited, self._landing(size, cands), size, 1, refused)
            first = self._home_with_room(size, cands, at_home.get(home)) if home else None
            picks = self.place(size, excluded, num_replicas, cands, near, first)
            if first is not None and picks[0] is first:
                # Every key of this run has the same home: as many as its room takes at once.
                k = max(
                    1,
                    min(
                        count,
                        *(
                            s.allocator.largest_free // s.allocator.reserved_size(size)
                            for s, _ in picks
                        ),
                    ),
                )
            elif near is None:
                k = self.run_length(picks, size, count, cands)
            else:
                k = near.run_length(picks, size, count, cands.nodes, cands.segments, RUN_BYTES)
            if limited is not None:
                k = self.admit(limited, picks, size, k, refused)
            return picks, k

        place.homes = homes  # type: ignore[attr-defined]
        return place

    @staticmethod
    def _home_with_room(size: int, cands: Candidates, i: int | None) -> tuple[Segment, Node] | None:
        """The fastest segment of candidate ``i`` (a key's home) when it has room for
        ``size`` without eviction; None otherwise (placement then goes as usual)."""
        if i is None or not cands.segments[i]:
            return None
        seg = cands.segments[i][0]
        alloc = seg.allocator
        if alloc.largest_free < alloc.reserved_size(size):
            return None
        return seg, cands.nodes[i]

    def _fits_without_eviction(self, size: int, num_replicas: int, cands: Candidates) -> bool:
        """Whether :meth:`place` finds its ``num_replicas`` segments without evicting."""
        chosen: list[str] = []
        while len(chosen) < num_replicas:
            pick = self._best_with_room(size, cands, chosen)
            if pick is None:
                return False
            chosen.append(pick[1].node_id)
        return True

    def _landing(self, size: int, cands: Candidates) -> list[tuple[Segment, Node]]:
        """Where a put that must evict lands on the first candidate node (its last tier that
        can hold ``size``, as :meth:`make_room` tries them), for a quota check before it
        evicts; nothing when there is no candidate."""
        for n, segments in zip(cands.nodes, cands.segments, strict=True):
            for seg in reversed(segments):
                if seg.allocator.reserved_size(size) <= seg.allocator.capacity:
                    return [(seg, n)]
        return []

    def admit(
        self,
        tenant: str,
        picks: list[tuple[Segment, Node]],
        size: int,
        count: int,
        refused: dict[tuple[str, str], NoSpaceError] | None = None,
    ) -> int:
        """How many of ``count`` objects of ``tenant`` (``size`` bytes each) placed at
        ``picks`` its quotas take (at least one), after freeing its own coldest objects in
        each tier it would go over.

        Why free more than the run needs (down to the tier's low watermark's share of the
        quota): a tenant writing steadily at its quota would otherwise rank its objects on
        every batch.

        Raises:
            NoSpaceError: not one object fits the tenant's quota in a tier even once its own
                evictable objects there are freed (nothing was freed); ``refused`` remembers it
                for the rest of the batch.
        """
        per_tier: dict[str, int] = {}
        for seg, _ in picks:
            per_tier[seg.tier] = per_tier.get(seg.tier, 0) + size
        quotas = self.quotas
        for tier, per in per_tier.items():
            quota = quotas.limit(tenant, tier)
            if quota is None:
                continue
            err = refused.get((tenant, tier)) if refused else None
            if err is not None:
                raise err
            room = quota - quotas.charged(tenant, tier)
            if room >= count * per:
                continue
            high, low = self.config.marks(tier)
            slack = int(quota * (1 - low / high))
            room += self.free_own(tenant, tier, per - room, count * per - room + slack)
            if room < per:
                quotas.refused(tenant)
                err = NoSpaceError(
                    f"tenant {tenant!r} is at its {tier} quota ({quota} bytes, "
                    f"{quotas.charged(tenant, tier)} used or being written) and none of its "
                    f"own {tier} objects can go now (leased, pinned or moving)"
                )
                if refused is not None:
                    refused[(tenant, tier)] = err
                raise err
            count = min(count, room // per)
        return count

    def free_own(self, tenant: str, tier: str, need: int, want: int) -> int:
        """Free ``tenant``'s own coldest replicas in ``tier``: at least ``need`` bytes or none
        at all, then on up to ``want``. Each is demoted one tier down on its node when that
        tier has room there and the tenant's quota there takes it (else it is deleted): never
        another's object goes for it.

        Returns:
            Bytes freed (0 when ``need`` could not be met: nothing changed).
        """
        now = self.clock()
        plain: list[ObjectMeta] = []
        soft: list[ObjectMeta] = []
        objects = self.objects
        for key in self.quotas.keys_in(tenant, tier):
            obj = objects.peek(key)
            if obj is None or obj.busy or obj.lease_until > now:
                continue
            pin = self.pin_of(obj, now)
            if pin != PIN_HARD:
                (soft if pin == PIN_SOFT else plain).append(obj)
        ranked = self.policy.rank(plain, len(plain)) + self.policy.rank(soft, len(soft))
        plan: list[tuple[ObjectMeta, list[Replica]]] = []
        total = 0
        for seen in ranked:
            here_bytes = seen.size * sum(1 for r in seen.replicas if r.tier == tier)
            if total >= need and total + here_bytes > want:
                break  # (past what is needed, never beyond what is wanted)
            obj = objects[seen.key]
            here = [r for r in obj.replicas if r.tier == tier]
            plan.append((obj, here))
            total += here_bytes
        if total < need:
            return 0
        freed = 0
        for obj, here in plan:
            for replica in here:
                self._free_own_replica(tenant, obj, replica, now)
                freed += obj.size
        return freed

    def _free_own_replica(self, tenant: str, obj: ObjectMeta, replica: Replica, now: float) -> None:
        """Demote ``replica`` of ``tenant``'s ``obj`` where :meth:`free_own` may, else delete it."""
        node = self.membership.nodes.get(replica.node_id)
        if node is not None and not obj.busy:
            segs = ordered_segments(node)
            i = next(i for i, s in enumerate(segs) if s.name == replica.segment)
            lower = segs[i + 1] if i + 1 < len(segs) else None
            if lower is not None and self._quota_room(tenant, lower.tier, obj.size):
                alloc = lower.allocator
                if alloc.largest_free >= alloc.reserved_size(obj.size):
                    self._move(obj, replica, node, lower, PURPOSE_DEMOTE, now)
                    return
        self.space.delete_replica(obj, replica)
        self.quotas.evicted(obj.key)
        self.num_sync_evictions += 1

    def _quota_room(self, tenant: str, tier: str, size: int) -> bool:
        """Whether ``tenant``'s quota in ``tier`` takes ``size`` more bytes (no quota: yes)."""
        quota = self.quotas.limit(tenant, tier)
        return quota is None or self.quotas.charged(tenant, tier) + size <= quota

    @staticmethod
    def run_length(
        picks: list[tuple[Segment, Node]], size: int, count: int, cands: Candidates
    ) -> int:
        """How many of ``count`` objects of ``size`` (at least 1) may go where one was just
        placed (``picks``), allocated together: as many as one free extent of every chosen
        segment holds (they surely fit), and no more than keep the objects spread as one
        placement each would: a chosen segment takes objects until it has ``RUN_BYTES`` less
        free than the roomiest segment of its tier on a node not chosen (one placement each
        would alternate between them object by object)."""
        if count <= 1:
            return 1
        chosen = [n.node_id for _, n in picks]
        k = count
        for seg, _ in picks:
            alloc = seg.allocator
            need = alloc.reserved_size(size)
            k = min(k, alloc.largest_free // need)
            rival = max(
                (
                    s.allocator.free_bytes
                    for n, segments in zip(cands.nodes, cands.segments, strict=True)
                    if n.node_id not in chosen
                    for s in segments
                    if s.tier == seg.tier and s.allocator.largest_free >= need
                ),
                default=None,
            )
            if rival is not None:
                k = min(k, max(0, alloc.free_bytes - rival + RUN_BYTES) // need)
        return max(1, k)

    def place(
        self,
        size: int,
        excluded: set[str],
        num_replicas: int,
        cands: Candidates | None = None,
        near: NearPlacer | None = None,
        first: tuple[Segment, Node] | None = None,
    ) -> list[tuple[Segment, Node]]:
        """Choose ``num_replicas`` segments on distinct nodes for a new object, evicting if needed.

        Args:
            cands: :meth:`candidates` of ``excluded``, when the caller places a batch.
            near: ranks the offers by locality instead (``locality.NearPlacer``).
            first: the first replica's segment, already chosen (the key's home, with room).

        Raises:
            NoSpaceError: too few nodes, an object larger than any segment, or no room left that
                eviction could make (the message says what holds the space).
        """
        if cands is None:
            cands = self.candidates(excluded)
        nodes, largest = cands.nodes, cands.largest
        if not self.membership.nodes:
            raise NoSpaceError("no storage node is registered")
        if len(nodes) < num_replicas:
            raise NoSpaceError(
                f"{num_replicas} replica(s) need as many nodes; {len(nodes)} can take data"
            )
        if nodes and self._reserved(nodes[0], size) > largest:
            raise NoSpaceError(
                f"an object of {size} bytes is larger than any tier segment ({largest} bytes)"
            )
        # The best node with room first, then the best of the others: each node offers its
        # fastest segment with room, ranked by tier, then free bytes, then node order.
        picks: list[tuple[Segment, Node]] = [first] if first is not None else []
        # (a list: it holds a replica count of ids, usually none)
        chosen: list[str] = [first[1].node_id] if first is not None else []
        while len(picks) < num_replicas:
            if near is None:
                pick = self._best_with_room(size, cands, chosen)
            else:
                pick = near.best(size, cands.nodes, cands.segments, [n for _, n in picks])
            if pick is None:
                break
            picks.append(pick)
            chosen.append(pick[1].node_id)
        if len(picks) < num_replicas:
            for n in nodes if near is None else near.ordered(nodes, [n for _, n in picks]):
                if n.node_id in chosen:
                    continue
                seg = self.make_room(n, size)
                if seg is not None:
                    picks.append((seg, n))
                    if len(picks) == num_replicas:
                        break
        if len(picks) < num_replicas:
            raise NoSpaceError(self._blocked_reason(size, nodes))
        return picks

    @staticmethod
    def _best_with_room(
        size: int, cands: Candidates, chosen: list[str]
    ) -> tuple[Segment, Node] | None:
        """The best segment with room for ``size`` without eviction on a node not in ``chosen``:
        each node's fastest segment with room, the fastest tier first, then the most free
        bytes, then the first node. One pass, no list of options to sort: it runs once per
        key of every put batch."""
        best: tuple[Segment, Node] | None = None
        best_rank, best_free = 0, 0
        rank_of, slowest = TIER_RANK.get, len(TIER_ORDER)
        for n, segments in zip(cands.nodes, cands.segments, strict=True):
            if chosen and n.node_id in chosen:
                continue
            for seg in segments:
                alloc = seg.allocator
                if alloc.largest_free >= alloc.reserved_size(size):
                    rank, free = rank_of(seg.tier, slowest), alloc.free_bytes
                    if best is None or rank < best_rank or rank == best_rank and free > best_free:
                        best, best_rank, best_free = (seg, n), rank, free
                    break
        return best

    def _reserved(self, node: Node, size: int) -> int:
        seg = next(iter(node.segments.values()))
        return seg.allocator.reserved_size(size)

    def make_room(self, node: Node, size: int) -> Segment | None:
        """Delete victims on ``node`` until one segment fits ``size`` (last tier first)."""
        now = self.clock()
        for seg in reversed(ordered_segments(node)):
            if self.make_room_in(node, seg, size, now):
                return seg
        return None

    def make_room_in(self, node: Node, seg: Segment, size: int, now: float) -> bool:
        need = seg.allocator.reserved_size(size)
        if need > seg.allocator.capacity:
            return False
        if seg.allocator.largest_free >= need:
            return True
        for obj, replica in self.victims(node, seg, now):
            self.space.delete_replica(obj, replica)
            self.num_sync_evictions += 1
            if obj.key < TENANT_END:
                self.quotas.evicted(obj.key)
            if seg.allocator.largest_free >= need:
                return True
        return False

    def _blocked_reason(self, size: int, nodes: list[Node]) -> str:
        now = self.clock()
        leased = pinned = moving = 0
        leased_b = pinned_b = 0
        for n in nodes:
            for seg in n.segments.values():
                for key in seg.holding.values():
                    obj = self.objects.peek(key)
                    if obj is None:
                        continue
                    if obj.busy:
                        moving += 1
                    elif obj.lease_until > now:
                        leased += 1
                        leased_b += obj.size
                    elif self.pin_of(obj, now) == PIN_HARD:
                        pinned += 1
                        pinned_b += obj.size
        writing = self.puts.num_writing_on({n.node_id for n in nodes})
        return (
            f"no room for {size} bytes: what is left is leased ({leased} objects, {leased_b} bytes), "
            f"hard-pinned ({pinned} objects, {pinned_b} bytes), moving between tiers ({moving}) "
            f"or being written ({writing} puts)"
        )

    # ================================================================ background
    def tick(self, now: float) -> None:
        """Bring every segment above its high watermark down towards its low watermark."""
        outgoing: dict[tuple[str, str], int] = {}
        for t in self.tasks.by_id.values():
            if t.purpose == PURPOSE_DEMOTE:
                k = (t.src.node_id, t.src.segment)
                outgoing[k] = outgoing.get(k, 0) + t.src.size
        for node in list(self.membership.nodes.values()):
            if node.retired:
                continue
            segs = ordered_segments(node)
            for i, seg in enumerate(segs):
                cap = seg.allocator.capacity
                if cap == 0:
                    continue
                high, low = self.config.marks(seg.tier)
                used = seg.allocator.used_bytes - outgoing.get((node.node_id, seg.name), 0)
                if used <= high * cap:
                    continue
                to_free = used - low * cap
                lower = segs[i + 1] if i + 1 < len(segs) else None
                for obj, replica in self.victims(node, seg, now):
                    if to_free <= 0:
                        break
                    if lower is None:
                        self.space.delete_replica(obj, replica)
                        self.num_evictions += 1
                        if obj.key < TENANT_END:
                            self.quotas.evicted(obj.key)
                    elif not self._demote_down(obj, replica, node, segs[i + 1 :], now):
                        break  # the lower tier is full of what it may not evict
                    to_free -= seg.allocator.reserved_size(obj.size)

    def _demote_down(
        self, obj: ObjectMeta, replica: Replica, node: Node, below: list[Segment], now: float
    ) -> bool:
        """Demote ``obj`` into the first segment of ``below`` (the node's lower tiers, fastest
        first) that a tenant's quota takes, else into the next one down whatever the quota: a
        demotion is never given up for a quota (``quotas.py``, Moves). Returns whether it was
        planned."""
        lower = below[0]
        if obj.key < TENANT_END and self.quotas.limited:
            tenant = owner_of(obj.key)
            if tenant is not None and not self.quotas.has_room(tenant, lower.tier, obj.size):
                has_room = self.quotas.has_room
                roomy = next((s for s in below[1:] if has_room(tenant, s.tier, obj.size)), None)
                if roomy is not None and self._demote(obj, replica, node, roomy, now):
                    return True
        if _short(lower, obj.size):
            # NOTE: the next tier is full: a tier further down with room (the shared tier under
            # a full NVMe) takes the object rather than the next tier losing its victims.
            roomy = next((s for s in below[1:] if not _short(s, obj.size)), None)
            if roomy is not None:
                self._move(obj, replica, node, roomy, PURPOSE_DEMOTE, now)
                return True
        return self._demote(obj, replica, node, lower, now)

    def _demote(
        self, obj: ObjectMeta, replica: Replica, node: Node, lower: Segment, now: float
    ) -> bool:
        short = lower.allocator.largest_free < lower.allocator.reserved_size(obj.size)
        if short and not self.make_room_in(node, lower, obj.size, now):
            return False
        self._move(obj, replica, node, lower, PURPOSE_DEMOTE, now)
        return True

    def _move(
        self, obj: ObjectMeta, src: Replica, node: Node, dst_seg: Segment, purpose: str, now: float
    ) -> None:
        offset = dst_seg.allocator.allocate(obj.size)
        assert offset is not None, "a move was planned without room"
        claim = dst_seg.claim_stamp(self.space.claim_base())
        dst = Replica(
            node.node_id,
            dst_seg.name,
            offset,
            obj.size,
            stamp=src.stamp,
            tier=dst_seg.tier,
            claim=claim,
        )
        tasks = self.tasks
        task_id = tasks.next_id()
        deadline = now + self.config.task_timeout_s + TASK_GRACE_S
        wire: dict[str, Any] = {
            "id": task_id,
            "kind": "move",
            "key": obj.key,
            "size": obj.size,
            "checksum": obj.checksum,
            "src": [src.segment, src.offset],
            "dst": [dst.segment, dst.offset],
            "stamp": dst.stamp,
            "deadline_ms": self.wall_ms() + int(self.config.task_timeout_s * 1000),
            # Where the node writes is a new allocation: its place among write grants for
            # those bytes (their expiry) fences every older one (kvstore.claims.WriteClaims).
            "claim_ms": claim,
        }
        tasks.add(Task(task_id, purpose, node.node_id, obj.key, src, dst, deadline, wire))
        obj.busy = task_id
        if obj.key < TENANT_END:
            self.quotas.move_started(obj.key, src.tier, dst.tier, obj.size, purpose)

    # ================================================================ promotion
    def on_read(self, obj: ObjectMeta, now: float) -> None:
        """Count a read; move an object that lives only below DRAM up after enough reads."""
        obj.hits += 1
        obj.hits_since_move += 1
        obj.last_access = now
        n = self.config.promote_after_hits
        if not n or obj.busy or obj.hits_since_move < n:
            return
        if any(TIER_RANK.get(r.tier, 9) <= TIER_RANK[TIER_DRAM] for r in obj.replicas):
            return
        for r in obj.replicas:
            node = self.membership.nodes.get(r.node_id)
            if node is None or node.draining or node.retired:
                continue
            segs = ordered_segments(node)
            upper = [s for s in segs if TIER_RANK.get(s.tier, 9) < TIER_RANK.get(r.tier, 9)]
            if not upper:
                continue
            target = upper[-1]  # one step up
            high, _ = self.config.marks(target.tier)
            need = target.allocator.reserved_size(obj.size)
            if (
                target.allocator.largest_free >= need
                and target.allocator.used_bytes + need <= high * target.allocator.capacity
                and (obj.key >= TENANT_END or self._promotable(obj, target.tier))
            ):
                self._move(obj, r, node, target, PURPOSE_PROMOTE, now)
                return

    def _promotable(self, obj: ObjectMeta, tier: str) -> bool:
        """Whether a tenant's ``obj`` may move up into ``tier``: its quota there takes it."""
        tenant = owner_of(obj.key)
        return tenant is None or self._quota_room(tenant, tier, obj.size)

    # ================================================================ completion
    def settle(self, task: Task, ok: bool, now: float) -> None:
        """A demotion or promotion finished (``ok``) or failed: switch the replica or undo."""
        obj = self.objects.get(task.key)
        # NOTE: ``busy`` names the task, so a removed-and-rewritten key (a new ObjectMeta) never
        # takes the bytes of the version this task copied.
        same = obj is not None and obj.busy == task.task_id
        if same:
            obj.busy = 0
        moved = ok and same and obj.swap_replica(task.src, task.dst)
        if task.key < TENANT_END:
            self.quotas.move_ended(
                task.key, task.src.tier, task.dst.tier, task.src.size, task.purpose, moved
            )
        if moved:
            self.space.attach(obj.key, task.dst)
            self.space.release(task.src, hold_until=self.space.hold_until(obj, now), lease_of=obj)
            self.prefix.moved(obj.key, task.src.tier, task.dst.tier)
            obj.hits_since_move = 0
            if task.purpose == PURPOSE_DEMOTE:
                self.num_demotions += 1
            else:
                self.num_promotions += 1
            return
        if not ok:
            self.num_moves_failed += 1
        self.space.release(task.dst)

    def stats(self) -> dict[str, Any]:
        return {
            "policy": self.policy.name,
            "num_demotions": self.num_demotions,
            "num_promotions": self.num_promotions,
            "num_evictions": self.num_evictions,
            "num_sync_evictions": self.num_sync_evictions,
            "num_moves_failed": self.num_moves_failed,
            "num_moves_in_flight": sum(
                1
                for t in self.tasks.by_id.values()
                if t.purpose in (PURPOSE_DEMOTE, PURPOSE_PROMOTE)
            ),
        }
