"""Data commands: ``kvstore get``, ``kvstore put``, ``kvstore ls``, ``kvstore rm``.

For poking at the pool by hand, as ``redis-cli`` does: they connect to the master's control
port through the client SDK (:class:`~kvstore.client.Client`, the same path an engine takes),
while the operator commands beside them (:mod:`kvstore.cli.ops`) read the admin REST API.
Where they connect: ``--master``, else ``$KVSTORE_MASTER``, else the config file's ``master``,
else ``127.0.0.1:7700`` (:func:`kvstore.cli.settings.resolve_master`); the token and timeout
come as for the operator commands.

Exit status: 0, or 1 for a key that is not there (``get``, ``rm``), or 2 for bad input.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from kvstore.cli.settings import resolve, resolve_master
from kvstore.client import Client
from kvstore.errors import KeyNotFoundError


def _connect(args: argparse.Namespace) -> Client:
    flags = {"admin": None, "token_file": args.token_file, "ca_file": None, "timeout": args.timeout}
    settings = resolve(flags, config_path=args.config)
    master, _ = resolve_master(args.master, config_path=args.config)
    return Client.connect(master, timeout=settings.timeout, token=settings.token)


def _shown(key: bytes) -> str:
    """A key as text (keys are UTF-8 on the wire; anything else is escaped)."""
    return key.decode("utf-8", "backslashreplace")


def cmd_get(args: argparse.Namespace) -> int:
    with _connect(args) as client:
        try:
            value = client.get(args.key)
        except KeyNotFoundError:
            print(f"kvstore get: no key {args.key!r}", file=sys.stderr)
            return 1
    if args.out is not None:
        Path(args.out).write_bytes(value)
        return 0
    out = sys.stdout.buffer
    out.write(value)
    if sys.stdout.isatty() and not value.endswith(b"\n"):
        out.write(b"\n")  # a terminal's prompt starts on its own line (a pipe gets the bytes)
    out.flush()
    return 0


def cmd_put(args: argparse.Namespace) -> int:
    if (args.value is None) == (args.file is None):
        print("kvstore put: give VALUE or --file FILE (exactly one)", file=sys.stderr)
        return 2
    if args.value is not None:
        value = args.value.encode()
    elif args.file == "-":  # a pipe, as `redis-cli -x` takes one
        value = sys.stdin.buffer.read()
    else:
        value = Path(args.file).read_bytes()
    with _connect(args) as client:
        client.put(args.key, value, replicas=args.replicas)
    print(f"stored {args.key!r} ({len(value)} bytes)")
    return 0


def cmd_ls(args: argparse.Namespace) -> int:
    with _connect(args) as client:
        keys = client.list_keys(args.prefix)
    for key in keys:
        print(_shown(key))
    return 0


def cmd_rm(args: argparse.Namespace) -> int:
    with _connect(args) as client:
        results = client.batch_remove(args.keys)
    code = 0
    for key, err in zip(args.keys, results, strict=True):
        if isinstance(err, KeyNotFoundError):
            print(f"kvstore rm: no key {key!r}", file=sys.stderr)
            code = 1
        elif err is not None:
            raise err
    return code


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--master",
        default=None,
        help="the master's control HOST:PORT (else env KVSTORE_MASTER, the config file's "
        "master, or 127.0.0.1:7700: kvstore up's default)",
    )
    p.add_argument(
        "--token-file", default=None, help="file holding the cluster token (env KVSTORE_TOKEN)"
    )
    p.add_argument("--timeout", type=float, default=None, help="seconds per call (default: 10)")
    p.add_argument("--config", default=None, help="TOML config file (env KVSTORE_CONFIG)")


def add_parsers(sub: Any) -> None:
    """Register ``get``, ``put``, ``ls`` and ``rm`` on the ``kvstore`` subparsers."""
    p = sub.add_parser("get", help="print the value stored under a key")
    _common(p)
    p.add_argument("key", metavar="KEY", help="the key")
    p.add_argument("--out", default=None, help="write the value to this file instead of stdout")
    p.set_defaults(func=cmd_get)
    p = sub.add_parser("put", help="store a value under a key (replacing an earlier one)")
    _common(p)
    p.add_argument("key", metavar="KEY", help="the key")
    p.add_argument("value", metavar="VALUE", nargs="?", default=None, help="the value, as text")
    p.add_argument(
        "--file",
        default=None,
        help="store this file's bytes instead of VALUE ('-': standard input)",
    )
    p.add_argument("--replicas", type=int, default=1, help="copies on distinct nodes")
    p.set_defaults(func=cmd_put)
    p = sub.add_parser("ls", help="list the keys stored, sorted")
    _common(p)
    p.add_argument("prefix", metavar="PREFIX", nargs="?", default="", help="only keys with it")
    p.set_defaults(func=cmd_ls)
    p = sub.add_parser("rm", help="remove keys")
    _common(p)
    p.add_argument("keys", metavar="KEY", nargs="+", help="the keys to remove")
    p.set_defaults(func=cmd_rm)
