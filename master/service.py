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

NOTE: single-threaded by design; the master's event loop is the only caller.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np
from kvstore.master.allocator import OffsetAllocator
from kvstore.master.prefix import PrefixIndex, PrefixMatch

from kvstore import grants
from kvstore.config import MAX_OBJECT_BYTES
from kvstore.errors import (
    InvalidRequestError,
    KeyNotFoundError,
    KVStoreError,
    NodeUnavailableError,
    NoSpaceError,
    ObjectBusyError,
    PutNotFoundError,
)
from kvstore.keys import Namespace
from kvstore.types import Location, ObjectInfo, PutTicket, SegmentSpec

log = logging.getLogger(__name__)

TIER_DRAM = "dram"


@dataclass(frozen=True, slots=True)
class MasterConfig:
    """Timeouts and limits of the control plane. Validated on creation."""

    put_timeout_s: float = 30.0
    node_ttl_s: float = 5.0
    heartbeat_interval_s: float = 1.0
    read_grant_s: float = 60.0
    max_batch: int = 65536
    max_object_bytes: int = MAX_OBJECT_BYTES

    def __post_init__(self) -> None:
        for name in ("put_timeout_s", "node_ttl_s", "heartbeat_interval_s", "read_grant_s"):
            if not getattr(self, name) > 0:
                raise InvalidRequestError(f"{name} must be > 0")
        if self.heartbeat_interval_s >= self.node_ttl_s:
            raise InvalidRequestError("heartbeat_interval_s must be shorter than node_ttl_s")
        if self.max_batch <= 0 or self.max_object_bytes <= 0:
            raise InvalidRequestError("max_batch and max_object_bytes must be > 0")


@dataclass(slots=True)
class Segment:
    name: str
    tier: str
    allocator: OffsetAllocator
    shm_path: str = ""


@dataclass(slots=True)
class Node:
    node_id: str
    host: str
    port: int
    secret: bytes
    segments: dict[str, Segment]
    last_seen: float
    # (segment, offset) pairs freed since the last heartbeat: the node drops them from its manifest.
    forgotten: list[tuple[str, int]] = field(default_factory=list)
    # Data-plane details the node offers beyond TCP (shm, rdma), opaque to the master: clients
    # read them with ``node_transports`` (see kvstore/transports.py).
    transports: dict[str, object] = field(default_factory=dict)

    @property
    def free_bytes(self) -> int:
        return sum(s.allocator.free_bytes for s in self.segments.values())


@dataclass(frozen=True, slots=True)
class Replica:
    node_id: str
    segment: str
    offset: int
    size: int


@dataclass(slots=True)
class ObjectMeta:
    key: bytes
    size: int
    checksum: int
    replicas: list[Replica]


@dataclass(slots=True)
class PendingPut:
    put_id: int
    key: bytes
    size: int
    replicas: list[Replica]
    deadline: float


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
    ) -> None:
        self.config = config or MasterConfig()
        self.clock = clock
        self.wall_ms = wall_ms
        self.nodes: dict[str, Node] = {}
        self.objects: dict[bytes, ObjectMeta] = {}
        self.pending: dict[int, PendingPut] = {}
        self.pending_by_key: dict[bytes, int] = {}
        self._put_ids = itertools.count(1)
        self.num_reclaimed = 0
        self.num_dead_nodes = 0
        self.prefix = PrefixIndex()

    # ================================================================ membership
    def register(
        self,
        node_id: str,
        host: str,
        port: int,
        secret: bytes,
        segments: Sequence[SegmentSpec],
        transports: dict[str, object] | None = None,
    ) -> None:
        """Add a node (or replace an earlier incarnation with the same id, dropping its objects).

        Raises:
            InvalidRequestError: empty id, bad port, short secret, no or duplicate segments.
        """
        if not node_id or len(node_id) > 128:
            raise InvalidRequestError("node_id must be 1..128 characters")
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
        if node_id in self.nodes:
            log.info("node %s re-registered; dropping what its previous incarnation held", node_id)
            self._drop_node(node_id)
        self.nodes[node_id] = Node(
            node_id=node_id,
            host=host,
            port=port,
            secret=secret,
            segments={
                s.name: Segment(s.name, s.tier, OffsetAllocator(s.capacity), s.shm_path)
                for s in segments
            },
            last_seen=self.clock(),
            transports=dict(transports or {}),
        )
        log.info(
            "node %s registered at %s:%d with %d segment(s)", node_id, host, port, len(segments)
        )

    def heartbeat(self, node_id: str) -> list[tuple[str, int]]:
        """Mark a node alive. Returns the (segment, offset) pairs it may forget.

        Raises:
            NodeUnavailableError: the node is unknown (declared dead): it must register again.
        """
        node = self.nodes.get(node_id)
        if node is None:
            raise NodeUnavailableError(f"node {node_id!r} is not registered")
        node.last_seen = self.clock()
        forgotten, node.forgotten = node.forgotten, []
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
        self.nodes.pop(node_id)
        for put in [
            p for p in self.pending.values() if any(r.node_id == node_id for r in p.replicas)
        ]:
            self._discard_pending(put)
        for key in [
            k for k, o in self.objects.items() if any(r.node_id == node_id for r in o.replicas)
        ]:
            obj = self.objects[key]
            obj.replicas = [r for r in obj.replicas if r.node_id != node_id]
            if not obj.replicas:
                del self.objects[key]
                self.prefix.forget(key)

    # ================================================================ puts
    def put_start(
        self, keys: Sequence[bytes], sizes: Sequence[int], exclude_nodes: Iterable[str] = ()
    ) -> list[PutTicket | KVStoreError]:
        """Allocate room for each key; the client then writes the bytes straight to the node.

        Returns:
            Per key, a ticket (put id and where to write) or the error for that key.
        """
        self._check_batch(keys)
        if len(sizes) != len(keys):
            raise InvalidRequestError("keys and sizes differ in length")
        excluded = set(exclude_nodes)
        results: list[PutTicket | KVStoreError] = []
        for key, size in zip(keys, sizes, strict=True):
            try:
                results.append(self._put_start_one(key, size, excluded))
            except KVStoreError as err:
                results.append(err)
        return results

    def _put_start_one(self, key: bytes, size: int, excluded: set[str]) -> PutTicket:
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise InvalidRequestError(f"size must be a non-negative integer, got {size!r}")
        if size > self.config.max_object_bytes:
            raise InvalidRequestError(
                f"object of {size} bytes exceeds the limit of {self.config.max_object_bytes}"
            )
        if key in self.pending_by_key:
            raise ObjectBusyError("another put of this key is in flight")
        segment, node = self._place(size, excluded)
        offset = segment.allocator.allocate(size)
        assert offset is not None, "placement chose a segment without room"
        replica = Replica(node.node_id, segment.name, offset, size)
        put = PendingPut(
            next(self._put_ids), key, size, [replica], self.clock() + self.config.put_timeout_s
        )
        self.pending[put.put_id] = put
        self.pending_by_key[key] = put.put_id
        expires = self.wall_ms() + int(self.config.put_timeout_s * 1000)
        return PutTicket(put.put_id, [self._location(replica, key, grants.OP_WRITE, expires)])

    def _place(self, size: int, excluded: set[str]) -> tuple[Segment, Node]:
        """Pick the segment with the most free bytes among those with an extent that fits."""
        best: tuple[int, Segment, Node] | None = None
        for node in self.nodes.values():
            if node.node_id in excluded:
                continue
            for seg in node.segments.values():
                if seg.allocator.largest_free >= seg.allocator.reserved_size(size):
                    free = seg.allocator.free_bytes
                    if best is None or free > best[0]:
                        best = (free, seg, node)
        if best is None:
            if not self.nodes:
                raise NoSpaceError("no storage node is registered")
            raise NoSpaceError(f"no segment has a free extent of {size} bytes")
        return best[1], best[2]

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
            old = self.objects.get(put.key)
            if old is not None:
                self._free_replicas(old.replicas)
            self.objects[put.key] = ObjectMeta(put.key, put.size, checksum, put.replicas)
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

    def _free_replicas(self, replicas: Iterable[Replica]) -> None:
        for r in replicas:
            node = self.nodes.get(r.node_id)
            if node is None:
                continue  # the node is gone and its allocator with it
            node.segments[r.segment].allocator.free(r.offset)
            node.forgotten.append((r.segment, r.offset))

    def node_transports(self) -> dict[str, dict[str, object]]:
        """Per live node, the data-plane details it offers beyond TCP (shm, rdma)."""
        return {n.node_id: n.transports for n in self.nodes.values()}

    # ================================================================ reads
    def get_locations(self, keys: Sequence[bytes]) -> list[ObjectInfo | KVStoreError]:
        """Where each committed object lives, with read grants."""
        self._check_batch(keys)
        expires = self.wall_ms() + int(self.config.read_grant_s * 1000)
        results: list[ObjectInfo | KVStoreError] = []
        for key in keys:
            obj = self.objects.get(key)
            if obj is None:
                results.append(KeyNotFoundError(f"key {key[:64]!r} not found"))
                continue
            locs = [self._location(r, key, grants.OP_READ, expires) for r in obj.replicas]
            results.append(ObjectInfo(obj.size, obj.checksum, locs))
        return results

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
                self._free_replicas(obj.replicas)
                self.prefix.forget(key)
                results.append(None)
        return results

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
        """
        results = self.put_end(put_ids, checksums)
        return results, self.prefix.index(namespace, tokens, self.objects.__contains__)

    def kv_match(
        self, namespace: Namespace, tokens: np.ndarray
    ) -> tuple[PrefixMatch, list[ObjectInfo | KVStoreError]]:
        """The cached prefix of a prompt and, per block, where its replicas are (one call)."""
        match = self.prefix.match(namespace, tokens, self.objects.__contains__)
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
        return {
            "num_nodes": len(self.nodes),
            "num_objects": len(self.objects),
            "num_pending": len(self.pending),
            "capacity_bytes": capacity,
            "used_bytes": used,
            "object_bytes": sum(o.size for o in self.objects.values()),
            "num_reclaimed": self.num_reclaimed,
            "num_dead_nodes": self.num_dead_nodes,
            "prefix": self.prefix.stats(),
            "nodes": [
                {
                    "node_id": n.node_id,
                    "address": f"{n.host}:{n.port}",
                    "segments": [
                        {
                            "name": s.name,
                            "tier": s.tier,
                            "capacity_bytes": s.allocator.capacity,
                            "used_bytes": s.allocator.used_bytes,
                        }
                        for s in n.segments.values()
                    ],
                }
                for n in self.nodes.values()
            ],
        }
