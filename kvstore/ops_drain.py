"""``kvstore drain NODE``: move a node's objects to other nodes, then retire it.

Posts ``/api/v1/nodes/{id}/drain`` on the master's admin API (the same settings, token and TLS
as ``kvstore status``), then polls the same endpoint until the node has retired (the master
tells it to stop at its next heartbeat; its process exits 0).
"""

from __future__ import annotations

import argparse
import json
import time
import urllib.parse
from typing import Any

from kvstore.errors import KVTimeoutError
from kvstore.ops import _client, _common

POLL_S = 0.5


def cmd_drain(args: argparse.Namespace) -> int:
    """Start (or poll) a drain and wait for the node to retire.

    Raises:
        KeyNotFoundError: no such node; InvalidRequestError: nowhere to drain to;
        KVTimeoutError: not retired within ``--wait``.
    """
    client = _client(args)
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


def add_parser(sub: Any) -> None:
    """Register ``drain`` on the ``kvstore`` command's subparsers."""
    p = sub.add_parser("drain", help="move a node's objects elsewhere, then retire the node")
    _common(p)
    p.add_argument("node_id", metavar="NODE")
    p.add_argument("--wait", type=float, default=600.0, help="seconds to wait for retirement")
    p.add_argument("--no-wait", action="store_true", help="start the drain and return")
    p.set_defaults(func=cmd_drain)
