"""``kvstore master``, ``kvstore node`` and ``kvstore up``: the daemons of the store.

Each command turns its flags (and the environment, :class:`kvstore.env.Env`) into the daemon's
frozen options (:class:`~kvstore.master.daemon.MasterDaemonConfig`,
:class:`~kvstore.node.daemon.NodeDaemonConfig`) and runs it; the daemons know nothing of argparse.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from kvstore import auth
from kvstore.address import Address
from kvstore.cli.common import (
    add_security_flags,
    add_wire_flags,
    derived_port,
    run_loop,
    wire_deadlines,
)
from kvstore.cli.daemon_config import add_config_flag
from kvstore.env import Env
from kvstore.etcd import parse_endpoints
from kvstore.limits import format_size, parse_size
from kvstore.node.daemon import NodeDaemonConfig, serve_node
from kvstore.node.follow import serve_node_ha
from kvstore.processes import die_with_parent, parse_ready, ready_line
from kvstore.topology import Site

if TYPE_CHECKING:
    from kvstore.master.daemon import Master, MasterDaemonConfig, MasterEndpoints

#: Seconds ``kvstore up`` waits for its node's ready line.
READY_TIMEOUT_S = 60.0


def master_options(args: argparse.Namespace, admin_port: int, env: Env) -> MasterDaemonConfig:
    """The options of ``kvstore master`` (and of the master ``kvstore up`` runs).

    Raises:
        InvalidRequestError: a bad value (the options and configs validate themselves).
    """
    # NOTE: the master's modules (aiohttp, prometheus; two thirds of this command's start-up)
    # are imported where a master runs, so that a ``kvstore node`` process never loads them.
    from kvstore.master.daemon import MasterDaemonConfig
    from kvstore.master.ha import HAConfig
    from kvstore.master.service import MasterConfig
    from kvstore.master.tiering import TierConfig

    ha = None
    if getattr(args, "etcd", None):
        ha = HAConfig(
            parse_endpoints(args.etcd),
            prefix=args.etcd_prefix,
            lease_ttl_s=args.lease_ttl,
            recovery_s=args.recovery,
            connect_attempts=args.etcd_attempts,
            advertise_host=args.advertise_host or "",
        )
    return MasterDaemonConfig(
        host=args.host,
        port=args.port,
        admin_port=admin_port,
        config=MasterConfig(
            put_timeout_s=args.put_timeout,
            node_ttl_s=args.node_ttl,
            heartbeat_interval_s=args.heartbeat_interval,
            event_ring_events=args.event_ring,
        ),
        tiers=TierConfig(
            high_watermark=args.high_watermark,
            low_watermark=args.low_watermark,
            eviction_policy=args.eviction_policy,
            lease_s=args.lease,
            promote_after_hits=args.promote_after,
        ),
        token=auth.load_token(args.token_file),
        public_reads=args.public_reads,
        ssl_context=auth.tls_context(args.tls_cert, args.tls_key),
        chunk_items=env.chunk_items,
        deadlines=wire_deadlines(args),
        ha=ha,
        tenants_file=getattr(args, "tenants_file", None),
    )


def cmd_master(args: argparse.Namespace) -> int:
    from kvstore.master.daemon import serve_master  # see master_options

    options = master_options(args, derived_port(args.port, args.admin_port, 1), Env.read())
    if options.ha is not None:
        asyncio.run(serve_master(options))  # grpc.aio (etcd) runs on the standard asyncio loop
    else:
        run_loop(serve_master(options))
    return 0


def cmd_node(args: argparse.Namespace) -> int:
    if args.parent_pipe is not None:  # started by `kvstore up`: stop when it dies
        die_with_parent(args.parent_pipe)

    options = NodeDaemonConfig(
        host=args.host,
        port=args.port,
        dram_bytes=parse_size(args.dram),
        data_dir=Path(args.data_dir),
        nvme_bytes=parse_size(args.nvme),
        hbm_bytes=parse_size(args.hbm),
        shared_dir=Path(args.shared_dir) if args.shared_dir else None,
        shared_bytes=parse_size(args.shared),
        shared_namespace=args.shared_namespace,
        token=auth.load_token(args.token_file),
        admin_port=args.admin_port,
        public_reads=args.public_reads,
        shm=args.shm,
        site=Site.declared(args.host_id, args.rack, args.zone),
        ssl_context=auth.tls_context(args.tls_cert, args.tls_key),
        deadlines=wire_deadlines(args),
    )
    if args.master.startswith("etcd://"):
        serve_node_ha(args.master, args.etcd_prefix, args.etcd_ttl, options)
    else:
        serve_node(Address.parse(args.master), options)
    return 0


async def _up(args: argparse.Namespace) -> int:
    from kvstore.master.daemon import Master, apply_collector_policy, install_stop_signals

    # Checked here, before anything starts: the node child would only fail on them later.
    parse_size(args.dram)
    parse_size(args.nvme)
    parse_size(args.shared)
    # The node child reads the same env / token file.
    options = master_options(args, derived_port(args.port, args.admin_port, 1), Env.read())
    node_port = derived_port(args.port, args.node_port, 2)
    master = Master(options)
    endpoints = await master.start()
    apply_collector_policy()  # as ``kvstore master`` does: this process runs a master too
    stop = asyncio.Event()
    install_stop_signals(stop)
    data_dir = Path(args.data_dir).resolve()
    # The node holds the read end; only we hold the write end (not inheritable), so the node
    # sees EOF when we die, even by SIGKILL, and stops (kvstore.processes.die_with_parent).
    parent_r, parent_w = os.pipe()
    try:
        node = await asyncio.create_subprocess_exec(
            *node_argv(args, endpoints.control, node_port, data_dir, parent_r),
            stdout=asyncio.subprocess.PIPE,
            start_new_session=True,  # Ctrl-C reaches us; we stop the node ourselves, in order
            pass_fds=(parent_r,),
        )
    except BaseException:
        os.close(parent_w)
        raise
    finally:
        os.close(parent_r)
    try:
        return await _run_up(args, master, endpoints, node, stop, data_dir)
    finally:
        os.close(parent_w)


def node_argv(
    args: argparse.Namespace, control: str, node_port: int, data_dir: Path, parent_r: int
) -> list[str]:
    """The command line of the storage node ``kvstore up`` starts: the ``up`` flags that
    concern a node (size, tiers, security, TLS, wire deadlines) passed on, paths made
    absolute."""

    def absolute(path: str | None) -> str | None:
        return None if path is None else str(Path(path).resolve())

    tls = []
    if args.tls_cert is not None or args.tls_key is not None:
        tls = ["--tls-cert", absolute(args.tls_cert), "--tls-key", absolute(args.tls_key)]
    return [
        sys.executable,
        "-m",
        "kvstore",
        "--log-level",
        args.log_level,
        "node",
        "--master",
        control,
        "--parent-pipe",
        str(parent_r),
        "--host",
        args.host,
        "--port",
        str(node_port),
        "--dram",
        args.dram,
        "--nvme",
        args.nvme,
        *_shared_flags(args),
        "--data-dir",
        str(data_dir / "node-0"),
        *(["--token-file", str(Path(args.token_file).resolve())] if args.token_file else []),
        *([] if args.public_reads else ["--no-public-reads"]),
        *(["--shm"] if args.shm else []),
        "--frame-timeout",
        repr(args.frame_timeout),
        "--hello-timeout",
        repr(args.hello_timeout),
        *[str(a) for a in tls],
    ]


async def _run_up(
    args: argparse.Namespace,
    master: Master,
    endpoints: MasterEndpoints,
    node: asyncio.subprocess.Process,
    stop: asyncio.Event,
    data_dir: Path,
) -> int:
    assert node.stdout is not None
    code = 0
    try:
        try:
            line = (
                (await asyncio.wait_for(node.stdout.readline(), READY_TIMEOUT_S)).decode().strip()
            )
        except TimeoutError:
            line = ""
        ready = parse_ready(line, "node")
        if ready is None:
            if line:
                why = line
            elif node.returncode is not None or await _exited(node, 1.0):
                why = f"it exited with status {node.returncode}; its error is above"
            else:
                why = f"not ready within {READY_TIMEOUT_S:g} s"
            print(f"kvstore up: the storage node failed to start ({why})", file=sys.stderr)
            return 1
        data = ready["data"]
        print(
            "kvstore up: embedded cluster ready\n"
            f'  client connects to  {endpoints.control}    (Client.connect("{endpoints.control}"))\n'
            f"  admin API           {endpoints.admin}\n"
            f"  storage node        data={data} dram={format_size(parse_size(args.dram))} dir={data_dir / 'node-0'}\n"
            + ready_line(
                "up",
                control=endpoints.control,
                admin=endpoints.admin,
                data=data,
                node_pid=node.pid,
                node_admin=ready.get("admin"),
            ),
            flush=True,
        )
        waiter = asyncio.create_task(node.wait())
        stopper = asyncio.create_task(stop.wait())
        done, _ = await asyncio.wait({waiter, stopper}, return_when=asyncio.FIRST_COMPLETED)
        if waiter in done:
            print(f"kvstore up: storage node exited with {node.returncode}", file=sys.stderr)
            code = 1
        stopper.cancel()
    finally:
        if node.returncode is None:
            node.terminate()
            try:
                await asyncio.wait_for(node.wait(), 15)
            except TimeoutError:
                node.kill()
                await node.wait()
        await master.stop()
    print("kvstore up: stopped", flush=True)
    return code


async def _exited(proc: asyncio.subprocess.Process, timeout: float) -> bool:
    """Whether ``proc`` exits within ``timeout`` seconds."""
    try:
        await asyncio.wait_for(proc.wait(), timeout)
    except TimeoutError:
        return False
    return True


def cmd_up(args: argparse.Namespace) -> int:
    return int(run_loop(_up(args)))


def _add_shared_flags(p: argparse.ArgumentParser) -> None:
    """The shared-file-system tier's flags (``kvstore node`` and ``kvstore up``)."""
    p.add_argument(
        "--shared-dir",
        default=None,
        help="shared file system path (3FS, NFS, Lustre mount) for a tier below NVMe; "
        "objects there outlive every node",
    )
    p.add_argument("--shared", default="0", help="shared tier size (with --shared-dir)")
    p.add_argument(
        "--shared-namespace",
        default="default",
        help="folder under --shared-dir; clusters given the same path and namespace find "
        "each other's objects",
    )


def _shared_flags(args: argparse.Namespace) -> list[str]:
    """``kvstore up``'s shared-tier flags, passed on to its node (the path made absolute)."""
    if not args.shared_dir:
        return []
    return [
        "--shared-dir",
        str(Path(args.shared_dir).resolve()),
        "--shared",
        args.shared,
        "--shared-namespace",
        args.shared_namespace,
    ]


def _add_site_flags(p: argparse.ArgumentParser) -> None:
    """Where a node stands (``kvstore.topology``): puts go near their writer, replicas to
    distinct racks, reads to the nearest replica (docs/operating/topology.md)."""
    p.add_argument(
        "--host-id",
        default=None,
        help="this host's id (default: $KVSTORE_HOST_ID, else the hostname)",
    )
    p.add_argument(
        "--rack", default=None, help="this host's rack (default: $KVSTORE_RACK, else the default)"
    )
    p.add_argument(
        "--zone", default=None, help="this host's zone (default: $KVSTORE_ZONE, else the default)"
    )


def _add_master_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--event-ring",
        type=int,
        default=65536,
        help="KV events kept for subscribers that resume (older ones make them resync)",
    )
    p.add_argument(
        "--put-timeout",
        type=float,
        default=30.0,
        help="seconds before an uncommitted put is reclaimed",
    )
    p.add_argument(
        "--node-ttl",
        type=float,
        default=5.0,
        help="seconds without heartbeat before a node is dead",
    )
    p.add_argument(
        "--heartbeat-interval", type=float, default=1.0, help="seconds between node heartbeats"
    )
    p.add_argument(
        "--high-watermark", type=float, default=0.90, help="tier fill that starts eviction"
    )
    p.add_argument("--low-watermark", type=float, default=0.80, help="tier fill eviction stops at")
    p.add_argument("--eviction-policy", default="lru", help="lru or lfu")
    p.add_argument("--lease", type=float, default=5.0, help="seconds a read lease lasts")
    p.add_argument(
        "--promote-after", type=int, default=3, help="reads before an NVMe object moves to DRAM"
    )
    p.add_argument(
        "--tenants-file",
        default=None,
        help="keep the tenants in this JSON file across restarts (token digests only; needs "
        "--token-file; with --etcd they are kept in etcd)",
    )


HOST_HELP = "address to bind (loopback unless told otherwise)"
SHM_HELP = "let same-host clients of this user map the DRAM arena (shm transport)"


def add_parsers(sub: argparse._SubParsersAction) -> None:
    """Register ``master``, ``node`` and ``up`` on the ``kvstore`` command's subparsers."""
    p = sub.add_parser("master", help="run the control plane")
    p.add_argument("--host", default="127.0.0.1", help=HOST_HELP)
    p.add_argument("--port", type=int, default=7700, help="control port (0 picks a free one)")
    p.add_argument(
        "--admin-port", type=int, default=None, help="admin REST port (default: port + 1)"
    )
    _add_master_flags(p)
    p.add_argument(
        "--etcd",
        default=None,
        help="HOST:PORT[,HOST:PORT]: join an HA group of masters through etcd (default: embedded)",
    )
    p.add_argument("--etcd-prefix", default="/kvstore/default", help="our keys in etcd")
    p.add_argument(
        "--lease-ttl", type=int, default=2, help="leader lease TTL in seconds (failover time)"
    )
    p.add_argument(
        "--recovery",
        type=float,
        default=1.5,
        help="seconds a new leader waits for live nodes to re-register",
    )
    p.add_argument("--etcd-attempts", type=int, default=5, help="tries to reach etcd at start")
    p.add_argument(
        "--advertise-host", default=None, help="host published to clients (default: --host)"
    )
    add_security_flags(p, tls=True)
    add_wire_flags(p)
    add_config_flag(p)
    p.set_defaults(func=cmd_master)

    p = sub.add_parser("node", help="run a storage node")
    p.add_argument(
        "--master", required=True, help="the master's HOST:PORT, or etcd://HOST:PORT[,HOST:PORT]"
    )
    p.add_argument("--etcd-prefix", default="/kvstore/default", help="our keys in etcd")
    p.add_argument(
        "--etcd-ttl", type=int, default=2, help="membership lease TTL in seconds (with etcd://)"
    )
    p.add_argument("--host", default="127.0.0.1", help=HOST_HELP)
    p.add_argument("--port", type=int, default=0, help="data port (0 picks a free one)")
    p.add_argument("--dram", default="512MiB", help="DRAM arena size, e.g. 512MiB, 4GiB")
    p.add_argument("--data-dir", required=True, help="where the node keeps its id and files")
    p.add_argument("--nvme", default="0", help="NVMe (lmdb) tier size under --data-dir; 0: none")
    p.add_argument("--hbm", default="0", help="GPU memory tier size where a GPU exists; 0: none")
    _add_shared_flags(p)
    p.add_argument(
        "--admin-port", type=int, default=0, help="REST port for /health and /metrics (0: any)"
    )
    add_security_flags(p, tls=True)
    add_wire_flags(p)
    p.add_argument("--shm", action="store_true", help=SHM_HELP)
    _add_site_flags(p)
    # Internal (kvstore up): the read end of a pipe; EOF on it means the parent died.
    p.add_argument("--parent-pipe", type=int, default=None, help=argparse.SUPPRESS)
    add_config_flag(p)
    p.set_defaults(func=cmd_node)

    p = sub.add_parser("up", help="run an embedded master and one storage node (no etcd)")
    p.add_argument("--host", default="127.0.0.1", help=HOST_HELP)
    p.add_argument("--port", type=int, default=7700, help="control port (0 picks a free one)")
    p.add_argument(
        "--admin-port", type=int, default=None, help="admin REST port (default: port + 1)"
    )
    p.add_argument(
        "--node-port", type=int, default=None, help="the node's data port (default: port + 2)"
    )
    p.add_argument("--dram", default="512MiB", help="the node's DRAM arena size, e.g. 4GiB")
    p.add_argument("--nvme", default="0", help="NVMe (lmdb) tier size; 0: none")
    _add_shared_flags(p)
    p.add_argument("--data-dir", default=".kvstore-data", help="where the node keeps its files")
    p.add_argument("--shm", action="store_true", help=SHM_HELP)
    _add_master_flags(p)
    add_security_flags(p, tls=True)
    add_wire_flags(p)
    add_config_flag(p)
    p.set_defaults(func=cmd_up)
