"""Run a storage node: the DRAM arena, the data server and the link to the master."""

from __future__ import annotations

import logging
import os
import secrets
import signal
import ssl
import threading
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from kvstore import auth, grants
from kvstore.address import Address
from kvstore.errors import InvalidRequestError, MasterUnavailableError
from kvstore.gc_policy import tune_collector
from kvstore.node import rdma as rdma_node
from kvstore.node.admin import NodeAdmin
from kvstore.node.agent import MasterLink
from kvstore.node.arena import ShmArena, default_arena_path, reclaim_stale_arenas
from kvstore.node.hbm import open_hbm
from kvstore.node.nvme import NvmeTier
from kvstore.node.server import DataServer
from kvstore.node.shared import SharedTier, check_name
from kvstore.node.shm_verbs import make_shm_commit
from kvstore.node.tiers import Tier
from kvstore.processes import ready_line
from kvstore.serving import WireDeadlines
from kvstore.topology import Site
from kvstore.transports import ShmOffer
from kvstore.types import SegmentSpec

log = logging.getLogger(__name__)

REGISTER_TIMEOUT_S = 30.0


def load_node_id(data_dir: Path) -> str:
    """The node's stable id, kept in ``data_dir/node_id`` across restarts."""
    path = data_dir / "node_id"
    if path.exists():
        node_id = path.read_text().strip()
        if node_id:
            return node_id
    node_id = f"node-{uuid.uuid4().hex[:12]}"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(node_id + "\n")
    os.replace(tmp, path)
    return node_id


def load_node_key(data_dir: Path) -> bytes:
    """The node's identity key, kept in ``data_dir/node_key`` (mode 0600) across restarts.

    It proves the node's id to the master (``MasterService.check_node_identity``): the id is
    public, the key never leaves this directory except to the master it registers with.
    """
    path = data_dir / "node_key"
    try:
        key = bytes.fromhex(path.read_text().strip())
        if len(key) >= 16:
            return key
    except (FileNotFoundError, ValueError):
        pass
    key = secrets.token_bytes(32)
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(key.hex() + "\n")
    os.replace(tmp, path)
    return key


@dataclass(frozen=True, slots=True)
class NodeDaemonConfig:
    """How a storage node runs: the ``kvstore node`` flags, whatever finds its master.
    Validated on creation.

    Attributes:
        shm: offer same-host clients of this user the arena file (the shm transport).
        site: where the node stands (``--host-id --rack --zone``, see ``kvstore.topology``);
            None: the hostname, in the default rack and zone.
        admin_port: serve the node's small REST there (None: no REST).
        deadlines: how long the data server waits for a frame and for a hello
            (``--frame-timeout``, ``--hello-timeout``).
    """

    host: str
    port: int
    dram_bytes: int
    data_dir: Path
    nvme_bytes: int = 0
    hbm_bytes: int = 0
    #: The shared-file-system tier (``kvstore.node.shared``): its path, size and namespace.
    shared_dir: Path | None = None
    shared_bytes: int = 0
    shared_namespace: str = "default"
    token: auth.Token | None = None
    admin_port: int | None = None
    public_reads: bool = True
    shm: bool = False
    site: Site | None = None
    ssl_context: ssl.SSLContext | None = None
    deadlines: WireDeadlines = field(default_factory=WireDeadlines)

    def __post_init__(self) -> None:
        if self.dram_bytes <= 0:
            raise InvalidRequestError("--dram must be > 0")
        if self.nvme_bytes < 0 or self.hbm_bytes < 0:
            raise InvalidRequestError("--nvme and --hbm must be >= 0")
        if self.shared_bytes < 0 or (self.shared_bytes > 0) != (self.shared_dir is not None):
            raise InvalidRequestError("--shared SIZE > 0 and --shared-dir PATH go together")
        check_name("--shared-namespace", self.shared_namespace)
        for name in ("port", "admin_port"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= 65535:
                raise InvalidRequestError(f"--{name.replace('_', '-')} must be 0..65535")


class StorageNode:
    """A node's parts, started and stopped together."""

    def __init__(self, master: Address, options: NodeDaemonConfig) -> None:
        self.options = options
        host, port, data_dir = options.host, options.port, options.data_dir
        dram_bytes, nvme_bytes, hbm_bytes = (
            options.dram_bytes,
            options.nvme_bytes,
            options.hbm_bytes,
        )
        token = options.token
        data_dir.mkdir(parents=True, exist_ok=True)
        self.node_id = load_node_id(data_dir)
        identity = load_node_key(data_dir)
        # NOTE: lmdb must be opened after any fork: this is the node's own process.
        tiers: dict[str, Tier] = {}
        hbm = open_hbm(hbm_bytes)
        if hbm is not None:
            tiers[hbm.segment] = hbm
        if nvme_bytes:
            nvme = NvmeTier(data_dir / "nvme", nvme_bytes)
            tiers[nvme.segment] = nvme
        if options.shared_dir is not None:
            shared = SharedTier(
                options.shared_dir, options.shared_namespace, self.node_id, options.shared_bytes
            )
            tiers[shared.segment] = shared
        self.tiers = tiers
        arena_path = default_arena_path(self.node_id, data_dir)
        reclaim_stale_arenas(arena_path.parent)
        self.dram = ShmArena(arena_path, dram_bytes)
        self.server = DataServer(
            {"dram": self.dram},
            grants.new_secret(),
            host,
            port,
            tiers=tiers,
            token=token,
            deadlines=options.deadlines,
        )
        specs = [SegmentSpec("dram", "dram", dram_bytes, str(self.dram.path))]
        specs += [SegmentSpec(t.segment, t.tier, t.capacity) for t in tiers.values()]
        self.link = MasterLink(
            master,
            self.node_id,
            host,
            self.server,
            specs,
            token=token,
            transports=node_transports(self.server, {"dram": self.dram.path}, options.shm),
            identity=identity,
            site=options.site if options.site is not None else Site.declared(),
        )
        self.admin: NodeAdmin | None = None
        if options.admin_port is not None:
            self.admin = NodeAdmin(
                host,
                options.admin_port,
                self.node_id,
                self.server.stats,
                {
                    "dram": ("dram", dram_bytes),
                    **{t.segment: (t.tier, t.capacity) for t in tiers.values()},
                },
                token=token,
                public_reads=options.public_reads,
                ssl_context=options.ssl_context,
            )

    def start(self, register_timeout_s: float = REGISTER_TIMEOUT_S) -> None:
        """Serve, and wait until the master has accepted us.

        Raises:
            MasterUnavailableError: no registration within ``register_timeout_s``.
        """
        self.server.start()
        if self.admin is not None:
            self.admin.start()
        self.link.patience_s = register_timeout_s  # said in its first "unreachable" line
        self.link.start()
        if not self.link.registered.wait(register_timeout_s):
            self.stop()
            raise MasterUnavailableError(
                f"could not register with master {self.link.master} in {register_timeout_s:.0f}s "
                "(is a master running there? kvstore master, or kvstore up, starts one)"
            )

    def stop(self) -> None:
        self.link.stop()
        if self.admin is not None:
            self.admin.stop()
        self.server.stop()
        self.dram.close()
        for tier in self.tiers.values():
            tier.close()


def node_transports(
    server: DataServer, arena_files: dict[str, Path], shm: bool
) -> dict[str, dict[str, object]]:
    """What this node offers beyond TCP: shm when asked for (``--shm``), RDMA where a device is."""
    offered: dict[str, dict[str, object]] = {}
    if shm:
        server.register_verb("shm_commit", make_shm_commit(server))
        offered["shm"] = ShmOffer.of_files(arena_files).to_wire()
    rdma_offer = rdma_node.install(server)
    if rdma_offer is not None:
        offered["rdma"] = rdma_offer
    return offered


def serve_node(master: Address, options: NodeDaemonConfig) -> None:
    """Run a node until SIGINT/SIGTERM (or the master retires it). Prints one ``ready`` line."""
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    node = StorageNode(master, options)
    node.start()
    run_until_stopped(node, str(master), stop)


def run_until_stopped(node: StorageNode, master_label: str, stop: threading.Event) -> None:
    """Set the daemon's collector policy (:func:`~kvstore.gc_policy.tune_collector`: this is
    a node's own process), print the ready line (:func:`~kvstore.processes.ready_line`), serve
    until ``stop`` (a signal) or retirement, then stop the node."""
    log.debug("froze %d start-up objects", tune_collector())
    host = node.server.host
    admin = (
        {} if node.admin is None else {"admin": f"{node.admin.scheme}://{host}:{node.admin.port}"}
    )
    record = ready_line(
        "node",
        id=node.node_id,
        data=f"{host}:{node.server.port}",
        master=master_label,
        dram=node.dram.size,
        tiers={t.tier: t.capacity for t in node.tiers.values()},
        shm=node.options.shm,
        **admin,
    )
    print(record, flush=True)
    threading.Thread(
        target=lambda: (node.link.retired.wait(), stop.set()), name="node-retire", daemon=True
    ).start()
    try:
        stop.wait()
    finally:
        node.stop()
        print("kvstore node stopped", flush=True)
