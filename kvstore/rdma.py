"""RDMA transport through pyverbs: device discovery, memory regions, connection details, fallback.

NOTE: the verbs path (:class:`RcQueuePair`) has never run on real RDMA hardware: the machines
this was written on have no InfiniBand/RoCE device (no ``/sys/class/infiniband``). What is tested
is everything that needs no device: discovery reporting "none", the memory-region table, the wire
forms of the connection details, their exchange through the master, and the fallback to TCP.

How it fits together (Mooncake's transfer engine does the same with its metadata service):

1. A node that finds a device registers each arena as a memory region (``ibv_reg_mr`` with
   remote READ/WRITE) and publishes an :class:`RdmaOffer` (device, port, GID, LID, and per segment
   the region's address, length and rkey) through the master (``register`` → ``transports``).
2. A client that also has a device reads the offer (``node_transports``), creates an RC queue
   pair and exchanges :class:`QpEndpoint` details with the node over TCP (node verb
   ``rdma_connect``: RC queue pairs are point to point, so each client gets its own on the node).
3. Reads and writes are then one-sided RDMA READ/WRITE at ``region.addr + grant.offset``: the
   node's CPU is not involved; the master's grant still decides which bytes, and a write is
   still committed by ``put_end`` with its checksum (the node checks it on ``shm_commit``-style
   commit before the master sees ``put_end``).

Where either side has no device, or pyverbs is missing, the node and the client each log one line
saying so and use TCP.

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
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

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


def first_device(role: str) -> RdmaDevice | None:
    """The device to use, or None after logging once why TCP is used instead."""
    try:
        return discover()[0]
    except TransportUnavailableError as err:
        log_once("rdma-fallback", f"{role}: RDMA unavailable ({err.message}); using TCP")
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
        log_once("rdma-client-none", "client: node offers RDMA but this host has none; using TCP")
        return None
    try:
        return RdmaOffer.from_wire(offer_wire)
    except ProtocolError as err:
        log_once("rdma-bad-offer", f"client: ignoring node's RDMA offer ({err.message}); TCP")
        return None


def node_offer(arena_files: dict[str, Path]) -> dict[str, Any] | None:
    """What a node publishes for RDMA, or None (logged once) where there is no device.

    With a device, the arenas are registered by :class:`RcQueuePair`'s owner at node start;
    that path is untested on real hardware (see the module docstring).
    """
    if first_device("node") is None:
        return None
    log_once(
        "rdma-node-untested",
        "node: RDMA device found, but the node's verbs path is untested; serving TCP and shm",
    )
    return None


# ---------------------------------------------------------------- the verbs path (untested)
class RcQueuePair:  # pragma: no cover - needs an RDMA device
    """One reliable-connected queue pair with one-sided READ/WRITE. Untested on real hardware.

    Args:
        device: the local device.
        port: its port number (usually 1).
        gid_index: which GID to use (RoCE v2 usually 1 or 3).
    """

    def __init__(self, device: RdmaDevice, port: int = 1, gid_index: int = 0) -> None:
        import_pyverbs()
        import pyverbs.enums as e
        from pyverbs.cq import CQ
        from pyverbs.device import Context
        from pyverbs.pd import PD
        from pyverbs.qp import QP, QPCap, QPInitAttr

        self._e = e
        self.ctx = Context(name=device.name)
        self.pd = PD(self.ctx)
        self.cq = CQ(self.ctx, 256)
        cap = QPCap(max_send_wr=256, max_recv_wr=1, max_send_sge=1, max_recv_sge=1)
        self.qp = QP(self.pd, QPInitAttr(qp_type=e.IBV_QPT_RC, scq=self.cq, rcq=self.cq, cap=cap))
        self.port = port
        self.gid_index = gid_index
        self.gid = bytes.fromhex(str(self.ctx.query_gid(port, gid_index)).replace(":", ""))
        self.lid = self.ctx.query_port(port).lid
        self.mrs = MemoryRegionTable()
        self._mr_objects: dict[str, Any] = {}

    def register(self, name: str, buffer: memoryview) -> MemoryRegion:
        """Register ``buffer`` for local use and remote READ/WRITE."""
        from pyverbs.mr import MR

        e = self._e
        access = e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_READ | e.IBV_ACCESS_REMOTE_WRITE
        mr = MR(self.pd, len(buffer), access, address=_address_of(buffer))
        region = MemoryRegion(name, mr.buf, len(buffer), mr.lkey, mr.rkey)
        self.mrs.add(region)
        self._mr_objects[name] = mr
        return region

    def endpoint(self, psn: int) -> QpEndpoint:
        return QpEndpoint(self.gid, self.lid, self.qp.qp_num, psn)

    def connect(self, remote: QpEndpoint, local_psn: int) -> None:
        """Move the QP to RTS, connected to ``remote``."""
        from pyverbs.addr import GID, AHAttr, GlobalRoute
        from pyverbs.qp import QPAttr

        e = self._e
        attr = QPAttr(qp_state=e.IBV_QPS_INIT, port_num=self.port)
        attr.qp_access_flags = e.IBV_ACCESS_REMOTE_READ | e.IBV_ACCESS_REMOTE_WRITE
        self.qp.to_init(attr)
        gr = GlobalRoute(dgid=GID(remote.gid.hex(":")), sgid_index=self.gid_index)
        attr = QPAttr(qp_state=e.IBV_QPS_RTR, path_mtu=e.IBV_MTU_4096)
        attr.dest_qp_num = remote.qpn
        attr.rq_psn = remote.psn
        attr.max_dest_rd_atomic = 16
        attr.min_rnr_timer = 12
        attr.ah_attr = AHAttr(gr=gr, is_global=1, dlid=remote.lid, port_num=self.port)
        self.qp.to_rtr(attr)
        attr = QPAttr(qp_state=e.IBV_QPS_RTS)
        attr.sq_psn = local_psn
        attr.timeout, attr.retry_cnt, attr.rnr_retry, attr.max_rd_atomic = 14, 7, 7, 16
        self.qp.to_rts(attr)

    def transfer(
        self, write: bool, local: str, offset: int, length: int, raddr: int, rkey: int
    ) -> None:
        """One RDMA READ (or WRITE) of ``length`` bytes, waited for.

        Raises:
            TransportUnavailableError: the completion carries an error.
        """
        from pyverbs.wr import SGE, SendWR

        e = self._e
        region = self.mrs.get(local)
        sge = SGE(region.addr + offset, length, region.lkey)
        opcode = e.IBV_WR_RDMA_WRITE if write else e.IBV_WR_RDMA_READ
        wr = SendWR(opcode=opcode, num_sge=1, sg=[sge], send_flags=e.IBV_SEND_SIGNALED)
        wr.set_wr_rdma(rkey, raddr)
        self.qp.post_send(wr)
        while True:
            n, wcs = self.cq.poll()
            if n:
                if wcs[0].status != e.IBV_WC_SUCCESS:
                    raise TransportUnavailableError(f"RDMA completion status {wcs[0].status}")
                return


def _address_of(buffer: memoryview) -> int:  # pragma: no cover - used by the verbs path
    import ctypes

    return ctypes.addressof(ctypes.c_char.from_buffer(buffer))
