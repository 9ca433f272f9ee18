"""RDMA transport: one-sided READ/WRITE straight between the caller's buffers and node arenas.

Untested on real hardware (see :mod:`kvstore.rdma`, which also states the trust model: the rkey
is the capability, as the arena file is for shm). Used by :class:`~kvstore.client.datapath.DataPath`
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

from kvstore import grants, protocol, rdma
from kvstore.client.shm import SHM_WRITE_MARGIN_MS
from kvstore.client.transport import Endpoint, NodePool, ReadItem, WriteItem
from kvstore.errors import KVStoreError, TransportUnavailableError
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
        register: Callable[[str, memoryview], rdma.MemoryRegion],
        deregister: Callable[[str], None],
        capacity: int = MR_CACHE_SIZE,
    ) -> None:
        self._register = register
        self._deregister = deregister
        self.capacity = capacity
        self.table = rdma.MemoryRegionTable()
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

    def _add(self, view: memoryview, addr: int) -> rdma.MemoryRegion:
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
                start = rdma.address_of(whole)
                if start <= addr and addr + view.nbytes <= start + whole.nbytes:
                    return whole, start
    return view, addr


@dataclass(slots=True)
class _Session:
    """One node's queue pair and the TCP connection that keeps it alive on the node."""

    qp: Any
    conn: protocol.FramedSocket
    offer: rdma.RdmaOffer
    last_used: float = field(default_factory=time.monotonic)


class RdmaTransport:
    """Sessions with RDMA-capable nodes, made on first use. Thread-safe (one batch at a time).

    Args:
        device: this host's device.
        pool: where TCP connections to nodes come from (for ``rdma_connect``).
        settings: port and GID index.
        open_context: opens the device (:class:`~kvstore.rdma.VerbsContext`) and
        make_qp: makes a queue pair on it (:class:`~kvstore.rdma.RcQueuePair`); tests pass
            software stand-ins, as no device exists where they run.
    """

    def __init__(
        self,
        device: rdma.RdmaDevice,
        pool: NodePool,
        settings: rdma.RdmaSettings,
        open_context: Callable[[], Any] | None = None,
        make_qp: Callable[[Any], Any] | None = None,
    ) -> None:
        self.device = device
        self.pool = pool
        self.settings = settings
        self._open_context = open_context or (lambda: rdma.VerbsContext(device, settings))
        self._make_qp = make_qp or rdma.RcQueuePair
        self._offers: dict[str, rdma.RdmaOffer] = {}
        # node_id -> session, or why RDMA does not serve that node (not retried until a new offer).
        self._sessions: dict[str, _Session | TransportUnavailableError] = {}
        self._ctx: Any = None  # VerbsContext, opened on first use
        self._ctx_error: TransportUnavailableError | None = None
        self._mrs: MrCache | None = None
        self._pins: list[str] = []  # the batch's registrations (one batch at a time)
        self._lock = threading.Lock()
        #: Nodes whose session failed: the data path asks the master for their offers again
        #: (a node that restarted publishes a new one, and :meth:`learn` then retries RDMA).
        self.dropped: set[str] = set()

    def learn(self, node_id: str, offer: rdma.RdmaOffer) -> None:
        """Record a node's offer; a changed one ends the node's session (the node restarted), or
        clears its recorded failure, so RDMA is tried again."""
        with self._lock:
            if self._offers.get(node_id) != offer:
                self._offers[node_id] = offer
                self._end(node_id)

    def serves(self, node_id: str) -> bool:
        """Whether RDMA may be tried for ``node_id`` (an offer, and no failure recorded)."""
        return (
            self._ctx_error is None
            and node_id in self._offers
            and not isinstance(self._sessions.get(node_id), TransportUnavailableError)
        )

    def close(self) -> None:
        with self._lock:
            for node_id in list(self._sessions):
                self._end(node_id)
            if self._mrs is not None:
                self._mrs.close()
            if self._ctx is not None:
                self._ctx.close()
                self._ctx = None

    # ---------------------------------------------------------------- sessions
    def _end(self, node_id: str) -> None:
        s = self._sessions.pop(node_id, None)
        if isinstance(s, _Session):
            s.conn.close()  # the node destroys its queue pair when this connection closes
            s.qp.close()

    def _fail(self, node_id: str, err: TransportUnavailableError) -> None:
        self._end(node_id)
        self._sessions[node_id] = err
        self.dropped.add(node_id)
        rdma.log_fallback(f"rdma-node-{node_id}", f"client, node {node_id}", err.message)

    def _context(self) -> Any:
        if self._ctx is None and self._ctx_error is None:
            try:
                self._ctx = self._open_context()
                self._mrs = MrCache(
                    lambda name, buf: self._ctx.register(name, buf, remote=False),
                    self._ctx.deregister,
                )
            except TransportUnavailableError as err:
                self._ctx_error = err
                rdma.log_fallback("rdma-client-open", "client", err.message)
        return self._ctx

    def _session(self, node_id: str, endpoint: Endpoint) -> _Session | None:
        """The node's session, connecting it now if needed; None where RDMA does not serve."""
        s = self._sessions.get(node_id)
        if isinstance(s, TransportUnavailableError):
            return None
        if isinstance(s, _Session):
            if time.monotonic() - s.last_used < KEEPALIVE_S or _alive(s.conn):
                return s
            self._end(node_id)  # the node closed the idle connection: reconnect once
        offer = self._offers.get(node_id)
        ctx = self._context()
        if offer is None or ctx is None:
            return None
        try:
            s = self._connect(ctx, endpoint, offer)
        except TransportUnavailableError as err:
            self._fail(node_id, err)
            return None
        except KVStoreError as err:
            self._fail(node_id, TransportUnavailableError(f"rdma_connect: {err.message}"))
            return None
        self._sessions[node_id] = s
        log.info("node %s: using RDMA (%s)", node_id, self.device.name)
        return s

    def _connect(self, ctx: Any, endpoint: Endpoint, offer: rdma.RdmaOffer) -> _Session:
        qp = self._make_qp(ctx)
        try:
            conn, _ = self.pool.acquire(endpoint)  # kept by the session, never pooled
        except BaseException:
            qp.close()
            raise
        try:
            psn = secrets.randbelow(1 << 24)
            req_id = conn.send_request("rdma_connect", {"endpoint": qp.endpoint(psn).to_wire()}, ())
            response, payload_len = conn.read_response()
            if response.req_id != req_id or payload_len:
                raise TransportUnavailableError("rdma_connect: unexpected reply")
            result = response.unwrap()
            if not isinstance(result, dict):
                raise TransportUnavailableError("rdma_connect: malformed reply")
            qp.connect(rdma.QpEndpoint.from_wire(result.get("endpoint")), psn)
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
    def _plan(
        self, loc: Location, view: memoryview, op: str, ranges: list[list[int]] | None
    ) -> tuple[_Session, list[rdma.RdmaOp]] | None:
        """The session and operations for one item, or None where RDMA cannot serve it."""
        if not self.serves(loc.node_id):
            return None
        grant = loc.grant
        offer = self._offers[loc.node_id]
        region = offer.regions.get(grant.segment)
        # A write needs its grant to hold a while longer (see kvstore.client.shm).
        margin = SHM_WRITE_MARGIN_MS if op == grants.OP_WRITE else 0
        if region is None or grant.op != op or grant.expires_ms - margin < time.time() * 1000:
            return None
        raddr, rlength, rkey = region
        if grant.offset + grant.size > rlength:
            return None  # the master granted more than the node registered: TCP decides
        if ranges is None:
            ranges = [[0, grant.size]]
        if not all(isinstance(r, list | tuple) and len(r) == 2 for r in ranges):
            return None
        if view.nbytes == 0 or sum(r[1] for r in ranges) != view.nbytes:
            return None
        for start, length in ranges:
            grants.check_range(grant, start, length)  # OutOfRangeError: a bad request
        s = self._session(loc.node_id, (loc.host, loc.port))
        if s is None or self._mrs is None:
            return None
        ops: list[rdma.RdmaOp] = []
        laddr = rdma.address_of(view)
        lkey = self._mrs.lkey(view, laddr, self._pins)
        pos = 0
        for start, length in ranges:
            for done in range(0, length, rdma.MAX_OP_BYTES):
                n = min(rdma.MAX_OP_BYTES, length - done)
                remote = raddr + grant.offset + start + done
                ops.append(
                    rdma.RdmaOp(op == grants.OP_WRITE, laddr + pos + done, lkey, n, remote, rkey)
                )
            pos += length
        return s, ops

    def _run(self, plans: dict[str, tuple[_Session, list[rdma.RdmaOp], list[Any]]]) -> list[Any]:
        """Run each node's operations; returns the items of nodes whose session failed."""
        failed: list[Any] = []
        try:
            for node_id, (s, ops, items) in plans.items():
                try:
                    s.qp.run(ops)
                    s.last_used = time.monotonic()
                except TransportUnavailableError as err:
                    self._fail(node_id, err)
                    failed.extend(items)
        finally:
            if self._mrs is not None:
                self._mrs.end_batch(self._pins)
        return failed

    def read(self, items: Sequence[ReadItem]) -> list[ReadItem]:
        """Fill what RDMA can serve; returns the items left for TCP."""
        rest: list[ReadItem] = []
        with self._lock:
            plans: dict[str, tuple[_Session, list[rdma.RdmaOp], list[Any]]] = {}
            for item in items:
                try:
                    planned = self._plan(item.location, item.dest, grants.OP_READ, item.ranges)
                except KVStoreError as err:
                    if isinstance(err, TransportUnavailableError):
                        rest.append(item)
                    else:
                        item.result = err
                    continue
                if planned is None:
                    rest.append(item)
                    continue
                s, ops = planned
                entry = plans.setdefault(item.location.node_id, (s, [], []))
                entry[1].extend(ops)
                entry[2].append(item)
            failed = self._run(plans)
        failed_ids = {id(i) for i in failed}
        for _, (_, _, done) in plans.items():
            for item in done:
                if id(item) not in failed_ids:
                    item.filled = item.dest.nbytes
        return rest + failed

    def write(self, items: Sequence[WriteItem]) -> tuple[list[WriteItem], list[WriteItem]]:
        """Write what RDMA can take into node arenas.

        Returns:
            ``(written, rest)``: items placed (still to be committed with ``rdma_commit``), and
            items left for TCP.
        """
        rest: list[WriteItem] = []
        with self._lock:
            plans: dict[str, tuple[_Session, list[rdma.RdmaOp], list[Any]]] = {}
            for item in items:
                try:
                    planned = self._plan(item.location, item.data, grants.OP_WRITE, None)
                except KVStoreError:
                    planned = None
                if planned is None:
                    rest.append(item)
                    continue
                s, ops = planned
                entry = plans.setdefault(item.location.node_id, (s, [], []))
                entry[1].extend(ops)
                entry[2].append(item)
            failed = self._run(plans)
        failed_ids = {id(i) for i in failed}
        written = [i for _, (_, _, done) in plans.items() for i in done if id(i) not in failed_ids]
        return written, rest + failed


def _alive(conn: protocol.FramedSocket) -> bool:
    """Ping a session's idle connection (the node closes connections idle past its timeout)."""
    try:
        req_id = conn.send_request("ping", {}, ())
        response, payload_len = conn.read_response()
        response.unwrap()
        return response.req_id == req_id and not payload_len
    except (KVStoreError, OSError, ConnectionError):
        return False
