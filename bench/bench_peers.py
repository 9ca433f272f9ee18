"""kvstore side by side with Mooncake Store and Redis, on this machine, in one command.

Run:  .venv/bin/python bench/bench_peers.py [--repeat 3] [--only kvstore,redis] [--objects N]
      [--markdown]

What it does, in one run:
1. installs what it needs outside the repo: a throwaway venv under /tmp with the PyPI wheels
   ``mooncake-transfer-engine-non-cuda``, ``redis`` and ``hiredis``; Debian's ``redis-server``
   and ``libibverbs1`` (Mooncake's binaries link it even for TCP) when missing;
2. starts each system on free loopback ports with its storage in a separate process from the
   client: kvstore (``kvstore up --shm``: master and node processes), Mooncake (``mooncake_master``
   with its HTTP metadata server, plus one storage process that mounts a segment), Redis
   (``redis-server``, no persistence);
3. runs the same workloads against each (bench/peers_worker.py: sizes 4 KiB, 64 KiB, 1 MiB,
   16 MiB; put/get of bytes, put_from/get_into of buffers, batches of 16), verifying the bytes.
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
   setting for content-addressed KV blocks: a key located within the master's read lease is
   reread from its node directly), over TCP with every read asking the master
   (``kvstore-strict``, as Mooncake does), through shared memory (with lease reads), and
   through Mooncake's own Python API served by kvstore (``kvstore-mcapi``, "Mooncake API on
   kvstore": ``kvstore.client.compat.mooncake`` driven by the very same worker class, calls and
   keys as real Mooncake; its client's default transport, shared memory here; the ratio column
   ``kv-mcapi/mooncake`` compares the two in the same run);
4. stops everything it started by PID and prints its tables: each system's GB/s (bytes per
   operation over the median operation time, so that other jobs on a shared machine skew it
   less; the mean-based figure is in each worker's JSON), and kvstore's ratio to each peer;
   keys/s and master bytes per object for the metadata rows.
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
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np  # noqa: F401 - the worker needs it in this venv too

sys.path.append(str(Path(__file__).resolve().parents[1]))  # for bench.markdown
from bench import markdown  # noqa: E402

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
def kvstore_cluster(tmp: Path) -> Iterator[tuple[str, int]]:
    """``kvstore up --shm``, warmed up (its arena pre-faulted); yields the control address and
    the master's PID (``kvstore up`` serves the master in-process, the node is its child)."""
    from kvstore.cli.embedded import EmbeddedCluster

    with EmbeddedCluster(str(tmp / "kvstore-data"), str(SEGMENT), ["--shm"]) as cluster:
        cluster.wait_warm(READY_TIMEOUT_S)
        yield cluster.address, cluster.pid


@contextlib.contextmanager
def mooncake_cluster(tmp: Path, python: Path) -> Iterator[tuple[str, str, int]]:
    """``mooncake_master`` and a storage process; yields the master's address, the metadata
    server's URL and the master's PID."""
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
        yield address, metadata, master.p.pid
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


def _wait_port(port: int, timeout: float = READY_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 1):
            return
        time.sleep(0.05)  # polling a port for readiness, bounded by the deadline
    raise RuntimeError(f"nothing listens on port {port}")


def run_worker(
    python: Path | str, system: str, address: str, metadata: str, tag: str, *extra: str
) -> dict:
    argv = [str(python), str(WORKER), system, "--address", address, "--tag", tag, *extra]
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


def rss_bytes(pid: int) -> int:
    """Resident memory of a process (``VmRSS``)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def master_bytes_per_object(
    python: Path | str, system: str, address: str, metadata: str, pid: int, n: int
) -> dict:
    """The master's RSS before and after putting ``n`` 16 B objects, per object."""
    before = rss_bytes(pid)
    out = subprocess.run(
        [str(python), str(WORKER), system, "--address", address, "--fill", str(n)]
        + (["--metadata", metadata] if metadata else []),
        capture_output=True,
        text=True,
        timeout=1800,
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
SYSTEMS = ["kvstore", "kvstore-strict", "kvstore-shm", "kvstore-mcapi", "mooncake", "redis"]
KVSTORES = [s for s in SYSTEMS if s.startswith("kvstore")]
#: "Mooncake API on kvstore" (kvstore.client.compat.mooncake) is compared with real Mooncake only.
PEERS_OF = {"kvstore-mcapi": ("mooncake",)}
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
        (a, b)
        for a in KVSTORES
        for b in PEERS_OF.get(a, ("mooncake", "redis"))
        if a in have and b in have
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


def table(results: dict[str, dict], hot: bool) -> str:
    """GB/s per system of the distinct-key rows (``hot=False``) or the hot-key rows."""
    present = [s for s in SYSTEMS if s in results]
    keys = [
        k
        for k in next(iter(results.values()))
        if k[0] not in METADATA and not k[0].startswith(KV_PREFIX) and ("[hot" in k[0]) == hot
    ]
    ratios = _ratios(results)
    head = ["workload", "size", *[f"{s} GB/s" for s in present]]
    head += [f"{_short(a)}/{b}" for a, b in ratios]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for k in keys:
        rows = {s: results[s].get(k) for s in results}
        cells = [k[0], k[1], *_cells(rows, present, ratios, "gbps", ".3f")]
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    suffix = " [hot key]" if hot else ""
    for op in ("get", "get_into"):
        lat = [f"single 4KiB {op}{suffix} p50 (µs):"]
        for s in present:
            r = results[s].get((op + suffix, "4KiB"))
            lat.append(f"{s}={r['p50_us']:.0f}" if r else f"{s}=-")
        lines.append(" ".join(lat))
    return "\n".join(lines)


def kv_table(results: dict[str, dict]) -> str:
    """The KV-cache level rows: GB/s of a prompt's blocks per system, then each kvstore
    client's ``KVCache.store`` / ``load`` against its own raw batch of the same bytes and
    against Mooncake's ``batch_put_from`` / ``batch_get_into``."""
    present = [s for s in SYSTEMS if s in results]
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
    present = [s for s in SYSTEMS if s in results] or [s for s in SYSTEMS if s in memory]
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeat", type=int, default=1, help="best of N runs per cell")
    ap.add_argument("--only", default=",".join(SYSTEMS), help="comma-separated systems")
    ap.add_argument(
        "--objects",
        type=int,
        default=1_000_000,
        help="16 B objects put to measure master memory per object (0: skip)",
    )
    ap.add_argument("--markdown", action="store_true", help="write into docs/benchmarks.md")
    args = ap.parse_args()
    only = [s for s in args.only.split(",") if s]
    peers = {"mooncake", "redis"} & set(only)
    if peers:  # kvstore alone needs neither Redis nor Mooncake's libibverbs
        ensure_debian_packages()
    peers_python = ensure_peers_venv() if peers else None
    runs: dict[str, list[dict]] = {s: [] for s in only}
    memory: dict[str, dict] = {}
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
                    with mooncake_cluster(tmp, peers_python) as (address, metadata, _):
                        runs["mooncake"].append(
                            run_worker(peers_python, "mooncake", address, metadata, f"r{rep}")
                        )
                except RuntimeError as err:
                    log(f"mooncake failed: {err}")
            if "redis" in only:
                assert peers_python is not None
                with redis_server(tmp) as (address, _):
                    runs["redis"].append(run_worker(peers_python, "redis", address, "", f"r{rep}"))
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
                    with mooncake_cluster(tmp, peers_python) as (address, metadata, pid):
                        memory["mooncake"] = master_bytes_per_object(
                            peers_python, "mooncake", address, metadata, pid, n
                        )
                except RuntimeError as err:
                    log(f"mooncake fill failed: {err}")
            if "redis" in only:
                assert peers_python is not None
                with redis_server(tmp) as (address, pid):
                    memory["redis"] = master_bytes_per_object(
                        peers_python, "redis", address, "", pid, n
                    )
    results = {s: best(r) for s, r in runs.items() if r}
    parts = [
        f"GB/s = bytes per op / median op time; best of {args.repeat} run(s); "
        f"load average {os.getloadavg()[0]:.2f}; "
        f"{os.cpu_count()} cores; loopback; storage in separate processes"
    ]
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
    text = "\n\n".join(parts)
    print(text)
    if args.markdown:
        markdown.write_table("peers", text)


if __name__ == "__main__":
    main()
