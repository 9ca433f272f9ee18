"""The node's link to the master: register, then heartbeat; register again whenever the master
forgets us (restart, or we were declared dead)."""

from __future__ import annotations

import logging
import threading

from kvstore import protocol
from kvstore.config import Address
from kvstore.errors import ErrorCode, KVStoreError, NodeUnavailableError
from kvstore.node.server import DataServer
from kvstore.types import SegmentSpec

log = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 5.0


class MasterLink:
    """Keeps this node registered with the master, in a background thread.

    Args:
        master: the master's control address.
        node_id: this node's stable id.
        advertise_host: the host clients should dial for this node's data port.
        server: the data server (its port, secret and manifest).
        segments: what to offer the master.
    """

    def __init__(
        self,
        master: Address,
        node_id: str,
        advertise_host: str,
        server: DataServer,
        segments: list[SegmentSpec],
        transports: dict[str, dict[str, object]] | None = None,
    ) -> None:
        self.master = master
        self.node_id = node_id
        self.advertise_host = advertise_host
        self.server = server
        self.segments = segments
        self.transports = transports or {}
        self.registered = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="node-master-link", daemon=True)
        self.heartbeat_interval_s = 1.0

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _register(self, conn: protocol.FramedSocket) -> None:
        # A fresh registration means the master holds nothing of ours: start a clean manifest.
        self.server.manifest.clear()
        reply = conn.call(
            "register",
            {
                "node_id": self.node_id,
                "host": self.advertise_host,
                "port": self.server.port,
                "secret": self.server.secret,
                "segments": [s.to_wire() for s in self.segments],
                "transports": self.transports,
            },
        )
        self.heartbeat_interval_s = float(reply["heartbeat_interval_s"])
        self.registered.set()
        log.info("registered with master %s as %s", self.master, self.node_id)

    def _run(self) -> None:
        backoff = 0.1
        while not self._stop.is_set():
            conn: protocol.FramedSocket | None = None
            try:
                conn = protocol.FramedSocket.connect(
                    self.master.host, self.master.port, timeout=CONNECT_TIMEOUT_S
                )
                self._register(conn)
                backoff = 0.1
                while not self._stop.wait(self.heartbeat_interval_s):
                    try:
                        reply = conn.call("heartbeat", {"node_id": self.node_id})
                    except KVStoreError as err:
                        if err.code != ErrorCode.NODE_UNAVAILABLE:
                            raise
                        log.warning("master forgot this node; registering again")
                        self._register(conn)
                        continue
                    forget = reply.get("forget", [])
                    if forget:
                        self.server.manifest.forget([(s, o) for s, o in forget])
            except (NodeUnavailableError, ConnectionError, TimeoutError, OSError) as exc:
                self.registered.clear()
                log.warning(
                    "master %s unreachable (%s); retrying in %.1fs", self.master, exc, backoff
                )
            except KVStoreError as err:
                self.registered.clear()
                log.error("master rejected this node: %s", err)
            finally:
                if conn is not None:
                    conn.close()
            self._stop.wait(backoff)
            backoff = min(backoff * 2, 2.0)
