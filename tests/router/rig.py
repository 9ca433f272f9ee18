"""What the router's engine tests share: a router process, its metrics, JSON posts."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.error
import urllib.request
from typing import Any


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
    assert "ready" in line, f"the router did not start: {line!r}"
    return proc, line.split("url=")[1].split()[0]


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
