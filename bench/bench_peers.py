"""kvstore side by side with Mooncake Store and Redis, on this machine, in one command.

Run:  .venv/bin/python bench/bench_peers.py [--repeat 3] [--only kvstore,redis] [--objects N]
      [--mooncake-setting NAME] [--mooncake-sweep] [--markdown]
      (the sweep alone: ``--only none --mooncake-sweep --objects 0``)

What it does, in one run:
1. installs what it needs outside the repo: a throwaway venv under /tmp with the PyPI wheels
   ``mooncake-transfer-engine-non-cuda``, ``redis`` and ``hiredis``; Debian's ``redis-server``
   and ``libibverbs1`` (Mooncake's binaries link it even for TCP) when missing;
2. starts each system on free loopback ports with its storage in a separate process from the
   client: kvstore (``kvstore up --shm``: master and node processes), Mooncake (``mooncake_master``
   with its HTTP metadata server, plus one storage process that mounts a segment), Redis
   (``redis-server``, no persistence), and "plain-tcp", the limit (bench/plain_tcp_server.py:
   one object per size, a get answered with ``sendall`` of its bytes, a put's bytes received and
   answered with 4 bytes; TCP_NODELAY, no index, no metadata; buffer rows only, and each kvstore
   variant's ratio to it, ``kv/plain-tcp``, says how much of the loopback's reach it keeps);
   Mooncake runs in one of the named settings of ``MOONCAKE_SETTINGS`` (``--mooncake-setting``,
   by default "connection pool": ``MC_TCP_ENABLE_CONNECTION_POOL=1``, which Mooncake's own vLLM
   setup script and SGLang deployments export; without it its TCP transport opens and closes a
   connection per transfer); the setting's environment reaches both its storage process and
   the client;
3. runs the same workloads against each (bench/peers_worker.py: sizes 4 KiB, 64 KiB, 1 MiB,
   16 MiB; put/get of bytes, put_from/get_into of buffers, batches of 16), verifying the bytes.
   The write rows do not measure the same thing on every system: kvstore's puts return once the
   node holds the bytes and the master has committed the object; Mooncake's ``put_from`` /
   ``batch_put_from`` return before the bytes land (its TCP write completes without an
   acknowledgement from the storage process), so its write GB/s can exceed what loopback moves.
   The headline reads touch **distinct keys, each read once**, after the node is warm (what a
   decode engine does with the blocks a prefill wrote: no location cache or lease helps); reads
   that reread one hot key again and again (which flatter caches and leases) are a separate,
   labelled table. KV-cache level rows: a 512-token prompt's 64-token blocks in Llama-3-8B's
   shape (8 MiB a block) and SmolLM2-135M's (1.4 MiB), each prompt new and each read once: the
   raw ``batch_put_from`` / ``batch_get_into`` of its blocks on every system and, on kvstore,
   ``KVCache.store`` / ``KVCache.load`` of the same bytes from per-layer K and V tensors, set
   against its own raw batches and Mooncake's. Metadata rows: ``batch_put`` / ``batch_get`` of 1,000 x 16 B objects (keys/s),
   and the master's memory per object: its RSS before and after putting ``--objects`` (1M by
   default) 16 B objects into a fresh cluster, divided by their number;
   kvstore three times: over TCP with lease reads (``Client.connect(..., lease_reads=True)``, the
   setting for content-addressed KV blocks: a key is read from its home node in one hop without
   asking the master, and a key located within the master's read lease is reread from its node
   directly; docs/data-plane.md; and single small puts through blanks, puts the master started
   ahead: docs/architecture.md), over TCP with every read and every put starting at the master
   (``kvstore-strict``, as Mooncake does: no lease reads, ``blanks=False``), through shared
   memory (with lease reads and blanks), and
   through Mooncake's own Python API served by kvstore (``kvstore-mcapi``, "Mooncake API on
   kvstore": ``kvstore.client.compat.mooncake`` driven by the very same worker class, calls and
   keys as real Mooncake; its client's default transport, shared memory here; the ratio column
   ``kv-mcapi/mooncake`` compares the two in the same run);
4. stops everything it started by PID and prints its tables: each system's GB/s (bytes per
   operation over the median operation time, so that other jobs on a shared machine skew it
   less; the mean-based figure is in each worker's JSON), and kvstore's ratio to each peer;
   keys/s and master bytes per object for the metadata rows.
   With ``--repeat N`` each cell is the best of N runs.
5. with ``--mooncake-sweep``: Mooncake in every setting of ``MOONCAKE_SETTINGS``, a short 1 MiB
   workload each (bench/peers_worker.py ``--sweep``: ``put_from`` N distinct keys, then
   ``get_into`` each once; the same in batches of 16), best of ``--repeat``, in a table of
   read GB/s with the best remote setting marked. One setting gives the client a segment of its
   own, so that some reads are served from its own memory: labelled, never the best remote.
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
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np  # noqa: F401 - the worker needs it in this venv too

sys.path.append(str(Path(__file__).resolve().parents[1]))  # for bench.markdown
from bench import markdown  # noqa: E402

HERE = Path(__file__).resolve().parent
WORKER = HERE / "peers_worker.py"
PLAIN_TCP_SERVER = HERE / "plain_tcp_server.py"
PEERS_VENV = Path(tempfile.gettempdir()) / "kvstore-peers-venv"
PEER_WHEELS = ["mooncake-transfer-engine-non-cuda", "redis", "hiredis", "numpy"]
READY_TIMEOUT_S = 60.0
SEGMENT = 4 << 30
#: Objects of the Mooncake settings sweep's short 1 MiB workload, per setting and run.
SWEEP_OBJECTS = 128


def _size(n: int) -> str:
    return f"{n >> 30} GiB" if n >= 1 << 30 and n % (1 << 30) == 0 else f"{n >> 20} MiB"


@dataclass(frozen=True)
class MooncakeSetting:
    """One way to run Mooncake: environment (storage process and client alike), the client's
    ``local_buffer_size`` and own segment, the storage process's segment and local buffer,
    and which program the storage process is (a Python process calling ``setup``, or
    Mooncake's own ``mooncake_client`` binary)."""

    name: str
    env: dict[str, str] = field(default_factory=dict)
    client_buffer: int = 512 << 20
    storage_segment: int = SEGMENT
    storage_buffer: int = 16 << 20
    storage: str = "python"  # or "mooncake_client"
    client_segment: int = 0
    #: Non-empty where reads are not all remote: shown beside the others, never the best.
    label: str = ""

    def describe(self) -> str:
        parts = [f"{k}={v}" for k, v in self.env.items()] or ["no MC_* environment"]
        parts.append(f"client local buffer {_size(self.client_buffer)}")
        if self.client_segment:
            parts.append(f"client segment {_size(self.client_segment)}")
        if self.storage == "python":
            parts.append(
                f"storage segment {_size(self.storage_segment)} "
                f"(Python setup, local buffer {_size(self.storage_buffer)})"
            )
        else:
            parts.append(f"storage segment {_size(self.storage_segment)} ({self.storage})")
        return ", ".join([*parts, "TCP"])

    def worker_args(self) -> list[str]:
        return [
            "--client-buffer",
            str(self.client_buffer),
            "--client-segment",
            str(self.client_segment),
        ]


POOL = {"MC_TCP_ENABLE_CONNECTION_POOL": "1"}
MOONCAKE_SETTINGS = [
    MooncakeSetting("defaults"),
    MooncakeSetting("connection pool", POOL),
    MooncakeSetting("pool + slice 1 MiB", {**POOL, "MC_TCP_SLICE_SIZE": str(1 << 20)}),
    MooncakeSetting("pool + lanes 1", {**POOL, "MC_TCP_LANES_PER_PEER": "1"}),
    MooncakeSetting("pool + client buffer 16 MiB", POOL, client_buffer=16 << 20),
    MooncakeSetting("pool + mooncake_client storage", POOL, storage="mooncake_client"),
    MooncakeSetting(
        "pool + client segment 1 GiB",
        POOL,
        client_segment=1 << 30,
        label="client holds a segment: some reads local, not remote",
    ),
]
MOONCAKE_BY_NAME = {m.name: m for m in MOONCAKE_SETTINGS}
#: The setting of the main tables: Mooncake's TCP as its own deployments configure it.
DEFAULT_MOONCAKE = "connection pool"


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

    def __init__(
        self, name: str, argv: list[str], logdir: Path, env: dict[str, str] | None = None
    ) -> None:
        self.name = name
        self.log_path = logdir / f"{name}.log"
        self.log = self.log_path.open("w")
        self.p = subprocess.Popen(
            argv,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **env} if env else None,
        )

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
def kvstore_cluster(tmp: Path) -> Iterator[tuple[str, int]]:
    """``kvstore up --shm``, warmed up (its arena pre-faulted); yields the control address and
    the master's PID (``kvstore up`` serves the master in-process, the node is its child)."""
    from kvstore.cli.embedded import EmbeddedCluster

    with EmbeddedCluster(str(tmp / "kvstore-data"), str(SEGMENT), ["--shm"]) as cluster:
        cluster.wait_warm(READY_TIMEOUT_S)
        yield cluster.address, cluster.pid


@contextlib.contextmanager
def mooncake_cluster(
    tmp: Path, python: Path, setting: MooncakeSetting
) -> Iterator[tuple[str, str, int]]:
    """``mooncake_master`` and a storage process in ``setting``; yields the master's address,
    the metadata server's URL and the master's PID."""
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
        if setting.storage == "mooncake_client":
            assert setting.storage_segment % (1 << 30) == 0, "mooncake_client takes whole GB"
            argv = [
                str(PEERS_VENV / "bin" / "mooncake_client"),
                "--host=127.0.0.1",
                f"--port={free_port()}",
                "--protocol=tcp",
                f"--master_server_address={address}",
                f"--metadata_server={metadata}",
                f"--global_segment_size={setting.storage_segment >> 30}GB",
            ]
            ready = "Starting real client service"
        else:
            storage_py = tmp / "mooncake_storage.py"
            storage_py.write_text(MOONCAKE_STORAGE)
            argv = [str(python), str(storage_py), address, metadata]
            argv += [str(setting.storage_segment), str(setting.storage_buffer)]
            ready = "storage ready"
        storage = Proc("mooncake_storage", argv, tmp, env=setting.env)
        storage.wait_for(ready)
        yield address, metadata, master.p.pid
    finally:
        if storage is not None:
            storage.stop()
        master.stop()


MOONCAKE_STORAGE = """
import signal, sys, threading
from mooncake.store import MooncakeDistributedStore
address, metadata = sys.argv[1], sys.argv[2]
segment, local_buffer = int(sys.argv[3]), int(sys.argv[4])
store = MooncakeDistributedStore()
rc = store.setup("127.0.0.1", metadata, segment, local_buffer, "tcp", "", address)
if rc != 0:
    sys.exit(f"setup failed: {rc}")
stop = threading.Event()
signal.signal(signal.SIGTERM, lambda *_: stop.set())
print("storage ready", flush=True)
stop.wait()
store.close()
"""


@contextlib.contextmanager
def redis_server(tmp: Path) -> Iterator[tuple[str, int]]:
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
        yield f"127.0.0.1:{port}", proc.p.pid
    finally:
        proc.stop()


@contextlib.contextmanager
def plain_tcp_server(tmp: Path) -> Iterator[str]:
    """bench/plain_tcp_server.py (the limit); yields its address."""
    port = free_port()
    proc = Proc("plain-tcp", [sys.executable, str(PLAIN_TCP_SERVER), str(port)], tmp)
    try:
        proc.wait_for("plain-tcp ready")
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


def run_worker(
    python: Path | str,
    system: str,
    address: str,
    metadata: str,
    tag: str,
    *extra: str,
    env: dict[str, str] | None = None,
) -> dict:
    argv = [str(python), str(WORKER), system, "--address", address, "--tag", tag, *extra]
    if metadata:
        argv += ["--metadata", metadata]
    out = subprocess.run(
        argv,
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, **env} if env else None,
    )
    if out.returncode != 0:
        raise RuntimeError(f"{system} worker failed:\n{out.stderr[-3000:]}")
    rows = {}
    for line in out.stdout.splitlines():
        if line.startswith("{"):
            r = json.loads(line)
            rows[(r["workload"], r["size"])] = r
    return rows


def rss_bytes(pid: int) -> int:
    """Resident memory of a process (``VmRSS``)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def master_bytes_per_object(
    python: Path | str,
    system: str,
    address: str,
    metadata: str,
    pid: int,
    n: int,
    extra: tuple[str, ...] = (),
    env: dict[str, str] | None = None,
) -> dict:
    """The master's RSS before and after putting ``n`` 16 B objects, per object."""
    before = rss_bytes(pid)
    out = subprocess.run(
        [str(python), str(WORKER), system, "--address", address, "--fill", str(n), *extra]
        + (["--metadata", metadata] if metadata else []),
        capture_output=True,
        text=True,
        timeout=1800,
        env={**os.environ, **env} if env else None,
    )
    if out.returncode != 0:
        raise RuntimeError(f"{system} fill failed:\n{out.stderr[-3000:]}")
    after = rss_bytes(pid)
    report = json.loads(out.stdout.strip().splitlines()[-1])
    present = report["present"]
    log(
        f"{system}: {n} objects put in {report['seconds']:.1f}s, {present} present after; "
        f"master RSS {before >> 20} -> {after >> 20} MiB"
    )
    return {
        "objects": n,
        "present": present,
        "seconds": report["seconds"],
        "rss_before": before,
        "rss_after": after,
        "per_object": (after - before) / n,
    }


# ---------------------------------------------------------------- table
SYSTEMS = [
    "kvstore",
    "kvstore-strict",
    "kvstore-shm",
    "kvstore-mcapi",
    "mooncake",
    "redis",
    "plain-tcp",
]
KVSTORES = [s for s in SYSTEMS if s.startswith("kvstore")]
#: The limit: plain TCP request/response, no store (bench/plain_tcp_server.py).
LIMIT = "plain-tcp"
#: "Mooncake API on kvstore" (kvstore.client.compat.mooncake) is compared with real Mooncake
#: and the limit only.
PEERS_OF = {"kvstore-mcapi": ("mooncake", LIMIT)}
DEFAULT_PEERS = ("mooncake", "redis", LIMIT)
#: Systems whose master memory is measured (one kvstore master serves every kvstore client).
MEMORY_SYSTEMS = {"kvstore": "kvstore", "mooncake": "mooncake", "redis": "redis"}
METADATA = ("batch_put", "batch_get")
#: The worker's KV-cache level rows (a prompt's blocks; kvstore's ``KVCache`` beside raw batches).
KV_PREFIX = "kv: "
KV_PROMPT = "512-token"


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
                cur["keys_s"] = max(cur["keys_s"], r["keys_s"])
    return out


def _ratios(present: Iterable[str]) -> list[tuple[str, str]]:
    """(kvstore variant, peer) pairs to compare among the systems ``present``."""
    have = set(present)
    return [
        (a, b) for a in KVSTORES for b in PEERS_OF.get(a, DEFAULT_PEERS) if a in have and b in have
    ]


def _short(name: str) -> str:
    return name.replace("kvstore", "kv")


def _cells(
    rows: dict[str, dict | None],
    present: list[str],
    ratios: list[tuple[str, str]],
    key: str,
    fmt: str,
) -> list[str]:
    """One table row's cells: ``rows[s][key]`` per system present (``-`` where missing), then
    one ``a/b`` ratio per pair (``-`` where either is missing or ``b``'s is 0)."""
    cells = [format(rows[s][key], fmt) if rows.get(s) else "-" for s in present]
    for a, b in ratios:
        ra, rb = rows.get(a), rows.get(b)
        cells.append(f"{ra[key] / rb[key]:.2f}x" if ra and rb and rb[key] else "-")
    return cells


def _with_rows(results: dict[str, dict], keys: Iterable[tuple[str, str]]) -> list[str]:
    """The systems (in ``SYSTEMS`` order) with a row for at least one of ``keys``: a system
    with none (plain-tcp in the hot-key table) gets no column of dashes."""
    want = set(keys)
    return [s for s in SYSTEMS if s in results and want & set(results[s])]


def table(results: dict[str, dict], hot: bool) -> str:
    """GB/s per system of the distinct-key rows (``hot=False``) or the hot-key rows."""
    everything = dict.fromkeys(k for s in SYSTEMS if s in results for k in results[s])
    keys = [
        k
        for k in everything
        if k[0] not in METADATA and not k[0].startswith(KV_PREFIX) and ("[hot" in k[0]) == hot
    ]
    present = _with_rows(results, keys)
    ratios = _ratios(present)
    head = ["workload", "size", *[f"{s} GB/s" for s in present]]
    head += [f"{_short(a)}/{b}" for a, b in ratios]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for k in keys:
        rows = {s: results[s].get(k) for s in present}
        cells = [k[0], k[1], *_cells(rows, present, ratios, "gbps", ".3f")]
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    suffix = " [hot key]" if hot else ""
    # (A put's round trips are counted against the limit's put: request and bytes, an ack.)
    for op in ("get", "get_into") if hot else ("put_from", "get", "get_into"):
        lat = [f"single 4KiB {op}{suffix} p50 (µs):"]
        for s in present:
            r = results[s].get((op + suffix, "4KiB"))
            lat.append(f"{s}={r['p50_us']:.0f}" if r else f"{s}=-")
        limit = results.get(LIMIT, {}).get((op + suffix, "4KiB"))
        if limit:
            # The limit's p50 is one request/response on loopback: a store's p50 over it is
            # how many such round trips' worth of time one call costs.
            trips = []
            for s in (s for s in present if s in KVSTORES):
                r = results[s].get((op + suffix, "4KiB"))
                if r:
                    trips.append(f"{s}={r['p50_us'] / limit['p50_us']:.1f}")
            if trips:
                lat.append(f"| round trips (p50 / {LIMIT} p50): " + " ".join(trips))
        lines.append(" ".join(lat))
    return "\n".join(lines)


def kv_table(results: dict[str, dict]) -> str:
    """The KV-cache level rows: GB/s of a prompt's blocks per system, then each kvstore
    client's ``KVCache.store`` / ``load`` against its own raw batch of the same bytes and
    against Mooncake's ``batch_put_from`` / ``batch_get_into``."""
    present = _with_rows(
        results, (k for r in results.values() for k in r if k[0].startswith(KV_PREFIX))
    )
    shapes = list(
        dict.fromkeys(k[1] for r in results.values() for k in r if k[0].startswith(KV_PREFIX))
    )
    head = ["workload", "model", *[f"{s} GB/s" for s in present]]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    pairs = (("batch_put_from", "KVCache.store"), ("batch_get_into", "KVCache.load"))
    for shape in shapes:
        for op in (name for pair in pairs for name in pair):
            rows = {s: results[s].get((KV_PREFIX + op, shape)) for s in present}
            if any(rows.values()):
                cells = [op, shape, *_cells(rows, present, [], "gbps", ".3f")]
                lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    mooncake = results.get("mooncake", {})
    for shape in shapes:
        for s in (s for s in present if s.startswith("kvstore")):
            for raw, kv in pairs:
                ours = results[s].get((KV_PREFIX + kv, shape))
                if ours is None:
                    continue
                own = results[s].get((KV_PREFIX + raw, shape))
                peer = mooncake.get((KV_PREFIX + raw, shape))
                text = f"{shape} {s}: {kv} = "
                text += f"{ours['gbps'] / own['gbps']:.0%} of its {raw}" if own else "-"
                if peer:
                    text += f", {ours['gbps'] / peer['gbps']:.2f}x mooncake's {raw}"
                lines.append(text)
    return "\n".join(lines)


def metadata_table(results: dict[str, dict], memory: dict[str, dict]) -> str:
    """keys/s of the 1,000 x 16 B batch rows, and master bytes per object."""
    # Every kvstore client shares one master: its memory figure stands for all of them.
    present = _with_rows(results, ((op, "1000x16B") for op in METADATA))
    present = present or [s for s in SYSTEMS if s in memory]
    ratios = _ratios(present)
    head = ["metric", *present, *[f"{_short(a)}/{b}" for a, b in ratios]]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for op in METADATA:
        rows = {s: results.get(s, {}).get((op, "1000x16B")) for s in present}
        cells = [f"{op} 1000x16B (keys/s)", *_cells(rows, present, ratios, "keys_s", ",.0f")]
        lines.append("| " + " | ".join(cells) + " |")
    if memory:
        n = next(iter(memory.values()))["objects"]
        per = {s: memory.get("kvstore" if s.startswith("kvstore") else s) for s in present}
        cells = [f"master bytes/object at {n:,} objects"]
        cells += _cells(per, present, ratios, "per_object", ".0f")
        lines.append("| " + " | ".join(cells) + " |")
        for s, m in memory.items():
            if m["present"] is not None and m["present"] != m["objects"]:
                lines.append(
                    f"\nNOTE: {s} held {m['present']:,} of the {m['objects']:,} objects after the "
                    "fill (objects were lost meanwhile, e.g. a node declared dead): its figure "
                    "is suspect."
                )
    return "\n".join(lines)


def mooncake_sweep(tmp: Path, python: Path, repeat: int, n: int) -> dict[str, dict]:
    """Every setting of ``MOONCAKE_SETTINGS`` on the worker's short 1 MiB workload (``--sweep
    n``), each in a fresh cluster; best of ``repeat`` runs per setting. Runs interleave the
    settings (all settings, then all again) so that a change of load touches them alike."""
    runs: dict[str, list[dict]] = {m.name: [] for m in MOONCAKE_SETTINGS}
    for rep in range(repeat):
        for m in MOONCAKE_SETTINGS:
            log(f"sweep run {rep + 1}/{repeat}: {m.name}")
            try:
                with mooncake_cluster(tmp, python, m) as (address, metadata, _):
                    extra = ["--sweep", str(n), *m.worker_args()]
                    tag = f"s{rep}"
                    rows = run_worker(python, "mooncake", address, metadata, tag, *extra, env=m.env)
                runs[m.name].append(rows)
            except RuntimeError as err:
                log(f"mooncake setting {m.name!r} failed: {err}")
    return {name: best(r) for name, r in runs.items() if r}


SWEEP_COLUMNS = (("get_into", "1MiB"), ("batch_get_into x16", "1MiB"))


def sweep_table(results: dict[str, dict], repeat: int, n: int) -> str:
    """Read GB/s per Mooncake setting; the best remote setting of each column in bold, and the
    best remote setting by ``get_into`` named below."""
    head = ["setting", "parameters", *[f"{w} {size} GB/s" for w, size in SWEEP_COLUMNS]]
    lines = [
        f"{n} distinct 1 MiB keys per run, each read once; best of {repeat} run(s) per setting",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
    ]
    remote = [m for m in MOONCAKE_SETTINGS if m.name in results and not m.label]
    best_of: dict[tuple[str, str], str] = {}
    for col in SWEEP_COLUMNS:
        have = [m.name for m in remote if col in results[m.name]]
        if have:
            best_of[col] = max(have, key=lambda name: results[name][col]["gbps"])
    for m in (m for m in MOONCAKE_SETTINGS if m.name in results):
        name = f"{m.name} [{m.label}]" if m.label else m.name
        cells = [name, m.describe()]
        for col in SWEEP_COLUMNS:
            r = results[m.name].get(col)
            text = f"{r['gbps']:.3f}" if r else "-"
            cells.append(f"**{text}**" if best_of.get(col) == m.name else text)
        lines.append("| " + " | ".join(cells) + " |")
    top = best_of.get(SWEEP_COLUMNS[0])
    if top:
        lines += ["", f"Best remote setting by get_into 1 MiB: '{top}' (bold: best remote cell)."]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeat", type=int, default=1, help="best of N runs per cell")
    ap.add_argument(
        "--only", default=",".join(SYSTEMS), help="comma-separated systems ('none': no system)"
    )
    ap.add_argument(
        "--mooncake-setting",
        default=DEFAULT_MOONCAKE,
        choices=list(MOONCAKE_BY_NAME),
        help="the Mooncake setting of the main tables",
    )
    ap.add_argument(
        "--mooncake-sweep",
        action="store_true",
        help="also run every Mooncake setting on a short 1 MiB workload and print its table",
    )
    ap.add_argument(
        "--objects",
        type=int,
        default=1_000_000,
        help="16 B objects put to measure master memory per object (0: skip)",
    )
    ap.add_argument("--markdown", action="store_true", help="write into docs/benchmarks.md")
    args = ap.parse_args()
    only = [s for s in args.only.split(",") if s and s != "none"]
    unknown = set(only) - set(SYSTEMS)
    if unknown:
        ap.error(f"unknown systems {sorted(unknown)}; known: {','.join(SYSTEMS)}")
    setting = MOONCAKE_BY_NAME[args.mooncake_setting]
    peers = {"mooncake", "redis"} & set(only) or ({"mooncake"} if args.mooncake_sweep else set())
    if peers:  # kvstore alone needs neither Redis nor Mooncake's libibverbs
        ensure_debian_packages()
    peers_python = ensure_peers_venv() if peers else None
    runs: dict[str, list[dict]] = {s: [] for s in only}
    memory: dict[str, dict] = {}
    sweep: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="kvstore-peers-") as tmp_s:
        tmp = Path(tmp_s)
        for rep in range(args.repeat):
            log(f"run {rep + 1}/{args.repeat}, load {os.getloadavg()[0]:.2f}")
            if set(KVSTORES) & set(only):
                with kvstore_cluster(tmp) as (address, _):
                    for s in KVSTORES:
                        if s in only:
                            runs[s].append(run_worker(sys.executable, s, address, "", f"r{rep}"))
            if "mooncake" in only:
                assert peers_python is not None
                try:
                    with mooncake_cluster(tmp, peers_python, setting) as (address, metadata, _):
                        runs["mooncake"].append(
                            run_worker(
                                peers_python,
                                "mooncake",
                                address,
                                metadata,
                                f"r{rep}",
                                *setting.worker_args(),
                                env=setting.env,
                            )
                        )
                except RuntimeError as err:
                    log(f"mooncake failed: {err}")
            if "redis" in only:
                assert peers_python is not None
                with redis_server(tmp) as (address, _):
                    runs["redis"].append(run_worker(peers_python, "redis", address, "", f"r{rep}"))
            if LIMIT in only:
                with plain_tcp_server(tmp) as address:
                    runs[LIMIT].append(run_worker(sys.executable, LIMIT, address, "", f"r{rep}"))
        if args.objects > 0:  # each in a fresh cluster: the figure is the objects', nothing else's
            n = args.objects
            if set(KVSTORES) & set(only):
                with kvstore_cluster(tmp) as (address, pid):
                    memory["kvstore"] = master_bytes_per_object(
                        sys.executable, "kvstore", address, "", pid, n
                    )
            if "mooncake" in only:
                assert peers_python is not None
                try:
                    with mooncake_cluster(tmp, peers_python, setting) as (address, metadata, pid):
                        memory["mooncake"] = master_bytes_per_object(
                            peers_python,
                            "mooncake",
                            address,
                            metadata,
                            pid,
                            n,
                            tuple(setting.worker_args()),
                            setting.env,
                        )
                except RuntimeError as err:
                    log(f"mooncake fill failed: {err}")
            if "redis" in only:
                assert peers_python is not None
                with redis_server(tmp) as (address, pid):
                    memory["redis"] = master_bytes_per_object(
                        peers_python, "redis", address, "", pid, n
                    )
        if args.mooncake_sweep:
            assert peers_python is not None
            sweep = mooncake_sweep(tmp, peers_python, args.repeat, SWEEP_OBJECTS)
    results = {s: best(r) for s, r in runs.items() if r}
    parts = [
        f"GB/s = bytes per op / median op time; best of {args.repeat} run(s); "
        f"load average {os.getloadavg()[0]:.2f}; "
        f"{os.cpu_count()} cores; loopback; storage in separate processes"
    ]
    if "mooncake" in results or "mooncake" in memory:
        parts.append(f"Mooncake: setting '{setting.name}' ({setting.describe()})")
    if LIMIT in results:
        parts.append(
            f"{LIMIT}: the limit, not a store: one TCP request/response per object "
            "(bench/plain_tcp_server.py, TCP_NODELAY, batches pipelined), buffer rows only; "
            "kv/plain-tcp is the share of it a kvstore variant keeps"
        )
    if results:
        parts += [
            "**Headline: distinct keys, each read once, node warm**",
            table(results, hot=False),
            "**Hot key: one key (one batch) reread every time (flatters caches and leases)**",
            table(results, hot=True),
            f"**KV-cache level: a {KV_PROMPT} prompt's blocks (64 tokens, 2 bytes an element), "
            "each prompt new, each read once**",
            kv_table(results),
        ]
    if results or memory:
        parts += [
            "**Metadata: 1,000 x 16 B batches; master memory per object**",
            metadata_table(results, memory),
        ]
    if sweep:
        parts += [
            "**Mooncake settings sweep: 1 MiB reads, distinct keys, each read once**",
            sweep_table(sweep, args.repeat, SWEEP_OBJECTS),
        ]
    text = "\n\n".join(parts)
    print(text)
    if args.markdown:
        markdown.write_table("peers", text)


if __name__ == "__main__":
    main()
