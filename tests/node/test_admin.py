"""The node's small REST endpoint under idle connections: its threads stay bounded."""

from __future__ import annotations

import os
import select
import socket
import urllib.request
from pathlib import Path

from kvstore.node.admin import MAX_CONNECTIONS
from tests.support import start_master, start_node, wait_until


def _threads(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/task"))


def test_idle_connections_to_a_nodes_rest_port_do_not_grow_its_threads(tmp_path: Path) -> None:
    master = start_master()
    node = start_node(master.field("control"), tmp_path / "node", "16MiB")
    try:
        url = node.field("admin")
        host, port = url.split("//", 1)[1].rsplit(":", 1)
        with urllib.request.urlopen(url + "/health", timeout=10) as r:
            assert r.status == 200
        baseline = _threads(node.pid)
        idle = [socket.create_connection((host, int(port)), timeout=10) for _ in range(400)]
        most = [0]
        try:
            # The node has taken every connection once all but those it serves are closed by
            # it (past the cap it closes a new one at once; a served one after its idle time).
            def taken_all() -> bool:
                most[0] = max(most[0], _threads(node.pid))
                ready, _, _ = select.select(idle, [], [], 0)
                closed = sum(1 for s in ready if s.recv(1, socket.MSG_PEEK) == b"")
                return closed >= len(idle) - MAX_CONNECTIONS

            wait_until(taken_all, timeout=60, what="the node to take the idle connections")
            assert most[0] <= baseline + MAX_CONNECTIONS + 1, most[0]
        finally:
            for s in idle:
                s.close()
        # Its threads end with their connections, and it answers again.
        wait_until(lambda: _threads(node.pid) <= baseline + 1, timeout=30, what="threads to end")
        with urllib.request.urlopen(url + "/health", timeout=10) as r:
            assert r.status == 200
    finally:
        node.stop()
        master.stop()


def test_a_silent_connection_is_closed_after_the_idle_timeout() -> None:
    from kvstore.node.admin import NodeAdmin

    admin = NodeAdmin("127.0.0.1", 0, "n1", lambda: {"num_objects": 0}, {}, idle_timeout_s=0.2)
    admin.start()
    try:
        with socket.create_connection(("127.0.0.1", admin.port), timeout=30) as s:
            assert s.recv(1) == b""  # closed by the node, not by our timeout (which would raise)
    finally:
        admin.stop()
