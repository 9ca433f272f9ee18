"""The master service: the verbs of the control plane, over the owners of the master's state.

It knows no sockets and reads no clock of its own: the RPC edge (``server.py``) and the admin
API (``admin.py``, ``rest/``) decode requests and call these methods; tests drive them with a
fake clock. Each verb checks its batch and delegates to the module that owns what it touches;
the verbs that cross owners (a node leaving, a task settling, a read) are orchestrated here.

Who owns what (each a class of its own module, one instance per master term)::

    config.py       MasterConfig: timeouts and limits
    table.py        ObjectTable, ObjectMeta, Replica, the tier names: committed objects
                    (idle ones as plain tuples, see its docstring)
    membership.py   Membership, Node, Segment: register, heartbeat, expiry, node identity
    space.py        Space: replica extents; freeing them now or once the read leases that
                    cover them end (it keeps the leases)
    puts.py         Puts, PendingPut: put_start / put_end / put_revoke, reclaiming expired puts
    tiering.py      TierManager: placement, watermark eviction, demotion and promotion
    quotas.py       TenantQuotas: quotas and usage per tenant per tier (space counts,
                    tiering enforces)
    replication.py  Replicator: re-replication after node deaths, drain
    recovery.py     Recovery: admitting node manifests (failover keeps the cache)
    prefix.py       PrefixIndex (over radix.py), which records KV events (events.py)
    leases.py, tasks.py, allocator.py (the SpaceAllocator interface), budget.py,
    eviction.py, prefix_restore.py: the records and structures the owners use

Import order, lowest first; each module imports only modules above it in this list::

    events, leases, tasks, eviction, radix_tables, radix, allocator, budget, prefix_restore,
    collector
    config, table, prefix, quotas
    membership
    space
    puts          (placement comes in as a callable: puts needs no tier manager)
    tiering
    replication, recovery
    service       (this module)
    server        (the RPC edge), then metrics, rest/, admin, daemon, ha

No master module imports another inside a function, and none reaches into another's private
members (``tests/master/test_layers.py`` checks both, and the order of the owners).

A master term is one instance: a new HA term builds a fresh ``MasterService`` with
:meth:`next_term` and swaps it into the :class:`ServiceSlot` that everything serving requests
reads (the RPC edge, metrics, the admin API, housekeeping), never keeping an instance.

NOTE: single-threaded by design; the master's event loop is the only caller.
"""

from __future__ import annotations

import collections
import functools
import logging
import secrets
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np

from kvstore import grants
from kvstore.errors import (
    ErrorCode,
    ForbiddenError,
    InvalidRequestError,
    KeyNotFoundError,
    KVStoreError,
)
from kvstore.keys import Namespace
from kvstore.master.config import MasterConfig
from kvstore.master.event_ring import EVENT_REMOVED, EventLog
from kvstore.master.leases import (
    PIN_HARD,
    PIN_NONE,
    PIN_SOFT,
    check_lease_tokens,
    check_pin_ttl,
    lease_owner,
)
from kvstore.master.locality import order_replicas
from kvstore.master.membership import Membership, Node
from kvstore.master.prefix import PrefixIndex, PrefixMatch, Steps, check_prompt_size
from kvstore.master.prefix_restore import PromptMetaBacklog, is_prompt_meta
from kvstore.master.puts import PendingRecord, Puts
from kvstore.master.quotas import TENANT_END, TenantQuotas
from kvstore.master.recovery import AdmissionReport, Recovery
from kvstore.master.replication import Replicator
from kvstore.master.space import Space
from kvstore.master.table import ObjectMeta, ObjectTable, Replica
from kvstore.master.tasks import PURPOSE_DEMOTE, PURPOSE_PROMOTE, TaskBook
from kvstore.master.tiering import TierConfig, TierManager
from kvstore.stored_object import ManifestClaim
from kvstore.tenants import TenantDirectory
from kvstore.topology import Site
from kvstore.types import ObjectInfo, PutTicket, SegmentSpec

log = logging.getLogger(__name__)

#: MasterConfig is re-exported: callers configure the service through this module.
__all__ = ["MasterConfig", "MasterService", "ServiceSlot"]

#: Hot objects one cooling step looks at to turn back into tuples (table.py): a step this small
#: holds the master's loop briefly, where a step many times larger delays every other client
#: (``.venv/bin/python bench/bench_fairness.py`` prints the loop's longest lag around big reads).
#: :meth:`MasterService.tick` runs one step; the daemon's housekeeping runs up to
#: :data:`COOL_STEPS_PER_TICK` per tick, a turn of the loop each, so a 65,536-key read batch
#: is cooled within a few ticks without holding the loop.
COOL_STEP = 2048
COOL_STEPS_PER_TICK = 8


class MasterService:
    """The control plane's verbs for one master term.

    Args:
        config: timeouts and limits.
        clock: monotonic seconds (liveness, put timeouts).
        wall_ms: wall-clock milliseconds (grant expiry, checked by nodes with their own clock).
        tiers: the tier policy.
        epoch: the HA term's epoch (its KV events carry it, and its put ids start at
            ``(epoch << 32) + 1`` so ids of different terms never collide); None without HA (a
            random event epoch, put ids from 1).
    """

    def __init__(
        self,
        config: MasterConfig | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall_ms: Callable[[], int] = lambda: int(time.time() * 1000),
        tiers: TierConfig | None = None,
        *,
        epoch: int | None = None,
    ) -> None:
        self.config = config = config or MasterConfig()
        tiers = tiers or TierConfig()
        self.clock = clock
        self.wall_ms = wall_ms
        #: KV events of this term (stored / evicted / removed / moved), for routers.
        self.events = EventLog(config.event_ring_events, config.event_ring_blocks, epoch)
        self.prefix = PrefixIndex(self.events)
        self.objects = ObjectTable()
        self.membership = Membership(config, clock)
        #: Tenant quotas and usage per tier (master/quotas.py); the space counts what comes
        #: and goes, the tier manager enforces them.
        self.quotas = TenantQuotas()
        self.tenants = TenantDirectory()
        #: Per node, the tenant directory version its last heartbeat said it holds.
        self.node_tenant_versions: dict[str, int] = {}
        self.space = Space(
            config,
            self.membership,
            self.objects,
            self.prefix,
            clock,
            wall_ms,
            tiers.lease_grace_s,
            quotas=self.quotas,
        )
        # A fixed master (no epoch) starts its put ids at a random point: a put id from before
        # a restart (a blank's above all, which a client holds for seconds) names no put of
        # the new one, and its commit is refused as unknown.
        first_put_id = (epoch << 32) + 1 if epoch else ((secrets.randbits(24) + 1) << 32) + 1
        self.puts = Puts(config, self.membership, self.objects, self.space, clock, first_put_id)
        self.tasks = TaskBook()
        self.tiering = TierManager(
            tiers,
            self.membership,
            self.objects,
            self.space,
            self.puts,
            self.tasks,
            self.prefix,
            clock,
            wall_ms,
        )
        self.replication = Replicator(
            self.membership,
            self.objects,
            self.space,
            self.puts,
            self.tasks,
            tiers.task_timeout_s,
            clock,
            wall_ms,
        )
        self.recovery = Recovery(
            self.membership, self.objects, self.space, config.max_object_bytes, clock
        )
        self.prompt_metas = PromptMetaBacklog()
        self.prompt_metas_dirty = False
        self.num_corrupt_replicas = 0
        self.num_hits = 0
        self.num_misses = 0
        # Hits by the tier of the replica a reader tries first (metrics read these, cheaply).
        self.hits_by_tier: collections.Counter[str] = collections.Counter()
        # The owners' tables, under the names the admin API, metrics and tests read.
        self.nodes: dict[str, Node] = self.membership.nodes
        self.pending: dict[int, PendingRecord] = self.puts.pending
        self.leases = self.space.leases
        self.deferred = self.space.deferred
        self.manifest_stamps = self.recovery.manifest_stamps

    def next_term(self, epoch: int | None = None) -> MasterService:
        """A fresh, empty service with this one's settings, for the next master term.

        This one's KV event waiters are woken: they then see the new term's log (a new epoch)
        or the fence's refusal.

        Args:
            epoch: the new term's HA epoch (None: a random event epoch).
        """
        fresh = MasterService(
            self.config, self.clock, self.wall_ms, self.tiering.config, epoch=epoch
        )
        fresh.quotas.carry_over(self.quotas)  # (usage is rebuilt from the manifests)
        fresh.tenants = self.tenants
        self.events.wake()
        return fresh

    @property
    def tenants(self) -> TenantDirectory:
        """The tenants' token digests, shared namespaces and prefixes (the master's book keeps
        it current; kept across terms): every node gets it in its register and heartbeat
        replies, and the prefix index maps tenants' blocks with it."""
        return self.prefix.directory

    @tenants.setter
    def tenants(self, directory: TenantDirectory) -> None:
        self.prefix.directory = directory

    @property
    def num_reclaimed(self) -> int:
        """Puts reclaimed after their timeout."""
        return self.puts.num_reclaimed

    @property
    def num_dead_nodes(self) -> int:
        """Nodes declared dead."""
        return self.membership.num_dead_nodes

    # ================================================================ manifests
    def admit_manifest(self, node_id: str, claims: Iterable[ManifestClaim]) -> AdmissionReport:
        """Rebuild table entries from a registered node's manifest (see ``recovery.py``).

        Raises:
            NodeUnavailableError: the node is not registered.
        """
        self.recovery.forget_stale_stamps()
        claims = list(claims)
        report = self.recovery.admit(node_id, claims)
        # Prompt metas let the prefix index be rebuilt (master/prefix_restore.py); new objects
        # may also complete prompts fetched earlier.
        self.prompt_metas.to_fetch.update(
            c.key for c in claims if is_prompt_meta(c.key) and c.key in self.objects
        )
        self.prompt_metas_dirty = True
        return report

    def restore_prefix_index(self) -> int:
        """Index every fetched prompt meta whose blocks are all committed by now.

        Returns:
            Prompts fully indexed by this call (the others wait for more nodes to re-register).
        """
        return self.prompt_metas.index_ready(self.prefix, self.objects.__contains__)

    # ================================================================ membership
    def check_node_identity(self, node_id: str, identity: bytes | None) -> None:
        """Refuse a claim to ``node_id`` by anyone but the node that first registered it
        (see ``Membership.check_identity``).

        Raises:
            ForbiddenError: the id is bound to another key, or the claim carries none.
        """
        self.membership.check_identity(node_id, identity)

    def register(
        self,
        node_id: str,
        host: str,
        port: int,
        secret: bytes,
        segments: Sequence[SegmentSpec],
        transports: dict[str, object] | None = None,
        identity: bytes | None = None,
        site: Site | None = None,
    ) -> None:
        """Add a node (or replace an earlier incarnation with the same id, dropping its objects).

        Args:
            identity: the node's identity key (see :meth:`check_node_identity`); None for a
                node that proves nothing (its id stays unbound).
            site: where the node stands (None: nothing declared, the default rack).

        Raises:
            InvalidRequestError: empty id, bad port, short secret or identity key, no or
                duplicate segments.
            ForbiddenError: the id belongs to another node (nothing changes).
        """
        node = self.membership.admit(
            node_id, host, port, secret, segments, transports, identity, site
        )
        self.replication.retired.pop(node_id, None)
        if node_id in self.nodes:
            log.info("node %s re-registered; dropping what its previous incarnation held", node_id)
            self.drop_node(node_id)
        self.membership.add(node)
        self.space.fence(node)

    def heartbeat(self, node_id: str) -> list[tuple[str, int, int]]:
        """Mark a node alive. Returns the (segment, offset, stamp) of replicas it may forget.

        Raises:
            NodeUnavailableError: the node is unknown (declared dead): it must register again.
        """
        return self.membership.heartbeat(node_id)

    def expire_nodes(self) -> list[str]:
        """Declare nodes without a heartbeat for ``node_ttl_s`` dead; their replicas disappear."""
        dead = self.membership.silent()
        for node_id in dead:
            log.warning(
                "node %s missed heartbeats for %.1fs: declared dead",
                node_id,
                self.config.node_ttl_s,
            )
            self.drop_dead_node(node_id)
        return dead

    def drop_dead_node(self, node_id: str) -> None:
        """A node is dead (no heartbeats, or its etcd lease ended): drop it and count it."""
        self.drop_node(node_id)
        self.membership.num_dead_nodes += 1

    def drop_node(self, node_id: str) -> None:
        """Take a node out of every owner: its pending puts, its tasks, its replicas.

        Raises:
            KeyError: no such node.
        """
        node = self.nodes[node_id]
        writes = self.puts.on_node(node_id)
        # Freed space still waiting for a read lease to end was never forgotten by the node
        # yet; bytes of a put this master never committed may sit complete on the node's NVMe:
        # never admit either when it comes back (only committed versions return).
        stones = self.space.held_by_node(node)
        for put in writes:
            stones.update((r.segment, r.offset) for r in put.replicas if r.node_id == node_id)
        held = self.objects.keys_on(node_id)
        self.space.fence_dropped(node, (self.objects[k] for k in held))
        self.space.forget_node(node)
        self.membership.remove(node_id, stones)
        # From here on the node's space is gone with it: releases on it change nothing.
        for put in writes:
            self.puts.discard(put)
        for task in [
            t for t in self.tasks.by_id.values() if t.node_id == node_id or t.src.node_id == node_id
        ]:
            self._settle(task.task_id, ok=False)
        self.tasks.outbox.pop(node_id, None)
        for key in held:
            obj = self.objects.get(key)
            if obj is None:
                continue  # a settled task took it
            obj.replicas = [r for r in obj.replicas if r.node_id != node_id]
            if not obj.replicas:
                del self.objects[key]
                self.prefix.forget(key)
            else:
                self.replication.replica_lost(obj)

    def leader_heard_again(self) -> None:
        """An HA leader proved its lease again after a while it could not (it refused every
        heartbeat meanwhile): restart every node's heartbeat clock, so none is declared dead
        for the leader's deafness."""
        self.membership.heard_from_all(self.clock())

    def tenants_behind(self) -> list[str]:
        """Live nodes that have not yet confirmed the current tenant directory: until they do,
        a new tenant's token does not open them, and a deleted one's still may."""
        version = self.tenants.version
        seen = self.node_tenant_versions
        return sorted(n for n in self.membership.nodes if seen.get(n, 0) < version)

    def node_transports(self) -> dict[str, dict[str, object]]:
        """Per live node, the data-plane details it offers beyond TCP (shm, rdma)."""
        return self.membership.node_transports()

    # ================================================================ puts
    def put_start(
        self,
        keys: Sequence[bytes],
        sizes: Sequence[int],
        exclude_nodes: Iterable[str] = (),
        replicas: int = 1,
        kv_blocks: bool = False,
        batch_grants: bool = False,
        at: Site | None = None,
    ) -> list[PutTicket | list[Any] | KVStoreError]:
        """Allocate room for each key; the client then writes the bytes straight to the node
        (see ``Puts.start``; placement is the tier manager's).

        Args:
            at: the writer's site: its objects go near it (``locality.py``).
            batch_grants: each ticket in its wire form (``PutTicket.to_wire``), its write grants
                batched: one per node and claim stamp for the whole answer, each replica's grant
                a reference to it (see :mod:`kvstore.grants`), so the master signs, the client
                reads and the node verifies one grant a batch instead of one a key.

        Returns:
            Per key, a ticket (put id and where to write) or the error for that key.

        Raises:
            InvalidRequestError: a malformed batch or replica count.
        """
        place = self.tiering.placer(set(exclude_nodes), at)
        batcher = grants.GrantBatcher(grants.OP_WRITE) if batch_grants else None
        return self.puts.start(keys, sizes, place, replicas, kv_blocks, batcher)

    def put_end(
        self,
        put_ids: Sequence[int],
        checksums: Sequence[int],
        keys: Sequence[bytes | KVStoreError | None] | None = None,
    ) -> list[KVStoreError | None]:
        """Commit puts: each object becomes visible now, replacing any earlier version
        (``keys``: the key each blank is committed under, see ``Puts.end``)."""
        return self.puts.end(put_ids, checksums, keys)

    def put_blanks(
        self, size: int, wanted: Sequence[tuple[str, int]] | int, at: Site | None = None
    ) -> list[list[Any]]:
        """Start blanks of ``size`` bytes (see ``Puts.blanks``): ``(node_id, count)`` each, or
        as many on each node that takes new data.

        Raises:
            InvalidRequestError: a size or count out of range.
            ForbiddenError: the master places this writer's puts near its site (``at``): where
                its object goes depends on the room near it when it is put, so it takes none.
        """
        if self.tiering.locality.view(at) is not None:
            raise ForbiddenError("a writer whose puts are placed near its site takes no blanks")
        if isinstance(wanted, int):
            wanted = [
                (n.node_id, wanted)
                for n in self.membership.nodes.values()
                if not n.draining and not n.retired
            ]
        return self.puts.blanks(size, wanted, self.tiering.placer(set(), at))

    def put_revoke(self, put_ids: Sequence[int]) -> list[KVStoreError | None]:
        """Abandon puts: their space is freed and nothing becomes visible."""
        return self.puts.revoke(put_ids)

    def reclaim_expired_puts(self) -> int:
        """Free PENDING puts whose writer never committed within ``put_timeout_s``."""
        return self.puts.reclaim_expired()

    # ================================================================ reads
    def get_locations(
        self, keys: Sequence[bytes], at: Site | None = None
    ) -> list[ObjectInfo | KVStoreError]:
        """Where each committed object lives, with read grants and a read lease; with ``at``
        (the reader's site) each object's replicas nearest it first (``locality.py``).

        Until the lease ends (``lease_s``) or is given back (:meth:`release_leases`, with the
        token in ``ObjectInfo.lease``) the object is not evicted and space it occupies is not
        reused; the read grants expire with it, so a read after that fails cleanly.

        Raises:
            InvalidRequestError: a batch over the limit.
        """
        return self._locate(keys, wire=False, at=at)

    def get_locations_wire(
        self, keys: Sequence[bytes], batch_grants: bool = False, at: Site | None = None
    ) -> list[list[Any]]:
        """:meth:`get_locations` with each answer in its wire form (``result_to_wire`` of the
        ObjectInfo or the error), built without the records: what ``get_locations`` sends
        (per key a grant, a location and an answer fewer to make and then encode, a large share
        of the verb's cost a key: ``.venv/bin/python bench/bench_small.py`` prints the master's
        CPU a key).

        Args:
            batch_grants: one batch grant per node for the whole answer, each replica's grant a
                reference to it (see :mod:`kvstore.grants`), instead of a grant per replica.

        Raises:
            InvalidRequestError: a batch over the limit.
        """
        return self._locate(keys, wire=True, batch_grants=batch_grants, at=at)

    def _locate(
        self, keys: Sequence[bytes], *, wire: bool, batch_grants: bool = False, at: Site | None
    ) -> list[Any]:
        self.config.check_batch(keys)
        # The reader's distance to each node; None (no preference) without topology.
        near = self.tiering.locality.view(at) if at is not None else None
        lease_s = self.tiering.config.lease_s
        expires = self.wall_ms() + int(lease_s * 1000)
        now = self.clock()
        found = [self.objects.get(key) for key in keys]
        batcher = grants.GrantBatcher(grants.OP_READ) if batch_grants else None
        if batcher is not None:
            location = functools.partial(self.membership.location_ref, batcher)
        else:
            location = self.membership.location_wire if wire else self.membership.location
        until = now + lease_s
        tenants_read = bool(keys) and (keys[0] < TENANT_END or keys[-1] < TENANT_END)
        owner = lease_owner(keys) if tenants_read else None  # who may give the leases back
        first_token = self.space.leases.grant(found, until, owner)
        results: list[Any] = []
        hits_by_tier, on_read, op = self.hits_by_tier, self.tiering.on_read, grants.OP_READ
        misses = 0
        for i, (key, obj) in enumerate(zip(keys, found, strict=True)):
            if obj is None:
                misses += 1
                err = KeyNotFoundError(f"key {key[:64]!r} not found")
                results.append(err.to_wire() if wire else err)
                continue
            replicas = obj.replicas
            if obj.lease_until < until:
                obj.lease_until = until
            on_read(obj, now)
            if len(replicas) == 1:  # (most objects: no comprehension's frame for one replica)
                hits_by_tier[replicas[0].tier] += 1
                locs = [location(replicas[0], key, op, expires)]
            else:
                if near is not None:
                    replicas = order_replicas(replicas, near)
                if replicas:
                    hits_by_tier[replicas[0].tier] += 1
                locs = [location(r, key, op, expires) for r in replicas]
            token = first_token + i
            if not wire:
                results.append(ObjectInfo(obj.size, obj.checksum, locs, token))  # type: ignore[arg-type]
            elif token:
                results.append([0, [obj.size, obj.checksum, locs, token]])
            else:
                results.append([0, [obj.size, obj.checksum, locs]])
        self.num_misses += misses
        self.num_hits += len(keys) - misses
        if tenants_read:
            self.quotas.count_reads(keys, found)  # (a tenant's hits and misses)
        if batcher is not None:
            batcher.sign()
        return results

    def release_leases(self, tokens: object, tenant: str | None = None) -> list[bool]:
        """Give read leases back: the reads they covered are done.

        An object none of whose leases is outstanding any more may be evicted, and space freed
        under it (a remove, an overwrite, a move) is freed now. A token released twice, after
        its lease ended or never issued by this master changes nothing; so does, for a
        ``tenant``'s connection, a token of a lease that is not the tenant's (None: the
        operator, who may give back any; see ``leases.py``).

        Returns:
            Per token whether it ended a lease.

        Raises:
            InvalidRequestError: not a list of lease tokens, or over the batch limit (nothing
                is released).
        """
        return self.space.release_leases(check_lease_tokens(tokens, self.config.max_batch), tenant)

    def exists(self, keys: Sequence[bytes]) -> list[bool]:
        """Whether each key is committed. Takes no lease and changes nothing."""
        self.config.check_batch(keys)
        return [key in self.objects for key in keys]

    def remove(self, keys: Sequence[bytes]) -> list[KVStoreError | None]:
        self.config.check_batch(keys)
        results: list[KVStoreError | None] = []
        for key in keys:
            obj = self.objects.pop(key, None)
            if obj is None:
                results.append(KeyNotFoundError(f"key {key[:64]!r} not found"))
            else:
                self.space.release_object(obj)
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
        A move or copy in flight does not keep the replica (see :meth:`_drop_corrupt`).
        Why trust a reader: any token holder may remove the key outright, so a report gives no
        new power, and a replica that fails its checksum serves no reader anyway.

        Returns:
            How many replicas were dropped.

        Raises:
            InvalidRequestError: a malformed report.
        """
        self.config.check_batch(reports)
        dropped = 0
        for rep in reports:
            if not isinstance(rep, list | tuple) or len(rep) != 5:
                raise InvalidRequestError(
                    "a corruption report is [key, node_id, segment, offset, checksum]"
                )
            key, node_id, segment, offset, checksum = rep
            obj = self.objects.get(key) if isinstance(key, bytes) else None
            if obj is None or obj.checksum != checksum:
                continue
            bad = next(
                (
                    r
                    for r in obj.replicas
                    if r.node_id == node_id and r.segment == segment and r.offset == offset
                ),
                None,
            )
            if bad is not None:
                self._drop_corrupt(obj, bad)
                dropped += 1
        return dropped

    def _drop_corrupt(self, obj: ObjectMeta, bad: Replica) -> None:
        """Drop ``bad``, a replica of ``obj`` whose bytes fail their checksum.

        A move or copy in flight (``obj.busy``) does not keep it: a task that reads it fails
        its own checksum check on the node, or, had it copied good bytes, finds its source gone
        when it settles and stores nothing (a promotion never makes the bad copy a good one).
        The space waits for that task's deadline too, as a move from memory reads it in place.
        """
        log.warning(
            "replica of %r on node %s (%s@%d) is corrupt: dropped",
            obj.key[:64],
            bad.node_id,
            bad.segment,
            bad.offset,
        )
        task = self.tasks.by_id.get(obj.busy) if obj.busy else None
        reading_until = task.deadline if task is not None and task.src == bad else 0.0
        # Its bytes are garbage, but a reader may still be on them: hold the space alike.
        wanted = obj.replicas_wanted
        self.space.delete_replica(
            obj, bad, hold=True, kind=EVENT_REMOVED, hold_at_least=reading_until
        )
        if obj.replicas:
            obj.replicas_wanted = wanted
            self.replication.replica_lost(obj)
        self.num_corrupt_replicas += 1

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
        self.config.check_batch(keys)
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
        self.config.check_batch(keys)
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
        self.space.tick(now)
        for task in self.tasks.expired(now):
            log.warning("task %d (%s of %r) timed out", task.task_id, task.purpose, task.key[:64])
            self._settle(task.task_id, ok=False)
        self.tiering.tick(now)
        self.replication.tick(now)
        self.cool_step()

    def cool_step(self) -> int:
        """Turn up to :data:`COOL_STEP` hot objects that nothing else refers to back into
        tuples (``ObjectTable.cool``). Returns how many were turned."""
        return self.objects.cool(self.clock(), COOL_STEP)

    def num_cool_steps_due(self) -> int:
        """Cooling steps worth running after a tick's own (bounded by
        :data:`COOL_STEPS_PER_TICK`): enough to look at every hot object once."""
        return min(COOL_STEPS_PER_TICK, -(-self.objects.num_hot // COOL_STEP)) - 1

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
            obj = self.objects.get(task.key)
            copied = obj is not None and obj.busy == task_id  # (the version the task copied)
            self._settle(task_id, ok=code == 0)
            # A task whose source bytes failed their checksum found a corrupt replica: it goes
            # as if a reader had reported it.
            if (
                code == ErrorCode.CHECKSUM_MISMATCH
                and copied
                and obj is self.objects.get(task.key)
                and task.src in obj.replicas
            ):
                self._drop_corrupt(obj, task.src)

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
        self.membership.retire(node_id)
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
        tenant: str | None = None,
    ) -> tuple[list[KVStoreError | None], int]:
        """``put_end`` for a prompt's new block objects, then index the prompt's committed prefix
        (``tenant``: in that tenant's own tree, see ``prefix.py``).

        Returns:
            Per put, None or its error; and the number of blocks newly indexed.

        Raises:
            InvalidRequestError: a prompt over the block limit (nothing is committed).
        """
        results = self.kv_commit_puts(put_ids, checksums, namespace, tokens)
        return results, self.kv_index(namespace, tokens, tenant)

    def kv_commit_puts(
        self,
        put_ids: Sequence[int],
        checksums: Sequence[int],
        namespace: Namespace,
        tokens: np.ndarray,
    ) -> list[KVStoreError | None]:
        """The first half of :meth:`kv_commit`: the prompt checked, then its puts committed.

        Raises:
            InvalidRequestError: a prompt over the block limit (nothing is committed).
        """
        check_prompt_size(namespace, tokens)
        return self.put_end(put_ids, checksums)

    def kv_index(self, namespace: Namespace, tokens: np.ndarray, tenant: str | None = None) -> int:
        """The second half of :meth:`kv_commit`: index the prompt's committed prefix.

        Returns:
            The number of blocks newly indexed.
        """
        return self.prefix.index(namespace, tokens, self.objects.__contains__, tenant)

    def kv_index_steps(
        self, namespace: Namespace, tokens: np.ndarray, step_blocks: int, tenant: str | None = None
    ) -> Steps[int]:
        """Index a prompt's committed prefix in steps of ``step_blocks`` blocks (the RPC edge
        serves a large ``kv_commit`` so: its ``put_end`` in chunks, then this, a step a turn).

        Returns:
            Steps whose result is the number of blocks newly indexed.
        """
        return self.prefix.index_steps(
            namespace, tokens, self.objects.__contains__, step_blocks, tenant
        )

    def kv_match_steps(
        self, namespace: Namespace, tokens: np.ndarray, step_blocks: int, tenant: str | None = None
    ) -> Steps[PrefixMatch]:
        """The cached prefix of a prompt (``kv_match`` without locations), in steps of
        ``step_blocks`` blocks (see ``PrefixIndex.match_steps``)."""
        return self.prefix.match_steps(
            namespace, tokens, self.objects.__contains__, step_blocks, tenant
        )

    def kv_match(
        self,
        namespace: Namespace,
        tokens: np.ndarray,
        *,
        locate: bool = True,
        tenant: str | None = None,
        at: Site | None = None,
    ) -> tuple[PrefixMatch, list[ObjectInfo | KVStoreError]]:
        """The cached prefix of a prompt and, per block, where its replicas are (one call).

        With ``locate=False`` only the prefix: no locations, so no read leases are taken (a
        lookup that leased every block would hold them from eviction for nothing).
        """
        match = self.prefix.match(namespace, tokens, self.objects.__contains__, tenant)
        if not locate:
            return match, []
        return match, self.get_locations([key for key, _ in match.blocks], at)

    # ================================================================ figures
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
            "num_blanks": self.puts.num_blanks,
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
                    "state": n.state,
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


class ServiceSlot:
    """Which :class:`MasterService` serves now: the one object everything serving requests
    holds (the RPC edge, metrics, the admin API, housekeeping, the HA fence).

    Why a slot and not the service itself: a new HA term is a fresh instance (nothing of the
    last term's table may leak into the next), and readers must all switch to it at once. Each
    reads ``slot.service`` when it serves, never keeping the instance across requests.
    """

    __slots__ = ("service",)

    def __init__(self, service: MasterService) -> None:
        self.service = service

    def next_term(self, epoch: int | None = None) -> MasterService:
        """Start the next term: a fresh, empty service (see :meth:`MasterService.next_term`).

        Returns:
            The new service (now in the slot).
        """
        self.service = self.service.next_term(epoch)
        return self.service
