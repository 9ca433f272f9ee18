"""kvstore side by side with Mooncake Store and Redis, on this machine, in one command.

Run:  .venv/bin/python bench/bench_peers.py [--repeat 3] [--only kvstore,redis]

What it does, in one run:
1. installs what it needs outside the repo: a throwaway venv under /tmp with the PyPI wheels
   ``mooncake-transfer-engine-non-cuda``, ``redis`` and ``hiredis``; Debian's ``redis-server``
   and ``libibverbs1`` (Mooncake's binaries link it even for TCP) when missing;
2. starts each system on free loopback ports with its storage in a separate process from the
   client: kvstore (``kvstore up --shm``: master and node processes), Mooncake (``mooncake_master``
   with its HTTP metadata server, plus one storage process that mounts a segment), Redis
   (``redis-server``, no persistence);
3. runs the same workloads against each (bench/peers_worker.py: sizes 4 KiB, 64 KiB, 1 MiB,
   16 MiB; put/get of bytes, put_from/get_into of buffers, batches of 16), verifying the bytes;
   kvstore three times: over TCP with lease reads (``Client.connect(..., lease_reads=True)``, the
   setting for content-addressed KV blocks: a key located within the master's read lease is
   reread from its node directly), over TCP with every read asking the master
   (``kvstore-strict``, as Mooncake does), through shared memory (with lease reads), and
   through Mooncake's own Python API served by kvstore (``kvstore-mcapi``, "Mooncake API on
   kvstore": ``kvstore.client.compat.mooncake`` driven by the very same worker class, calls and
   keys as real Mooncake; its client's default transport, shared memory here; the ratio column
   ``kv-mcapi/mooncake`` compares the two in the same run);
4. stops everything it started by PID and prints one table: each system's GB/s (bytes per
   operation over the median operation time, so that other jobs on a shared machine skew it
   less; the mean-based figure is in each worker's JSON), and kvstore's ratio to each peer.
   With ``--repeat N`` each cell is the best of N runs.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np  # noqa: F401 - the worker needs it in this venv too

HERE = Path(__file__).resolve().parent
WORKER = HERE / "peers_worker.py"
PEERS_VENV = Path(tempfile.gettempdir()) / "kvstore-peers-venv"
PEER_WHEELS = ["mooncake-transfer-engine-non-cuda", "redis", "hiredis", "numpy"]
READY_TIMEOUT_S = 60.0
SEGMENT = 4 << 30


def log(msg: str) -> None:
    print(f"# {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------- installs
def ensure_debian_packages() -> None:
    need = []
    if shutil.which("redis-server") is None:
        need.append("redis-server")
    libs = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True).stdout
    if "libibverbs.so.1" not in libs:
        need.append("libibverbs1")
    if not need:
        return
    log(f"apt-get install {' '.join(need)}")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    subprocess.run(["apt-get", "update", "-q"], check=True, env=env, stdout=subprocess.DEVNULL)
    subprocess.run(
        ["apt-get", "install", "-y", "-q", "-o", "DPkg::Lock::Timeout=600", *need],
        check=True,
        env=env,
        stdout=subprocess.DEVNULL,
    )


def ensure_peers_venv() -> Path:
    python = PEERS_VENV / "bin" / "python"
    check = "import mooncake.store, redis, hiredis, numpy"
    if (
        python.exists()
        and subprocess.run([python, "-c", check], capture_output=True).returncode == 0
    ):
        return python
    log(f"creating {PEERS_VENV} with {' '.join(PEER_WHEELS)}")
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(PEERS_VENV)], check=True)
    subprocess.run([python, "-m", "pip", "install", "-q", *PEER_WHEELS], check=True)
    return python


# ---------------------------------------------------------------- processes
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Proc:
    """A child process we started; stopped by PID (SIGTERM, then SIGKILL)."""

    def __init__(self, name: str, argv: list[str], logdir: Path) -> None:
        self.name = name
        self.log_path = logdir / f"{name}.log"
        self.log = self.log_path.open("w")
        self.p = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT)

    def wait_for(self, text: str, timeout: float = READY_TIMEOUT_S) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            content = self.log_path.read_text(errors="replace")
            for line in content.splitlines():
                if text in line:
                    return line
            if self.p.poll() is not None:
                break
            time.sleep(0.05)  # polling a log file for readiness, bounded by the deadline
        raise RuntimeError(f"{self.name} not ready:\n{self.log_path.read_text()[-2000:]}")

    def stop(self) -> None:
        from kvstore.processes import terminate

        terminate(self.p, timeout=15)
        self.log.close()


@contextlib.contextmanager
def kvstore_cluster(tmp: Path) -> Iterator[str]:
    """``kvstore up --shm``, warmed up (its arena pre-faulted); yields the control address."""
    from kvstore.embedded import EmbeddedCluster

    with EmbeddedCluster(str(tmp / "kvstore-data"), str(SEGMENT), ["--shm"]) as cluster:
        cluster.wait_warm(READY_TIMEOUT_S)
        yield cluster.address


@contextlib.contextmanager
def mooncake_cluster(tmp: Path, python: Path) -> Iterator[tuple[str, str]]:
    rpc, http, metrics = free_port(), free_port(), free_port()
    master_bin = PEERS_VENV / "bin" / "mooncake_master"
    master = Proc(
        "mooncake_master",
        [
            str(master_bin),
            f"--rpc_port={rpc}",
            "--rpc_address=127.0.0.1",
            "--enable_http_metadata_server=true",
            "--http_metadata_server_host=127.0.0.1",
            f"--http_metadata_server_port={http}",
            f"--metrics_port={metrics}",
        ],
        tmp,
    )
    storage: Proc | None = None
    try:
        _wait_port(rpc)
        _wait_port(http)
        metadata = f"http://127.0.0.1:{http}/metadata"
        address = f"127.0.0.1:{rpc}"
        storage_py = tmp / "mooncake_storage.py"
        storage_py.write_text(MOONCAKE_STORAGE)
        storage = Proc(
            "mooncake_storage",
            [str(python), str(storage_py), address, metadata, str(SEGMENT)],
            tmp,
        )
        storage.wait_for("storage ready")
        yield address, metadata
    finally:
        if storage is not None:
            storage.stop()
        master.stop()


MOONCAKE_STORAGE = """
import signal, sys, threading
from mooncake.store import MooncakeDistributedStore
address, metadata, segment = sys.argv[1], sys.argv[2], int(sys.argv[3])
store = MooncakeDistributedStore()
rc = store.setup("127.0.0.1", metadata, segment, 16 << 20, "tcp", "", address)
if rc != 0:
    sys.exit(f"setup failed: {rc}")
stop = threading.Event()
signal.signal(signal.SIGTERM, lambda *_: stop.set())
print("storage ready", flush=True)
stop.wait()
store.close()
"""


@contextlib.contextmanager
def redis_server(tmp: Path) -> Iterator[str]:
    port = free_port()
    proc = Proc(
        "redis",
        [
            "redis-server",
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(tmp),
        ],
        tmp,
    )
    try:
        proc.wait_for("Ready to accept connections")
        yield f"127.0.0.1:{port}"
    finally:
        proc.stop()


def _wait_port(port: int, timeout: float = READY_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 1):
            return
        time.sleep(0.05)  # polling a port for readiness, bounded by the deadline
    raise RuntimeError(f"nothing listens on port {port}")


def run_worker(python: Path | str, system: str, address: str, metadata: str, tag: str) -> dict:
    argv = [str(python), str(WORKER), system, "--address", address, "--tag", tag]
    if metadata:
        argv += ["--metadata", metadata]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=900)
    if out.returncode != 0:
        raise RuntimeError(f"{system} worker failed:\n{out.stderr[-3000:]}")
    rows = {}
    for line in out.stdout.splitlines():
        if line.startswith("{"):
            r = json.loads(line)
            rows[(r["workload"], r["size"])] = r
    return rows


# ---------------------------------------------------------------- table
SYSTEMS = ["kvstore", "kvstore-strict", "kvstore-shm", "kvstore-mcapi", "mooncake", "redis"]
KVSTORES = [s for s in SYSTEMS if s.startswith("kvstore")]
#: "Mooncake API on kvstore" (kvstore.client.compat.mooncake) is compared with real Mooncake only.
PEERS_OF = {"kvstore-mcapi": ("mooncake",)}


def best(runs: list[dict]) -> dict:
    out: dict = {}
    for rows in runs:
        for k, r in rows.items():
            cur = out.get(k)
            if cur is None:
                out[k] = dict(r)
            else:
                cur["gbps"] = max(cur["gbps"], r["gbps"])
                cur["p50_us"] = min(cur["p50_us"], r["p50_us"])
    return out


def table(results: dict[str, dict]) -> str:
    present = [s for s in SYSTEMS if s in results]
    keys = next(iter(results.values())).keys()
    head = ["workload", "size", *[f"{s} GB/s" for s in present]]
    ratios = [
        (a, b)
        for a in KVSTORES
        for b in PEERS_OF.get(a, ("mooncake", "redis"))
        if a in results and b in results
    ]
    head += [f"{a.replace('kvstore', 'kv')}/{b}" for a, b in ratios]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for k in keys:
        cells = [k[0], k[1]]
        for s in present:
            r = results[s].get(k)
            cells.append(f"{r['gbps']:.3f}" if r else "-")
        for a, b in ratios:
            ra, rb = results[a].get(k), results[b].get(k)
            cells.append(f"{ra['gbps'] / rb['gbps']:.2f}x" if ra and rb and rb["gbps"] else "-")
        lines.append("| " + " | ".join(cells) + " |")
    # Latency of a single 4 KiB get_into.
    lat = ["single 4KiB get_into p50 (µs)"]
    for s in present:
        r = results[s].get(("get_into", "4KiB"))
        lat.append(f"{s}={r['p50_us']:.0f}" if r else f"{s}=-")
    lines.append("")
    lines.append(" ".join(lat))
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeat", type=int, default=1, help="best of N runs per cell")
    ap.add_argument("--only", default=",".join(SYSTEMS), help="comma-separated systems")
    args = ap.parse_args()
    only = [s for s in args.only.split(",") if s]
    ensure_debian_packages()
    peers_python = ensure_peers_venv() if {"mooncake", "redis"} & set(only) else None
    runs: dict[str, list[dict]] = {s: [] for s in only}
    with tempfile.TemporaryDirectory(prefix="kvstore-peers-") as tmp_s:
        tmp = Path(tmp_s)
        for rep in range(args.repeat):
            log(f"run {rep + 1}/{args.repeat}, load {os.getloadavg()[0]:.2f}")
            if set(KVSTORES) & set(only):
                with kvstore_cluster(tmp) as address:
                    for s in KVSTORES:
                        if s in only:
                            runs[s].append(run_worker(sys.executable, s, address, "", f"r{rep}"))
            if "mooncake" in only:
                assert peers_python is not None
                try:
                    with mooncake_cluster(tmp, peers_python) as (address, metadata):
                        runs["mooncake"].append(
                            run_worker(peers_python, "mooncake", address, metadata, f"r{rep}")
                        )
                except RuntimeError as err:
                    log(f"mooncake failed: {err}")
            if "redis" in only:
                assert peers_python is not None
                with redis_server(tmp) as address:
                    runs["redis"].append(run_worker(peers_python, "redis", address, "", f"r{rep}"))
    results = {s: best(r) for s, r in runs.items() if r}
    print(
        f"GB/s = bytes per op / median op time; best of {args.repeat} run(s); "
        f"load average {os.getloadavg()[0]:.2f}; "
        f"{os.cpu_count()} cores; loopback; storage in separate processes"
    )
    print(table(results))


if __name__ == "__main__":
    main()
