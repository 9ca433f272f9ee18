"""The ``kvstore`` command: the top layer, the one place allowed to import every other.

Why a layer of its own: the daemons, the SDK and the operator tools are libraries that know
nothing of argparse; this package turns a command line (and the environment,
:class:`kvstore.env.Env`) into their frozen options and runs them. Because it sits above every
layer, it imports them at module level, and the core needs no hidden function-level imports
to reach the master or the client.

One module per command group:

* :mod:`~kvstore.cli.daemons`: ``master``, ``node``, ``up``;
* :mod:`~kvstore.cli.ops`: ``status``, ``nodes``, ``evict``, ``drain`` (the admin REST API);
* :mod:`~kvstore.cli.objects`: ``get``, ``put``, ``ls``, ``rm`` (the pool by hand, through the SDK);
* :mod:`~kvstore.cli.tenant_commands`: ``tenant create|list|show|set|delete`` (the admin REST API);
* :mod:`~kvstore.cli.inference`: ``demo``, ``proxy``, ``router``, ``engine``, ``model``;
* :mod:`~kvstore.cli.testbed`: ``testbed up|down`` (hosts as network namespaces, racks);
* ``replay``: registered by :mod:`kvstore.replay.cli`, next to the replay it drives.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import logging
import sys
from collections.abc import Sequence

from kvstore.cli import (
    daemon_config,
    daemons,
    inference,
    objects,
    ops,
    tenant_commands,
    testbed,
)
from kvstore.cli.common import Parser, os_error_text, port_in_use_text
from kvstore.env import LOG_LEVELS, Env
from kvstore.errors import KVStoreError
from kvstore.replay import cli as replay_cli

log = logging.getLogger("kvstore")


def version() -> str:
    """This installation's version, from the package metadata."""
    try:
        return importlib.metadata.version("kvstore")
    except importlib.metadata.PackageNotFoundError:  # run from a tree that is not installed
        return "unknown"


def _setup_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )


def build_parser(env: Env | None = None) -> Parser:
    """The ``kvstore`` command line, every subcommand registered.

    Args:
        env: the environment's settings (the ``--log-level`` default); None reads them.
    """
    env = env or Env.read()
    parser = Parser(prog="kvstore", description="A distributed, tiered KV cache store.")
    parser.add_argument(
        "--version", action="version", version=f"%(prog)s {version()}", help="print the version"
    )
    parser.add_argument(
        "--log-level",
        default=env.log_level,
        type=str.lower,
        choices=LOG_LEVELS,
        help="log messages at least this important (env KVSTORE_LOG_LEVEL)",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    daemons.add_parsers(sub)
    inference.add_parsers(sub)
    ops.add_parsers(sub)
    objects.add_parsers(sub)
    tenant_commands.add_parsers(sub)
    testbed.add_parsers(sub)
    replay_cli.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run one ``kvstore`` command; its exit status (2: bad input, 1: failure, 130: Ctrl-C)."""
    try:
        env = Env.read()
    except KVStoreError as err:  # a bad KVSTORE_* variable: before any command is parsed
        print(f"kvstore: {err.message}", file=sys.stderr)
        return 2
    parser = build_parser(env)
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        command = daemon_config.apply(parser, argv)  # --config FILE of up|master|node|router
    except KVStoreError as err:
        print(f"kvstore {daemon_config.find(argv)[0]}: {err.message}", file=sys.stderr)
        return 2
    args = parser.parse_args(argv)
    if command is not None:
        daemon_config.fill_lists(args)
    _setup_logging(args.log_level)
    try:
        return int(args.func(args))
    except KVStoreError as err:
        print(f"kvstore {args.command}: {err.message}", file=sys.stderr)
        return 2
    except OSError as exc:  # a port in use, a data dir we may not write: one line, no traceback
        text = port_in_use_text(exc, args) or os_error_text(exc)
        print(f"kvstore {args.command}: {text}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    with contextlib.suppress(BrokenPipeError):
        sys.exit(main())
