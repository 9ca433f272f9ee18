"""The verbs wrapper: memory regions, one-sided operations, RC queue pairs over pyverbs.

Part of the experimental :mod:`kvstore.rdma` package. :class:`MemoryRegionTable`,
:func:`address_of`, :class:`RdmaOp` and :func:`gid_text` are pure and tested everywhere;
:class:`VerbsContext` (device + protection domain + registrations) and :class:`RcQueuePair`
(RESET → INIT → RTR → RTS, post and poll) call pyverbs and run only where a device exists: a
software one (``rdma_rxe``) where the kernel has the module, never a real NIC so far.

pyverbs is imported inside the methods that use it, on purpose: it is an optional system package
(see :mod:`kvstore.rdma.devices`), and a host without it must still import this module.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvstore.errors import InvalidRequestError, OutOfRangeError, TransportUnavailableError
from kvstore.rdma.devices import RdmaConfig, RdmaDevice, import_pyverbs
from kvstore.rdma.wire import QpEndpoint


@dataclass(frozen=True, slots=True)
class MemoryRegion:
    """A registered region: ``[addr, addr + length)`` with the keys the NIC gave it."""

    name: str
    addr: int
    length: int
    lkey: int
    rkey: int

    @property
    def end(self) -> int:
        return self.addr + self.length


class MemoryRegionTable:
    """The regions a process registered, by name and by address.

    Registration is expensive (pins pages), so each arena and each client staging buffer is
    registered once and looked up per transfer. Regions never overlap.
    """

    def __init__(self) -> None:
        self._by_name: dict[str, MemoryRegion] = {}

    def add(self, region: MemoryRegion) -> None:
        """Raises InvalidRequestError: empty, duplicate name, or overlapping another region."""
        if region.length <= 0 or region.addr < 0:
            raise InvalidRequestError(f"region {region.name!r} must have a positive length")
        if region.name in self._by_name:
            raise InvalidRequestError(f"region {region.name!r} already registered")
        for other in self._by_name.values():
            if region.addr < other.end and other.addr < region.end:
                raise InvalidRequestError(f"region {region.name!r} overlaps {other.name!r}")
        self._by_name[region.name] = region

    def remove(self, name: str) -> MemoryRegion:
        """Raises InvalidRequestError when ``name`` is not registered."""
        try:
            return self._by_name.pop(name)
        except KeyError:
            raise InvalidRequestError(f"region {name!r} not registered") from None

    def get(self, name: str) -> MemoryRegion:
        """Raises InvalidRequestError when ``name`` is not registered."""
        try:
            return self._by_name[name]
        except KeyError:
            raise InvalidRequestError(f"region {name!r} not registered") from None

    def locate(self, addr: int, length: int) -> MemoryRegion:
        """The region holding all of ``[addr, addr + length)``.

        Raises:
            OutOfRangeError: no single region holds the whole range.
        """
        for region in self._by_name.values():
            if region.addr <= addr and addr + length <= region.end and length >= 0:
                return region
        raise OutOfRangeError(f"range [{addr:#x}, +{length}) is not inside a registered region")

    def remote_address(self, name: str, offset: int, length: int) -> tuple[int, int]:
        """``(address, rkey)`` of ``[offset, offset + length)`` of region ``name``.

        Raises:
            InvalidRequestError: unknown region. OutOfRangeError: the range leaves the region.
        """
        region = self.get(name)
        if offset < 0 or length < 0 or offset + length > region.length:
            raise OutOfRangeError(f"range ({offset}, {length}) outside region {name!r}")
        return region.addr + offset, region.rkey

    def regions(self) -> list[MemoryRegion]:
        return list(self._by_name.values())

    def __len__(self) -> int:
        return len(self._by_name)


#: ``QpEndpoint.mtu`` (bytes) -> ``ibv_mtu`` enum value (IBV_MTU_256 = 1 ... IBV_MTU_4096 = 5).
MTU_ENUM = {256: 1, 512: 2, 1024: 3, 2048: 4, 4096: 5}
MTU_BYTES = {v: k for k, v in MTU_ENUM.items()}
#: Work requests in flight per queue pair (the send queue's depth).
MAX_SEND_WR = 256
#: Largest single RDMA operation (devices allow 1-2 GiB messages; larger ranges are split).
MAX_OP_BYTES = 1 << 30
#: How long one batch of RDMA operations may take before the queue pair is given up.
COMPLETION_TIMEOUT_S = 10.0


def address_of(buffer: memoryview) -> int:
    """The address of a contiguous buffer's first byte (read-only buffers too).

    Raises:
        InvalidRequestError: the buffer is not contiguous.
    """
    if not buffer.contiguous:
        raise InvalidRequestError("RDMA buffers must be contiguous")
    if buffer.nbytes == 0:
        raise InvalidRequestError("RDMA buffers must not be empty")
    # NOTE: the numpy array is a transient export of ``buffer``; it is dropped at once, so the
    # buffer's owner (an arena's mmap) can still be closed later.
    return int(
        np.frombuffer(buffer.cast("B") if buffer.ndim != 1 else buffer, np.uint8).ctypes.data
    )


def verbs_errors() -> tuple[type[BaseException], ...]:
    """The exception classes pyverbs raises (PyverbsError covers RDMA and user errors)."""
    from pyverbs.pyverbs_error import PyverbsError

    return (PyverbsError,)


def gid_text(gid: bytes) -> str:
    """16 GID bytes in pyverbs' text form: eight groups of four hex digits."""
    h = gid.hex()
    return ":".join(h[i : i + 4] for i in range(0, 32, 4))


@dataclass(frozen=True, slots=True)
class RdmaOp:
    """One one-sided operation: ``length`` bytes between local ``laddr`` and remote ``raddr``."""

    write: bool
    laddr: int
    lkey: int
    length: int
    raddr: int
    rkey: int


class VerbsContext:  # pragma: no cover - needs an RDMA device
    """An opened device with one protection domain: what memory regions and queue pairs share.

    Untested on real hardware (see :mod:`kvstore.rdma`).

    Args:
        device: the local device.
        settings: port and GID index.

    Raises:
        TransportUnavailableError: the device cannot be opened or queried.
    """

    def __init__(self, device: RdmaDevice, settings: RdmaConfig) -> None:
        import_pyverbs()
        try:
            import pyverbs.enums as e
            from pyverbs.device import Context
            from pyverbs.pd import PD

            self.e = e
            self.ctx = Context(name=device.name)
            self.pd = PD(self.ctx)
            port = self.ctx.query_port(settings.port)
            dev = self.ctx.query_device()
            # Outstanding RDMA READs per QP, as initiator and as target: what the device allows.
            self.max_rd_atomic = max(1, min(16, dev.max_qp_init_rd_atom, dev.max_qp_rd_atom))
            self.lid = int(port.lid)
            self.mtu = MTU_BYTES.get(int(port.active_mtu), 1024)
            self.gid = bytes.fromhex(
                str(self.ctx.query_gid(settings.port, settings.gid_index)).replace(":", "")
            )
        except verbs_errors() as exc:
            raise TransportUnavailableError(
                f"cannot open RDMA device {device.name}: {exc}"
            ) from None
        self.device = device
        self.port = settings.port
        self.gid_index = settings.gid_index
        self.mrs = MemoryRegionTable()
        self._mr_objects: dict[str, Any] = {}
        self._lock = threading.Lock()

    def register(self, name: str, buffer: memoryview, remote: bool) -> MemoryRegion:
        """Register ``buffer`` (``ibv_reg_mr``): local access, plus remote READ/WRITE if asked.

        A read-only buffer is registered without LOCAL_WRITE (it can only be a WRITE's source).

        Raises:
            InvalidRequestError: duplicate or overlapping region. TransportUnavailableError: the
                device refused the registration.
        """
        from pyverbs.mr import MR

        e = self.e
        access = 0 if buffer.readonly else e.IBV_ACCESS_LOCAL_WRITE
        if remote:
            access |= e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_READ
            access |= e.IBV_ACCESS_REMOTE_WRITE
        addr = address_of(buffer)
        try:
            mr = MR(self.pd, buffer.nbytes, access, address=addr)
        except verbs_errors() as exc:
            raise TransportUnavailableError(f"ibv_reg_mr of {name!r} failed: {exc}") from None
        region = MemoryRegion(name, addr, buffer.nbytes, int(mr.lkey), int(mr.rkey))
        with self._lock:
            try:
                self.mrs.add(region)
            except InvalidRequestError:
                mr.close()
                raise
            self._mr_objects[name] = mr
        return region

    def deregister(self, name: str) -> None:
        """``ibv_dereg_mr``; unknown names are ignored."""
        with self._lock:
            mr = self._mr_objects.pop(name, None)
            if mr is None:
                return
            self.mrs.remove(name)
        mr.close()

    def close(self) -> None:
        with self._lock:
            mrs, self._mr_objects = list(self._mr_objects.values()), {}
        for mr in mrs:
            mr.close()
        self.pd.close()
        self.ctx.close()


class RcQueuePair:  # pragma: no cover - needs an RDMA device
    """One reliable-connected queue pair with its own completion queue. Untested on real hardware.

    RC queue pairs are point to point: a node makes one per client connection, a client one per
    node. Moves RESET → INIT → RTR → RTS in :meth:`connect`, with the attributes the rdma-core
    tests use (timeout 14, 7 retries, RNR timer 12).

    Raises:
        TransportUnavailableError: the device refused the CQ or QP.
    """

    def __init__(self, ctx: VerbsContext) -> None:
        from pyverbs.cq import CQ
        from pyverbs.qp import QP, QPCap, QPInitAttr

        e = ctx.e
        self.ctx = ctx
        try:
            self.cq = CQ(ctx.ctx, MAX_SEND_WR)
            cap = QPCap(max_send_wr=MAX_SEND_WR, max_recv_wr=1, max_send_sge=1, max_recv_sge=1)
            init = QPInitAttr(qp_type=e.IBV_QPT_RC, scq=self.cq, rcq=self.cq, cap=cap)
            self.qp = QP(ctx.pd, init)
        except verbs_errors() as exc:
            raise TransportUnavailableError(f"cannot create an RC queue pair: {exc}") from None

    def endpoint(self, psn: int) -> QpEndpoint:
        """This end's details for the peer (``psn``: the first packet sequence number we send)."""
        return QpEndpoint(self.ctx.gid, self.ctx.lid, int(self.qp.qp_num), psn, self.ctx.mtu)

    def connect(self, remote: QpEndpoint, local_psn: int) -> None:
        """Move the QP to RTS, connected to ``remote``.

        Raises:
            TransportUnavailableError: a state transition failed.
        """
        from pyverbs.addr import GID, AHAttr, GlobalRoute
        from pyverbs.qp import QPAttr

        e = self.ctx.e
        try:
            attr = QPAttr(qp_state=e.IBV_QPS_INIT, cur_qp_state=e.IBV_QPS_RESET)
            attr.port_num = self.ctx.port
            attr.pkey_index = 0
            attr.qp_access_flags = (
                e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_READ | e.IBV_ACCESS_REMOTE_WRITE
            )
            self.qp.to_init(attr)
            gr = GlobalRoute(dgid=GID(gid_text(remote.gid)), sgid_index=self.ctx.gid_index)
            attr.path_mtu = MTU_ENUM[min(remote.mtu, self.ctx.mtu)]
            attr.dest_qp_num = remote.qpn
            attr.rq_psn = remote.psn
            attr.max_dest_rd_atomic = self.ctx.max_rd_atomic
            attr.min_rnr_timer = 12
            attr.ah_attr = AHAttr(gr=gr, is_global=1, dlid=remote.lid, port_num=self.ctx.port)
            self.qp.to_rtr(attr)
            attr.sq_psn = local_psn
            attr.timeout, attr.retry_cnt, attr.rnr_retry = 14, 7, 7
            attr.max_rd_atomic = self.ctx.max_rd_atomic
            self.qp.to_rts(attr)
        except verbs_errors() as exc:
            raise TransportUnavailableError(f"queue pair did not reach RTS: {exc}") from None

    def run(self, ops: list[RdmaOp], timeout_s: float = COMPLETION_TIMEOUT_S) -> None:
        """Post ``ops`` (at most MAX_SEND_WR in flight) and wait until all have completed.

        Raises:
            TransportUnavailableError: a completion carries an error, posting failed, or the
                operations did not complete in ``timeout_s`` (the QP is then unusable).
        """
        from pyverbs.wr import SGE, SendWR

        e = self.ctx.e
        deadline = time.monotonic() + timeout_s
        posted = done = 0
        try:
            while done < len(ops):
                while posted < len(ops) and posted - done < MAX_SEND_WR:
                    op = ops[posted]
                    sge = SGE(op.laddr, op.length, op.lkey)
                    opcode = e.IBV_WR_RDMA_WRITE if op.write else e.IBV_WR_RDMA_READ
                    wr = SendWR(
                        wr_id=posted,
                        opcode=opcode,
                        num_sge=1,
                        sg=[sge],
                        send_flags=e.IBV_SEND_SIGNALED,
                    )
                    wr.set_wr_rdma(op.rkey, op.raddr)
                    self.qp.post_send(wr)
                    posted += 1
                n, wcs = self.cq.poll(num_entries=min(16, posted - done))
                for wc in wcs[:n]:
                    if wc.status != e.IBV_WC_SUCCESS:
                        raise TransportUnavailableError(f"RDMA completion status {wc.status}")
                done += n
                if not n and time.monotonic() > deadline:
                    raise TransportUnavailableError(
                        f"RDMA operations did not complete in {timeout_s:.0f}s"
                    )
        except verbs_errors() as exc:
            raise TransportUnavailableError(f"RDMA post failed: {exc}") from None

    def close(self) -> None:
        self.qp.close()
        self.cq.close()
