"""The master's state machine: membership, object table, allocation, two-phase puts.

It knows no sockets and reads no clock of its own: the RPC edge (``server.py``) decodes
requests and calls these methods; tests drive them with a fake clock.

Object life cycle::

    put_start ──► PENDING ──put_end──► COMPLETE ──remove / overwrite / node death──► gone
                     └──put_revoke / timeout / node death──► gone (space freed)

A key has at most one PENDING put at a time (a second ``put_start`` gets ``ObjectBusyError``).
A ``put_end`` over a COMPLETE key replaces it: the new bytes become visible atomically and the
old replicas' space is freed (last committed writer wins). Readers of the old version that are
still in flight either finish before the space is reused or fail the checksum: never wrong bytes.

Tiers, leases, pins, replication and drain live in their own modules (``tiering.py``,
``leases.py``, ``replication.py``, ``tasks.py``); this module keeps the tables they act on and
small hooks into them. ``tick`` runs their background work (the daemon calls it).

NOTE: single-threaded by design; the master's event loop is the only caller.
"""

from __future__ import annotations

import collections
import hashlib
import hmac
import itertools
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from kvstore import grants
from kvstore.config import MAX_OBJECT_BYTES
from kvstore.errors import (
    ForbiddenError,
    InvalidRequestError,
    KeyNotFoundError,
    KVStoreError,
    NodeUnavailableError,
    ObjectBusyError,
    ObjectExistsError,
    PutNotFoundError,
)
from kvstore.keys import Namespace
from kvstore.kvblocks import KV_META_PREFIX, is_kv_key
from kvstore.master.allocator import OffsetAllocator
from kvstore.master.budget import ByteBudget
from kvstore.master.events import (
    DEFAULT_RING_BLOCKS,
    DEFAULT_RING_EVENTS,
    EVENT_EVICTED,
    EVENT_REMOVED,
    EventLog,
)
from kvstore.master.leases import (
    PIN_HARD,
    PIN_NONE,
    PIN_SOFT,
    DeferredFrees,
    ReadLeases,
    check_lease_tokens,
    check_pin_ttl,
)
from kvstore.master.prefix import PrefixIndex, PrefixMatch, check_prompt_size
from kvstore.master.prefix_restore import PromptMetaBacklog
from kvstore.master.replication import Replicator
from kvstore.master.table import ObjectMeta, ObjectTable, Replica
from kvstore.master.tasks import PURPOSE_DEMOTE, PURPOSE_PROMOTE, TaskBook
from kvstore.master.tiering import TIER_NVME, TIER_RANK, Candidates, TierConfig, TierManager
from kvstore.types import Location, ObjectInfo, PutTicket, SegmentSpec, node_state

if TYPE_CHECKING:
    from kvstore.manifest import ManifestClaim
    from kvstore.master.recovery import AdmissionReport

log = logging.getLogger(__name__)

TIER_DRAM = "dram"
#: Hot objects :meth:`MasterService.tick` looks at to turn back into tuples (table.py): bounds
#: the work of one tick (a few ms) while cooling a 65,536-key read batch within a few ticks.
MAX_COOL_PER_TICK = 16384


@dataclass(frozen=True, slots=True)
class MasterConfig:
    """Timeouts and limits of the control plane. Validated on creation."""

    put_timeout_s: float = 30.0
    node_ttl_s: float = 5.0
    heartbeat_interval_s: float = 1.0
    read_grant_s: float = 60.0
    max_batch: int = 65536
    max_object_bytes: int = MAX_OBJECT_BYTES
    #: The KV event ring (``events.py``): most events, and most block keys they name together.
    event_ring_events: int = DEFAULT_RING_EVENTS
    event_ring_blocks: int = DEFAULT_RING_BLOCKS

    def __post_init__(self) -> None:
        for name in ("put_timeout_s", "node_ttl_s", "heartbeat_interval_s", "read_grant_s"):
            if not getattr(self, name) > 0:
                raise InvalidRequestError(f"{name} must be > 0")
        if self.heartbeat_interval_s >= self.node_ttl_s:
            raise InvalidRequestError("heartbeat_interval_s must be shorter than node_ttl_s")
        if self.max_batch <= 0 or self.max_object_bytes <= 0:
            raise InvalidRequestError("max_batch and max_object_bytes must be > 0")
        if self.event_ring_events < 1 or self.event_ring_blocks < 1:
            raise InvalidRequestError("event_ring_events and event_ring_blocks must be > 0")


@dataclass(slots=True)
class Segment:
    name: str
    tier: str
    allocator: OffsetAllocator | ByteBudget
    shm_path: str = ""
    # offset -> key of every committed replica here (what eviction and drain walk).
    holding: dict[int, bytes] = field(default_factory=dict)
    # The newest write claim (grant expiry, wall ms) of any allocation freed here. Nodes order
    # the writes of reused bytes by that stamp (kvstore.grants.WriteClaims) and cannot order
    # equal ones, so space freed in the millisecond it was allocated (an eviction right after
    # a commit) must go to a strictly later stamp: see :meth:`claim_stamp`.
    reuse_floor: int = 0

    def claim_stamp(self, base_ms: int) -> int:
        """The write claim for a new allocation here: ``base_ms`` (now + put timeout), or just
        after every claim on bytes freed here, whichever is later."""
        return base_ms if base_ms > self.reuse_floor else self.reuse_floor + 1


@dataclass(slots=True)
class Node:
    node_id: str
    host: str
    port: int
    secret: bytes
    segments: dict[str, Segment]
    last_seen: float
    # (segment, offset, stamp) of replicas freed since the last heartbeat: the node drops them
    # from its manifest. The stamp names the version: an extent already reused by a newer
    # write (another stamp) stays in the manifest.
    forgotten: list[tuple[str, int, int]] = field(default_factory=list)
    # Budget bytes freed since the last heartbeat, and those the last reply told it to forget.
    limbo: list[tuple[str, int]] = field(default_factory=list)
    delivered: list[tuple[str, int]] = field(default_factory=list)
    # What the last heartbeat reply told it to forget (not yet confirmed by the next heartbeat).
    unconfirmed: list[tuple[str, int, int]] = field(default_factory=list)
    draining: bool = False  # no new data; its objects are being copied elsewhere
    retired: bool = False  # drained: told to stop at its next heartbeat
    # Data-plane details the node offers beyond TCP (shm, rdma), opaque to the master: clients
    # read them with ``node_transports`` (see kvstore/transports.py).
    transports: dict[str, object] = field(default_factory=dict)

    @property
    def free_bytes(self) -> int:
        return sum(s.allocator.free_bytes for s in self.segments.values())


@dataclass(slots=True)
class PendingPut:
    put_id: int
    key: bytes
    size: int
    replicas: list[Replica]
    deadline: float
    replicas_wanted: int = 1


class MasterService:
    """Membership, allocation and the object table.

    Args:
        config: timeouts and limits.
        clock: monotonic seconds (liveness, put timeouts).
        wall_ms: wall-clock milliseconds (grant expiry, checked by nodes with their own clock).
    """

    def __init__(
        self,
        config: MasterConfig | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall_ms: Callable[[], int] = lambda: int(time.time() * 1000),
        tiers: TierConfig | None = None,
    ) -> None:
        self.config = config or MasterConfig()
        self.clock = clock
        self.wall_ms = wall_ms
        self.nodes: dict[str, Node] = {}
        #: node id -> SHA-256 of the identity key it proved (see check_node_identity).
        self.identities: dict[str, bytes] = {}
        #: Committed objects by key (see table.py: most of them are plain tuples inside).
        self.objects = ObjectTable()
        self.pending: dict[int, PendingPut] = {}
        self.pending_by_key: dict[bytes, int] = {}
        self._put_ids = itertools.count(1)
        self.num_reclaimed = 0
        self.num_dead_nodes = 0
        self.num_corrupt_replicas = 0
        self.num_hits = 0
        self.num_misses = 0
        # Hits by the tier of the replica a reader tries first (metrics read these, cheaply).
        self.hits_by_tier: collections.Counter[str] = collections.Counter()
        self.deferred = DeferredFrees()
        self.leases = ReadLeases()
        self.tasks = TaskBook()
        self.tiering = TierManager(self, tiers or TierConfig())
        self.replication = Replicator(self)
        #: KV events of this term (stored / evicted / removed / moved), for routers.
        self.events = EventLog(self.config.event_ring_events, self.config.event_ring_blocks)
        self.prefix = PrefixIndex(self.events)
        # node id -> (segment, offset) it was told to forget but may still hold when it comes
        # back (restart before the next heartbeat): admission never takes those (recovery.py).
        self.tombstones: dict[str, set[tuple[str, int]]] = {}
        self.prompt_metas = PromptMetaBacklog()
        self.prompt_metas_dirty = False
        # Objects admitted from node manifests: key -> (stamp, the ObjectMeta admitted). An entry
        # whose ObjectMeta is no longer the key's current one is stale (see recovery.py).
        self.manifest_stamps: dict[bytes, tuple[int, ObjectMeta]] = {}

    def reset(self) -> None:
        """Forget everything (a master that lost leadership starts its next term empty).

        The event log starts afresh under a new epoch; subscribers waiting on the old one
        are woken (they then see the new epoch, or the fence's refusal).
        """
        old_events = self.events
        self.__init__(self.config, self.clock, self.wall_ms, self.tiering.config)  # type: ignore[misc]
        old_events.wake()

    def admit_manifest(self, node_id: str, claims: Iterable[ManifestClaim]) -> AdmissionReport:
        """Rebuild table entries from a registered node's manifest (see ``recovery.py``).

        Raises:
            NodeUnavailableError: the node is not registered.
        """
        from kvstore.master.recovery import admit_manifest, forget_stale_stamps

        forget_stale_stamps(self)
        claims = list(claims)
        report = admit_manifest(self, node_id, claims)
        # Prompt metas let the prefix index be rebuilt (master/prefix_restore.py); new objects
        # may also complete prompts fetched earlier.
        self.prompt_metas.to_fetch.update(
            c.key for c in claims if c.key.startswith(KV_META_PREFIX) and c.key in self.objects
        )
        self.prompt_metas_dirty = True
        return report

    def restore_prefix_index(self) -> int:
        """Index every fetched prompt meta whose blocks are all committed by now.

        Returns:
            Prompts fully indexed by this call (the others wait for more nodes to re-register).
        """
        done = 0
        for key, (namespace, tokens) in list(self.prompt_metas.incomplete.items()):
            if key not in self.objects:
                del self.prompt_metas.incomplete[key]  # the meta itself went away
                continue
            self.prefix.index(namespace, tokens, self.objects.__contains__)
            full = len(tokens) // namespace.block_size * namespace.block_size
            if self.prefix.radix.match(namespace, tokens).num_tokens >= full:
                del self.prompt_metas.incomplete[key]
                done += 1
        self.prompt_metas.num_restored += done
        return done

    # ================================================================ membership
    def check_node_identity(self, node_id: str, identity: bytes | None) -> None:
        """Refuse a claim to ``node_id`` by anyone but the node that first registered it.

        A node proves its id with the identity key it keeps in its data directory (so a restart
        on the same directory proves the same id). The first registration that carries a key
        binds the id to it (only its SHA-256 is kept); from then on every registration and
        heartbeat for the id must carry the same key. Ids are public (``/api/v1/nodes``); the
        key is not.

        Raises:
            ForbiddenError: the id is bound to another key, or the claim carries none.
        """
        bound = self.identities.get(node_id)
        if bound is None:
            return
        if identity is None or not hmac.compare_digest(bound, hashlib.sha256(identity).digest()):
            raise ForbiddenError(
                f"node id {node_id[:128]!r} belongs to another node: its identity key differs"
            )

    def register(
        self,
        node_id: str,
        host: str,
        port: int,
        secret: bytes,
        segments: Sequence[SegmentSpec],
        transports: dict[str, object] | None = None,
        identity: bytes | None = None,
    ) -> None:
        """Add a node (or replace an earlier incarnation with the same id, dropping its objects).

        Args:
            identity: the node's identity key (see :meth:`check_node_identity`); None for a
                node that proves nothing (its id stays unbound).

        Raises:
            InvalidRequestError: empty id, bad port, short secret or identity key, no or
                duplicate segments.
            ForbiddenError: the id belongs to another node (nothing changes).
        """
        if not node_id or len(node_id) > 128:
            raise InvalidRequestError("node_id must be 1..128 characters")
        if identity is not None and not 16 <= len(identity) <= 1024:
            raise InvalidRequestError("a node identity key must be 16..1024 bytes")
        self.check_node_identity(node_id, identity)
        if not 0 < port < 65536:
            raise InvalidRequestError(f"bad port {port}")
        if len(secret) < 16:
            raise InvalidRequestError("node secret must be at least 16 bytes")
        if not segments:
            raise InvalidRequestError("a node must register at least one segment")
        names = [s.name for s in segments]
        if len(set(names)) != len(names):
            raise InvalidRequestError("segment names must be unique")
        for s in segments:
            if s.capacity < 0:
                raise InvalidRequestError(f"segment {s.name!r} has negative capacity")
            if s.tier not in TIER_RANK:
                raise InvalidRequestError(f"segment {s.name!r} has unknown tier {s.tier!r}")
        self.replication.retired.pop(node_id, None)
        if identity is not None:
            self.identities[node_id] = hashlib.sha256(identity).digest()
        if node_id in self.nodes:
            log.info("node %s re-registered; dropping what its previous incarnation held", node_id)
            self._drop_node(node_id)
        self.nodes[node_id] = Node(
            node_id=node_id,
            host=host,
            port=port,
            secret=secret,
            segments={
                s.name: Segment(
                    s.name,
                    s.tier,
                    ByteBudget(s.capacity) if s.tier == TIER_NVME else OffsetAllocator(s.capacity),
                    s.shm_path,
                )
                for s in segments
            },
            last_seen=self.clock(),
            transports=dict(transports or {}),
        )
        log.info(
            "node %s registered at %s:%d with %d segment(s)", node_id, host, port, len(segments)
        )

    def heartbeat(self, node_id: str) -> list[tuple[str, int, int]]:
        """Mark a node alive. Returns the (segment, offset, stamp) of replicas it may forget.

        Raises:
            NodeUnavailableError: the node is unknown (declared dead): it must register again.
        """
        node = self.nodes.get(node_id)
        if node is None:
            raise NodeUnavailableError(f"node {node_id!r} is not registered")
        node.last_seen = self.clock()
        # The node applied the previous reply's forgets before sending this heartbeat.
        for segment, num_bytes in node.delivered:
            allocator = node.segments[segment].allocator
            if isinstance(allocator, ByteBudget):
                allocator.ack(num_bytes)
        node.delivered, node.limbo = node.limbo, []
        forgotten, node.forgotten = node.forgotten, []
        node.unconfirmed = forgotten
        return forgotten

    def expire_nodes(self) -> list[str]:
        """Declare nodes without a heartbeat for ``node_ttl_s`` dead; their replicas disappear."""
        now = self.clock()
        dead = [
            n.node_id for n in self.nodes.values() if now - n.last_seen > self.config.node_ttl_s
        ]
        for node_id in dead:
            log.warning(
                "node %s missed heartbeats for %.1fs: declared dead",
                node_id,
                self.config.node_ttl_s,
            )
            self._drop_node(node_id)
            self.num_dead_nodes += 1
        return dead

    def _drop_node(self, node_id: str) -> None:
        node = self.nodes.pop(node_id)
        # What it was told to forget but may still hold (a restart before the next heartbeat):
        # never re-admit those (an overwritten or removed version must not come back).
        self.tombstones[node_id] = {(s, o) for s, o, *_ in [*node.forgotten, *node.unconfirmed]}
        # Freed space still waiting for a read lease to end was never forgotten by the node yet.
        self.tombstones[node_id].update((r.segment, r.offset) for r in self.deferred.held_for(node))
        for put in [
            p for p in self.pending.values() if any(r.node_id == node_id for r in p.replicas)
        ]:
            # Bytes of a put this master never committed may sit complete on the node's NVMe:
            # never admit them when it comes back (only committed versions return).
            self.tombstones[node_id].update(
                (r.segment, r.offset) for r in put.replicas if r.node_id == node_id
            )
            self._discard_pending(put)
        for task in [
            t for t in self.tasks.by_id.values() if t.node_id == node_id or t.src.node_id == node_id
        ]:
            self._settle(task.task_id, ok=False)
        self.tasks.outbox.pop(node_id, None)
        for key in self.objects.keys_on(node_id):
            obj = self.objects[key]
            obj.replicas = [r for r in obj.replicas if r.node_id != node_id]
            if not obj.replicas:
                del self.objects[key]
                self.prefix.forget(key)
            else:
                self.replication.replica_lost(obj)

    # ================================================================ puts
    def put_start(
        self,
        keys: Sequence[bytes],
        sizes: Sequence[int],
        exclude_nodes: Iterable[str] = (),
        replicas: int = 1,
        kv_blocks: bool = False,
    ) -> list[PutTicket | KVStoreError]:
        """Allocate room for each key; the client then writes the bytes straight to the node.

        Args:
            replicas: copies of each object, on distinct nodes (the client writes every one).
            kv_blocks: the KV-cache layer is writing: keys under ``kv/`` and ``kvmeta/`` are
                allowed, and one that is already stored gets ``ObjectExistsError`` (blocks are
                immutable: the prefix index may be serving it).

        Returns:
            Per key, a ticket (put id and where to write) or the error for that key.

        Raises:
            InvalidRequestError: a malformed batch or replica count.
        """
        self._check_batch(keys)
        if len(sizes) != len(keys):
            raise InvalidRequestError("keys and sizes differ in length")
        if not isinstance(replicas, int) or isinstance(replicas, bool) or not 1 <= replicas <= 16:
            raise InvalidRequestError(f"replicas must be an integer in 1..16, got {replicas!r}")
        excluded = set(exclude_nodes)
        results: list[PutTicket | KVStoreError] = []
        # Once per batch: where objects may go, and the grants' expiry base (each allocation's
        # claim stamp is still ordered after every claim on its bytes, see Segment.claim_stamp).
        cands = self.tiering.candidates(excluded)
        base = self.wall_ms() + int(self.config.put_timeout_s * 1000)
        for key, size in zip(keys, sizes, strict=True):
            try:
                if is_kv_key(key):
                    if not kv_blocks:
                        raise InvalidRequestError(
                            "keys under kv/ and kvmeta/ are written by KVCache only"
                        )
                    if key in self.objects:
                        raise ObjectExistsError("this KV block is already stored")
                results.append(self._put_start_one(key, size, excluded, replicas, cands, base))
            except KVStoreError as err:
                results.append(err)
        return results

    def _put_start_one(
        self,
        key: bytes,
        size: int,
        excluded: set[str],
        num_replicas: int,
        cands: Candidates,
        base: int,
    ) -> PutTicket:
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise InvalidRequestError(f"size must be a non-negative integer, got {size!r}")
        if size > self.config.max_object_bytes:
            raise InvalidRequestError(
                f"object of {size} bytes exceeds the limit of {self.config.max_object_bytes}"
            )
        if key in self.pending_by_key:
            raise ObjectBusyError("another put of this key is in flight")
        picks = self.tiering.place(size, excluded, num_replicas, cands)
        if len(picks) == 1:
            expires = picks[0][0].claim_stamp(base)
        else:
            expires = max(segment.claim_stamp(base) for segment, _ in picks)
        placed: list[Replica] = []
        for segment, node in picks:
            offset = segment.allocator.allocate(size)
            assert offset is not None, "placement chose a segment without room"
            placed.append(
                Replica(node.node_id, segment.name, offset, size, stamp=expires, tier=segment.tier)
            )
        put = PendingPut(
            next(self._put_ids), key, size, placed, self.clock() + self.config.put_timeout_s
        )
        put.replicas_wanted = num_replicas
        self.pending[put.put_id] = put
        self.pending_by_key[key] = put.put_id
        return PutTicket(
            put.put_id, [self._location(r, key, grants.OP_WRITE, expires) for r in placed]
        )

    def put_end(
        self, put_ids: Sequence[int], checksums: Sequence[int]
    ) -> list[KVStoreError | None]:
        """Commit puts: each object becomes visible now, replacing any earlier version."""
        self._check_batch(put_ids)
        if len(checksums) != len(put_ids):
            raise InvalidRequestError("put_ids and checksums differ in length")
        results: list[KVStoreError | None] = []
        for put_id, checksum in zip(put_ids, checksums, strict=True):
            put = self.pending.get(put_id) if isinstance(put_id, int) else None
            if put is None:
                results.append(
                    PutNotFoundError(f"put {put_id!r} is not pending (timed out or revoked?)")
                )
                continue
            if not isinstance(checksum, int) or not 0 <= checksum < 1 << 64:
                results.append(InvalidRequestError("checksum must be an unsigned 64-bit integer"))
                continue
            del self.pending[put_id]
            del self.pending_by_key[put.key]
            now = self.clock()
            old = self.objects.get(put.key)
            if old is not None:
                self._free_replicas(
                    old.replicas, hold_until=self.hold_until(old, now), lease_of=old
                )
            self.objects.commit(put.key, put.size, checksum, put.replicas, put.replicas_wanted, now)
            if old is not None and old.pin != PIN_NONE:
                # A pin belongs to the key: it holds the new version too.
                new = self.objects[put.key]
                new.pin, new.pin_until = old.pin, old.pin_until
            for r in put.replicas:
                self.attach(put.key, r)
            results.append(None)
        return results

    def put_revoke(self, put_ids: Sequence[int]) -> list[KVStoreError | None]:
        """Abandon puts: their space is freed and nothing becomes visible."""
        self._check_batch(put_ids)
        results: list[KVStoreError | None] = []
        for put_id in put_ids:
            put = self.pending.get(put_id) if isinstance(put_id, int) else None
            if put is None:
                results.append(PutNotFoundError(f"put {put_id!r} is not pending"))
            else:
                self._discard_pending(put)
                results.append(None)
        return results

    def reclaim_expired_puts(self) -> int:
        """Free PENDING puts whose writer never committed within ``put_timeout_s``."""
        now = self.clock()
        expired = [p for p in self.pending.values() if p.deadline <= now]
        for put in expired:
            log.info("reclaiming put %d of %r: not committed in time", put.put_id, put.key[:64])
            self._discard_pending(put)
        self.num_reclaimed += len(expired)
        return len(expired)

    def _discard_pending(self, put: PendingPut) -> None:
        del self.pending[put.put_id]
        del self.pending_by_key[put.key]
        self._free_replicas(put.replicas)

    def _free_replicas(
        self,
        replicas: Iterable[Replica],
        hold_until: float = 0.0,
        lease_of: ObjectMeta | None = None,
    ) -> None:
        for r in replicas:
            self.release(r, hold_until, lease_of)

    # ================================================================ replica bookkeeping
    def attach(self, key: bytes, replica: Replica) -> None:
        """Record a committed replica in its segment's index (eviction and drain walk it)."""
        node = self.nodes.get(replica.node_id)
        if node is not None:
            node.segments[replica.segment].holding[replica.offset] = key

    def release(
        self, replica: Replica, hold_until: float = 0.0, lease_of: ObjectMeta | None = None
    ) -> None:
        """Free a replica's space: now, or once ``hold_until`` (a lease's end) has passed or
        every lease of ``lease_of`` (the object it belonged to) was given back."""
        node = self.nodes.get(replica.node_id)
        if node is None:
            return  # the node is gone and its allocator with it
        seg = node.segments[replica.segment]
        seg.holding.pop(replica.offset, None)
        if hold_until > self.clock():
            self.deferred.hold(hold_until, node, replica, lease_of)
            return
        self._free_now(node, replica)

    def _free_now(self, node: Node, replica: Replica) -> None:
        seg = node.segments[replica.segment]
        seg.reuse_floor = max(seg.reuse_floor, replica.stamp, replica.claim)
        allocator = seg.allocator
        if isinstance(allocator, ByteBudget):
            node.limbo.append((replica.segment, allocator.free(replica.offset)))
        else:
            allocator.free(replica.offset)
        node.forgotten.append((replica.segment, replica.offset, replica.stamp))

    def hold_until(self, obj: ObjectMeta, now: float) -> float:
        """Until when freed space of ``obj`` must stay untouched (0 when no lease covers it)."""
        if obj.lease_until <= now:
            return 0.0
        return obj.lease_until + self.tiering.config.lease_grace_s

    def delete_replica(
        self, obj: ObjectMeta, replica: Replica, hold: bool = False, kind: str = EVENT_EVICTED
    ) -> None:
        """Drop one replica (eviction, drain); the object goes when its last replica does.

        Args:
            kind: the KV event its blocks leave the prefix index with, if it goes.
        """
        obj.remove_replica(replica)
        if not obj.num_replicas:
            del self.objects[obj.key]
            self.prefix.forget(obj.key, kind)
        elif obj.num_replicas < obj.replicas_wanted:
            # An evicted copy is not re-made: the object now wants what it has.
            obj.replicas_wanted = obj.num_replicas
        self.release(replica, self.hold_until(obj, self.clock()) if hold else 0.0, obj)

    def node_transports(self) -> dict[str, dict[str, object]]:
        """Per live node, the data-plane details it offers beyond TCP (shm, rdma)."""
        return {n.node_id: n.transports for n in self.nodes.values()}

    # ================================================================ reads
    def get_locations(self, keys: Sequence[bytes]) -> list[ObjectInfo | KVStoreError]:
        """Where each committed object lives, with read grants and a read lease.

        Until the lease ends (``lease_s``) or is given back (:meth:`release_leases`, with the
        token in ``ObjectInfo.lease``) the object is not evicted and space it occupies is not
        reused; the read grants expire with it, so a read after that fails cleanly.

        Raises:
            InvalidRequestError: a batch over the limit.
        """
        self._check_batch(keys)
        lease_s = self.tiering.config.lease_s
        expires = self.wall_ms() + int(lease_s * 1000)
        now = self.clock()
        found = [self.objects.get(key) for key in keys]
        first_token = self.leases.grant(found, now + lease_s)
        results: list[ObjectInfo | KVStoreError] = []
        for i, (key, obj) in enumerate(zip(keys, found, strict=True)):
            if obj is None:
                self.num_misses += 1
                results.append(KeyNotFoundError(f"key {key[:64]!r} not found"))
                continue
            self.num_hits += 1
            replicas = obj.replicas
            if replicas:
                self.hits_by_tier[replicas[0].tier] += 1
            obj.lease_until = max(obj.lease_until, now + lease_s)
            self.tiering.on_read(obj, now)
            locs = [self._location(r, key, grants.OP_READ, expires) for r in replicas]
            results.append(ObjectInfo(obj.size, obj.checksum, locs, first_token + i))
        return results

    def release_leases(self, tokens: object) -> list[bool]:
        """Give read leases back: the reads they covered are done.

        An object none of whose leases is outstanding any more may be evicted, and space freed
        under it (a remove, an overwrite, a move) is freed now. A token released twice, after
        its lease ended or never issued by this master changes nothing.

        Returns:
            Per token whether it ended a lease.

        Raises:
            InvalidRequestError: not a list of lease tokens, or over the batch limit (nothing
                is released).
        """
        checked = check_lease_tokens(tokens, self.config.max_batch)
        ended, emptied = self.leases.release(checked)
        now = self.clock()
        for obj in emptied:
            self._lease_ended(obj, now)
        return ended

    def _lease_ended(self, obj: ObjectMeta, now: float) -> None:
        """No lease of ``obj`` is outstanding: it may be evicted, its held space freed."""
        obj.lease_until = 0.0
        # A lease that ran out without being given back may still have a read on its way to a
        # node whose clock lags ours: space waits out the grace after its end, as before.
        not_before = self.leases.last_unreleased_end + self.tiering.config.lease_grace_s
        for owner, replica in self.deferred.release_for(obj, not_before if not_before > now else 0):
            if self.nodes.get(owner.node_id) is owner:
                self._free_now(owner, replica)

    def exists(self, keys: Sequence[bytes]) -> list[bool]:
        """Whether each key is committed. Takes no lease and changes nothing."""
        self._check_batch(keys)
        return [key in self.objects for key in keys]

    def remove(self, keys: Sequence[bytes]) -> list[KVStoreError | None]:
        self._check_batch(keys)
        results: list[KVStoreError | None] = []
        for key in keys:
            obj = self.objects.pop(key, None)
            if obj is None:
                results.append(KeyNotFoundError(f"key {key[:64]!r} not found"))
            else:
                # A reader holding a lease finishes on intact bytes; the space waits for it.
                self._free_replicas(
                    obj.replicas, hold_until=self.hold_until(obj, self.clock()), lease_of=obj
                )
                self.prefix.forget(key)
                results.append(None)
        return results

    def report_corrupt(self, reports: Sequence[object]) -> int:
        """Drop replicas a reader found corrupt (bytes that do not match their checksum).

        Each report is ``[key, node_id, segment, offset, checksum]``: the replica the reader
        read and the checksum it expected. Only a replica the key's *current* object still
        names, with that checksum, goes (a report about an older version, or a stale guess,
        changes nothing). The object keeps its replica count, so replication copies a good
        replica back; a corrupt last replica takes the object with it (a miss, never bad bytes).
        Why trust a reader: any token holder may remove the key outright, so a report gives no
        new power, and a replica that fails its checksum serves no reader anyway.

        Returns:
            How many replicas were dropped.

        Raises:
            InvalidRequestError: a malformed report.
        """
        self._check_batch(reports)
        dropped = 0
        for rep in reports:
            if not isinstance(rep, list | tuple) or len(rep) != 5:
                raise InvalidRequestError(
                    "a corruption report is [key, node_id, segment, offset, checksum]"
                )
            key, node_id, segment, offset, checksum = rep
            obj = self.objects.get(key) if isinstance(key, bytes) else None
            if obj is None or obj.checksum != checksum or obj.busy:
                continue  # (a move or copy in flight verifies its bytes itself)
            bad = next(
                (
                    r
                    for r in obj.replicas
                    if r.node_id == node_id and r.segment == segment and r.offset == offset
                ),
                None,
            )
            if bad is None:
                continue
            log.warning(
                "replica of %r on node %s (%s@%d) is corrupt: dropped",
                key[:64],
                node_id,
                segment,
                offset,
            )
            # Its bytes are garbage, but a reader may still be on them: hold the space alike.
            wanted = obj.replicas_wanted
            self.delete_replica(obj, bad, hold=True, kind=EVENT_REMOVED)
            if obj.replicas:
                obj.replicas_wanted = wanted
                self.replication.replica_lost(obj)
            self.num_corrupt_replicas += 1
            dropped += 1
        return dropped

    # ================================================================ pins
    def pin(
        self, keys: Sequence[bytes], ttl_s: float, hard: bool = False
    ) -> list[KVStoreError | None]:
        """Keep objects from eviction for ``ttl_s`` seconds.

        A soft pin makes an object go last, and only under pressure; a hard pin keeps it until
        unpinned or the TTL ends. Pinning again replaces the earlier pin.

        Returns:
            Per key, None or the error (KeyNotFoundError for a missing key).

        Raises:
            InvalidRequestError: a TTL outside ``(0, max_pin_ttl_s]``.
        """
        self._check_batch(keys)
        ttl = check_pin_ttl(ttl_s, self.tiering.config.max_pin_ttl_s)
        now = self.clock()
        results: list[KVStoreError | None] = []
        for key in keys:
            obj = self.objects.get(key)
            if obj is None:
                results.append(KeyNotFoundError(f"cannot pin {key[:64]!r}: not found"))
                continue
            obj.pin = PIN_HARD if hard else PIN_SOFT
            obj.pin_until = now + ttl
            results.append(None)
        return results

    def unpin(self, keys: Sequence[bytes]) -> list[KVStoreError | None]:
        """Drop pins (a key that is stored but not pinned is fine)."""
        self._check_batch(keys)
        results: list[KVStoreError | None] = []
        for key in keys:
            obj = self.objects.get(key)
            if obj is None:
                results.append(KeyNotFoundError(f"cannot unpin {key[:64]!r}: not found"))
                continue
            obj.pin = PIN_NONE
            obj.pin_until = 0.0
            results.append(None)
        return results

    # ================================================================ node tasks and manifests
    def tick(self) -> None:
        """Background work: free space whose leases ended, settle late tasks, evict, replicate."""
        now = self.clock()
        for obj in self.leases.expire(now):
            self._lease_ended(obj, now)
        for owner, replica in self.deferred.due(now):
            if self.nodes.get(owner.node_id) is not owner:
                continue  # the node died or re-registered: that allocator is gone
            self._free_now(owner, replica)
        for task in self.tasks.expired(now):
            log.warning("task %d (%s of %r) timed out", task.task_id, task.purpose, task.key[:64])
            self._settle(task.task_id, ok=False)
        self.tiering.tick(now)
        self.replication.tick(now)
        self.objects.cool(now, MAX_COOL_PER_TICK)

    def tasks_done(self, node_id: str, done: Sequence[object]) -> None:
        """A node reports tasks it ran: ``[task_id, code, message]`` each."""
        for item in done:
            if not isinstance(item, list | tuple) or len(item) != 3:
                continue
            task_id, code = item[0], item[1]
            task = self.tasks.by_id.get(task_id) if isinstance(task_id, int) else None
            if task is None or task.node_id != node_id:
                continue
            if code:
                log.warning("node %s failed task %d: %s", node_id, task_id, item[2])
            self._settle(task_id, ok=code == 0)

    def _settle(self, task_id: int, ok: bool) -> None:
        task = self.tasks.pop(task_id)
        if task is None:
            return
        if ok:
            self.tasks.num_done += 1
        else:
            self.tasks.num_failed += 1
        if task.purpose in (PURPOSE_DEMOTE, PURPOSE_PROMOTE):
            self.tiering.settle(task, ok, self.clock())
        else:
            self.replication.settle(task, ok, self.clock())

    def take_tasks(self, node_id: str) -> list[dict[str, object]]:
        """Tasks to hand ``node_id`` in its heartbeat reply."""
        cfg = self.tiering.config
        return self.tasks.take(
            node_id, cfg.max_tasks_per_heartbeat, cfg.max_task_bytes_per_heartbeat
        )

    def take_retirement(self, node_id: str) -> bool:
        """True once a drained node may stop; it leaves the membership at the same time."""
        node = self.nodes.get(node_id)
        if node is None or not node.retired:
            return False
        self.replication.retired[node_id] = self.replication.drain_status(node_id)
        self.nodes.pop(node_id)
        self.tasks.outbox.pop(node_id, None)
        return True

    def drain_node(self, node_id: str) -> dict[str, object]:
        """Move a node's objects to other nodes, then retire it. Returns its drain status.

        Raises:
            KeyNotFoundError: no such node.
            InvalidRequestError: it holds objects and no other node can take them.
        """
        return self.replication.drain(node_id)

    # ================================================================ KV cache (prefix index)
    def kv_commit(
        self,
        put_ids: Sequence[int],
        checksums: Sequence[int],
        namespace: Namespace,
        tokens: np.ndarray,
    ) -> tuple[list[KVStoreError | None], int]:
        """``put_end`` for a prompt's new block objects, then index the prompt's committed prefix.

        Returns:
            Per put, None or its error; and the number of blocks newly indexed.

        Raises:
            InvalidRequestError: a prompt over the block limit (nothing is committed).
        """
        check_prompt_size(namespace, tokens)
        results = self.put_end(put_ids, checksums)
        return results, self.prefix.index(namespace, tokens, self.objects.__contains__)

    def kv_match(
        self, namespace: Namespace, tokens: np.ndarray, *, locate: bool = True
    ) -> tuple[PrefixMatch, list[ObjectInfo | KVStoreError]]:
        """The cached prefix of a prompt and, per block, where its replicas are (one call).

        With ``locate=False`` only the prefix: no locations, so no read leases are taken (a
        lookup that leased every block would hold them from eviction for nothing).
        """
        match = self.prefix.match(namespace, tokens, self.objects.__contains__)
        if not locate:
            return match, []
        return match, self.get_locations([key for key, _ in match.blocks])

    # ================================================================ helpers
    def _location(self, replica: Replica, key: bytes, op: str, expires_ms: int) -> Location:
        node = self.nodes[replica.node_id]
        grant = grants.sign(
            node.secret, op, key, replica.segment, replica.offset, replica.size, expires_ms
        )
        return Location(node.node_id, node.host, node.port, grant)

    def _check_batch(self, items: Sequence[object]) -> None:
        if len(items) > self.config.max_batch:
            raise InvalidRequestError(
                f"batch of {len(items)} exceeds the limit of {self.config.max_batch}"
            )

    def stats(self) -> dict[str, object]:
        """Cluster figures for the admin API and the CLI."""
        capacity = sum(
            s.allocator.capacity for n in self.nodes.values() for s in n.segments.values()
        )
        used = sum(s.allocator.used_bytes for n in self.nodes.values() for s in n.segments.values())
        by_tier: dict[str, dict[str, int]] = {}
        for n in self.nodes.values():
            for seg in n.segments.values():
                t = by_tier.setdefault(
                    seg.tier, {"capacity_bytes": 0, "used_bytes": 0, "num_replicas": 0}
                )
                t["capacity_bytes"] += seg.allocator.capacity
                t["used_bytes"] += seg.allocator.used_bytes
                t["num_replicas"] += len(seg.holding)
        return {
            "tiers": by_tier,
            "eviction": self.tiering.stats(),
            "replication": self.replication.stats(),
            "num_hits": self.num_hits,
            "num_misses": self.num_misses,
            "num_held_frees": len(self.deferred),
            "held_bytes": self.deferred.held_bytes(),
            "leases": self.leases.stats(),
            "num_pinned": sum(
                1
                for o in self.objects.hot_values()
                if o.pin != PIN_NONE and o.pin_until > self.clock()
            ),
            "num_nodes": len(self.nodes),
            "num_objects": len(self.objects),
            "num_pending": len(self.pending),
            "capacity_bytes": capacity,
            "used_bytes": used,
            "object_bytes": self.objects.total_bytes(),
            "num_reclaimed": self.num_reclaimed,
            "num_dead_nodes": self.num_dead_nodes,
            "num_corrupt_replicas": self.num_corrupt_replicas,
            "prefix": self.prefix.stats(),
            "events": self.events.stats(),
            "nodes": [
                {
                    "node_id": n.node_id,
                    "address": f"{n.host}:{n.port}",
                    "state": node_state(n.draining, n.retired),
                    "segments": [
                        {
                            "name": s.name,
                            "tier": s.tier,
                            "capacity_bytes": s.allocator.capacity,
                            "used_bytes": s.allocator.used_bytes,
                            "num_replicas": len(s.holding),
                        }
                        for s in n.segments.values()
                    ],
                }
                for n in self.nodes.values()
            ],
        }
