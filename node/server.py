"""The storage node's data server: connections, and the verbs registered on them.

One thread per connection, blocking sockets. Socket calls release the GIL, so the bytes move
at kernel speed: writes ``recv_into`` the arena directly, reads ``sendmsg`` arena memoryviews.

The node's data plane is split by what each part owns:

* this module: the listening socket, one thread per connection and its frame loop (the rules
  of that loop, deadlines and length checks, are ``kvstore.serving``'s, shared with the
  master), the verb registry (:meth:`DataServer.register_verb`), and the grant checks every verb
  shares (:meth:`DataServer.granted_view`);
* ``kvstore.node.verbs``: the verbs every node serves (``write``, ``read``, ``ping``,
  ``manifest``, ``stats``); ``kvstore.node.shm_verbs`` and the RDMA verbs register theirs where
  those transports are on;
* ``kvstore.node.manifest``: what the node holds whole, to claim it to a new master;
* ``kvstore.node.tiers`` and its tiers (``arena`` for DRAM, ``nvme``, ``hbm``): where the bytes
  are. Every segment is a tier; the DRAM one lets writes land in place.

Tenants (``kvstore.tenants``): a connection whose ``hello`` carries a tenant's token is bound to
that tenant (:class:`DataConnection`), and every grant it presents must name a key in that
tenant's part of the key space (:meth:`DataServer.check_owned`): another tenant's grant, or one
of the operator's keys, is refused per item with ``FORBIDDEN`` and touches nothing, however
validly signed. A block key of a namespace the operator shared (no tenant's, open to all) is the
one exception. The node learns the tenant tokens and the shared namespaces from the master
(``kvstore.node.agent``).
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from kvstore import auth, grants, protocol, serving
from kvstore.clocks import MasterClock
from kvstore.errors import (
    ForbiddenError,
    GrantInvalidError,
    InternalError,
    InvalidRequestError,
    KVStoreError,
    OutOfRangeError,
)
from kvstore.node import claims, verbs
from kvstore.node.arena import DramTier, ShmArena
from kvstore.node.manifest import Manifest
from kvstore.node.tiers import Tier
from kvstore.stored_object import StoredObject
from kvstore.tenants import TenantDirectory, prefix_of

log = logging.getLogger(__name__)

#: A connection that sends nothing for this long (idle, or stalled mid-payload) is closed.
#: A frame's header and body have a shorter deadline (the server's serving.WireDeadlines).
IDLE_TIMEOUT_S = 120.0

#: A verb: ``(conn, request, payload_len, scratch)``. It answers on ``conn`` itself, after
#: reading the request's ``payload_len`` payload bytes (``scratch``: a buffer to drop bytes
#: into). A ``KVStoreError`` it raises before touching the payload is answered for it.
VerbHandler = Callable[[protocol.FramedSocket, protocol.Request, int, memoryview], None]


class DataConnection(protocol.FramedSocket):
    """An accepted data connection, and whose it is: the verbs check each grant against
    :attr:`owned` (see :meth:`DataServer.check_owned`)."""

    #: The tenant the connection's ``hello`` bound it to (None: the operator's).
    tenant: str | None = None
    #: What every key granted to this connection starts with: its tenant's part of the key
    #: space (None: the operator's connection, which may use any grant).
    owned: bytes | None = None

    def bind(self, tenant: str | None) -> None:
        """Bind the connection to ``tenant`` (after a ``hello``; None: the operator)."""
        self.tenant = tenant
        self.owned = None if tenant is None else prefix_of(tenant)


class DataServer:
    """Serves the data plane for a set of segments.

    Args:
        segments: the node's DRAM arenas by segment name (each served as a DramTier).
        secret: the key the master signs this node's grants with.
        host, port: where to listen (port 0 picks a free one).
        clock_ms: the master's wall-clock milliseconds, for grant expiry (default: the master's
            clock as the node's link to it keeps it, :attr:`master_clock`).
        tiers: the node's other tiers (NVMe, HBM) by segment name.
        token: the cluster token every connection must present first (None: no check).
        deadlines: how long a frame (and, before the token is proved, the hello) may take.
        tenants: the tenant tokens this node knows, one directory per node process (the
            master link keeps it current); None: a new, empty one (the cluster token only).

    Verbs are registered with :meth:`register_verb` before :meth:`start`.
    """

    def __init__(
        self,
        segments: dict[str, ShmArena],
        secret: bytes,
        host: str = "127.0.0.1",
        port: int = 0,
        clock_ms: Callable[[], int] | None = None,
        tiers: dict[str, Tier] | None = None,
        token: auth.Token | None = None,
        deadlines: serving.WireDeadlines = serving.DEFAULT_DEADLINES,
        tenants: TenantDirectory | None = None,
    ) -> None:
        #: The tenant tokens every connection's hello is checked against (kvstore.node.agent
        #: replaces its contents from the master's replies).
        self.tenants = tenants if tenants is not None else TenantDirectory()
        #: The DRAM arenas (shared-memory files, for the shm and RDMA transports' offers).
        self.segments = segments
        self.token = token
        self.deadlines = deadlines
        #: Every segment, by name: the DRAM arenas as tiers, then the other tiers.
        self.tiers: dict[str, Tier] = {name: DramTier(name, a) for name, a in segments.items()}
        self.tiers.update(tiers or {})
        self.secret = secret  # also starts the memo of verified grants
        #: The master's clock, fed by the replies to registration and heartbeats (agent.py).
        self.master_clock = MasterClock()
        self.clock_ms = clock_ms or self.master_clock
        #: Which allocation owns each granted range now (see kvstore.node.claims).
        self.claims = claims.WriteClaims(lambda: self.clock_ms())
        self.manifest = Manifest()
        for tier in self.tiers.values():
            self.manifest.record_many(tier.stored())
        self._listener = socket.create_server((host, port), backlog=128, reuse_port=False)
        self.host = host
        self.port = self._listener.getsockname()[1]
        self._stopped = threading.Event()
        self._conns: set[socket.socket] = set()
        self._conns_lock = threading.Lock()
        #: Connections that have not sent their hello yet (bounded; auth.PendingConnections).
        self.pending = auth.PendingConnections()
        self._accept_thread = threading.Thread(
            target=self._accept_loop, name="node-accept", daemon=True
        )
        self.num_reads = 0
        self.num_writes = 0
        #: Until when (``time.monotonic``) this node may serve one-hop reads: set by the master
        #: link from each acknowledged heartbeat (see :mod:`kvstore.placement`); 0: never.
        self.one_hop_until = 0.0
        #: Called with a connection's FramedSocket when it closes (e.g. RDMA queue pair teardown).
        self.on_disconnect: list[Callable[[protocol.FramedSocket], None]] = []
        self._verbs: dict[str, VerbHandler] = {}
        #: The most payload bytes each verb takes (kvstore.serving checks them).
        self._payload_limits: dict[str, int] = {}
        verbs.install(self)

    def register_verb(self, name: str, handler: VerbHandler, *, max_payload: int = 0) -> None:
        """Serve ``name`` with ``handler`` (see :data:`VerbHandler`) on every connection.

        Args:
            name: the verb; registering it again replaces its handler.
            handler: runs on the connection's thread, and answers on the connection.
            max_payload: the most payload bytes a request of this verb may carry (0: none);
                a longer one is refused before the handler runs.
        """
        self._verbs[name] = handler
        self._payload_limits[name] = max_payload

    @property
    def secret(self) -> bytes:
        """The key the master signs this node's grants with."""
        return self.verified.secret

    @secret.setter
    def secret(self, secret: bytes) -> None:
        # A new secret (a new registration) forgets every grant verified under the old one, and
        # stops every write still streaming in under one of them.
        self.verified = grants.VerifiedGrants(secret)
        held = getattr(self, "claims", None)
        if held is not None:
            held.reset()

    def start(self) -> None:
        self._accept_thread.start()

    def stop(self) -> None:
        self._stopped.set()
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        with self._conns_lock:
            for c in self._conns:
                with contextlib.suppress(OSError):
                    c.shutdown(socket.SHUT_RDWR)
        self._accept_thread.join(timeout=5)

    def serves_one_hop(self) -> bool:
        """Whether this node is sure enough it is still a member to serve reads by key."""
        return time.monotonic() < self.one_hop_until

    def forget(self, items: list[tuple[Any, ...]]) -> None:
        """The master freed these ``(segment, offset[, stamp])``: drop them from the manifest,
        and delete what durable tiers keep for them (NVMe ids are never reused)."""
        self.manifest.forget(items)
        by_tier: dict[str, list[int]] = {}
        for item in items:
            seg, off = item[0], item[1]
            if seg in self.tiers:
                by_tier.setdefault(seg, []).append(off)
        for seg, offsets in by_tier.items():
            self.tiers[seg].forget(offsets)

    def read_object(self, segment: str, offset: int, size: int) -> memoryview:
        """A whole object's bytes from any tier (used by moves between tiers and nodes).

        Raises:
            GrantInvalidError: no such segment; KeyNotFoundError, OutOfRangeError from the tier.
        """
        return self.tier_of(segment).read(offset, size)

    def store_objects(
        self, segment: str, items: list[tuple[StoredObject, memoryview]]
    ) -> list[KVStoreError | None]:
        """Store whole objects into one segment and record them in the manifest."""
        tier = self.tiers.get(segment)
        if tier is None:
            return [GrantInvalidError(f"no segment {segment!r} on this node")] * len(items)
        results = tier.write(items)
        self.manifest.record_many(
            obj for (obj, _), err in zip(items, results, strict=True) if err is None
        )
        return results

    def tier_of(self, segment: str) -> Tier:
        """The tier that serves ``segment``.

        Raises:
            GrantInvalidError: no such segment on this node.
        """
        tier = self.tiers.get(segment)
        if tier is None:
            raise GrantInvalidError(f"no segment {segment!r} on this node")
        return tier

    def stats(self) -> dict[str, Any]:
        return {
            "num_objects": len(self.manifest),
            "num_reads": self.num_reads,
            "num_writes": self.num_writes,
            # Whether every arena's pages are mapped yet (kvstore.pages; False while warming).
            "arenas_warm": all(a.warm() for a in self.segments.values()),
        }

    # ------------------------------------------------------------------ connections
    def _accept_loop(self) -> None:
        while not self._stopped.is_set():
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn.settimeout(IDLE_TIMEOUT_S)
            with self._conns_lock:
                self._conns.add(conn)
            if self.token is not None:
                self.pending.add(conn, lambda c=conn: c.shutdown(socket.SHUT_RDWR))
            threading.Thread(
                target=self._serve, args=(conn,), name="node-conn", daemon=True
            ).start()

    def _serve(self, conn: socket.socket) -> None:
        """One connection's frame loop (its rules: :class:`kvstore.serving.FrameSession`)."""
        fs = DataConnection(conn, max_payload=protocol.DEFAULT_MAX_PAYLOAD)
        scratch = memoryview(bytearray(1 << 16))
        session = serving.FrameSession(
            self.token, time.monotonic(), self._payload_limits, self.deadlines, self.tenants
        )
        try:
            while not self._stopped.is_set():
                try:
                    header, body_by = session.next_header(fs)  # idles up to IDLE_TIMEOUT_S
                except KVStoreError as err:
                    fs.send_frame(protocol.encode_error(0, err))
                    return
                body = fs.read_body(header, body_by)
                step = session.open_request(header, body)
                if isinstance(step, serving.Refusal):
                    # (A hello is answered here: bind the connection to whom it proved.)
                    if session.authenticated:
                        self.pending.discard(conn)
                        fs.bind(session.tenant)
                    if not self._answer(fs, step, scratch):
                        return
                    continue
                try:
                    self._verbs[step.verb](fs, step, header.payload_len, scratch)
                except KVStoreError as err:
                    # Raised before the payload was touched (handlers guarantee it).
                    if not self._answer(fs, serving.refuse(step.req_id, err, header), scratch):
                        return
        except (ConnectionError, TimeoutError, OSError):
            pass  # peer went away or stalled; nothing it sent was acknowledged
        except Exception:
            log.exception("data connection failed")
            with contextlib.suppress(OSError):
                fs.send_frame(protocol.encode_error(0, InternalError("internal error")))
        finally:
            self.pending.discard(conn)
            with self._conns_lock:
                self._conns.discard(conn)
            conn.close()
            for hook in self.on_disconnect:
                hook(fs)

    @staticmethod
    def _answer(fs: protocol.FramedSocket, refusal: serving.Refusal, scratch: memoryview) -> bool:
        """Send a refusal (its payload skipped first); returns whether the connection stays."""
        if refusal.skip:
            fs.discard(refusal.skip, scratch)
        fs.send_frame(refusal.frame)
        return not refusal.hang_up

    # ------------------------------------------------------------------ grants
    def granted_bytes(self, grant: grants.Grant) -> memoryview | None:
        """The granted bytes in place (DRAM), or None for a tier that has none (NVMe, HBM).

        Raises:
            GrantInvalidError: no such segment here; OutOfRangeError: the grant overruns it.
        """
        tier = self.tiers.get(grant.segment)  # tier_of, inline: every read comes here
        if tier is None:
            raise GrantInvalidError(f"no segment {grant.segment!r} on this node")
        try:
            return tier.in_place(grant.offset, grant.size)
        except OutOfRangeError:
            raise OutOfRangeError("granted range lies outside the segment") from None

    @staticmethod
    def owned_by(fs: protocol.FramedSocket) -> bytes | None:
        """What every key granted to connection ``fs`` must start with (None: any key): a
        connection this server did not accept (a test calling a verb) is the operator's."""
        return fs.owned if isinstance(fs, DataConnection) else None

    def check_owned(self, grant: grants.Grant, owned: bytes) -> None:
        """Refuse a grant outside a tenant connection's part of the key space, unless it is
        a block of a namespace the operator shared (stored as named, open to every tenant).
        Callers test ``owned is not None`` first, so an operator's connection pays one
        comparison per item.

        Raises:
            ForbiddenError: the granted key neither starts with ``owned`` nor is a shared
                namespace's.
        """
        if not grant.key.startswith(owned) and not self.tenants.is_shared_key(grant.key):
            # Not which tenant's it is (or whether any's): a guess learns nothing from it.
            raise ForbiddenError("this connection's tenant may not use a grant for that key")

    def grant_reader(self, op: str) -> grants.GrantReader:
        """A reader of one request's batch grant references, verifying each batch for ``op``."""
        now = self.clock_ms()
        return grants.GrantReader(
            lambda wire: self.verified.check_batch(wire, op, now), check=False
        )

    def granted_view(
        self,
        grant_wire: Any,
        op: str,
        remember: bool = True,
        reader: grants.GrantReader | None = None,
        *,
        owned: bytes | None,
    ) -> tuple[grants.Grant, memoryview]:
        """Check a grant for ``op`` and return it with the bytes it grants.

        Args:
            grant_wire: the grant as it came on the wire.
            op: ``grants.OP_READ`` or ``grants.OP_WRITE``.
            remember: keep the verified grant in the memo (reads reuse theirs).
            reader: the request's reader of batch grant references (:meth:`grant_reader`;
                None: one-key grants only).
            owned: what the granted key must start with, the connection's
                (:meth:`owned_by`); None: any key (the operator's connection). Required, so
                that no verb forgets whose connection it serves.

        Raises:
            KVStoreError: the grant is invalid, expired or for another op; ForbiddenError: its
                key is outside ``owned``; the segment is not here or too small; a write to a
                tier without memory in place.
        """
        grant = reader.resolve(grant_wire) if reader is not None else None
        if grant is None:
            grant = self.verified.check(grant_wire, op, self.clock_ms(), remember)
        if owned is not None:
            self.check_owned(grant, owned)
        view = self.granted_bytes(grant)
        if view is not None:
            return grant, view
        if op != grants.OP_READ:
            raise InvalidRequestError("tier writes go through the whole-object path")
        return grant, self.tiers[grant.segment].read(grant.offset, grant.size)
