"""What the router's engine tests share: a pool with vLLM servers and routers, the routers'
metrics, JSON posts."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path
from types import TracebackType
from typing import Any

from kvstore.processes import parse_ready, terminate
from tests.adapters.vllm_servers import VLLMServer, kv_config
from tests.support import Cluster, start_master


def start_router(master: str, *args: str) -> tuple[subprocess.Popen, str]:
    """Start ``kvstore router --port 0 --master MASTER ARGS`` and wait for its ready line.

    Args:
        master: the pool's master address.
        args: the rest of the command line (engines, policy, SLO config).

    Returns:
        The process (the caller terminates it) and the router's URL.
    """
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvstore", "router", "--port", "0", "--master", master, *args],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()  # the ready line, or EOF if it died
    ready = parse_ready(line, "router")
    assert ready is not None, f"the router did not start: {line!r}"
    return proc, ready["url"]


def post(url: str, body: Any, headers: dict[str, str] | None = None) -> tuple[int, Any, Any]:
    """POST ``body`` (JSON, or bytes as they are); returns status, headers and the JSON answer
    (of an error status too)."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(
        url, data=data, headers={"Content-Type": "application/json", **(headers or {})}
    )
    try:
        with urllib.request.urlopen(req, timeout=300) as resp:
            return resp.status, resp.headers, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, err.headers, json.loads(err.read())


def metric(router: str, name: str, *labels: str) -> float:
    """The sum of a router metric's samples whose labels include every one of ``labels``."""
    with urllib.request.urlopen(router + "/metrics", timeout=30) as resp:
        text = resp.read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name) and all(label in line for label in labels)
    )


class PoolRig:
    """A pool (a master and one 1 GiB node), the vLLM servers a test module adds on it and the
    routers it starts in front of them; closing it stops them all (a context manager).

    Attributes:
        tmp: the module's folder (logs, configs).
        cluster: the pool.
        kv: the kv_both connector config for a server on the pool.
        servers: the vLLM servers, added by the subclass.
        routers: the router processes :meth:`start_router` started.
    """

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.cluster = Cluster(tmp, start_master())
        self.cluster.add_node("1GiB")
        self.kv = kv_config("kv_both", self.cluster.address)
        self.servers: list[VLLMServer] = []
        self.routers: list[subprocess.Popen] = []

    def wait_ready(self) -> None:
        """Wait for every server to answer."""
        for server in self.servers:
            server.wait_ready()

    def start_router(self, *args: str) -> str:
        """Start a router on the pool (see :func:`start_router`); returns its URL."""
        proc, url = start_router(self.cluster.address, *args)
        self.routers.append(proc)
        return url

    def close(self) -> None:
        for proc in self.routers:
            terminate(proc)
        for server in self.servers:
            server.stop()
        self.cluster.stop()

    def __enter__(self) -> PoolRig:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
