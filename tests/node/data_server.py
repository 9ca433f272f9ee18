"""An in-process storage node's data server (a DRAM arena and an NVMe tier under ``tmp_path``)
and a framed connection to it, for the node's verb tests."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path

from kvstore import auth, grants, protocol
from kvstore.node.arena import ShmArena
from kvstore.node.nvme import NvmeTier
from kvstore.node.server import DataServer
from kvstore.tenants import TenantDirectory


@contextlib.contextmanager
def running(
    tmp_path: Path,
    dram: int,
    nvme: int,
    token: auth.Token | None = None,
    tenants: TenantDirectory | None = None,
) -> Iterator[DataServer]:
    """A started :class:`DataServer` with ``dram`` bytes of arena and ``nvme`` bytes of NVMe
    (``token``, ``tenants``: the cluster token and the tenant tokens it checks hellos against)."""
    arena = ShmArena(tmp_path / "arena", dram, prefault=False)
    tier = NvmeTier(tmp_path / "nvme", nvme)
    srv = DataServer(
        {"dram": arena}, grants.new_secret(), tiers={"nvme": tier}, token=token, tenants=tenants
    )
    srv.start()
    try:
        yield srv
    finally:
        srv.stop()
        arena.close()
        tier.close()


@contextlib.contextmanager
def connected(server: DataServer) -> Iterator[protocol.FramedSocket]:
    """A framed connection to ``server``."""
    c = protocol.FramedSocket.connect(server.host, server.port, timeout=10)
    try:
        yield c
    finally:
        c.close()


#: Opens a connection that said hello with a token.
Connect = Callable[[str], protocol.FramedSocket]


@contextlib.contextmanager
def hello_connections(server: DataServer) -> Iterator[Connect]:
    """A function that opens connections to ``server`` that said hello with a token (each
    closed when the context ends)."""
    with contextlib.ExitStack() as stack:

        def open_as(token: str) -> protocol.FramedSocket:
            conn = stack.enter_context(connected(server))
            conn.call("hello", {"token": token})
            return conn

        yield open_as
