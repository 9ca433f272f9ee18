"""Where a process is (its host, rack and zone) and how far apart two such places are.

A storage node declares its :class:`Site` when it registers (``kvstore node --host-id --rack
--zone``); a client declares its own when it connects (``Client.connect(host_id=, rack=,
zone=)``, or ``$KVSTORE_HOST_ID`` / ``$KVSTORE_RACK`` / ``$KVSTORE_ZONE``) and sends it with the
calls whose answer depends on it (``put_start``, ``get_locations``, ``kv_match``). The master
places a put near its writer and orders each object's replicas for its reader by
:func:`distance`; the router counts the same distance between a prefill engine and each decode
engine.

Distances, nearest first (seed §3.1: a transfer across nodes costs 25-50× one within a node)::

    SAME_HOST   the same host id (shared memory where the node offers it)
    SAME_RACK   the same rack of the same zone
    SAME_ZONE   another rack of the same zone
    FAR         another zone

An empty rack or zone is the default one: with nothing declared, every node is in one rack, and
placement and read order are what they were before topology existed. An empty host id is a host
that said nothing: it is never the same host as anyone.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass

from kvstore.errors import InvalidRequestError

SAME_HOST = 0
SAME_RACK = 1
SAME_ZONE = 2
FAR = 3
#: The longest host id, rack or zone name.
MAX_NAME = 128
HOST_ID_ENV = "KVSTORE_HOST_ID"
RACK_ENV = "KVSTORE_RACK"
ZONE_ENV = "KVSTORE_ZONE"


@dataclass(frozen=True, slots=True)
class Site:
    """Where one process runs. Validated on creation.

    Attributes:
        host_id: the host (by default its hostname); "" for a host that declared nothing.
        rack: the rack ("": the default rack).
        zone: the zone ("": the default zone).
    """

    host_id: str
    rack: str = ""
    zone: str = ""

    def __post_init__(self) -> None:
        for name in ("host_id", "rack", "zone"):
            value = getattr(self, name)
            if not isinstance(value, str) or len(value) > MAX_NAME:
                raise InvalidRequestError(f"{name} must be a string of at most {MAX_NAME} chars")

    @classmethod
    def declared(
        cls,
        host_id: str | None = None,
        rack: str | None = None,
        zone: str | None = None,
        environ: Mapping[str, str] | None = None,
    ) -> Site:
        """The site a process declares: each of ``host_id``, ``rack``, ``zone`` given, else its
        ``KVSTORE_*`` variable, else the hostname (host id) or "" (rack, zone: the default).

        Raises:
            InvalidRequestError: a name longer than :data:`MAX_NAME`.
        """
        env = os.environ if environ is None else environ
        return cls(
            host_id if host_id is not None else env.get(HOST_ID_ENV) or socket.gethostname(),
            rack if rack is not None else env.get(RACK_ENV, ""),
            zone if zone is not None else env.get(ZONE_ENV, ""),
        )

    def to_wire(self) -> list[str]:
        return [self.host_id, self.rack, self.zone]

    @classmethod
    def from_wire(cls, wire: object) -> Site:
        """A site from its wire form ``[host_id, rack, zone]``.

        Raises:
            InvalidRequestError: not a list of three strings of at most :data:`MAX_NAME` chars.
        """
        if not isinstance(wire, list | tuple) or len(wire) != 3:
            raise InvalidRequestError("a site is [host_id, rack, zone]")
        return cls(*wire)

    def to_json(self) -> dict[str, str]:
        return {"host_id": self.host_id, "rack": self.rack, "zone": self.zone}


#: A process that declared nothing: no host is the same as it, and it is in the default rack.
NOWHERE = Site("")


def distance(a: Site, b: Site) -> int:
    """How far apart two sites are: :data:`SAME_HOST`, :data:`SAME_RACK`, :data:`SAME_ZONE` or
    :data:`FAR` (see the module docstring)."""
    if a.zone != b.zone:
        return FAR
    if a.rack != b.rack:
        return SAME_ZONE
    if a.host_id and a.host_id == b.host_id:
        return SAME_HOST
    return SAME_RACK
