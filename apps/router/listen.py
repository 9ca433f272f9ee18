"""Where the router listens, and whether an engine URL names the router itself.

Why: an engine registration carrying the router's own URL would have the router send requests
to itself (each hop holding a slot, until all of them wait on the router). A URL names the
router when its port is one the router is bound to and its host reaches that socket: the bound
address itself; for a wildcard bind (``0.0.0.0``, ``::``) any address of this machine of that
family (one a socket can bind here) and this machine's own names; ``localhost`` names for
loopback binds. Other names are not resolved: a registration is checked on the event loop,
where a DNS lookup could stall every request. Those, and port mappings, are caught by the
poller instead: the router's answers carry its id (:data:`ROUTER_ID_HEADER`), and an engine
that answers with the router's own id is the router.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

#: The response header that carries a router process's id.
ROUTER_ID_HEADER = "x-kvstore-router"

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
_LOOPBACK = (ipaddress.IPv4Address("127.0.0.1"), ipaddress.IPv6Address("::1"))


def _ip(text: str) -> IPAddress | None:
    """An IP address (an IPv4-mapped IPv6 one as IPv4), or None for a name."""
    try:
        addr = ipaddress.ip_address(text.split("%", 1)[0])  # without an IPv6 zone
    except ValueError:
        return None
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        return addr.ipv4_mapped
    return addr


def _held_here(addr: IPAddress) -> bool:
    """Whether this machine holds ``addr``: a socket binds only to its own addresses."""
    if addr.is_loopback or addr.is_unspecified:
        return True
    family = socket.AF_INET6 if addr.version == 6 else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.bind((str(addr), 0))
    except OSError:
        return False
    return True


@dataclass(frozen=True, slots=True)
class ListenAddresses:
    """The router's bound sockets and this machine's names.

    Attributes:
        sockets: (address, port) of each bound socket.
        names: this machine's host names (lowercased) and the addresses they resolve to.
    """

    sockets: tuple[tuple[IPAddress, int], ...]
    names: Mapping[str, tuple[IPAddress, ...]]

    @staticmethod
    def of(bound: Sequence[Any]) -> ListenAddresses:
        """Read aiohttp's ``runner.addresses`` (resolves this machine's names: blocking).

        Args:
            bound: (host, port, ...) per bound socket.

        Returns:
            The addresses.
        """
        sockets = tuple(
            (ip, int(entry[1])) for entry in bound if (ip := _ip(str(entry[0]))) is not None
        )
        names: dict[str, tuple[IPAddress, ...]] = {}
        for name in {socket.gethostname(), socket.getfqdn()}:
            try:
                infos = socket.getaddrinfo(name, None, type=socket.SOCK_STREAM)
            except OSError:
                continue
            resolved = (_ip(str(info[4][0])) for info in infos)
            names[name.lower().rstrip(".")] = tuple(a for a in resolved if a is not None)
        return ListenAddresses(sockets, names)

    def _addresses(self, host: str) -> tuple[IPAddress, ...]:
        ip = _ip(host)
        if ip is not None:
            return (ip,)
        name = host.lower().rstrip(".")
        if name == "localhost" or name.endswith(".localhost"):
            return _LOOPBACK
        return self.names.get(name, ())

    def names_router(self, url: str) -> bool:
        """Whether ``url`` reaches one of the router's own sockets.

        Args:
            url: an engine's base URL, checked
                (:func:`~kvstore.client.engine_registry.check_engine_url`).

        Returns:
            True when it names the router itself.
        """
        parts = urlsplit(url)
        port = parts.port or (443 if parts.scheme == "https" else 80)
        addresses = self._addresses(parts.hostname or "")
        for bound, bound_port in self.sockets:
            if port != bound_port:
                continue
            for addr in addresses:
                if addr.version != bound.version:
                    continue  # asyncio binds IPv6 sockets IPv6-only
                if addr == bound or (bound.is_unspecified and _held_here(addr)):
                    return True
        return False
