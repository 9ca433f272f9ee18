"""Rebuilding the object table from the nodes' manifests (failover keeps the cache).

One admission path for every way a master learns objects it did not commit itself: a new
leader after a failover, a node that re-registers, (later) a node that restarts with
persistent tiers. Whatever else must be rebuilt from manifests (the prefix index) hooks in here.

Rules, in order:

1. A claim must name a registered segment of the claiming node and an extent its allocator can
   re-reserve exactly (``OffsetAllocator.allocate_at``): overlaps are rejected.
2. An object this master committed itself (``put_end`` while leading) always beats a claim: the
   live table is newer than anything a node remembers.
3. Two claims of one key (two nodes, or one node twice): equal size and checksum → both become
   replicas of one object; otherwise the larger ``stamp`` (the later put) wins, and on a tie the
   lower node id wins, so every order of registration ends in the same table.
4. Every rejected claim is logged with its reason and goes to the node's forget list, so the
   node drops it and never claims it again.
5. Tiers: a replica takes its segment's tier. NVMe ids a node reports are never handed out again
   while the node may still hold them (``SpaceAllocator.reserve_ids_through``), and a claim the master had
   told the node to forget just before it went away (a restart before the next heartbeat) is
   rejected: an overwritten or removed version never comes back.

PENDING puts of an old leader: the node records an entry only once the bytes arrived completely,
and checks them against their checksum before claiming them. A complete, verified extent is
admitted (committed) even if the old leader never saw its ``put_end``: the bytes are exactly
what the writer sent, and an acknowledged put can never be lost this way. An extent that never
completed is in no manifest, so the new leader's allocator has it free: reclaimed.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from kvstore.errors import NodeUnavailableError
from kvstore.master.membership import Membership, Node
from kvstore.master.space import Space
from kvstore.master.table import ObjectMeta, ObjectTable, Replica
from kvstore.stored_object import ManifestClaim

log = logging.getLogger(__name__)

MAX_REASONS = 32


@dataclass(slots=True)
class AdmissionReport:
    """What became of one node's manifest."""

    num_admitted: int = 0
    num_replicas: int = 0
    num_replaced: int = 0
    num_rejected: int = 0
    reasons: list[str] = field(default_factory=list)

    def reject(self, claim: ManifestClaim, node_id: str, why: str) -> None:
        self.num_rejected += 1
        text = f"{node_id} {claim.segment}@{claim.offset} key={claim.key[:64]!r}: {why}"
        log.warning("manifest claim rejected: %s", text)
        if len(self.reasons) < MAX_REASONS:
            self.reasons.append(text)

    def to_wire(self) -> dict[str, object]:
        return {
            "num_admitted": self.num_admitted,
            "num_replicas": self.num_replicas,
            "num_replaced": self.num_replaced,
            "num_rejected": self.num_rejected,
            "reasons": self.reasons,
        }


def _wins(claim: ManifestClaim, node_id: str, stamp: int, holder_ids: list[str]) -> bool:
    if claim.stamp != stamp:
        return claim.stamp > stamp
    return node_id < min(holder_ids)


class Recovery:
    """Admission of manifests into one master term's table.

    Args:
        membership: the claiming nodes (and their tombstones).
        objects: the object table claims are admitted into.
        space: indexes admitted replicas, frees replaced ones.
        max_object_bytes: the largest object a claim may name.
        clock: monotonic seconds.
    """

    def __init__(
        self,
        membership: Membership,
        objects: ObjectTable,
        space: Space,
        max_object_bytes: int,
        clock: Callable[[], float],
    ) -> None:
        self.membership = membership
        self.objects = objects
        self.space = space
        self.max_object_bytes = max_object_bytes
        self.clock = clock
        #: Objects admitted from node manifests: key -> (stamp, the ObjectMeta admitted). An
        #: entry whose ObjectMeta is no longer the key's current one is stale.
        self.manifest_stamps: dict[bytes, tuple[int, ObjectMeta]] = {}

    def admit(self, node_id: str, claims: Iterable[ManifestClaim]) -> AdmissionReport:
        """Admit a registered node's claims into the object table.

        Args:
            node_id: the claiming node (must be registered).
            claims: what it holds.

        Returns:
            Counts and the first reasons for rejections.

        Raises:
            NodeUnavailableError: the node is not registered.
        """
        node = self.membership.nodes.get(node_id)
        if node is None:
            raise NodeUnavailableError(f"node {node_id!r} is not registered")
        objects, space, stamps = self.objects, self.space, self.manifest_stamps
        report = AdmissionReport()
        tombstones = self.membership.tombstones.pop(node_id, set())
        claims = list(claims)
        for claim in claims:
            seg = node.segments.get(claim.segment)
            if seg is not None:
                seg.allocator.reserve_ids_through(claim.offset)
        # Newest first: a node's own older versions of a key then lose to its newer one.
        ordered = sorted(claims, key=lambda c: (-c.stamp, c.segment, c.offset))
        for claim in ordered:
            why = self._check_claim(node, claim)
            if not why and (claim.segment, claim.offset) in tombstones:
                why = "this master had told the node to forget it (freed or replaced)"
            if why:
                report.reject(claim, node_id, why)
                node.forgotten.append((claim.segment, claim.offset, claim.stamp))
                continue
            tier = node.segments[claim.segment].tier
            replica = Replica(
                node_id, claim.segment, claim.offset, claim.size, stamp=claim.stamp, tier=tier
            )
            cur = objects.get(claim.key)
            admitted = stamps.get(claim.key)
            if cur is not None and (admitted is None or admitted[1] is not cur):
                why = "the key was committed by this master since: the live table wins"
            elif cur is not None and cur.size == claim.size and cur.checksum == claim.checksum:
                if _reserve(node, claim):
                    cur.add_replica(replica)
                    space.attach(claim.key, replica)
                    report.num_replicas += 1
                    continue
                why = "extent not free on this node (overlap, misaligned or outside the segment)"
            elif cur is not None and not _wins(
                claim, node_id, admitted[0], [r.node_id for r in cur.replicas]
            ):
                why = "another node holds a newer version of this key"
            elif not _reserve(node, claim):
                why = "extent not free on this node (overlap, misaligned or outside the segment)"
            else:
                if cur is not None:
                    log.warning(
                        "manifest of %s replaces key %r held by %s (newer put)",
                        node_id,
                        claim.key[:64],
                        ",".join(r.node_id for r in cur.replicas),
                    )
                    space.release_all(cur.replicas)
                    report.num_replaced += 1
                meta = ObjectMeta(
                    claim.key, claim.size, claim.checksum, [replica], last_access=self.clock()
                )
                objects[claim.key] = meta
                space.attach(claim.key, replica)
                stamps[claim.key] = (claim.stamp, meta)
                report.num_admitted += 1
                continue
            report.reject(claim, node_id, why)
            node.forgotten.append((claim.segment, claim.offset, claim.stamp))
        return report

    def _check_claim(self, node: Node, claim: ManifestClaim) -> str:
        seg = node.segments.get(claim.segment)
        if seg is None:
            return f"the node registered no segment {claim.segment!r}"
        if claim.size > self.max_object_bytes:
            return "object larger than the limit"
        return ""

    def forget_stale_stamps(self) -> None:
        """Drop stamps of objects that were since replaced or removed (bounded memory)."""
        stamps, objects = self.manifest_stamps, self.objects
        stale = [k for k, (_, meta) in stamps.items() if objects.get(k) is not meta]
        for k in stale:
            del stamps[k]


def _reserve(node: Node, claim: ManifestClaim) -> bool:
    return node.segments[claim.segment].allocator.allocate_at(claim.offset, claim.size)
