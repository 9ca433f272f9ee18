"""Re-replication after node deaths, and draining a node before it retires.

Both copy objects node to node: the master plans a ``fetch`` task for the destination node,
carrying a read grant for a surviving replica; the node pulls the bytes from its peer, checks
the checksum and stores them; the master adds (re-replication) or switches (drain) the replica
when the node reports success. Everything runs from ``tick`` in the background, a bounded
number of copies at a time, and reports progress in :meth:`Replicator.stats`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from kvstore import grants
from kvstore.errors import InvalidRequestError, KeyNotFoundError
from kvstore.master.locality import spread_cost
from kvstore.master.membership import Membership, Node, Segment
from kvstore.master.puts import Puts
from kvstore.master.quotas import TENANT_END
from kvstore.master.space import Space
from kvstore.master.table import ObjectMeta, ObjectTable, Replica
from kvstore.master.tasks import PURPOSE_DRAIN, PURPOSE_REPLICATE, TASK_GRACE_S, Task, TaskBook
from kvstore.master.tiering import ordered_segments
from kvstore.tenants import owner_of

log = logging.getLogger(__name__)

#: Copies planned per tick (each is one object); bounds the work one tick does.
MAX_COPIES_PER_TICK = 256


class Replicator:
    """Copies objects node to node (re-replication, drain), acting on the master's owners.

    Args:
        membership: the nodes (copy targets, the node being drained).
        objects: the object table.
        space: frees what a drain moved away and what a failed copy allocated.
        puts: the pending puts (a drained node retires once nothing is written to it).
        tasks: where copies are queued for the nodes.
        task_timeout_s: how long a node has for a copy.
        clock: monotonic seconds.
        wall_ms: wall-clock milliseconds (grants and deadlines the nodes check).
    """

    def __init__(
        self,
        membership: Membership,
        objects: ObjectTable,
        space: Space,
        puts: Puts,
        tasks: TaskBook,
        task_timeout_s: float,
        clock: Callable[[], float],
        wall_ms: Callable[[], int],
    ) -> None:
        self.membership = membership
        self.objects = objects
        self.space = space
        self.puts = puts
        self.tasks = tasks
        self.task_timeout_s = task_timeout_s
        self.clock = clock
        self.wall_ms = wall_ms
        self.under: set[bytes] = set()  # keys that may have fewer replicas than wanted
        self.num_copies_done = 0
        self.num_copies_failed = 0
        self.num_drained = 0
        self.num_retired = 0
        self.retired: dict[str, dict[str, Any]] = {}  # node id -> its final drain status

    # ================================================================ hooks
    def replica_lost(self, obj: ObjectMeta) -> None:
        if obj.replicas and len(obj.replicas) < obj.replicas_wanted:
            self.under.add(obj.key)

    # ================================================================ planning
    def _target(self, obj: ObjectMeta, leaving: str | None = None) -> tuple[Node, Segment] | None:
        """Where a copy of ``obj`` goes: the fastest tier with room on a node that holds none,
        among the tiers a tenant's quota takes it into (``leaving``: a drain's source tier,
        which its copy takes nothing more in); where no such tier has room, the fastest with
        room whatever the quota (``quotas.py``, Moves: a copy that keeps data safe is never
        given up for a quota, and is counted)."""
        quotas = self.space.quotas
        if obj.key < TENANT_END and quotas.limited:
            tenant = owner_of(obj.key)
            if tenant is not None and tenant in quotas.limited:
                within = self._best_target(
                    obj,
                    lambda tier: tier == leaving or quotas.has_room(tenant, tier, obj.size),
                )
                if within is not None:
                    return within
        return self._best_target(obj, None)

    def _best_target(
        self, obj: ObjectMeta, takes: Callable[[str], bool] | None
    ) -> tuple[Node, Segment] | None:
        """The segment with room for ``obj`` on a node that holds no replica of it, in a tier
        ``takes`` (None: any): the farthest from the surviving copies (another zone, rack,
        host: ``locality.spread_cost``; all alike without topology), then the fastest tier, then
        the most free bytes."""
        holders = {r.node_id for r in obj.replicas}
        nodes = self.membership.nodes
        # (a drained node's copy is leaving: the new one is placed apart from the others)
        staying = [
            nodes[n]
            for n in holders
            if n in nodes and not nodes[n].draining and not nodes[n].retired
        ]
        best: tuple[tuple[int, int, int], Node, Segment] | None = None
        for node in self.membership.nodes.values():
            if node.node_id in holders or node.draining or node.retired:
                continue
            for rank, seg in enumerate(ordered_segments(node)):
                if takes is not None and not takes(seg.tier):
                    continue
                if seg.allocator.largest_free >= seg.allocator.reserved_size(obj.size):
                    score = (spread_cost(node, staying), rank, -seg.allocator.free_bytes)
                    if best is None or score < best[0]:
                        best = (score, node, seg)
                    break
        return None if best is None else (best[1], best[2])

    def _copy(
        self, obj: ObjectMeta, src: Replica, node: Node, seg: Segment, purpose: str, now: float
    ) -> None:
        offset = seg.allocator.allocate(obj.size)
        assert offset is not None, "a copy was planned without room"
        claim = seg.claim_stamp(self.space.claim_base())
        dst = Replica(
            node.node_id, seg.name, offset, obj.size, stamp=src.stamp, tier=seg.tier, claim=claim
        )
        timeout = self.task_timeout_s
        expires = self.wall_ms() + int(timeout * 1000)
        src_node = self.membership.nodes[src.node_id]
        grant = grants.sign(
            src_node.secret, grants.OP_READ, obj.key, src.segment, src.offset, src.size, expires
        )
        task_id = self.tasks.next_id()
        wire: dict[str, Any] = {
            "id": task_id,
            "kind": "fetch",
            "key": obj.key,
            "size": obj.size,
            "checksum": obj.checksum,
            "from": [src_node.node_id, src_node.host, src_node.port, grant.to_wire()],
            "dst": [dst.segment, dst.offset],
            "stamp": dst.stamp,
            "deadline_ms": expires,
            # Where the node writes is a new allocation: its place among write grants for
            # those bytes (their expiry) fences every older one (kvstore.claims.WriteClaims).
            "claim_ms": claim,
        }
        deadline = now + timeout + TASK_GRACE_S
        self.tasks.add(Task(task_id, purpose, node.node_id, obj.key, src, dst, deadline, wire))
        obj.busy = task_id
        if obj.key < TENANT_END:  # a tenant's copy counts in its destination tier from now
            self.space.quotas.move_started(obj.key, src.tier, dst.tier, obj.size, purpose)

    def tick(self, now: float) -> None:
        budget = MAX_COPIES_PER_TICK - sum(
            1 for t in self.tasks.by_id.values() if t.purpose in (PURPOSE_REPLICATE, PURPOSE_DRAIN)
        )
        for key in list(self.under):
            if budget <= 0:
                break
            obj = self.objects.get(key)
            if obj is None or not obj.replicas or len(obj.replicas) >= obj.replicas_wanted:
                self.under.discard(key)
                continue
            if obj.busy:
                continue
            target = self._target(obj)
            if target is None:
                continue
            self._copy(obj, obj.replicas[0], target[0], target[1], PURPOSE_REPLICATE, now)
            budget -= 1
        for node in [n for n in self.membership.nodes.values() if n.draining and not n.retired]:
            budget = self._drain_step(node, now, budget)

    # ================================================================ drain
    def drain(self, node_id: str) -> dict[str, Any]:
        """Start moving a node's objects elsewhere; it retires once it holds nothing.

        Raises:
            KeyNotFoundError: no such node.
            InvalidRequestError: it holds objects and no other node can take data.
        """
        node = self.membership.nodes.get(node_id)
        if node is None and node_id in self.retired:
            return self.retired[node_id]
        if node is None:
            raise KeyNotFoundError(f"node {node_id!r} is not registered")
        if not node.draining:
            others = [
                n
                for n in self.membership.nodes.values()
                if n.node_id != node_id and not n.draining and not n.retired
            ]
            if not others and self._held(node):
                raise InvalidRequestError(
                    f"node {node_id!r} holds objects and no other node can take them"
                )
            node.draining = True
            log.info("draining node %s", node_id)
        return self.drain_status(node_id)

    def _held(self, node: Node) -> int:
        return sum(len(s.holding) for s in node.segments.values())

    def drain_status(self, node_id: str) -> dict[str, Any]:
        node = self.membership.nodes.get(node_id)
        if node is None and node_id in self.retired:
            return self.retired[node_id]
        if node is None:
            raise KeyNotFoundError(f"node {node_id!r} is not registered")
        return {
            "node_id": node_id,
            "state": node.state,
            "num_objects_left": self._held(node),
            "bytes_left": sum(s.allocator.used_bytes for s in node.segments.values()),
        }

    def _drain_step(self, node: Node, now: float, budget: int) -> int:
        for seg in node.segments.values():
            for off, key in list(seg.holding.items()):
                if budget <= 0:
                    return budget
                obj = self.objects.get(key)
                if obj is None or obj.busy:
                    continue
                replica = next(
                    (
                        r
                        for r in obj.replicas
                        if r.node_id == node.node_id and r.segment == seg.name and r.offset == off
                    ),
                    None,
                )
                if replica is None:
                    continue
                target = self._target(obj, replica.tier)
                if target is None:
                    if len(obj.replicas) > 1:  # copies live elsewhere already: just drop this one
                        self.space.delete_replica(obj, replica, hold=True)
                    continue
                self._copy(obj, replica, target[0], target[1], PURPOSE_DRAIN, now)
                budget -= 1
        busy_here = any(
            t.node_id == node.node_id or t.src.node_id == node.node_id
            for t in self.tasks.by_id.values()
        )
        writing = self.puts.writing_on(node.node_id)
        if not self._held(node) and not busy_here and not writing:
            node.retired = True
            self.num_retired += 1
            log.info("node %s drained: retiring it", node.node_id)
        return budget

    # ================================================================ completion
    def settle(self, task: Task, ok: bool, now: float) -> None:
        space = self.space
        obj = self.objects.get(task.key)
        same = obj is not None and obj.busy == task.task_id  # the version this task copied
        if same:
            obj.busy = 0
        holders = {r.node_id for r in obj.replicas} if obj is not None else set()
        if task.key < TENANT_END:  # (its new bytes no longer pending: committed or given up)
            space.quotas.move_ended(
                task.key, task.src.tier, task.dst.tier, task.src.size, task.purpose, ok
            )
        if ok and same and task.dst.node_id not in holders:
            if task.purpose == PURPOSE_DRAIN and obj.swap_replica(task.src, task.dst):
                space.attach(obj.key, task.dst)
                space.release(task.src, hold_until=space.hold_until(obj, now), lease_of=obj)
                self.num_drained += 1
            else:
                obj.add_replica(task.dst)
                space.attach(obj.key, task.dst)
                if obj.num_replicas >= obj.replicas_wanted:
                    self.under.discard(obj.key)
            self.num_copies_done += 1
            return
        if not ok:
            self.num_copies_failed += 1
        space.release(task.dst)

    def stats(self) -> dict[str, Any]:
        under = 0
        for key in self.under:
            obj = self.objects.get(key)
            if obj is not None and len(obj.replicas) < obj.replicas_wanted:
                under += 1
        return {
            "num_under_replicated": under,
            "num_copies_in_flight": sum(
                1
                for t in self.tasks.by_id.values()
                if t.purpose in (PURPOSE_REPLICATE, PURPOSE_DRAIN)
            ),
            "num_copies_done": self.num_copies_done,
            "num_copies_failed": self.num_copies_failed,
            "num_drained": self.num_drained,
            "num_retired": self.num_retired,
        }
