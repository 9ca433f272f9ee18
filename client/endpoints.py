"""Which port a client was pointed at, when it is not a master's control port.

A kvstore cluster listens on several ports: the master's control port (what
:meth:`~kvstore.client.Client.connect` takes), the master's admin REST API (HTTP), each storage
node's data port and each node's admin port (HTTP). Pointed at the wrong one, a client used to
connect and then fail with the symptom (``unknown verb 'put_start'``, ``bad magic: not a
kvstore frame``, ``Name or service not known``). This module turns each symptom into a
:class:`~kvstore.errors.WrongEndpointError` at connect, saying what the port is and what to use:

* an ``http://`` or ``https://`` URL: refused before anything is sent (:func:`check_address`);
* a storage node's data port: its ``ping`` answers ``{"role": "node"}`` (:func:`check_ping`);
* an HTTP port (an admin API, the router): the ``ping`` fails with a malformed frame or no
  answer, and a one-line HTTP request on a second connection gets an HTTP status line back
  (:func:`speaks_http`). That probe runs only after such a failure, never on a good connect.
"""

from __future__ import annotations

import socket
from typing import Any

from kvstore.address import Address
from kvstore.errors import WrongEndpointError

#: Where a user finds the right address.
WHERE = "kvstore up prints it as 'client connects to'"
#: Seconds the HTTP probe may take, at most (it runs only after a failed connect).
PROBE_TIMEOUT_S = 2.0


def check_address(address: str) -> None:
    """Refuse a URL where a control address belongs.

    Raises:
        WrongEndpointError: ``address`` starts with ``http://`` or ``https://``.
    """
    scheme, sep, rest = address.partition("://")
    if sep and scheme.lower() in ("http", "https"):
        raise WrongEndpointError(
            f"{address} is an HTTP URL (the master's admin API is one), not a control "
            f"address: connect to the master's HOST:PORT without {scheme}:// ({WHERE})"
        )


def check_ping(address: str, ping: Any) -> None:
    """Refuse a ``ping`` answer that does not come from a master.

    Raises:
        WrongEndpointError: a storage node answered.
    """
    role = ping.get("role") if isinstance(ping, dict) else None
    if role == "node":
        raise WrongEndpointError(
            f"{address} is a storage node's data port, not a master: connect to the master "
            f"({WHERE})"
        )


def http_port_error(address: str) -> WrongEndpointError:
    """The error for a control address that turned out to serve HTTP."""
    return WrongEndpointError(
        f"{address} is an HTTP port (an admin API or the router), not a master's control "
        f"port: connect to the master's control address ({WHERE}; the master's admin port is "
        "that port + 1 by default)"
    )


def speaks_http(address: Address, timeout: float = PROBE_TIMEOUT_S) -> bool:
    """Whether an HTTP server listens at ``address``: a ``HEAD`` request on a fresh connection
    gets an HTTP status line back within ``timeout`` seconds."""
    try:
        with socket.create_connection((address.host, address.port), timeout=timeout) as sock:
            sock.sendall(b"HEAD / HTTP/1.0\r\nHost: kvstore\r\n\r\n")
            return sock.recv(5) == b"HTTP/"
    except OSError:
        return False
