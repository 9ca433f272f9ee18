"""The space under the object table: which segment extents hold committed replicas, and
freeing them (now, or once the read leases that cover them end).

Why its own owner: every way a replica goes (a remove, an overwrite, an eviction, a finished
move or drain, a revoked put, a corrupt copy) ends the same way here: the extent leaves its
segment's index, and its space is freed at once or *held* while a reader may still be on its
bytes (``leases.DeferredFrees``). Freed space is reported to its node in the next heartbeat
reply (``Node.forgotten``), and new write claims on it are ordered after every older one
(``Segment.reuse_floor``). The tier manager, the replicator, two-phase puts, recovery and the
service's verbs all free through this one path.

It also keeps the read leases (``leases.ReadLeases``): a lease that ends frees what it held.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from kvstore.master.config import MasterConfig
from kvstore.master.event_ring import EVENT_EVICTED
from kvstore.master.leases import DeferredFrees, ReadLeases
from kvstore.master.membership import Membership, Node
from kvstore.master.prefix import PrefixIndex
from kvstore.master.quotas import TENANT_END, TenantQuotas
from kvstore.master.table import ObjectMeta, ObjectTable, Replica
from kvstore.types import TIERS_BY_ID


class Space:
    """Replica extents of one master term.

    Args:
        config: the put timeout (how long a write claim lasts).
        membership: the nodes whose segments hold the space.
        objects: the object table (an object goes when its last replica does).
        prefix: the prefix index (told when an object goes).
        clock: monotonic seconds.
        wall_ms: wall-clock milliseconds (write claims, checked by nodes).
        lease_grace_s: how long freed space stays untouched past the end of a lease.
        quotas: told of every committed replica of a tenant's key that comes or goes (a fresh
            one when None).
    """

    def __init__(
        self,
        config: MasterConfig,
        membership: Membership,
        objects: ObjectTable,
        prefix: PrefixIndex,
        clock: Callable[[], float],
        wall_ms: Callable[[], int],
        lease_grace_s: float,
        quotas: TenantQuotas | None = None,
    ) -> None:
        self.config = config
        self.quotas = quotas if quotas is not None else TenantQuotas()
        self.membership = membership
        self.objects = objects
        self.prefix = prefix
        self.clock = clock
        self.wall_ms = wall_ms
        self.lease_grace_s = lease_grace_s
        self.deferred = DeferredFrees()
        self.leases = ReadLeases()
        #: Per dropped node: the memory extents a reader may still be on, each with the time its
        #: lease (and grace) ends, and the latest of those times (see :meth:`fence_dropped`).
        self.fenced: dict[str, tuple[float, list[tuple[Replica, float]]]] = {}

    def claim_base(self) -> int:
        """The write claim (wall ms) of an allocation made now, before its segment's floor
        (see ``Segment.claim_stamp``): now plus the put timeout."""
        return self.wall_ms() + int(self.config.put_timeout_s * 1000)

    # ================================================================ committed replicas
    def attach(self, key: bytes, replica: Replica) -> None:
        """Record a committed replica in its segment's index (eviction and drain walk it)."""
        node = self.membership.nodes.get(replica.node_id)
        if node is not None:
            seg = node.segments[replica.segment]
            seg.holding.add(replica.offset, key, replica.size)
            if key < TENANT_END:  # a tenant's: its usage grows (kvstore.tenants)
                self.quotas.attached(key, seg.tier, replica.size)

    def hold_until(self, obj: ObjectMeta, now: float) -> float:
        """Until when freed space of ``obj`` must stay untouched (0 when no lease covers it)."""
        if obj.lease_until <= now:
            return 0.0
        return obj.lease_until + self.lease_grace_s

    def release(
        self, replica: Replica, hold_until: float = 0.0, lease_of: ObjectMeta | None = None
    ) -> None:
        """Free a replica's space: now, or once ``hold_until`` (a lease's end) has passed or
        every lease of ``lease_of`` (the object it belonged to) was given back."""
        node = self.membership.nodes.get(replica.node_id)
        if node is None:
            return  # the node is gone and its allocator with it
        seg = node.segments[replica.segment]
        key = seg.holding.pop(replica.offset, None)
        # (None: a put's or a move's bytes never committed here, which no usage counted)
        if key is not None and key < TENANT_END:
            self.quotas.detached(key, seg.tier, replica.size)
        if hold_until > self.clock():
            self.deferred.hold(hold_until, node, replica, lease_of)
            return
        self.free_now(node, replica)

    def release_all(
        self,
        replicas: Iterable[Replica],
        hold_until: float = 0.0,
        lease_of: ObjectMeta | None = None,
    ) -> None:
        """:meth:`release` each of ``replicas``."""
        for r in replicas:
            self.release(r, hold_until, lease_of)

    def release_object(self, obj: ObjectMeta) -> None:
        """Free every replica of an object that left the table; a reader holding a lease
        finishes on intact bytes (the space waits for it)."""
        self.release_all(obj.replicas, hold_until=self.hold_until(obj, self.clock()), lease_of=obj)

    def free_now(self, node: Node, replica: Replica) -> None:
        """Give a replica's extent back to its allocator; its node forgets it at the next
        heartbeat."""
        seg = node.segments[replica.segment]
        seg.reuse_floor = max(seg.reuse_floor, replica.stamp, replica.claim)
        in_limbo = seg.allocator.free(replica.offset)
        if in_limbo:
            node.limbo.append((replica.segment, in_limbo))
        node.forgotten.append((replica.segment, replica.offset, replica.stamp))

    def delete_replica(
        self,
        obj: ObjectMeta,
        replica: Replica,
        hold: bool = False,
        kind: str = EVENT_EVICTED,
        hold_at_least: float = 0.0,
    ) -> None:
        """Drop one replica (eviction, drain); the object goes when its last replica does.

        Args:
            hold: keep the space while a lease of ``obj`` covers it.
            kind: the KV event its blocks leave the prefix index with, if it goes.
            hold_at_least: keep the space until then whatever the leases do (a node task
                may still read it).
        """
        obj.remove_replica(replica)
        if not obj.num_replicas:
            del self.objects[obj.key]
            self.prefix.forget(obj.key, kind)
        elif obj.num_replicas < obj.replicas_wanted:
            # An evicted copy is not re-made: the object now wants what it has.
            obj.replicas_wanted = obj.num_replicas
        until = self.hold_until(obj, self.clock()) if hold else 0.0
        if hold_at_least > until:
            self.release(replica, hold_at_least)
        else:
            self.release(replica, until, obj)

    # ================================================================ leases
    def lease_ended(self, obj: ObjectMeta, now: float) -> None:
        """No lease of ``obj`` is outstanding: it may be evicted, its held space freed."""
        obj.lease_until = 0.0
        # A lease that ran out without being given back may still have a read on its way to a
        # node whose clock lags ours: space waits out the grace after its end.
        not_before = self.leases.last_unreleased_end + self.lease_grace_s
        for owner, replica in self.deferred.release_for(obj, not_before if not_before > now else 0):
            if self.membership.owns(owner):
                self.free_now(owner, replica)

    def release_leases(self, tokens: list[int], tenant: str | None = None) -> list[bool]:
        """Give checked lease tokens back, ``tenant``'s only (None: the operator, any).
        Returns per token whether it ended a lease."""
        ended, emptied = self.leases.release(tokens, tenant)
        now = self.clock()
        for obj in emptied:
            self.lease_ended(obj, now)
        return ended

    # ================================================================ dropped nodes
    def fence_dropped(self, node: Node, objs: Iterable[ObjectMeta]) -> None:
        """Remember which memory extents of ``node`` (being dropped, with ``objs`` the objects
        it held) a reader may still be on, and until when.

        Why: a reader of a same-host node reads its shared memory in place, trusting its lease
        that nothing reuses the bytes (``client/inplace.py``); a node declared dead that comes
        back under the same id maps the same arena, and its new allocator would hand those
        bytes to the next writer while the lease holds. :meth:`fence` holds them instead.
        """
        now = self.clock()
        fences = [
            (replica, until)
            for until, replica in self.deferred.held_until(node)
            if node.segments[replica.segment].tier not in TIERS_BY_ID
        ]
        for obj in objs:
            until = self.hold_until(obj, now)
            if until:
                fences.extend(
                    (r, until)
                    for r in obj.replicas
                    if r.node_id == node.node_id
                    and node.segments[r.segment].tier not in TIERS_BY_ID
                )
        if fences:
            self.fenced[node.node_id] = (max(u for _, u in fences), fences)
        else:
            self.fenced.pop(node.node_id, None)

    def forget_node(self, node: Node) -> None:
        """``node`` leaves with its replicas (dropped, not drained): its tenants' usage loses
        them at once (its releases after this change nothing: the node is gone)."""
        if not self.quotas.has_usage():
            return
        for seg in node.segments.values():
            for _, key in seg.holding.items():
                if key < TENANT_END:
                    obj = self.objects.peek(key)
                    if obj is not None:
                        self.quotas.detached(key, seg.tier, obj.size)

    def fence(self, node: Node) -> None:
        """Hold, in a node that registered again, the extents its earlier incarnation had under
        a lease (:meth:`fence_dropped`) until those leases end, as space freed under a lease
        is held. An extent the new segment cannot hold (resized, already taken) is skipped."""
        now = self.clock()
        for replica, until in self.fenced.pop(node.node_id, (0.0, []))[1]:
            seg = node.segments.get(replica.segment)
            if until <= now or seg is None or seg.tier in TIERS_BY_ID:
                continue
            if seg.allocator.allocate_at(replica.offset, replica.size):
                self.deferred.hold(until, node, replica)

    def tick(self, now: float) -> None:
        """Free space whose leases ended (given back or run out)."""
        for node_id in [n for n, (last, _) in self.fenced.items() if last <= now]:
            del self.fenced[node_id]  # a node that never came back: its leases are over
        for obj in self.leases.expire(now):
            self.lease_ended(obj, now)
        for owner, replica in self.deferred.due(now):
            if not self.membership.owns(owner):
                continue  # the node died or re-registered: that allocator is gone
            self.free_now(owner, replica)

    def held_by_node(self, node: Node) -> set[tuple[str, int]]:
        """Extents of ``node`` freed but still held for a lease (the node has not forgotten
        them yet)."""
        return {(r.segment, r.offset) for r in self.deferred.held_for(node)}
