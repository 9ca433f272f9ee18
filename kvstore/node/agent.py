"""The node's link to the master: register, then heartbeat; register again whenever the master
forgets us (restart, or we were declared dead)."""

from __future__ import annotations

import logging
import threading

from kvstore import protocol
from kvstore.config import Address
from kvstore.errors import ErrorCode, KVStoreError, NodeUnavailableError
from kvstore.node.server import DataServer
from kvstore.node.tasks import run_tasks
from kvstore.types import ManifestRecord, SegmentSpec

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
    ) -> None:
        self.master = master
        self.node_id = node_id
        self.advertise_host = advertise_host
        self.server = server
        self.segments = segments
        self.registered = threading.Event()
        #: Set when the master retired this node (after a drain): the node should exit.
        self.retired = threading.Event()
        self._done: list[list[object]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="node-master-link", daemon=True)
        self.heartbeat_interval_s = 1.0

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _register(self, conn: protocol.FramedSocket) -> None:
        # A fresh registration means the master holds nothing of ours: start a clean manifest,
        # except for durable tiers (NVMe), whose objects we report for the master to re-admit.
        durable = {name for name, t in self.server.tiers.items() if t.durable}
        self.server.manifest.clear_volatile(durable)
        tier_of = {s.name: s.tier for s in self.segments}
        records = [
            ManifestRecord(seg, tier_of.get(seg, ""), off, key, size, checksum).to_wire()
            for seg, off, key, size, checksum in self.server.manifest.snapshot()
        ]
        self._done = []
        reply = conn.call(
            "register",
            {
                "node_id": self.node_id,
                "host": self.advertise_host,
                "port": self.server.port,
                "secret": self.server.secret,
                "segments": [s.to_wire() for s in self.segments],
                "manifest": records,
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
                wait_s = self.heartbeat_interval_s
                while not self._stop.wait(wait_s):
                    wait_s = self.heartbeat_interval_s
                    done, self._done = self._done, []
                    try:
                        reply = conn.call("heartbeat", {"node_id": self.node_id, "done": done})
                    except KVStoreError as err:
                        if err.code != ErrorCode.NODE_UNAVAILABLE:
                            raise
                        log.warning("master forgot this node; registering again")
                        self._register(conn)
                        continue
                    forget = reply.get("forget", [])
                    if forget:
                        self.server.forget([(s, o) for s, o in forget])
                    tasks = reply.get("tasks") or []
                    if tasks:
                        self._done = run_tasks(self.server, tasks)
                        wait_s = 0.0  # report at once: the master may have more work queued
                    if reply.get("retire"):
                        log.info("the master retired this node (drained): stopping")
                        self.retired.set()
                        return
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
