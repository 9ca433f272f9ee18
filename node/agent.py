"""The node's link to the master: register, then heartbeat; register again whenever the master
forgets us (restart, or we were declared dead).

A registration with a master that may not know our objects (HA, durable tiers) claims the
node's manifest (``kvstore.node.manifest``): each record is checked against its tier first
(durable tiers checked theirs when they stored them; DRAM and HBM are read back), so nothing
overwritten or half-written is ever claimed. The heartbeat reply's tasks run here too
(``kvstore.node.tasks``).

Tenants: the master's directory of tenant tokens (``kvstore.tenants``) comes whole in every
registration reply and in a heartbeat reply whenever it is newer than the version the heartbeat
said the node holds; the data server checks every ``hello`` against it, so a tenant created or
deleted at the master opens or closes this node's data port within a heartbeat. The directory
carries the shared namespaces too, whose block keys every tenant's connection may use."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from kvstore import auth, grants, protocol
from kvstore.address import Address
from kvstore.errors import ErrorCode, KVStoreError, NodeUnavailableError
from kvstore.node.server import DataServer
from kvstore.node.tasks import run_tasks
from kvstore.node.tiers import checksum_of
from kvstore.stored_object import StoredObject
from kvstore.tenants import TenantDirectory
from kvstore.topology import Site
from kvstore.types import SegmentSpec

log = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 5.0
#: With etcd: how long a call to a (maybe paused) leader may take before we look for another.
HA_CALL_TIMEOUT_S = 2.0
_FOLLOW_CODES = (ErrorCode.NOT_LEADER, ErrorCode.STALE_EPOCH)


class MasterLink:
    """Keeps this node registered with the master, in a background thread.

    Args:
        master: the master's control address.
        node_id: this node's stable id.
        advertise_host: the host clients should dial for this node's data port.
        server: the data server (its port, secret and manifest).
        segments: what to offer the master.
        resolver: with etcd, returns the leader's address and epoch. The node then sends its
            manifest when it registers with a new leader (failover keeps the cache), puts the
            epoch in every call, and rotates its grant secret per epoch, so grants of a deposed
            leader no longer open its arena.
        token: the cluster token, presented on every connection to the master.
        identity: the node's identity key (``data_dir/node_key``), sent with every registration
            and heartbeat: it proves the id is ours (``MasterService.check_node_identity``).
        site: where this node stands (``--host-id --rack --zone``), sent with every
            registration (None: nothing declared).
    """

    def __init__(
        self,
        master: Address,
        node_id: str,
        advertise_host: str,
        server: DataServer,
        segments: list[SegmentSpec],
        resolver: Callable[[], tuple[Address, int]] | None = None,
        token: auth.Token | None = None,
        transports: dict[str, dict[str, object]] | None = None,
        identity: bytes | None = None,
        site: Site | None = None,
    ) -> None:
        self.master = master
        self.identity = identity
        self.site = site
        self.token = token
        self.resolver = resolver
        self.epoch = 0
        self._secret_epoch = 0
        # With etcd: the (leader, epoch) we last registered with. A new connection to the same
        # one resumes heartbeats instead of registering again: re-registering would drop, for
        # a moment, objects committed after our manifest snapshot.
        self._registered_to: tuple[Address, int] | None = None
        self.max_backoff_s = 2.0 if resolver is None else 0.2
        self.last_admission: dict[str, object] = {}
        self.node_id = node_id
        self.advertise_host = advertise_host
        self.server = server
        self.segments = segments
        self.transports = transports or {}
        self.registered = threading.Event()
        #: Set when the master retired this node (after a drain): the node should exit.
        self.retired = threading.Event()
        self._done: list[list[object]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="node-master-link", daemon=True)
        self.heartbeat_interval_s = 1.0
        #: The master's ``node_ttl_s`` (from its registration reply; 0: no one-hop reads).
        self.node_ttl_s = 0.0
        #: Seconds the daemon waits for the first registration (said in the first "unreachable"
        #: line); None: it waits as long as it runs.
        self.patience_s: float | None = None
        #: Whether this outage was already said (one line per outage; each retry is DEBUG).
        self._outage_said = False
        self._ever_registered = False

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Stop the link (bounded); a link never started has nothing to stop."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)

    def _verified_manifest(self) -> list[list[object]]:
        claims = self.server.manifest.objects()
        # Durable tiers (NVMe) verified every object's checksum when they stored it, in one
        # atomic transaction; the others (DRAM, HBM) are read back and checked here.
        tiers = self.server.tiers
        good: list[StoredObject] = []
        bad: list[tuple[StoredObject, str]] = []
        for c in claims:
            tier = tiers.get(c.segment)
            if tier is None:
                bad.append((c, f"no segment {c.segment!r}"))
            elif tier.durable:
                good.append(c)
            else:
                try:
                    same = checksum_of(tier.read(c.offset, c.size)) == c.checksum
                except KVStoreError as err:
                    same = False
                    log.warning("cannot read %s@%d back: %s", c.segment, c.offset, err)
                if same:
                    good.append(c)
                else:
                    bad.append((c, "bytes do not match the checksum"))
        for claim, why in bad:
            log.warning("dropping manifest entry %s@%d: %s", claim.segment, claim.offset, why)
        self.server.manifest.forget([(c.segment, c.offset, c.stamp) for c, _ in bad])
        return [c.to_wire() for c in good]

    def _register(self, conn: protocol.FramedSocket) -> None:
        args: dict[str, object] = {
            "node_id": self.node_id,
            "host": self.advertise_host,
            "port": self.server.port,
            "segments": [s.to_wire() for s in self.segments],
            "transports": self.transports,
        }
        self._done = []
        if self.resolver is None:
            # A fresh registration means the master holds nothing of ours: start a clean manifest,
            # except for durable tiers (NVMe), whose objects we claim for it to re-admit, and a
            # new secret, so no grant of the master's earlier life reads or writes here (a
            # client rereading under an old lease falls back to the master).
            self.server.secret = grants.new_secret()
            durable = {name for name, t in self.server.tiers.items() if t.durable}
            self.server.manifest.clear_volatile(durable)
            if durable:
                args["manifest"] = self._verified_manifest()
        else:
            if self._secret_epoch != self.epoch:
                # NOTE: rotate before the manifest snapshot: a write granted by the old leader
                # either finished before it (and is claimed) or is refused from now on.
                self.server.secret = grants.new_secret()
                self._secret_epoch = self.epoch
            args["epoch"] = self.epoch
            args["manifest"] = self._verified_manifest()
        args["secret"] = self.server.secret
        if self.identity is not None:
            args["identity"] = self.identity
        if self.site is not None:
            args["site"] = self.site.to_wire()
        clock = self.server.master_clock
        sent = clock.sent()
        asked = time.monotonic()
        reply = conn.call("register", args)
        clock.observe(reply.get("now_ms"), sent)
        self.last_admission = dict(reply.get("admission") or {})
        self.heartbeat_interval_s = float(reply["heartbeat_interval_s"])
        self.node_ttl_s = float(reply.get("node_ttl_s") or 0.0)
        self._acknowledged(asked)
        if "tenants" in reply:
            self._take_tenants(reply["tenants"], registering=True)
        if self.resolver is not None:
            self._registered_to = (self.master, self.epoch)
        self.registered.set()
        self._outage_said = False
        self._ever_registered = True
        log.info("registered with master %s as %s", self.master, self.node_id)

    def _acknowledged(self, asked: float) -> None:
        """The master answered a registration or heartbeat sent after ``asked``
        (``time.monotonic``): this node serves one-hop reads for half the time the master
        waits before it declares a silent node dead, from then (:mod:`kvstore.placement`)."""
        if self.node_ttl_s > 0:
            self.server.one_hop_until = asked + self.node_ttl_s / 2

    def _take_tenants(self, wire: object, registering: bool) -> None:
        """Take the master's tenant directory (its ``TenantDirectory.wire`` form) into the data
        server's; a malformed one is logged and changes nothing.

        A registration's is taken whole even when its version is not newer: a master that
        restarted counts its versions again, and it alone says which tokens open this node.
        """
        directory = self.server.tenants
        taken = TenantDirectory(version=-1)  # checked in full before anything changes
        try:
            taken.take_wire(wire)
        except KVStoreError as err:
            log.warning("ignoring the master's malformed tenant directory: %s", err)
            return
        if registering and taken.version <= directory.version:
            older = taken.version < directory.version
            same = taken.wire()["digests"] == directory.wire()["digests"]
            moved = taken.shared != directory.shared or taken.shared_keys != directory.shared_keys
            if older or not same or moved:
                directory.version = -1  # (only this thread writes it: take_wire then takes)
        if directory.take_wire(wire):
            log.info(
                "tenant directory version %d: %d tenant tokens, %d shared namespaces,"
                " %d shared prefix blocks",
                taken.version,
                len(taken),
                len(taken.shared),
                len(taken.shared_keys),
            )

    def _say_unreachable(self, exc: BaseException, backoff: float) -> None:
        """One line per outage: which master, why, and that the node retries; then each retry
        at DEBUG only (a node started before its master used to print a warning every 2 s).
        With etcd, a failover is routine: that line is INFO."""
        if self._outage_said:
            log.debug("master %s unreachable (%s); retrying in %.1fs", self.master, exc, backoff)
            return
        self._outage_said = True
        if self.patience_s is not None and not self._ever_registered:
            until = f"for up to {self.patience_s:g}s"
        else:
            until = "until it answers"
        # NOTE: registered is still set here when a link that served drops (cleared after).
        level = logging.INFO if self.resolver and not self.registered.is_set() else logging.WARNING
        log.log(
            level,
            "master %s unreachable (%s); retrying every %gs at most %s, quietly",
            self.master,
            exc,
            self.max_backoff_s,
            until,
        )

    def _run(self) -> None:
        backoff = 0.1
        while not self._stop.is_set():
            conn: protocol.FramedSocket | None = None
            try:
                timeout = CONNECT_TIMEOUT_S
                if self.resolver is not None:
                    self.master, self.epoch = self.resolver()
                    timeout = HA_CALL_TIMEOUT_S
                conn = protocol.FramedSocket.connect(
                    self.master.host, self.master.port, timeout=timeout
                )
                auth.hello(conn, self.token)
                if self.resolver is None or self._registered_to != (self.master, self.epoch):
                    self._register(conn)
                else:
                    self.registered.set()  # same leader: resume; it says if it forgot us
                    self._outage_said = False
                backoff = 0.1
                wait_s = self.heartbeat_interval_s
                while not self._stop.wait(wait_s):
                    wait_s = self.heartbeat_interval_s
                    done, self._done = self._done, []
                    try:
                        beat: dict[str, object] = {"node_id": self.node_id, "done": done}
                        if self.identity is not None:
                            beat["identity"] = self.identity
                        if self.resolver is not None:
                            beat["epoch"] = self.epoch
                        # The master answers with its directory only when it is newer.
                        beat["tenants_version"] = self.server.tenants.version
                        sent = self.server.master_clock.sent()
                        asked = time.monotonic()
                        reply = conn.call("heartbeat", beat)
                        self.server.master_clock.observe(reply.get("now_ms"), sent)
                        self._acknowledged(asked)
                    except KVStoreError as err:
                        if err.code != ErrorCode.NODE_UNAVAILABLE:
                            raise
                        log.warning("master forgot this node; registering again")
                        self.server.one_hop_until = 0.0
                        self._register(conn)
                        continue
                    if "tenants" in reply:
                        self._take_tenants(reply["tenants"], registering=False)
                    forget = reply.get("forget", [])
                    if forget:
                        self.server.forget([tuple(p) for p in forget])
                    tasks = reply.get("tasks") or []
                    if tasks:
                        self._done = run_tasks(self.server, tasks)
                        wait_s = 0.0  # report at once: the master may have more work queued
                    if reply.get("retire"):
                        log.info("the master retired this node (drained): stopping")
                        self.retired.set()
                        return
            except (NodeUnavailableError, ConnectionError, TimeoutError, OSError) as exc:
                self._say_unreachable(exc, backoff)
                self.registered.clear()
                self.server.one_hop_until = 0.0
            except KVStoreError as err:
                self.registered.clear()
                self.server.one_hop_until = 0.0
                if err.code in _FOLLOW_CODES:
                    log.info("master %s is not the leader (%s); looking again", self.master, err)
                else:
                    log.error("master rejected this node: %s", err)
            except Exception:
                # Without this thread the node keeps running but no master knows it: whatever
                # went wrong, say it and connect again (with backoff), never end quietly.
                self.registered.clear()
                self.server.one_hop_until = 0.0
                log.exception("master link to %s failed; connecting again", self.master)
            finally:
                if conn is not None:
                    conn.close()
            self._stop.wait(backoff)
            backoff = min(backoff * 2, self.max_backoff_s)
