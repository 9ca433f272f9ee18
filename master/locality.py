"""Locality: a put placed near its writer, its replicas spread apart, and each reader's replicas
ordered nearest first, by the sites the nodes and clients declare (:mod:`kvstore.topology`).

The rules (``docs/operating/topology.md`` says them for operators):

- **Placement** (:class:`NearPlacer`, one per put batch). Each candidate node offers its fastest
  segment with room, as without topology; the best offer wins by, in order: (1) for a second or
  later replica, being far from the replicas already chosen (another zone, then another rack,
  then another host); (2) the fastest tier; (3) nearness to the writer (same host, same rack,
  same zone, other zone: Mooncake's ``local_first``), which counts only while the object keeps
  the segment at or under its high watermark (a full local node does not push its own data
  out: the put goes to the next nearest node with room under its mark); (4) the most free
  bytes; (5) node order.
- **Reads** (:func:`order_replicas`): an object's replicas in the order of their nodes'
  distance from the reader, ties in the table's order; the client reads the first.
- **Re-replication** (``replication.py``): a new copy goes as far from the surviving copies as
  a node with room stands, by the same rule (1).

Why a fast path matters: ``put_start`` and ``get_locations`` are the master's hot verbs. A
cluster whose nodes all declared one site (every node on one host and rack, as on one machine
with nothing declared) gives every reader no preference: :meth:`Locality.view` answers None and
placement and reads run exactly the code they ran before topology existed. A reader's view (its
distance to each node) is computed once per site and membership change, not per batch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvstore.master.membership import Membership, Node, Segment
from kvstore.master.table import Replica
from kvstore.topology import FAR, SAME_HOST, Site, distance
from kvstore.types import TIER_ORDER, TIER_RANK

#: Per node id, its distance from one reader or writer (:func:`kvstore.topology.distance`).
NearView = dict[str, int]
#: Most reader sites whose views are kept (a view is a dict of the nodes; few sites exist).
MAX_VIEWS = 1024
_BEYOND_MARK = FAR + 1  # nearness of a segment the object would take over its high watermark


def closeness(a: Site, b: Site) -> int:
    """How close two sites are, the reverse of :func:`kvstore.topology.distance`: 3 for the
    same host, 2 the same rack, 1 the same zone, 0 another zone."""
    return FAR - distance(a, b)


def spread_cost(node: Node, others: Sequence[Node]) -> int:
    """How close ``node`` stands to the nearest of ``others`` (0: none given, or every one in
    another zone): a replica is best placed where this is least."""
    if not others:
        return 0
    return max(closeness(node.site, o.site) for o in others)


def order_replicas(replicas: list[Replica], near: NearView) -> list[Replica]:
    """``replicas`` nearest first for a reader whose view is ``near`` (stable: ties keep their
    order; a node missing from the view counts as far)."""
    return sorted(replicas, key=lambda r: near.get(r.node_id, FAR))


class Locality:
    """The nodes' sites as seen from a reader's or writer's site, kept per membership change.

    Args:
        membership: the nodes (each with the :class:`~kvstore.topology.Site` it registered).
    """

    def __init__(self, membership: Membership) -> None:
        self.membership = membership
        self._version = -1
        self._flat = True
        self._views: dict[Site, NearView | None] = {}

    def _refresh(self) -> None:
        membership = self.membership
        self._version = membership.version
        self._views.clear()
        self._flat = len({n.site for n in membership.nodes.values()}) <= 1

    @property
    def spread(self) -> bool:
        """Whether the nodes stand in more than one place (replicas can be spread apart)."""
        if self._version != self.membership.version:
            self._refresh()
        return not self._flat

    def view(self, at: Site | None) -> NearView | None:
        """Per node, its distance from ``at``; None when ``at`` is None or every node is as far
        from it as every other (no preference: placement and read order as without topology).
        """
        if at is None:
            return None
        if self._version != self.membership.version:
            self._refresh()
        if self._flat:
            return None
        views = self._views
        if at in views:
            return views[at]
        near = {node_id: distance(at, n.site) for node_id, n in self.membership.nodes.items()}
        view = near if len(set(near.values())) > 1 else None
        if len(views) >= MAX_VIEWS:
            views.clear()
        views[at] = view
        return view

    def placer(self, at: Site | None, high_of: Callable[[str], float]) -> NearPlacer | None:
        """Placement for one put batch written from ``at``; None when locality changes nothing
        there (no writer preference and nowhere to spread replicas to)."""
        near = self.view(at)
        if near is None and not self.spread:
            return None
        return NearPlacer(near, high_of)


class NearPlacer:
    """Placement of one put batch by locality (the module docstring's rules).

    Args:
        near: per node, its distance from the writer (None: no preference for any node).
        high_of: a tier's high watermark (a fraction of a segment's capacity).
    """

    def __init__(self, near: NearView | None, high_of: Callable[[str], float]) -> None:
        self.near = near
        self.high_of = high_of

    def score(
        self, node: Node, seg: Segment, need: int, chosen: Sequence[Node]
    ) -> tuple[int, int, int, int]:
        """(spread, tier rank, nearness, -free bytes) of ``node``'s offer ``seg`` for an object
        of ``need`` reserved bytes, ``chosen`` the nodes of its replicas so far: least is best."""
        alloc = seg.allocator
        nearness = _BEYOND_MARK
        if self.near is not None and alloc.used_bytes + need <= self.high_of(seg.tier) * (
            alloc.capacity
        ):
            nearness = self.near.get(node.node_id, FAR)
        rank = TIER_RANK.get(seg.tier, len(TIER_ORDER))
        return spread_cost(node, chosen), rank, nearness, -alloc.free_bytes

    def best(
        self,
        size: int,
        nodes: Sequence[Node],
        segments: Sequence[Sequence[Segment]],
        chosen: Sequence[Node],
    ) -> tuple[Segment, Node] | None:
        """The best offer (each node's fastest segment with room for ``size`` without
        eviction) on a node not in ``chosen``."""
        best: tuple[Segment, Node] | None = None
        best_score: tuple[int, int, int, int] | None = None
        for n, segs in zip(nodes, segments, strict=True):
            if chosen and any(n is c for c in chosen):
                continue
            for seg in segs:
                alloc = seg.allocator
                need = alloc.reserved_size(size)
                if alloc.largest_free >= need:
                    score = self.score(n, seg, need, chosen)
                    if best_score is None or score < best_score:
                        best, best_score = (seg, n), score
                    break
        return best

    def ordered(self, nodes: Sequence[Node], chosen: Sequence[Node]) -> list[Node]:
        """``nodes`` in the order a put that must evict tries them: far from ``chosen``, then
        nearest the writer (ties in their order)."""
        near = self.near
        return sorted(
            nodes,
            key=lambda n: (spread_cost(n, chosen), near.get(n.node_id, FAR) if near else SAME_HOST),
        )

    def run_length(
        self,
        picks: Sequence[tuple[Segment, Node]],
        size: int,
        count: int,
        nodes: Sequence[Node],
        segments: Sequence[Sequence[Segment]],
        run_bytes: int,
    ) -> int:
        """How many of ``count`` objects of ``size`` (at least 1) may go where one was just
        placed (``picks``), allocated together: as many as fit one free extent of every chosen
        segment, keep a segment chosen for its nearness under its high watermark, and keep the
        objects spread over rivals that tie with a pick on all but free bytes as
        ``TierManager.run_length`` spreads them (``run_bytes``)."""
        if count <= 1:
            return 1
        chosen = [n for _, n in picks]
        k = count
        for i, (seg, node) in enumerate(picks):
            alloc = seg.allocator
            need = alloc.reserved_size(size)
            k = min(k, alloc.largest_free // need)
            mine = self.score(node, seg, need, chosen[:i])
            if mine[2] != _BEYOND_MARK:  # placed for nearness: only while under the mark
                room = int(self.high_of(seg.tier) * alloc.capacity) - alloc.used_bytes
                k = min(k, room // need)
            for n, segs in zip(nodes, segments, strict=True):
                if any(n is c for c in chosen):
                    continue
                for s in segs:
                    if s.allocator.largest_free >= s.allocator.reserved_size(size):
                        rival = self.score(n, s, need, chosen[:i])
                        if rival[:3] == mine[:3]:
                            spare = alloc.free_bytes - s.allocator.free_bytes + run_bytes
                            k = min(k, max(0, spare) // need)
                        break
        return max(1, k)
