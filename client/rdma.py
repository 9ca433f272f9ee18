"""EXPERIMENTAL RDMA transport: one-sided READ/WRITE between the caller's buffers and node arenas.

The client's half of the experimental RDMA package: untested on real hardware; what is and is
not tested, the package's shape and the trust model (the rkey is the capability, as the arena file
is for shm) are in :mod:`kvstore.rdma`. It lives in the client layer, not under
:mod:`kvstore.rdma`, because it is a client transport built on :mod:`kvstore.client.transport`'s
pool and items, and the core must not import the client. Used by :class:`~kvstore.client.datapath.DataPath`
for nodes that offer RDMA when this host has a device too.

Per node, on first use, the client opens a TCP connection that it keeps for the session, makes
an RC queue pair and exchanges endpoints with the node (``rdma_connect``); the node's queue pair
lives as long as that connection. The caller's buffers are registered as memory regions on first
use and kept in a small cache (:class:`MrCache`). Each item then costs one RDMA READ or WRITE
(one per range for partial reads) at ``region.addr + grant.offset``.

The node's CPU sees none of this, so the grant is checked here before any operation is posted:
operation, expiry, and that ``[offset, offset + size)`` lies inside the node's registered region.
Writes are committed by the node afterwards (``rdma_commit``, by the data path), reads are
checked against the object's checksum by the client, as over TCP.

Any failure (the local device cannot be opened, the node refuses ``rdma_connect``, a queue pair
error or timeout) logs one line and sends that node's items, and all later ones, over TCP.

Threads: each node has its own state and lock, held only for bookkeeping; ``rdma_connect`` runs
with no lock held while other threads wait for it (each until its own deadline), and each node's
queue pair is driven by one thread at a time. So a slow or silent node delays only the batches
that use it: other threads, and other nodes, go on (see :class:`RdmaTransport` for the locks).
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvstore import grants, protocol
from kvstore.client.shm import SHM_WRITE_MARGIN_MS
from kvstore.client.transport import Endpoint, NodePool, ReadItem, WriteItem
from kvstore.errors import KVStoreError, ProtocolError, TransportUnavailableError
from kvstore.rdma import devices, ibverbs, wire
from kvstore.types import Location

log = logging.getLogger(__name__)

#: Caller buffers kept registered (registration pins pages: the cache keeps it to a few).
MR_CACHE_SIZE = 32
#: A session's TCP connection idle this long is pinged before use (the node closes idle ones).
KEEPALIVE_S = 30.0


class MrCache:
    """The caller's buffers registered as memory regions, least recently used dropped first.

    A buffer is registered whole (its exporting object, e.g. the whole numpy array a slice comes
    from), so the slices of one staging buffer share one registration. Each entry keeps a
    reference to its buffer: the memory cannot be freed (and its address reused by another
    allocation, which the stale registration would still point past) while it is registered.

    Thread-safe: batches of several threads (to several nodes) plan at once. Each batch pins the
    registrations it uses (``pins``, one list per batch) and unpins them in :meth:`end_batch`; a
    registration pinned by any batch is never evicted, so one thread's eviction cannot pull a
    memory region from under another thread's operations in flight.

    NOTE: ``_lock`` guards the table and the pins, and is held across ``register``/``deregister``
    (``ibv_reg_mr``/``ibv_dereg_mr``: local calls into the device driver, no network). It is a
    leaf: nothing else is locked under it.

    Args:
        register: registers a buffer: ``(name, buffer) -> MemoryRegion``.
        deregister: releases a registration by name.
        capacity: the most buffers kept registered.
    """

    def __init__(
        self,
        register: Callable[[str, memoryview], ibverbs.MemoryRegion],
        deregister: Callable[[str], None],
        capacity: int = MR_CACHE_SIZE,
    ) -> None:
        self._register = register
        self._deregister = deregister
        self.capacity = capacity
        self.table = ibverbs.MemoryRegionTable()
        self._keep: OrderedDict[str, memoryview] = OrderedDict()
        # name -> how many batches in flight use it (pinned: never evicted while counted)
        self._in_use: Counter[str] = Counter()
        self._seq = 0
        self._lock = threading.Lock()

    def lkey(self, view: memoryview, addr: int, pins: list[str]) -> int:
        """The local key covering ``view`` (at ``addr``), registering its buffer if needed.

        Args:
            view: the bytes an operation reads or writes locally.
            addr: ``view``'s address.
            pins: the calling batch's pins: the registration's name is added (pinned until
                :meth:`end_batch` is given the same list).

        Raises:
            TransportUnavailableError: the device refused the registration, or the buffer
                overlaps a smaller registration another batch is using.
        """
        with self._lock:
            try:
                region = self.table.locate(addr, view.nbytes)
            except KVStoreError:
                region = self._add(view, addr)
            self._keep.move_to_end(region.name)
            self._in_use[region.name] += 1
            pins.append(region.name)
            return region.lkey

    def end_batch(self, pins: list[str]) -> None:
        """A batch's operations completed: unpin its buffers (emptying ``pins``); the cache
        goes back to its capacity."""
        with self._lock:
            self._in_use.subtract(pins)
            for name in set(pins):
                if self._in_use[name] <= 0:
                    del self._in_use[name]
            pins.clear()
            self._trim(self.capacity)

    def _trim(self, keep: int) -> None:
        """Evict least recently used buffers not in use until at most ``keep`` remain."""
        for name in [n for n in self._keep if n not in self._in_use]:
            if len(self._keep) <= keep:
                return
            self._drop(name)

    def _add(self, view: memoryview, addr: int) -> ibverbs.MemoryRegion:
        whole = _whole_buffer(view, addr)
        self._trim(self.capacity - 1)  # batches may exceed the capacity until end_batch()
        overlapping = [
            other.name
            for other in self.table.regions()
            if other.addr < whole[1] + whole[0].nbytes and whole[1] < other.end
        ]
        if any(name in self._in_use for name in overlapping):
            raise TransportUnavailableError("buffer overlaps a registration in use")
        for name in overlapping:  # a larger registration replaces overlapping ones
            self._drop(name)
        self._seq += 1
        name = f"buf{self._seq}"
        region = self._register(name, whole[0])
        self.table.add(region)
        self._keep[name] = whole[0]
        return region

    def _drop(self, name: str) -> None:
        self._keep.pop(name, None)
        self.table.remove(name)
        self._deregister(name)

    def close(self) -> None:
        with self._lock:
            self._in_use.clear()
            for name in list(self._keep):
                self._drop(name)

    def __len__(self) -> int:
        return len(self._keep)


def _whole_buffer(view: memoryview, addr: int) -> tuple[memoryview, int]:
    """The whole contiguous buffer ``view`` is a slice of (and its address), else ``view``."""
    obj = view.obj
    if obj is not None:
        with contextlib.suppress(TypeError, ValueError, KVStoreError):
            whole = memoryview(obj)
            if whole.contiguous and whole.nbytes >= view.nbytes:
                start = ibverbs.address_of(whole)
                if start <= addr and addr + view.nbytes <= start + whole.nbytes:
                    return whole, start
    return view, addr


@dataclass(slots=True, eq=False)
class _Session:
    """One node's queue pair and the TCP connection that keeps it alive on the node.

    ``users``, ``retired`` and ``qp_closed`` are guarded by the owning :class:`_Node`'s lock;
    ``qp_lock`` makes the queue pair one thread's at a time (see :class:`RdmaTransport`).
    """

    qp: Any
    conn: protocol.FramedSocket
    offer: wire.RdmaOffer
    last_used: float = field(default_factory=time.monotonic)  # a hint: written unlocked
    qp_lock: threading.Lock = field(default_factory=threading.Lock)
    users: int = 0  # threads holding this session (planning, waiting for or running the QP)
    retired: bool = False  # no longer the node's session: closed when its last user leaves
    qp_closed: bool = False


@dataclass(slots=True, eq=False)
class _Node:
    """What RDMA knows of one node. Every field but ``node_id`` and ``lock`` is guarded by
    ``lock``, which is only ever held for in-memory bookkeeping (never across I/O).

    The states: no session yet (``session``, ``connecting`` and ``error`` all None); connecting
    (``connecting`` set: one thread connects, others wait on the event with their own timeout);
    connected (``session``); failed (``error``: TCP until a new offer).
    """

    node_id: str
    offer: wire.RdmaOffer
    lock: threading.Lock = field(default_factory=threading.Lock)
    session: _Session | None = None
    #: Set when the connect (or the keepalive ping) in flight ends, however it ends.
    connecting: threading.Event | None = None
    error: TransportUnavailableError | None = None
    #: Bumped by a new offer and by close(): a connect begun under an older one is discarded.
    generation: int = 0


@dataclass(slots=True)
class _Plan:
    """One node's share of a batch: its session, operations and items, and the buffers pinned."""

    node: _Node
    items: list[Any] = field(default_factory=list)
    todo: list[tuple[Any, memoryview, int, list[list[int]]]] = field(default_factory=list)
    session: _Session | None = None
    ops: list[ibverbs.RdmaOp] = field(default_factory=list)
    pins: list[str] = field(default_factory=list)


class RdmaTransport:
    """Sessions with RDMA-capable nodes, made on first use. Thread-safe: batches of any number
    of threads run at once; only batches using the same node's queue pair take turns.

    NOTE: locks, and their order (a lock may be taken while holding one to its left, never the
    reverse). None is held across a network round trip (``rdma_connect``, the keepalive ping)
    or a call back into other client code; the one lock held across a call out, ``qp_lock``
    around ``qp.run``, is explained below.

        ``_Session.qp_lock``  →  ``_Node.lock``
        ``_lock`` (the node table), ``_ctx_lock`` (opening the device), ``MrCache._lock``:
        leaves, each taken with no other lock held and nothing locked under it.

    - ``_lock`` guards the ``node_id -> _Node`` table: lookups and inserts only.
    - ``_Node.lock`` guards one node's state and the bookkeeping of its sessions (users, retired).
      ``rdma_connect`` (a TCP round trip) and the keepalive ping run with no lock held: the
      thread that starts one leaves a "connecting" event in the node's state, other threads
      wait on that event with their own deadline (the client's timeout) and send their items
      over TCP for that batch if it passes. A slow node delays its own users only.
    - ``_Session.qp_lock`` is held around ``qp.run`` (post the work requests, poll the completion
      queue) and nothing else. A queue pair and its completion queue must be driven by one
      thread at a time (completions would otherwise be counted by the wrong poller). Holding a
      lock there is acceptable because the lock belongs to one node's queue pair (never shared
      across nodes, so another node's users never wait on it), ``run`` calls nothing of ours and
      is bounded by :data:`~kvstore.rdma.ibverbs.COMPLETION_TIMEOUT_S`, and a waiter waits for it with
      its own deadline, then uses TCP for that batch. Under it, ``_Node.lock`` is taken only to
      read whether the session was retired meanwhile.
    - The device context (opened once, ``ibv_open_device``) and memory registrations are local
      calls into the driver, no network; their locks are leaves.

    Args:
        device: this host's device.
        pool: where TCP connections to nodes come from (for ``rdma_connect``); its timeout is
            also the longest a batch waits for another thread's connect or queue pair.
        settings: port and GID index.
        open_context: opens the device (:class:`~kvstore.rdma.ibverbs.VerbsContext`) and
        make_qp: makes a queue pair on it (:class:`~kvstore.rdma.ibverbs.RcQueuePair`); tests pass
            software stand-ins, as no device exists where they run.
    """

    def __init__(
        self,
        device: devices.RdmaDevice,
        pool: NodePool,
        settings: devices.RdmaConfig,
        open_context: Callable[[], Any] | None = None,
        make_qp: Callable[[Any], Any] | None = None,
    ) -> None:
        self.device = device
        self.pool = pool
        self.settings = settings
        self._open_context = open_context or (lambda: ibverbs.VerbsContext(device, settings))
        self._make_qp = make_qp or ibverbs.RcQueuePair
        self._nodes: dict[str, _Node] = {}
        self._lock = threading.Lock()
        self._closed = False
        self._ctx: Any = None  # VerbsContext, opened on first use
        self._ctx_error: TransportUnavailableError | None = None
        self._mrs: MrCache | None = None
        self._ctx_lock = threading.Lock()
        #: Nodes whose session failed: the data path asks the master for their offers again
        #: (a node that restarted publishes a new one, and :meth:`learn` then retries RDMA).
        self.dropped: set[str] = set()

    def learn(self, node_id: str, offer: wire.RdmaOffer) -> None:
        """Record a node's offer; a changed one ends the node's session (the node restarted), or
        clears its recorded failure, so RDMA is tried again. In-memory only: never waits."""
        with self._lock:
            node = self._nodes.get(node_id)
            if node is None:
                self._nodes[node_id] = _Node(node_id, offer)
                return
        with node.lock:
            if node.offer == offer:
                return
            node.offer = offer
            old = self._reset(node)
        self._retire(node, old)

    def serves(self, node_id: str) -> bool:
        """Whether RDMA may be tried for ``node_id`` (an offer, and no failure recorded)."""
        with self._lock:
            node = self._nodes.get(node_id)
        if node is None or self._ctx_error is not None:
            return False
        with node.lock:
            return node.error is None

    def close(self) -> None:
        """End every session and release the device. Connects in flight are discarded when
        they end (they hold no lock, so close never waits for them)."""
        with self._lock:
            self._closed = True
            nodes = list(self._nodes.values())
        for node in nodes:
            with node.lock:
                old = self._reset(node)
            self._retire(node, old)
        with self._ctx_lock:
            mrs, ctx, self._ctx = self._mrs, self._ctx, None
        if mrs is not None:
            mrs.close()
        if ctx is not None:
            ctx.close()

    # ---------------------------------------------------------------- sessions
    @staticmethod
    def _reset(node: _Node) -> _Session | None:
        """Forget the node's session, failure and connect in flight (caller holds node.lock);
        returns the session to retire."""
        node.generation += 1
        old, node.session = node.session, None
        node.error = None
        node.connecting = None  # the connect in flight sees the new generation and is dropped
        return old

    @staticmethod
    def _retire(node: _Node, s: _Session | None) -> None:
        """End a session that is no longer the node's: its connection now (the node destroys
        its queue pair), its local queue pair once the last thread using it lets go."""
        if s is None:
            return
        with node.lock:
            s.retired = True
            close_qp = s.users == 0 and not s.qp_closed
            s.qp_closed = s.qp_closed or close_qp
        s.conn.close()
        if close_qp:
            s.qp.close()

    @staticmethod
    def _let_go(node: _Node, s: _Session) -> None:
        """This thread no longer uses ``s``; the last user of a retired session closes its QP."""
        with node.lock:
            s.users -= 1
            close_qp = s.retired and s.users == 0 and not s.qp_closed
            s.qp_closed = s.qp_closed or close_qp
        if close_qp:
            s.qp.close()

    def _fail(self, node: _Node, s: _Session, err: TransportUnavailableError) -> None:
        """Move ``node`` to TCP because its session ``s`` failed; one log line. A failure of a
        session that is no longer the node's (replaced, or failed already) changes nothing."""
        with node.lock:
            current = node.session is s
            if current:
                node.generation += 1
                node.session = None
                node.error = err
        self._retire(node, s)
        if current:
            self._log_fallback(node, err)

    def _log_fallback(self, node: _Node, err: TransportUnavailableError) -> None:
        """The node now uses TCP (its failure is recorded): say so once, and have the data path
        ask the master for its offer again."""
        self.dropped.add(node.node_id)
        devices.log_fallback(
            f"rdma-node-{node.node_id}", f"client, node {node.node_id}", err.message
        )

    def _context(self) -> Any:
        with self._ctx_lock:
            if self._ctx is None and self._ctx_error is None and not self._closed:
                try:
                    ctx = self._open_context()
                    self._mrs = MrCache(
                        lambda name, buf: ctx.register(name, buf, remote=False), ctx.deregister
                    )
                    self._ctx = ctx
                except TransportUnavailableError as err:
                    self._ctx_error = err
            ctx, err = self._ctx, self._ctx_error
        if err is not None:
            devices.log_fallback("rdma-client-open", "client", err.message)
        return ctx

    def _node(self, node_id: str) -> _Node | None:
        with self._lock:
            return None if self._closed else self._nodes.get(node_id)

    def _session(self, node: _Node, endpoint: Endpoint, deadline: float) -> _Session | None:
        """The node's session, held for this thread (give it back with :meth:`_let_go`), or None
        where RDMA does not serve this batch.

        Connects (or pings an idle session) with no lock held when no other thread is doing so,
        waiting for the node's reply one client timeout at most; else waits for that thread
        until ``deadline`` (a ``time.monotonic()``), then gives up for this batch only (its items
        go over TCP; the connecting thread decides the node's fate).
        """
        while True:
            with node.lock:
                if node.error is not None:
                    return None
                s = node.session
                if s is not None and time.monotonic() - s.last_used < KEEPALIVE_S:
                    s.users += 1
                    return s
                if node.connecting is None:  # this thread connects (or pings the idle session)
                    event = node.connecting = threading.Event()
                    generation, offer, stale = node.generation, node.offer, s
                    node.session = None  # others wait on the event until it is settled
                    if stale is not None:
                        stale.users += 1  # kept open while it is pinged
                    break
                event = node.connecting
            left = deadline - time.monotonic()
            if left <= 0 or not event.wait(left):
                return None
        try:
            # Its own round trip gets a whole timeout: a batch that spent its deadline waiting
            # for another node must not fail this one by giving it no time to answer.
            own_deadline = time.monotonic() + self.pool.timeout
            return self._establish(node, endpoint, generation, offer, stale, own_deadline)
        finally:
            with node.lock:  # settled by _establish; cleared here too if it raised
                if node.connecting is event:
                    node.connecting = None
            event.set()

    def _establish(
        self,
        node: _Node,
        endpoint: Endpoint,
        generation: int,
        offer: wire.RdmaOffer,
        stale: _Session | None,
        deadline: float,
    ) -> _Session | None:
        """Reuse ``stale`` if it answers a ping, else connect; publish the result if the node's
        state is still the one it began from (``generation``). Runs with no lock held; the
        replies are awaited until ``deadline`` at most."""
        s: _Session | None = None
        err: TransportUnavailableError | None = None
        if stale is not None:
            if _alive(stale.conn, deadline):
                s = stale
                s.last_used = time.monotonic()
            else:  # the node closed the idle connection: reconnect once
                self._let_go(node, stale)
                self._retire(node, stale)
        if s is None:
            ctx = self._context()
            if ctx is None:
                with node.lock:
                    if node.generation == generation:
                        node.connecting = None
                return None
            try:
                s = self._connect(ctx, endpoint, offer, deadline)
                s.users += 1  # this thread's, before anyone else can see it
            except TransportUnavailableError as exc:
                err = exc
            except KVStoreError as exc:
                err = TransportUnavailableError(f"rdma_connect: {exc.message}")
        with node.lock:
            current = node.generation == generation
            if current:
                node.connecting = None
                if s is not None:
                    node.session = s
                else:
                    assert err is not None
                    node.generation += 1
                    node.error = err
        if not current:  # a new offer (or close) came meanwhile: this result is stale
            if s is not None:
                self._let_go(node, s)
                self._retire(node, s)
            return None
        if err is not None:
            self._log_fallback(node, err)
            return None
        assert s is not None
        if s is not stale:
            log.info("node %s: using RDMA (%s)", node.node_id, self.device.name)
        return s

    def _connect(
        self, ctx: Any, endpoint: Endpoint, offer: wire.RdmaOffer, deadline: float
    ) -> _Session:
        """A queue pair connected to the node's through ``rdma_connect`` (its reply awaited until
        ``deadline``, a ``time.monotonic()``).

        Raises:
            TransportUnavailableError: the node refused, did not answer in time, or went away.
            KVStoreError: the node could not be reached (the caller falls back to TCP).
        """
        qp = self._make_qp(ctx)
        try:
            conn, _ = self.pool.acquire(endpoint)  # kept by the session, never pooled
        except BaseException:
            qp.close()
            raise
        try:
            psn = secrets.randbelow(1 << 24)
            req_id = conn.send_request("rdma_connect", {"endpoint": qp.endpoint(psn).to_wire()}, ())
            response, payload_len = _read_response(conn, deadline)
            if response.req_id != req_id or payload_len:
                raise TransportUnavailableError("rdma_connect: unexpected reply")
            result = response.unwrap()
            if not isinstance(result, dict):
                raise TransportUnavailableError("rdma_connect: malformed reply")
            qp.connect(wire.QpEndpoint.from_wire(result.get("endpoint")), psn)
        except (OSError, ConnectionError) as exc:
            conn.close()
            qp.close()
            raise TransportUnavailableError(f"rdma_connect: {exc}") from None
        except BaseException:
            conn.close()
            qp.close()
            raise
        return _Session(qp, conn, offer)

    # ---------------------------------------------------------------- operations
    def _eligible(
        self, node: _Node, loc: Location, view: memoryview, op: str, ranges: Any
    ) -> list[list[int]] | None:
        """The ranges to move for one item, or None where RDMA cannot serve it (TCP decides).

        Raises:
            OutOfRangeError: a range outside the grant (a bad request, not retried over TCP).
        """
        grant = loc.grant
        with node.lock:
            offer, failed = node.offer, node.error is not None
        region = offer.regions.get(grant.segment)
        # A write needs its grant to hold a while longer (see kvstore.client.shm).
        margin = SHM_WRITE_MARGIN_MS if op == grants.OP_WRITE else 0
        if failed or region is None or grant.op != op:
            return None
        if grant.expires_ms - margin < time.time() * 1000:
            return None
        if grant.offset + grant.size > region[1]:
            return None  # the master granted more than the node registered: TCP decides
        if ranges is None:
            ranges = [[0, grant.size]]
        if not all(isinstance(r, list | tuple) and len(r) == 2 for r in ranges):
            return None
        if view.nbytes == 0 or sum(r[1] for r in ranges) != view.nbytes:
            return None
        for start, length in ranges:
            grants.check_range(grant, start, length)
        return ranges

    def _ops(self, plan: _Plan, mrs: MrCache) -> None:
        """Fill ``plan.ops`` from its items, against the offer its session was made for.

        Raises:
            TransportUnavailableError: a buffer could not be registered (TCP for this batch).
        """
        assert plan.session is not None
        offer = plan.session.offer
        for item, view, laddr, ranges in plan.todo:
            grant = item.location.grant
            region = offer.regions.get(grant.segment)
            if region is None or grant.offset + grant.size > region[1]:
                raise TransportUnavailableError("the node's offer changed")
            raddr, _, rkey = region
            lkey = mrs.lkey(view, laddr, plan.pins)
            pos = 0
            write = grant.op == grants.OP_WRITE
            for start, length in ranges:
                for done in range(0, length, ibverbs.MAX_OP_BYTES):
                    n = min(ibverbs.MAX_OP_BYTES, length - done)
                    remote = raddr + grant.offset + start + done
                    plan.ops.append(
                        ibverbs.RdmaOp(write, laddr + pos + done, lkey, n, remote, rkey)
                    )
                pos += length

    def _run_node(self, plan: _Plan, deadline: float) -> bool:
        """Connect (or reuse) the node's session and run its operations. Returns whether the
        items were moved; False sends them over TCP (the node too, from now on, if its session
        failed)."""
        node = plan.node
        first = plan.items[0].location
        s = plan.session = self._session(node, (first.host, first.port), deadline)
        mrs = self._mrs
        if s is None or mrs is None:
            return False
        try:
            self._ops(plan, mrs)
        except TransportUnavailableError:
            return False
        if not s.qp_lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
            return False  # another thread's batch holds this node's queue pair: TCP this time
        try:
            with node.lock:
                retired = s.retired
            if retired:  # failed (or replaced) while this thread waited for it
                return False
            try:
                s.qp.run(plan.ops)
            except TransportUnavailableError as err:
                failure = err
            else:
                s.last_used = time.monotonic()
                return True
        finally:
            s.qp_lock.release()
        self._fail(node, s, failure)
        return False

    def _batch(self, items: Sequence[Any], op: str) -> tuple[list[Any], list[Any]]:
        """Move what RDMA can of ``items``; returns ``(moved, rest)``: rest is for TCP. An item
        whose ranges leave its grant gets its ``result`` (OutOfRangeError) and is in neither."""
        rest: list[Any] = []
        plans: dict[str, _Plan] = {}
        for item in items:
            loc = item.location
            node = self._node(loc.node_id)
            if node is None or self._ctx_error is not None:
                rest.append(item)
                continue
            view = item.dest if op == grants.OP_READ else item.data
            try:
                ranges = self._eligible(
                    node, loc, view, op, item.ranges if op == grants.OP_READ else None
                )
                laddr = ibverbs.address_of(view) if ranges is not None else 0
            except KVStoreError as err:
                if op == grants.OP_READ and not isinstance(err, TransportUnavailableError):
                    item.result = err
                else:
                    rest.append(item)
                continue
            if ranges is None:
                rest.append(item)
                continue
            plan = plans.get(loc.node_id)
            if plan is None:
                plan = plans[loc.node_id] = _Plan(node)
            plan.items.append(item)
            plan.todo.append((item, view, laddr, ranges))
        moved: list[Any] = []
        deadline = time.monotonic() + self.pool.timeout
        for plan in plans.values():
            try:
                ok = self._run_node(plan, deadline)
            finally:
                if plan.pins and self._mrs is not None:
                    self._mrs.end_batch(plan.pins)
                if plan.session is not None:
                    self._let_go(plan.node, plan.session)
            (moved if ok else rest).extend(plan.items)
        return moved, rest

    def read(self, items: Sequence[ReadItem]) -> list[ReadItem]:
        """Fill what RDMA can serve; returns the items left for TCP."""
        moved, rest = self._batch(items, grants.OP_READ)
        for item in moved:
            item.filled = item.dest.nbytes
        return rest

    def write(self, items: Sequence[WriteItem]) -> tuple[list[WriteItem], list[WriteItem]]:
        """Write what RDMA can take into node arenas.

        Returns:
            ``(written, rest)``: items placed (still to be committed with ``rdma_commit``), and
            items left for TCP.
        """
        return self._batch(items, grants.OP_WRITE)


def _read_response(conn: protocol.FramedSocket, deadline: float) -> tuple[protocol.Response, int]:
    """One response (and its payload's length), arriving by ``deadline`` (``time.monotonic()``).

    Raises:
        TimeoutError: past ``deadline``. ProtocolError: not a response frame.
    """
    header = conn.read_header(deadline)
    if header.kind != protocol.KIND_RESPONSE:
        raise ProtocolError("expected a response frame")
    return protocol.decode_response(conn.read_body(header, deadline)), header.payload_len


def _alive(conn: protocol.FramedSocket, deadline: float) -> bool:
    """Ping a session's idle connection (the node closes connections idle past its timeout);
    the answer must come by ``deadline``."""
    try:
        req_id = conn.send_request("ping", {}, ())
        response, payload_len = _read_response(conn, deadline)
        response.unwrap()
        return response.req_id == req_id and not payload_len
    except (KVStoreError, OSError, ConnectionError):
        return False
