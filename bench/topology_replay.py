"""``bench/bench_topology.py``'s replay part: the share of reads served from the reader's own host
under a replayed trace, with topology-aware placement on and off.

The bed: 5 hosts in 2 racks (h0 h1 h2 | h3 h4); a master on h0, a storage node (``--shm``) on
each of h1-h4, and on each of those four hosts one client that is both writer and reader: the
prefill and decode engines co-located with their node. A slice of the Mooncake conversation
trace is replayed in the trace's prefix structure: each request goes to a host (by the routing,
below); each of its blocks (``hash_ids``, one object of ``block_bytes`` per id) is written by
the host of the first request that holds it, and read by every later request's host. Each host
first writes all its blocks (every host at once), then, once all have written, reads its
requests' reused blocks (every host at once): for each read, which node the master names first
for this reader (``batch_locate``), then the reads themselves, timed (``batch_get`` per request).

Routing: ``round-robin`` sends request ``i`` to host ``i mod 4`` (the reader is the writer of a
reused block about one time in four); ``prefix-affine`` sends a request to the host that wrote
the longest prefix of it (two blocks or more: not only the common system prompt), else to the
host with the fewest requests: what a prefix-aware router does, so most reused blocks were
written by their reader's host.

Placement ``on``: the nodes carry ``--host-id/--rack`` and every process its host and rack in
``$KVSTORE_HOST_ID/$KVSTORE_RACK`` (the test bed's default). ``off``: no flags and both
variables empty, so every node and client declares the same site (the machine's hostname) and the
master places and orders as it did before topology existed. Each placement runs on a fresh
cluster, both routings one after the other on it (their keys apart).

``python bench/topology_replay.py worker ASK.json``: the client on one host (stdout: a
``stored TAG`` line per routing once its writes are done, then it waits for the file ``go-TAG``
beside ``ASK.json``, then a ``result JSON`` line).
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvstore.client import Client
from kvstore.errors import KVStoreError
from kvstore.sim.trace import load_trace

#: Where the trace is (the repository's sibling ``shared/``).
TRACE = (
    Path(__file__).resolve().parents[2] / "shared" / "data" / "traces" / "conversation_trace.jsonl"
)
ROUTINGS = ("round-robin", "prefix-affine")
#: The replay's cluster ports (the distance part's clusters use the ones below them).
REPLAY_MASTER_PORT, REPLAY_NODE_PORT = 7900, 8000
#: Most keys per ``batch_put`` (a request's new blocks may be many).
PUT_BATCH = 64
#: A worker waits at most this long for the other hosts' writes.
BARRIER_TIMEOUT_S = 300.0


def route(hash_ids: Sequence[Sequence[int]], num_hosts: int, routing: str) -> list[int]:
    """The host (0 .. ``num_hosts - 1``) of each request, whose blocks are ``hash_ids[i]``.

    Raises:
        ValueError: an unknown routing.
    """
    if routing == "round-robin":
        return [i % num_hosts for i in range(len(hash_ids))]
    if routing != "prefix-affine":
        raise ValueError(f"unknown routing {routing!r}; known: {', '.join(ROUTINGS)}")
    writer: dict[int, int] = {}
    served = [0] * num_hosts
    hosts = []
    for ids in hash_ids:
        matched = 0
        while matched < len(ids) and ids[matched] in writer:
            matched += 1
        if matched >= 2:
            host = writer[ids[matched - 1]]
        else:
            host = min(range(num_hosts), key=lambda h: (served[h], h))
        served[host] += 1
        hosts.append(host)
        for block in ids:
            writer.setdefault(block, host)
    return hosts


@dataclass(frozen=True, slots=True)
class Plan:
    """What each host writes and reads under one routing.

    Attributes:
        stores: per host, per request it serves, the blocks it writes first.
        loads: per host, per request it serves, the blocks it reads (written before).
        own_reads: reads whose block the reader's own host wrote.
    """

    stores: list[list[list[int]]]
    loads: list[list[list[int]]]
    own_reads: int


def plan(hash_ids: Sequence[Sequence[int]], num_hosts: int, routing: str) -> Plan:
    """The writes and reads of each host when ``hash_ids`` are routed by ``routing``."""
    stores: list[list[list[int]]] = [[] for _ in range(num_hosts)]
    loads: list[list[list[int]]] = [[] for _ in range(num_hosts)]
    writer: dict[int, int] = {}
    own = 0
    for host, ids in zip(route(hash_ids, num_hosts, routing), hash_ids, strict=True):
        new = [b for b in dict.fromkeys(ids) if b not in writer]
        old = [b for b in dict.fromkeys(ids) if b in writer]
        own += sum(writer[b] == host for b in old)
        for b in new:
            writer[b] = host
        stores[host].append(new)
        loads[host].append(old)
    return Plan(stores, loads, own)


# ---------------------------------------------------------------------- on a host
def worker(ask_path: Path) -> None:
    """One host's client: its writes, the barrier, its located and timed reads (module
    docstring)."""
    ask = json.loads(ask_path.read_text())
    value = os.urandom(ask["block_bytes"])
    with Client.connect(ask["master"], timeout=30.0) as c:
        for run in ask["runs"]:
            tag = run["tag"]
            for blocks in run["store"]:
                keys = [f"{tag}/{b}" for b in blocks]
                for i in range(0, len(keys), PUT_BATCH):
                    part = keys[i : i + PUT_BATCH]
                    errs = c.batch_put(part, [value] * len(part))
                    assert all(e is None for e in errs), errs
            print(f"stored {tag}", flush=True)
            go = ask_path.parent / f"go-{tag}"
            deadline = time.monotonic() + BARRIER_TIMEOUT_S
            while not go.exists():  # NOTE: a barrier across processes: the bench makes the file
                if time.monotonic() > deadline:
                    raise TimeoutError(f"no {go} within {BARRIER_TIMEOUT_S}s")
                time.sleep(0.005)
            loads = [[f"{tag}/{b}" for b in blocks] for blocks in run["load"] if blocks]
            first: Counter[str] = Counter()
            for keys in loads:
                infos = c.batch_locate(keys)
                found = [i for i in infos if not isinstance(i, KVStoreError)]
                assert len(found) == len(keys), [i for i in infos if i not in found]
                first.update(f"{i.locations[0].host}:{i.locations[0].port}" for i in found)
                c.release_leases(found)
            num_reads = sum(len(keys) for keys in loads)
            t0 = time.perf_counter()
            for keys in loads:
                got = c.batch_get(keys)
                assert all(isinstance(g, bytes | bytearray | memoryview) for g in got), got
            elapsed = time.perf_counter() - t0
            out = {"tag": tag, "first": dict(first), "reads": num_reads, "elapsed_s": elapsed}
            print("result " + json.dumps(out), flush=True)


# ---------------------------------------------------------------------- the bench side
def run(bed: Any, num_requests: int, block_bytes: int) -> list[list[object]]:
    """Both placements, both routings, on ``bed`` (a ``Testbed`` of 5 hosts in 2 racks); the
    table's rows."""
    trace = load_trace(TRACE, limit=num_requests)
    hash_ids = [r.hash_ids for r in trace]
    hosts = bed.hosts[1:5]
    plans = {routing: plan(hash_ids, len(hosts), routing) for routing in ROUTINGS}
    rows: list[list[object]] = []
    for i, placement in enumerate(("on", "off")):
        rows += _one_placement(bed, hosts, placement, plans, block_bytes, 10 * i)
    return rows


def _one_placement(
    bed: Any,
    hosts: list[Any],
    placement: str,
    plans: dict[str, Plan],
    block_bytes: int,
    port_offset: int,
) -> list[list[object]]:
    env = {} if placement == "on" else {"KVSTORE_HOST_ID": "", "KVSTORE_RACK": ""}
    master_proc = bed.start(
        bed.hosts[0],
        [sys.executable, "-m", "kvstore", "--log-level", "warning", "master",
         "--host", bed.hosts[0].address, "--port", str(REPLAY_MASTER_PORT + port_offset),
         "--admin-port", str(REPLAY_MASTER_PORT + port_offset + 1)],
        env=env,
    )  # fmt: skip
    master_proc.wait_for(r"kvstore master ready")
    master = f"{bed.hosts[0].address}:{REPLAY_MASTER_PORT + port_offset}"
    node_port = REPLAY_NODE_PORT + port_offset
    procs = [master_proc]
    for host in hosts:
        args = ["node", "--master", master, "--host", host.address, "--port", str(node_port),
                "--dram", "512MiB", "--shm",
                "--data-dir", str(bed.work_dir / host.name / f"replay-{placement}")]  # fmt: skip
        if placement == "on":
            args += ["--host-id", host.name, "--rack", host.rack_name]
        proc = bed.start(host, [sys.executable, "-m", "kvstore", "--log-level", "warning", *args],
                         env=env)  # fmt: skip
        proc.wait_for(r"kvstore node ready")
        procs.append(proc)
    where = {f"{h.address}:{node_port}": h for h in hosts}
    ask_dir = bed.work_dir / f"replay-{placement}"
    ask_dir.mkdir()
    workers = []
    for k, host in enumerate(hosts):
        runs = [
            {"tag": f"{placement}-{routing}", "store": p.stores[k], "load": p.loads[k]}
            for routing, p in plans.items()
        ]
        ask = {"master": master, "block_bytes": block_bytes, "runs": runs}
        path = ask_dir / f"{host.name}.json"
        path.write_text(json.dumps(ask))
        workers.append(bed.start(host, [sys.executable, __file__, "worker", str(path)], env=env))
    rows = []
    for routing, p in plans.items():
        tag = f"{placement}-{routing}"
        for w in workers:
            w.wait_for(rf"^stored {tag}$", timeout=BARRIER_TIMEOUT_S)
        (ask_dir / f"go-{tag}").touch()
        results = [
            json.loads(w.wait_for(r"^result ", timeout=BARRIER_TIMEOUT_S).split(" ", 1)[1])
            for w in workers
        ]
        local = rack = other = reads = 0
        for reader, result in zip(hosts, results, strict=True):
            for address, count in result["first"].items():
                holder = where[address]
                if holder is reader:
                    local += count
                elif holder.rack == reader.rack:
                    rack += count
                else:
                    other += count
            reads += result["reads"]
        slowest = max(r["elapsed_s"] for r in results)
        pct = (lambda n: f"{100 * n / reads:.0f}%") if reads else (lambda n: "-")
        rows.append([
            placement, routing, reads, pct(p.own_reads), pct(local), pct(rack), pct(other),
            f"{reads / slowest:.0f}", f"{reads * block_bytes / slowest / 1e6:.1f}",
        ])  # fmt: skip
        print(rows[-1], flush=True)
    for proc in [*workers, *reversed(procs)]:
        proc.stop()
    return rows


HEAD = [
    "placement", "routing", "reads", "written by the reader's host", "first replica: reader's host",
    "its rack", "other rack", "reads/s (4 readers)", "MB/s",
]  # fmt: skip


if __name__ == "__main__":
    if sys.argv[1:2] != ["worker"] or len(sys.argv) != 3:
        sys.exit("usage: topology_replay.py worker ASK.json (bench/bench_topology.py runs it)")
    worker(Path(sys.argv[2]))
