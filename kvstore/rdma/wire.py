"""What the RDMA peers exchange: the node's offer and the queue-pair endpoints.

Part of the experimental :mod:`kvstore.rdma` package. Pure data with wire forms (msgpack-ready
lists and dicts) and strict parsing: an offer travels node → master (``register``) → client
(``node_transports``), an endpoint each way of ``rdma_connect``. Malformed input is a
ProtocolError; :func:`choose` turns an unusable offer into "use TCP" with the one fallback line.
Nothing here needs pyverbs or a device, so all of it is tested on any host.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvstore.errors import ProtocolError
from kvstore.rdma.devices import RdmaDevice, log_fallback


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
