"""Membership: the storage nodes, their segments, and whether they are alive.

Owns the node records (:class:`Node`, :class:`Segment`) and the rules of joining: a node
registers with its address, the secret its grants are signed with and its segments; heartbeats
keep it alive (a node silent for ``node_ttl_s`` is declared dead); an identity key binds a node
id to the node that first proved it. It also keeps what each node must forget (freed replicas,
delivered in heartbeat replies) and what a dead node may still hold but must never claim again
(its *tombstones*, read by ``recovery.py``).

What leaving costs the rest of the master (pending puts, tasks, objects on the node) is not
decided here: the service's ``drop_node`` takes the node out of every owner, this module last.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
from collections.abc import Callable, ItemsView, Iterator, MutableMapping, Sequence
from dataclasses import dataclass, field

from kvstore import grants
from kvstore.errors import ForbiddenError, InvalidRequestError, NodeUnavailableError
from kvstore.master.allocator import OffsetAllocator, SpaceAllocator
from kvstore.master.budget import ByteBudget
from kvstore.master.config import MasterConfig
from kvstore.master.table import Replica
from kvstore.topology import NOWHERE, Site
from kvstore.types import TIER_RANK, TIERS_BY_ID, Location, SegmentSpec, node_state

log = logging.getLogger(__name__)


#: Units per page of :class:`Holding` (a page is a list of this many slots: 2 KiB).
HOLDING_PAGE_UNITS = 256
_HOLDING_PAGE_SHIFT = 8
_HOLDING_SLOT_MASK = HOLDING_PAGE_UNITS - 1


class Holding(MutableMapping[int, bytes]):
    """Offset -> key of every committed replica in a segment (what eviction and drain walk).

    Why not a plain dict: a segment of tiny objects holds millions of replicas, and a dict entry
    with its int key costs ~70 bytes a replica. A replica that fits one allocation unit
    (:meth:`add` of at most ``unit`` bytes) takes a slot in a page of :data:`HOLDING_PAGE_UNITS` units
    instead (one pointer: ~8 bytes in a full page; its offset is the slot's position); larger
    ones, which are sparse in offsets, keep dict entries. Pages are made on first use and
    dropped when empty. Iteration yields the dict's entries, then the pages' in offset order.

    Args:
        unit: the allocation unit of the segment's offsets (its allocator's alignment); 0 keeps
            every entry in the dict (offsets that are ids, not byte positions).
    """

    __slots__ = ("_unit_shift", "_unit_mask", "_small_max", "_big", "_pages", "_num_small")

    def __init__(self, unit: int = 0) -> None:
        assert unit >= 0 and not unit & (unit - 1), "the unit is 0 or a power of two"
        assert HOLDING_PAGE_UNITS == 1 << _HOLDING_PAGE_SHIFT
        self._unit_shift = unit.bit_length() - 1 if unit else -1
        self._unit_mask = unit - 1 if unit else 0
        self._small_max = unit if unit else -1  # the largest replica a page slot takes
        self._big: dict[int, bytes] = {}
        self._pages: dict[int, list[bytes | None]] = {}
        self._num_small = 0

    def add(self, offset: int, key: bytes, size: int) -> None:
        """Record the replica of ``key`` (``size`` bytes) at ``offset``."""
        if size > self._small_max or offset & self._unit_mask or offset in self._big:
            self[offset] = key
            return
        unit = offset >> self._unit_shift
        page = self._pages.get(unit >> _HOLDING_PAGE_SHIFT)
        if page is None:
            page = self._pages[unit >> _HOLDING_PAGE_SHIFT] = [None] * HOLDING_PAGE_UNITS
        i = unit & _HOLDING_SLOT_MASK
        if page[i] is None:
            self._num_small += 1
        page[i] = key

    def _slot(self, offset: int) -> tuple[list[bytes | None] | None, int]:
        shift = self._unit_shift
        if shift < 0 or offset < 0 or offset & ((1 << shift) - 1):
            return None, 0
        unit = offset >> shift
        return self._pages.get(unit // HOLDING_PAGE_UNITS), unit % HOLDING_PAGE_UNITS

    def __getitem__(self, offset: int) -> bytes:
        key = self._big.get(offset)
        if key is not None:
            return key
        page, i = self._slot(offset)
        key = page[i] if page is not None else None
        if key is None:
            raise KeyError(offset)
        return key

    def __setitem__(self, offset: int, key: bytes) -> None:
        page, i = self._slot(offset)
        if page is not None and page[i] is not None:
            del self[offset]
        self._big[offset] = key

    def __delitem__(self, offset: int) -> None:
        if self._big.pop(offset, None) is not None:
            return
        page, i = self._slot(offset)
        if page is None or page[i] is None:
            raise KeyError(offset)
        page[i] = None
        self._num_small -= 1
        if page.count(None) == HOLDING_PAGE_UNITS:
            del self._pages[(offset >> self._unit_shift) // HOLDING_PAGE_UNITS]

    def __iter__(self) -> Iterator[int]:
        return (offset for offset, _ in self._iter_items())

    def __len__(self) -> int:
        return len(self._big) + self._num_small

    def items(self) -> ItemsView[int, bytes]:
        """(offset, key) of every replica, without a lookup per entry."""
        return _HoldingItems(self)

    def _iter_items(self) -> Iterator[tuple[int, bytes]]:
        yield from self._big.items()
        shift = self._unit_shift
        for p, page in list(self._pages.items()):
            base = p * HOLDING_PAGE_UNITS
            for i, key in enumerate(page):
                if key is not None:
                    yield (base + i) << shift, key

    def __repr__(self) -> str:
        return f"Holding({dict(self._iter_items())!r})"


class _HoldingItems(ItemsView[int, bytes]):
    """``Holding.items()``: iterates the pages directly."""

    _mapping: Holding

    def __iter__(self) -> Iterator[tuple[int, bytes]]:
        return self._mapping._iter_items()


@dataclass(slots=True)
class Segment:
    name: str
    tier: str
    allocator: SpaceAllocator
    shm_path: str = ""
    # offset -> key of every committed replica here (what eviction and drain walk).
    holding: Holding = field(default_factory=Holding)
    # The newest write claim (grant expiry, wall ms) of any allocation freed here. Nodes order
    # the writes of reused bytes by that stamp (kvstore.claims.WriteClaims) and cannot order
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
    # Bytes freed since the last heartbeat that stay in limbo until the node drops them
    # (see SpaceAllocator.free), and those the last reply told it to forget.
    limbo: list[tuple[str, int]] = field(default_factory=list)
    delivered: list[tuple[str, int]] = field(default_factory=list)
    # What the last heartbeat reply told it to forget (not yet confirmed by the next heartbeat).
    unconfirmed: list[tuple[str, int, int]] = field(default_factory=list)
    draining: bool = False  # no new data; its objects are being copied elsewhere
    retired: bool = False  # drained: told to stop at its next heartbeat
    # Data-plane details the node offers beyond TCP (shm, rdma), opaque to the master: clients
    # read them with ``node_transports`` (see kvstore/transports.py).
    transports: dict[str, object] = field(default_factory=dict)
    # Where the node stands (``kvstore node --host-id --rack --zone``; master/locality.py).
    site: Site = NOWHERE

    @property
    def free_bytes(self) -> int:
        return sum(s.allocator.free_bytes for s in self.segments.values())

    @property
    def state(self) -> str:
        """``active``, ``draining`` or ``retired`` (:data:`kvstore.types.NODE_STATES`)."""
        return node_state(self.draining, self.retired)


def make_allocator(tier: str, capacity: int) -> SpaceAllocator:
    """The allocator of a segment: ids under a byte budget on NVMe and the shared tier (lmdb
    and the file system place values themselves), byte extents elsewhere."""
    return ByteBudget(capacity) if tier in TIERS_BY_ID else OffsetAllocator(capacity)


def make_segment(spec: SegmentSpec) -> Segment:
    """A registered segment: its allocator, and a holding index paged by its allocation unit
    where offsets are byte positions."""
    allocator = make_allocator(spec.tier, spec.capacity)
    return Segment(spec.name, spec.tier, allocator, spec.shm_path, Holding(allocator.offset_unit))


class Membership:
    """The registered nodes by id, their identities and tombstones.

    Args:
        config: the node TTL.
        clock: monotonic seconds (liveness).
    """

    def __init__(self, config: MasterConfig, clock: Callable[[], float]) -> None:
        self.config = config
        self.clock = clock
        self.nodes: dict[str, Node] = {}
        #: node id -> SHA-256 of the identity key it proved (see check_identity).
        self.identities: dict[str, bytes] = {}
        #: node id -> (segment, offset) it was told to forget but may still hold when it comes
        #: back (restart before the next heartbeat): admission never takes those (recovery.py).
        self.tombstones: dict[str, set[tuple[str, int]]] = {}
        self.num_dead_nodes = 0
        #: Bumped whenever a node joins or leaves (``locality.Locality`` keeps views per version).
        self.version = 0

    # ================================================================ joining
    def check_identity(self, node_id: str, identity: bytes | None) -> None:
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

    def admit(
        self,
        node_id: str,
        host: str,
        port: int,
        secret: bytes,
        segments: Sequence[SegmentSpec],
        transports: dict[str, object] | None = None,
        identity: bytes | None = None,
        site: Site | None = None,
    ) -> Node:
        """Check a registration and bind the id to ``identity``; the node record to :meth:`add`.

        Raises:
            InvalidRequestError: empty id, bad port, short secret or identity key, no or
                duplicate segments, a negative capacity or an unknown tier.
            ForbiddenError: the id belongs to another node (nothing changes).
        """
        if not node_id or len(node_id) > 128:
            raise InvalidRequestError("node_id must be 1..128 characters")
        if identity is not None and not 16 <= len(identity) <= 1024:
            raise InvalidRequestError("a node identity key must be 16..1024 bytes")
        self.check_identity(node_id, identity)
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
        if identity is not None:
            self.identities[node_id] = hashlib.sha256(identity).digest()
        return Node(
            node_id=node_id,
            host=host,
            port=port,
            secret=secret,
            segments={s.name: make_segment(s) for s in segments},
            last_seen=self.clock(),
            transports=dict(transports or {}),
            site=site if site is not None else NOWHERE,
        )

    def add(self, node: Node) -> None:
        """Make an admitted node a member (an earlier incarnation must be dropped first)."""
        assert node.node_id not in self.nodes, "drop the earlier incarnation first"
        self.nodes[node.node_id] = node
        self.version += 1
        log.info(
            "node %s registered at %s:%d with %d segment(s)",
            node.node_id,
            node.host,
            node.port,
            len(node.segments),
        )

    # ================================================================ liveness
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
            node.segments[segment].allocator.acknowledge(num_bytes)
        node.delivered, node.limbo = node.limbo, []
        forgotten, node.forgotten = node.forgotten, []
        node.unconfirmed = forgotten
        return forgotten

    def silent(self) -> list[str]:
        """Nodes without a heartbeat for ``node_ttl_s``: to be declared dead."""
        now = self.clock()
        return [
            n.node_id for n in self.nodes.values() if now - n.last_seen > self.config.node_ttl_s
        ]

    def heard_from_all(self, now: float) -> None:
        """Count every node as heard from at ``now`` (a leader that could not listen for a
        while: its nodes were not silent, it was deaf)."""
        for node in self.nodes.values():
            node.last_seen = max(node.last_seen, now)

    def remove(self, node_id: str, extra_tombstones: set[tuple[str, int]]) -> Node:
        """Take a node out of the membership; remember what it may still hold.

        Args:
            extra_tombstones: extents beyond its unconfirmed forgets that it must never claim
                again (space held for a lease, writes this master never committed).

        Raises:
            KeyError: no such node.
        """
        node = self.nodes.pop(node_id)
        self.version += 1
        # What it was told to forget but may still hold (a restart before the next heartbeat):
        # never re-admit those (an overwritten or removed version must not come back).
        stones = {(s, o) for s, o, *_ in [*node.forgotten, *node.unconfirmed]}
        stones |= extra_tombstones
        self.tombstones[node_id] = stones
        return node

    def retire(self, node_id: str) -> Node:
        """A drained node leaves: it holds nothing, so nothing is remembered of it.

        Raises:
            KeyError: no such node.
        """
        node = self.nodes.pop(node_id)
        self.version += 1
        assert node.retired, "only a drained node retires"
        return node

    # ================================================================ grants
    def location(self, replica: Replica, key: bytes, op: str, expires_ms: int) -> Location:
        """Where ``replica`` lives, with a grant for ``op`` signed with its node's secret.

        Raises:
            KeyError: the replica's node is not registered.
        """
        node = self.nodes[replica.node_id]
        grant = grants.sign(
            node.secret, op, key, replica.segment, replica.offset, replica.size, expires_ms
        )
        return Location(node.node_id, node.host, node.port, grant)

    def location_wire(self, replica: Replica, key: bytes, op: str, expires_ms: int) -> list[object]:
        """:meth:`location` in its wire form (``Location.to_wire``), without the records.

        Raises:
            KeyError: the replica's node is not registered.
        """
        node = self.nodes[replica.node_id]
        grant = grants.sign_wire(
            node.secret, op, key, replica.segment, replica.offset, replica.size, expires_ms
        )
        return [node.node_id, node.host, node.port, grant]

    def location_ref(
        self, batcher: grants.GrantBatcher, replica: Replica, key: bytes, op: str, expires_ms: int
    ) -> list[object]:
        """:meth:`location_wire` with the grant a reference into ``batcher``'s batch grant for
        the replica's node and ``expires_ms`` (``op`` is the batcher's).

        Raises:
            KeyError: the replica's node is not registered.
        """
        node = self.nodes[replica.node_id]
        ref = batcher.ref(
            node.node_id,
            node.secret,
            key,
            replica.segment,
            replica.offset,
            replica.size,
            expires_ms,
        )
        return [node.node_id, node.host, node.port, ref]

    def node_transports(self) -> dict[str, dict[str, object]]:
        """Per live node, the data-plane details it offers beyond TCP (shm, rdma)."""
        return {n.node_id: n.transports for n in self.nodes.values()}

    def owns(self, node: Node) -> bool:
        """Whether ``node`` is the current incarnation of its id (a dropped or re-registered
        node's record is not: its allocators are gone)."""
        return self.nodes.get(node.node_id) is node
