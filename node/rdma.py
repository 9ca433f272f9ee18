"""EXPERIMENTAL: the node's side of the RDMA transport: queue pairs per client connection, commits.

Part of the experimental :mod:`kvstore.rdma` package (what is tested is said there; real hardware
is not). Here rather than in :mod:`kvstore.node` so that all of RDMA's node code is one place that
reads as experimental; the node daemon calls :func:`install` and nothing else. Where this node has
a device it opens it at start, registers every DRAM arena once as a memory region with remote
READ/WRITE (kept in the context's :class:`~kvstore.rdma.ibverbs.MemoryRegionTable`) and publishes an
:class:`~kvstore.rdma.wire.RdmaOffer`. Clients then connect queue pairs over their TCP connection:

``rdma_connect``  ``{"endpoint": QpEndpoint}`` → ``{"endpoint": QpEndpoint}``: the node makes an
                  RC queue pair for *this TCP connection*, moves it to RTS towards the client's
                  endpoint and answers with its own. The queue pair is destroyed when the
                  connection closes. At most ``max_qps`` live at once (TransportUnavailableError
                  past it). A node without a device answers TransportUnavailableError, and so
                  does every node to a tenant's connection (a queue pair is not checked per
                  grant, so tenants use TCP).
``rdma_commit``   same as ``shm_commit`` (``{"items": [[grant, checksum], ...]}``): after a
                  client's one-sided WRITE, the node checks the write grant and the checksum of
                  the bytes in its arena and records them, before the client calls ``put_end``.
"""

from __future__ import annotations

import logging
import secrets
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from kvstore import protocol
from kvstore.errors import ProtocolError, TransportUnavailableError
from kvstore.node.server import DataConnection
from kvstore.node.shm_verbs import make_shm_commit
from kvstore.rdma import devices, ibverbs, wire

if TYPE_CHECKING:
    from kvstore.node.arena import ShmArena
    from kvstore.node.server import DataServer

log = logging.getLogger(__name__)

#: Queue pairs one node serves at once (each pins a little device memory).
DEFAULT_MAX_QPS = 256

Q = TypeVar("Q")


class QpBook(Generic[Q]):
    """Which queue pairs belong to which client connection, with a bound on the total.

    Pure bookkeeping (no device): the node adds a queue pair when a connection asks for one and
    takes all of a connection's back when it closes, to destroy them. Thread-safe: every client
    connection is served by its own thread.

    Args:
        max_qps: the most queue pairs alive at once.
    """

    def __init__(self, max_qps: int = DEFAULT_MAX_QPS) -> None:
        if max_qps < 1:
            raise ValueError("max_qps must be >= 1")
        self.max_qps = max_qps
        self._by_conn: dict[int, list[Q]] = {}
        self._count = 0
        self._lock = threading.Lock()

    def add(self, conn_id: int, qp: Q) -> None:
        """Record ``qp`` as belonging to connection ``conn_id``.

        Raises:
            TransportUnavailableError: ``max_qps`` are already alive (nothing recorded).
        """
        with self._lock:
            if self._count >= self.max_qps:
                raise TransportUnavailableError(
                    f"node serves at most {self.max_qps} RDMA queue pairs"
                )
            self._by_conn.setdefault(conn_id, []).append(qp)
            self._count += 1

    def remove(self, conn_id: int, qp: Q) -> None:
        """Forget one queue pair of ``conn_id`` (its connect failed); unknown ones are ignored."""
        with self._lock:
            qps = self._by_conn.get(conn_id, [])
            if qp in qps:
                qps.remove(qp)
                self._count -= 1
                if not qps:
                    del self._by_conn[conn_id]

    def close_conn(self, conn_id: int) -> list[Q]:
        """Forget connection ``conn_id``; returns its queue pairs for the caller to destroy."""
        with self._lock:
            qps = self._by_conn.pop(conn_id, [])
            self._count -= len(qps)
            return qps

    def of(self, conn_id: int) -> list[Q]:
        """The queue pairs of connection ``conn_id`` (a copy)."""
        with self._lock:
            return list(self._by_conn.get(conn_id, ()))

    def __len__(self) -> int:
        return self._count


class NodeRdma:
    """This node's device context (arenas registered), and its queue pairs per connection.

    Args:
        ctx: the opened device with the arenas registered (see :meth:`open`).
        max_qps: the most queue pairs alive at once.
        make_qp: makes a queue pair on ``ctx`` (:class:`~kvstore.rdma.ibverbs.RcQueuePair`; tests pass a
            software stand-in, as no device exists where they run).
    """

    def __init__(
        self,
        ctx: Any,
        max_qps: int = DEFAULT_MAX_QPS,
        make_qp: Callable[[Any], Any] | None = None,
    ) -> None:
        self.ctx = ctx
        self.book: QpBook[Any] = QpBook(max_qps)
        self._make_qp = make_qp or ibverbs.RcQueuePair

    @staticmethod
    def open(
        device: devices.RdmaDevice, arenas: dict[str, ShmArena], settings: devices.RdmaConfig
    ) -> NodeRdma:  # pragma: no cover - needs an RDMA device
        """Open ``device`` and register every arena once with remote READ/WRITE.

        Raises:
            TransportUnavailableError: the device cannot be opened or an arena registered.
        """
        ctx = ibverbs.VerbsContext(device, settings)
        try:
            for name, arena in arenas.items():
                ctx.register(name, arena.view, remote=True)
        except BaseException:
            ctx.close()
            raise
        return NodeRdma(ctx)

    def offer(self) -> wire.RdmaOffer:
        """What to publish: the device's address and each registered arena's region."""
        regions = {r.name: (r.addr, r.length, r.rkey) for r in self.ctx.mrs.regions()}
        return wire.RdmaOffer(
            self.ctx.device.name, self.ctx.port, self.ctx.gid, self.ctx.lid, regions
        )

    def accept(self, conn_id: int, remote: wire.QpEndpoint) -> wire.QpEndpoint:
        """A new queue pair for ``conn_id``, in RTS towards ``remote``; returns its endpoint.

        Raises:
            TransportUnavailableError: too many queue pairs, or the device refused.
        """
        qp = self._make_qp(self.ctx)
        try:
            self.book.add(conn_id, qp)
        except TransportUnavailableError:
            qp.close()
            raise
        psn = secrets.randbelow(1 << 24)
        try:
            qp.connect(remote, psn)
        except TransportUnavailableError:
            self.book.remove(conn_id, qp)
            qp.close()
            raise
        return qp.endpoint(psn)

    def disconnected(self, conn_id: int) -> None:
        """The client's TCP connection closed: destroy its queue pairs (errors only logged)."""
        for qp in self.book.close_conn(conn_id):
            try:
                qp.close()
            except Exception as exc:  # noqa: BLE001 - pyverbs errors; teardown must go on
                log.warning("destroying an RDMA queue pair failed: %s", exc)


def make_rdma_connect(service: NodeRdma | None) -> Callable[..., None]:
    """The ``rdma_connect`` handler (``service`` None: this node has no usable device)."""

    def rdma_connect(
        fs: protocol.FramedSocket, req: protocol.Request, payload_len: int, scratch: memoryview
    ) -> None:
        if payload_len:
            raise ProtocolError("rdma_connect takes no payload")
        remote = wire.QpEndpoint.from_wire(req.args.get("endpoint"))
        if service is None:
            raise TransportUnavailableError("this node has no usable RDMA device; use TCP")
        if isinstance(fs, DataConnection) and fs.tenant is not None:
            # A queue pair opens every arena to one-sided READ and WRITE that no grant checks:
            # a tenant's connection moves its bytes over TCP, where each grant is checked.
            raise TransportUnavailableError("a tenant's connection moves its bytes over TCP")
        local = service.accept(id(fs), remote)
        fs.send_frame(protocol.encode_response(req.req_id, {"endpoint": local.to_wire()}))

    return rdma_connect


def serve(server: DataServer, service: NodeRdma | None) -> None:
    """Give ``server`` the RDMA verbs. ``rdma_connect`` is installed even without a device, so a
    client asking such a node gets a typed TransportUnavailableError, not an unknown verb."""
    server.register_verb("rdma_connect", make_rdma_connect(service))
    if service is not None:
        server.register_verb("rdma_commit", make_shm_commit(server, via="RDMA"))
        server.on_disconnect.append(lambda fs: service.disconnected(id(fs)))


def install(
    server: DataServer, settings: devices.RdmaConfig | None = None
) -> dict[str, Any] | None:
    """Open this host's device (if any) and serve RDMA; returns the offer to publish, or None
    (logged once why)."""
    settings = settings or devices.RdmaConfig.from_env()
    device = devices.first_device("node", settings)
    service: NodeRdma | None = None
    if device is not None and not settings.pretend_device:  # pragma: no cover - needs a device
        try:
            service = NodeRdma.open(device, server.segments, settings)
            log.warning(
                "node: serving RDMA on %s (untested on real hardware; KVSTORE_RDMA=off disables)",
                device.name,
            )
        except TransportUnavailableError as err:
            devices.log_fallback("rdma-node-open", "node", err.message)
    serve(server, service)
    if service is not None:  # pragma: no cover - needs a device
        return service.offer().to_wire()
    if settings.pretend_device:
        log.warning("node: %s is set: publishing a pretend RDMA offer", devices.TEST_DEVICE_ENV)
        return pretend_offer(settings.pretend_device, server.segments)
    return None


def pretend_offer(device: str, arenas: dict[str, ShmArena]) -> dict[str, Any]:
    """The test hook's offer: the arenas' sizes, no real addresses or keys (rkey 0)."""
    regions = {name: (0, arena.size, 0) for name, arena in arenas.items()}
    return wire.RdmaOffer(device, 1, bytes(16), 0, regions).to_wire()
