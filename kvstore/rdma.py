"""RDMA through pyverbs: device discovery, memory regions, connection details, queue pairs.

NOTE: the verbs path (:class:`VerbsContext`, :class:`RcQueuePair`, the node's
``kvstore.node.rdma_verbs`` and the client's ``kvstore.client.rdma``) has never run on real RDMA
hardware: the machines it was written on have no InfiniBand/RoCE device (no
``/sys/class/infiniband``). What is tested is everything that needs no device: discovery reporting
"none", the memory-region table, the queue-pair bookkeeping, the wire forms, their exchange
through the master, the node's typed refusal, and the client's fallback to TCP.

How it fits together (Mooncake's transfer engine does the same with its metadata service):

1. A node that finds a device opens it, registers each DRAM arena once as a memory region
   (``ibv_reg_mr`` with LOCAL_WRITE | REMOTE_READ | REMOTE_WRITE) and publishes an
   :class:`RdmaOffer` (device, port, GID, LID, and per segment the region's address, length and
   rkey) through the master (``register`` → ``transports``).
2. A client that also has a device reads the offer (``node_transports``), creates an RC queue
   pair and sends its :class:`QpEndpoint` to the node over a TCP connection it keeps for that
   purpose (node verb ``rdma_connect``); the node creates a queue pair for that connection, moves
   it to RTS and answers with its own endpoint. The node tears the queue pair down when that TCP
   connection closes, and serves a bounded number of them.
3. Reads and writes are then one-sided RDMA READ/WRITE at ``region.addr + grant.offset``. The
   node's CPU is not involved, so the *client* keeps to the ranges the master granted (segment,
   offset, size, operation, expiry). A write is still committed by the node (``rdma_commit``:
   grant and checksum checked, exactly like ``shm_commit``) before the client calls ``put_end``;
   a read is checked against the object's checksum by the client, as over TCP.

Trust: the rkey is the capability. Any process that holds a node's offer and can reach its device
can read and write the node's whole arena, grant or not: the same trust as the shm transport
(one cluster, one operator), and the same reason the cluster token guards ``node_transports``.

Where either side has no device, pyverbs is missing, or anything on the RDMA path fails, the
node and the client each log one line saying so and use TCP. Settings come from the environment
(:class:`RdmaSettings`): ``KVSTORE_RDMA=off`` disables RDMA, ``KVSTORE_RDMA_DEVICE`` picks a
device, ``KVSTORE_RDMA_PORT`` and ``KVSTORE_RDMA_GID_INDEX`` (RoCE v2: usually 1 or 3).

pyverbs is a Debian system package (``python3-pyverbs``), not on PyPI. A virtual environment does
not see system packages, so :func:`import_pyverbs` imports it from the system ``dist-packages``
folder alone (that one package, the path removed again afterwards), and only when it was built
for this interpreter's version.
"""

from __future__ import annotations

import importlib
import logging
import sys
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from kvstore.env import Env
from kvstore.errors import (
    InvalidRequestError,
    OutOfRangeError,
    ProtocolError,
    TransportUnavailableError,
)

log = logging.getLogger(__name__)

SYSTEM_DIST_PACKAGES = Path("/usr/lib/python3/dist-packages")
_logged: set[str] = set()
_logged_lock = threading.Lock()


def log_once(what: str, message: str) -> None:
    """Log ``message`` at INFO once per process per ``what`` (the fallback must not spam)."""
    with _logged_lock:
        if what in _logged:
            return
        _logged.add(what)
    log.info(message)


def log_fallback(what: str, role: str, why: str) -> None:
    """Say once per ``what`` that ``role`` (client, node ...) uses TCP instead of RDMA, and why.

    Every fallback line has one shape, ``"<role>: RDMA off (<why>); using TCP"``, so an operator
    (or a test) finds it by "RDMA off" whatever the cause: no pyverbs, no device, a refused
    connect, a bad offer.
    """
    log_once(what, f"{role}: RDMA off ({why}); using TCP")


# ---------------------------------------------------------------- discovery
def import_pyverbs() -> ModuleType:
    """Import pyverbs, from the system dist-packages if the environment lacks it.

    Raises:
        TransportUnavailableError: pyverbs is not installed for this Python version.
    """
    try:
        return importlib.import_module("pyverbs")
    except ImportError:
        pass
    tag = f"cpython-{sys.version_info.major}{sys.version_info.minor}"
    pkg = SYSTEM_DIST_PACKAGES / "pyverbs"
    if not pkg.is_dir() or not any(tag in p.name for p in pkg.glob("*.so")):
        raise TransportUnavailableError(
            "pyverbs is not installed for this Python (Debian: apt-get install python3-pyverbs)"
        )
    sys.path.append(str(SYSTEM_DIST_PACKAGES))
    try:
        return importlib.import_module("pyverbs")
    except ImportError as exc:
        raise TransportUnavailableError(f"pyverbs does not import: {exc}") from None
    finally:
        sys.path.remove(str(SYSTEM_DIST_PACKAGES))


@dataclass(frozen=True, slots=True)
class RdmaDevice:
    name: str


def discover() -> list[RdmaDevice]:
    """The RDMA devices of this host.

    Raises:
        TransportUnavailableError: no pyverbs, or no device (with the reason).
    """
    import_pyverbs()
    device = importlib.import_module("pyverbs.device")
    try:
        found = device.get_device_list()
    except Exception as exc:  # noqa: BLE001 - pyverbs raises its own errors for "no devices"
        raise TransportUnavailableError(f"no RDMA device ({exc})") from None
    if not found:
        raise TransportUnavailableError("no RDMA device")
    return [
        RdmaDevice(d.name.decode() if isinstance(d.name, bytes) else str(d.name)) for d in found
    ]


#: Test-only hook (no device here): pretend this host has the named device. A node that cannot
#: open it still publishes an offer (so clients try RDMA, fail, and fall back), and answers
#: ``rdma_connect`` with TransportUnavailableError. Never set it outside tests.
TEST_DEVICE_ENV = "KVSTORE_TEST_RDMA_DEVICE"  # read by kvstore.env.Env (test_rdma_device)


@dataclass(frozen=True, slots=True)
class RdmaSettings:
    """Where and whether to use RDMA, from the environment (see the module docstring)."""

    enabled: bool = True
    device: str | None = None
    port: int = 1
    gid_index: int = 0
    pretend_device: str | None = None

    @staticmethod
    def from_env(env: Mapping[str, str] | None = None) -> RdmaSettings:
        """Raises EnvError (an InvalidRequestError) for a port or GID index that is not a small
        integer (:class:`kvstore.env.Env` reads the variables)."""
        read = Env.read(env)
        return RdmaSettings(
            enabled=read.rdma,
            device=read.rdma_device,
            port=read.rdma_port,
            gid_index=read.rdma_gid_index,
            pretend_device=read.test_rdma_device,
        )


def first_device(role: str, settings: RdmaSettings | None = None) -> RdmaDevice | None:
    """The device to use, or None after logging once why TCP is used instead."""
    settings = settings or RdmaSettings.from_env()
    if not settings.enabled:
        log_fallback("rdma-off", role, "disabled by KVSTORE_RDMA=off")
        return None
    if settings.pretend_device:
        return RdmaDevice(settings.pretend_device)
    try:
        found = discover()
    except TransportUnavailableError as err:
        log_fallback("rdma-fallback", role, err.message)
        return None
    if settings.device is None:
        return found[0]
    for d in found:
        if d.name == settings.device:
            return d
    log_fallback("rdma-fallback", role, f"no RDMA device named {settings.device!r}")
    return None


# ---------------------------------------------------------------- memory regions
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


# ---------------------------------------------------------------- connection details
@dataclass(frozen=True, slots=True)
class RdmaOffer:
    """What a node publishes through the master: its device and its regions (per segment)."""

    device: str
    port: int
    gid: bytes
    lid: int
    regions: dict[str, tuple[int, int, int]]  # segment -> (addr, length, rkey)

    def to_wire(self) -> dict[str, Any]:
        return {
            "device": self.device,
            "port": self.port,
            "gid": self.gid,
            "lid": self.lid,
            "regions": {k: list(v) for k, v in self.regions.items()},
        }

    @staticmethod
    def from_wire(obj: Any) -> RdmaOffer:
        """Raises ProtocolError when ``obj`` is malformed."""
        try:
            regions = {}
            for name, v in obj["regions"].items():
                addr, length, rkey = (int(x) for x in v)
                if not isinstance(name, str) or addr < 0 or length <= 0 or rkey < 0:
                    raise ValueError(name)
                regions[name] = (addr, length, rkey)
            gid = obj["gid"]
            if not isinstance(gid, bytes) or len(gid) != 16:
                raise ValueError("gid")
            return RdmaOffer(str(obj["device"]), int(obj["port"]), gid, int(obj["lid"]), regions)
        except (KeyError, TypeError, ValueError, AttributeError):
            raise ProtocolError("malformed rdma offer") from None


@dataclass(frozen=True, slots=True)
class QpEndpoint:
    """One end of an RC queue pair, as exchanged by ``rdma_connect``."""

    gid: bytes
    lid: int
    qpn: int
    psn: int
    mtu: int = 4096

    def to_wire(self) -> list[Any]:
        return [self.gid, self.lid, self.qpn, self.psn, self.mtu]

    @staticmethod
    def from_wire(obj: Any) -> QpEndpoint:
        """Raises ProtocolError when ``obj`` is malformed."""
        if (
            not isinstance(obj, list)
            or len(obj) != 5
            or not isinstance(obj[0], bytes)
            or len(obj[0]) != 16
            or not all(isinstance(v, int) and not isinstance(v, bool) for v in obj[1:])
            or not 0 <= obj[2] < 1 << 24
            or not 0 <= obj[3] < 1 << 24
            or obj[4] not in (256, 512, 1024, 2048, 4096)
        ):
            raise ProtocolError("qp endpoint must be [gid(16 bytes), lid, qpn, psn, mtu]")
        return QpEndpoint(obj[0], obj[1], obj[2], obj[3], obj[4])


def choose(offer_wire: Any, local: RdmaDevice | None) -> RdmaOffer | None:
    """The node's offer if both sides can use RDMA; else None (and one log line says why)."""
    if offer_wire is None:
        return None
    if local is None:
        log_fallback("rdma-client-none", "client", "node offers RDMA but this host has no device")
        return None
    try:
        return RdmaOffer.from_wire(offer_wire)
    except ProtocolError as err:
        log_fallback("rdma-bad-offer", "client", f"ignoring the node's offer: {err.message}")
        return None


# ---------------------------------------------------------------- the verbs path (hardware only)
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
    import numpy as np

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

    Untested on real hardware (see the module docstring).

    Args:
        device: the local device.
        settings: port and GID index.

    Raises:
        TransportUnavailableError: the device cannot be opened or queried.
    """

    def __init__(self, device: RdmaDevice, settings: RdmaSettings) -> None:
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
        import time

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
