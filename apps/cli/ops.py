"""Operator commands: ``kvstore status``, ``kvstore nodes``, ``kvstore evict``, ``kvstore drain``.

They read the master's admin REST API (the same one the status page and Prometheus use) and
print readable tables, or JSON with ``--json``. Settings: see :mod:`kvstore.cli.settings`.

``kvstore drain NODE`` posts ``/api/v1/nodes/{id}/drain`` (the same settings, token and TLS as
``kvstore status``), then polls the same endpoint until the node has retired (the master tells
it to stop at its next heartbeat; its process exits 0).
"""

from __future__ import annotations

import argparse
import http.client
import json
import ssl
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Sequence
from typing import Any

from kvstore.cli.settings import CliConfig, resolve
from kvstore.errors import (
    InvalidRequestError,
    KVStoreError,
    KVTimeoutError,
    MasterUnavailableError,
    ProtocolError,
)
from kvstore.limits import format_size

#: Seconds between two polls of a drain.
POLL_S = 0.5


class AdminClient:
    """A small blocking client of the admin API.

    Args:
        settings: where to connect, the token, TLS and timeout.
    """

    def __init__(self, settings: CliConfig) -> None:
        self.settings = settings
        self._ssl: ssl.SSLContext | None = None
        if settings.admin.startswith("https://"):
            self._ssl = ssl.create_default_context(cafile=settings.ca_file)

    def call(self, method: str, path: str, body: Any = None) -> Any:
        """One request; returns the decoded JSON body.

        Raises:
            KVStoreError: the error the API answered with (same code as on the wire).
            MasterUnavailableError: nothing answered.
        """
        headers = {"Accept": "application/json"}
        data = None
        if body is not None:
            data = json.dumps(body).encode()
            headers["Content-Type"] = "application/json"
        if self.settings.token is not None:
            headers["Authorization"] = "Bearer " + self.settings.token.reveal().decode()
        req = urllib.request.Request(
            self.settings.admin + path, data=data, headers=headers, method=method
        )
        try:
            with urllib.request.urlopen(req, timeout=self.settings.timeout, context=self._ssl) as r:
                raw = r.read()
            try:
                return json.loads(raw)
            except (ValueError, UnicodeDecodeError):
                raise ProtocolError(
                    f"{self.settings.admin} answered, but not with JSON: is it the admin URL?"
                ) from None
        except urllib.error.HTTPError as exc:
            try:
                err = json.loads(exc.read())["error"]
                wire = [err["error_code"], err["message"]]
            except (ValueError, KeyError, TypeError):
                raise ProtocolError(f"the admin API answered HTTP {exc.code}") from None
            # NOTE: raised outside the try: KeyNotFoundError is a KeyError.
            raise KVStoreError.from_wire(wire) from None
        except http.client.HTTPException as exc:  # not HTTP at all (BadStatusLine, ...)
            raise ProtocolError(
                f"{self.settings.admin} does not speak HTTP ({type(exc).__name__}): "
                "is it the admin URL?"
            ) from None
        except (urllib.error.URLError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            raise MasterUnavailableError(
                f"admin API {self.settings.admin} unreachable: {reason}"
            ) from None


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """Columns padded to their widest cell; numbers right-aligned."""
    cells = [[str(c) for c in headers], *[[str(c) for c in r] for r in rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    numeric = [
        all(isinstance(r[i], int | float) for r in rows) and rows for i in range(len(headers))
    ]
    lines = []
    for n, row in enumerate(cells):
        parts = [
            c.rjust(w) if numeric[i] and n else c.ljust(w)
            for i, (c, w) in enumerate(zip(row, widths, strict=True))
        ]
        lines.append("  ".join(parts).rstrip())
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _pct(used: int, cap: int) -> str:
    return f"{100 * used / cap:.1f}%" if cap else "-"


def admin_client(args: argparse.Namespace) -> AdminClient:
    """The admin client the flags of :func:`add_admin_flags` (and the settings) point at."""
    flags = {
        "admin": args.admin,
        "token_file": args.token_file,
        "ca_file": args.ca_file,
        "timeout": args.timeout,
    }
    return AdminClient(resolve(flags, config_path=args.config))


def cmd_status(args: argparse.Namespace) -> int:
    client = admin_client(args)
    cluster = client.call("GET", "/api/v1/cluster")
    nodes = client.call("GET", "/api/v1/nodes")["nodes"]
    if args.json:
        print(json.dumps({"cluster": cluster, "nodes": nodes}, indent=2))
        return 0
    tiers: dict[str, list[int]] = {}
    for n in nodes:
        for s in n["segments"]:
            t = tiers.setdefault(s["tier"], [0, 0])
            t[0] += s["used_bytes"]
            t[1] += s["capacity_bytes"]
    print(f"admin     {client.settings.admin}")
    print(f"nodes     {cluster['num_nodes']}")
    print(f"objects   {cluster['num_objects']}  ({format_size(cluster.get('object_bytes', 0))})")
    print(f"pending   {cluster.get('num_pending', 0)}")
    print(
        f"used      {format_size(cluster['used_bytes'])} of {format_size(cluster['capacity_bytes'])}"
        f" ({_pct(cluster['used_bytes'], cluster['capacity_bytes'])})"
    )
    print()
    rows = [[t, format_size(u), format_size(c), _pct(u, c)] for t, (u, c) in sorted(tiers.items())]
    print(format_table(["TIER", "USED", "CAPACITY", "FILL"], rows))
    return 0


def cmd_nodes(args: argparse.Namespace) -> int:
    nodes = admin_client(args).call("GET", "/api/v1/nodes")["nodes"]
    if args.json:
        print(json.dumps(nodes, indent=2))
        return 0
    rows = [
        [
            n["node_id"],
            n["address"],
            n["state"],
            n.get("host_id") or "-",
            _rack(n),
            ",".join(sorted({s["tier"] for s in n["segments"]})),
            format_size(n["used_bytes"]),
            format_size(n["capacity_bytes"]),
            _pct(n["used_bytes"], n["capacity_bytes"]),
            f"{n['last_heartbeat_s_ago']:.1f}s",
        ]
        for n in nodes
    ]
    print(
        format_table(
            ["NODE", "ADDRESS", "STATE", "HOST", "RACK", "TIERS", "USED", "CAPACITY", "FILL"]
            + ["HEARTBEAT"],
            rows,
        )
    )
    return 0


def _rack(node: dict[str, Any]) -> str:
    """A node's rack as ``kvstore nodes`` shows it: ``ZONE/RACK``, ``-`` for the default."""
    rack, zone = node.get("rack") or "", node.get("zone") or ""
    if not rack and not zone:
        return "-"
    return f"{zone}/{rack or '-'}" if zone else rack


def cmd_evict(args: argparse.Namespace) -> int:
    if bool(args.keys) == bool(args.prefix):
        raise InvalidRequestError("give KEY... or --prefix (exactly one)")
    body: dict[str, Any] = {"keys": list(args.keys)} if args.keys else {"prefix": args.prefix}
    if args.prefix and args.limit is not None:
        body["limit"] = args.limit
    reply = admin_client(args).call("POST", "/api/v1/evict", body)
    if args.json:
        print(json.dumps(reply))
    else:
        print(f"evicted {reply['num_evicted']} object(s); {reply['num_missing']} not found")
    return 0


def cmd_drain(args: argparse.Namespace) -> int:
    """Start (or poll) a drain and wait for the node to retire.

    Raises:
        KeyNotFoundError: no such node; InvalidRequestError: nowhere to drain to;
        KVTimeoutError: not retired within ``--wait``.
    """
    client = admin_client(args)
    path = f"/api/v1/nodes/{urllib.parse.quote(args.node_id, safe='')}/drain"
    deadline = time.monotonic() + args.wait
    while True:
        status = client.call("POST", path)
        if args.json:
            print(json.dumps(status), flush=True)
        else:
            print(
                f"node {status['node_id']}: {status['state']}, "
                f"{status['num_objects_left']} object(s) left",
                flush=True,
            )
        if status["state"] == "retired" or args.no_wait:
            return 0
        if time.monotonic() > deadline:
            raise KVTimeoutError(
                f"node {args.node_id} not drained within {args.wait:g}s; the drain goes on"
            )
        time.sleep(POLL_S)


def add_admin_flags(p: argparse.ArgumentParser) -> None:
    """The flags of every command that calls the admin API (also ``kvstore tenant``'s)."""
    p.add_argument("--admin", default=None, help="admin URL (env KVSTORE_ADMIN)")
    p.add_argument(
        "--token-file", default=None, help="file holding the cluster token (env KVSTORE_TOKEN)"
    )
    p.add_argument("--ca-file", default=None, help="CA bundle for an https admin URL")
    p.add_argument("--timeout", type=float, default=None, help="seconds per call (default: 10)")
    p.add_argument("--config", default=None, help="TOML config file (env KVSTORE_CONFIG)")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")


def add_parsers(sub: Any) -> None:
    """Register ``status``, ``nodes``, ``evict`` and ``drain`` on the ``kvstore`` subparsers."""
    epilog = (
        "settings: flags > environment > config file > defaults "
        "(see `kvstore.cli.settings` and README 'Operating')"
    )
    p = sub.add_parser("status", help="cluster summary and tier fill", epilog=epilog)
    add_admin_flags(p)
    p.set_defaults(func=cmd_status)
    p = sub.add_parser("nodes", help="storage nodes, one per line", epilog=epilog)
    add_admin_flags(p)
    p.set_defaults(func=cmd_nodes)
    p = sub.add_parser("evict", help="remove objects by key or prefix", epilog=epilog)
    add_admin_flags(p)
    p.add_argument("keys", nargs="*", metavar="KEY", help="the keys to evict")
    p.add_argument("--prefix", default=None, help="evict every key starting with this")
    p.add_argument("--limit", type=int, default=None, help="at most this many (with --prefix)")
    p.set_defaults(func=cmd_evict)
    p = sub.add_parser(
        "drain", help="move a node's objects elsewhere, then retire the node", epilog=epilog
    )
    add_admin_flags(p)
    p.add_argument("node_id", metavar="NODE", help="the node's id (kvstore nodes)")
    p.add_argument("--wait", type=float, default=600.0, help="seconds to wait for retirement")
    p.add_argument("--no-wait", action="store_true", help="start the drain and return")
    p.set_defaults(func=cmd_drain)
