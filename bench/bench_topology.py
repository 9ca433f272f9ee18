"""Reads from the local host, the same rack and the other rack, on the multi-host test bed.

Run:  .venv/bin/python bench/bench_topology.py [--part distance|replay|all] [--markdown]   (root)

The bed (``kvstore.cli.testbed``): 5 hosts in 2 racks (h0 h1 h2 | h3 h4), host NICs at
``--intra-rack-rate``, each rack's uplink at ``--inter-rack-rate``. The reader runs on h1. Three
one-node clusters, their masters on h0, put their one node on h1 (the reader's own host: shared
memory, the node runs ``--shm``), h2 (same rack) and h3 (other rack), so every object of a
cluster sits at the distance under test, whatever the placement policy. Per distance: ``get_into``
of distinct 1 MiB and 64 KiB keys (each read once: a master call and a node read each), and
``KVCache.load`` of distinct 512-token prompts (8 MiB each); beside each row, a plain TCP
request/response of the same size over the same path (a server on the node's host), measured in
the same run: the path's own limit. ``--markdown`` also writes the table into docs/benchmarks.md.

The replay part (``bench/topology_replay.py``, on the same bed): four hosts, each a node with a
co-located writer and reader, replay a slice of the Mooncake conversation trace; the share of
reads whose first replica the master names on the reader's host, in its rack or across, and the
read rate, with topology-aware placement on and off, under round-robin and prefix-affine routing.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[1]))  # for bench.markdown

from bench import markdown, topology_replay  # noqa: E402
from kvstore.cli.testbed import MASTER_PORT, NODE_PORT, Testbed, parse_rate  # noqa: E402

WORKER = str(Path(__file__).resolve().parent / "topology_worker.py")
TCP_PORT = 9000
READS = [("1MiB", 1 << 20, 64), ("64KiB", 64 << 10, 256)]
PROMPT_TOKENS, PROMPTS = 512, 8


def run(bed: Testbed) -> list[list[object]]:
    h0, reader = bed.hosts[0], bed.hosts[1]
    targets = [("local host (shm)", bed.hosts[1]), ("same rack", bed.hosts[2]),
               ("other rack", bed.hosts[3])]  # fmt: skip
    rows: list[list[object]] = []
    for i, (distance, host) in enumerate(targets):
        server = bed.start(host, [sys.executable, WORKER, "serve", str(TCP_PORT + i)])
        server.wait_for("serving")
        master = bed.start_master(h0, port=MASTER_PORT + 10 * i).ready["control"]
        bed.start_node(host, master, "--shm", dram="512MiB", port=NODE_PORT + 10 * i)
        ask = {
            "master": master,
            "tcp": f"{host.address}:{TCP_PORT + i}",
            "tag": distance,
            "reads": READS,
            "prompt_tokens": PROMPT_TOKENS,
            "prompts": PROMPTS,
            "seed": i * 1_000_000,
        }
        out = json.loads(bed.run(reader, [sys.executable, WORKER, "measure", json.dumps(ask)]))
        link = _link(bed, reader, host)
        for label, _, count in READS:
            r = out[label]
            rows.append([distance, f"get_into {label} x{count}", f"{r['mbps']:.0f}",
                         f"{r['us_per_op']:.0f}", f"{r['tcp_mbps']:.0f}", link])  # fmt: skip
        r = out["load"]
        rows.append([distance, f"KVCache.load {r['bytes'] >> 20} MiB x{PROMPTS}",
                     f"{r['mbps']:.0f}", f"{r['us_per_op']:.0f}", f"{r['tcp_mbps']:.0f}",
                     link])  # fmt: skip
        print(*rows[-3:], sep="\n", flush=True)
    return rows


def _link(bed: Testbed, a: object, b: object) -> str:
    """The shaped limit on the path from ``a`` to ``b``, in MB/s."""
    if a is b:
        return "none (one host)"
    rate = parse_rate(bed.intra_rack_rate)
    name = f"{bed.intra_rack_rate} NICs"
    if a.rack != b.rack:  # type: ignore[attr-defined]
        rate = min(rate, parse_rate(bed.inter_rack_rate))
        name = f"{bed.inter_rack_rate} uplink"
    return f"{rate / 8e6:.0f} ({name})"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--inter-rack-rate", default="1gbit")
    p.add_argument("--intra-rack-rate", default="10gbit")
    p.add_argument("--part", choices=("distance", "replay", "all"), default="all",
                   help="reads by distance, the replayed trace's local share, or both")  # fmt: skip
    p.add_argument("--replay-requests", type=int, default=400, help="trace requests replayed")
    p.add_argument("--block-kib", type=int, default=32, help="bytes of one trace block, in KiB")
    p.add_argument("--markdown", action="store_true", help="write the table into the docs")
    args = p.parse_args()
    rows, replay_rows = [], []
    with Testbed(5, 2, inter_rack_rate=args.inter_rack_rate,
                 intra_rack_rate=args.intra_rack_rate) as bed:  # fmt: skip
        print(bed.describe(), flush=True)
        if args.part in ("distance", "all"):
            rows = run(bed)
        if args.part in ("replay", "all"):
            replay_rows = topology_replay.run(bed, args.replay_requests, args.block_kib << 10)
        netem = bed.netem
    if replay_rows:
        _replay_table(replay_rows, args, netem)
    if not rows:
        return 0
    head = ["reader to data", "operation", "MB/s", "µs/op", "TCP same size MB/s", "shaped MB/s"]
    body = markdown.table(head, rows)
    body += (
        "\n\nThe reader on h1; each row's objects on one node at that distance (one-node "
        "clusters). TCP: a plain request/response of the row's size over the same path, in the "
        "same run. "
        + (
            "Between racks: 0.5 ms one way (netem)."
            if netem
            else "No delay between racks: this kernel has no netem, links are rate-shaped only."
        )
    )
    print(body)
    if args.markdown:
        markdown.write_table("topology", body)
    return 0


def _replay_table(rows: list[list[object]], args: argparse.Namespace, netem: bool) -> None:
    body = markdown.table(topology_replay.HEAD, rows)
    body += (
        f"\n\nThe first {args.replay_requests} requests of the Mooncake conversation trace, "
        f"{args.block_kib} KiB a block, replicas=1; nodes on h1 h2 (rack 0) and h3 h4 (rack 1), "
        "each host's client both writer and reader (engines co-located with their node). "
        "Written by the reader's host: the reads whose block that host wrote (what local-first "
        "placement can serve at best). First replica: where the master's answer to that reader "
        "puts the object. Reads/s and MB/s: all four hosts reading at once, each request's "
        "reused blocks in one batch_get. Between racks: "
        + (
            f"{args.inter_rack_rate}, 0.5 ms one way (netem)."
            if netem
            else f"{args.inter_rack_rate}, no delay (no netem in this kernel)."
        )
    )
    print(body, flush=True)
    if args.markdown:
        markdown.write_table("topology-replay", body)


if __name__ == "__main__":
    sys.exit(main())
