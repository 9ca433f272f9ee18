"""Failover under load: etcd + 3 masters + 3 nodes + a client process; kill -9 the leader N times.

Prints, per kill, the time until a new leader serves and until the client's next acknowledged
put, and at the end re-reads every acknowledged object.

    .venv/bin/python bench/bench_failover.py [--rounds 3] [--lease-ttl 2]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.etcd_harness import (  # noqa: E402
    EtcdProcess,
    HACluster,
    LoadProcess,
    check_all_readable,
    outage_after,
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--lease-ttl", type=int, default=2)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="kvstore-failover-"))
    etcd = EtcdProcess(tmp / "etcd")
    cluster = HACluster(
        tmp,
        etcd,
        ("--lease-ttl", str(args.lease_ttl), "--heartbeat-interval", "0.5", "--node-ttl", "4"),
    )
    rows = []
    load = None
    try:
        for _ in range(3):
            cluster.add_master()
        cluster.leader()
        for _ in range(3):
            cluster.add_node()
        load = LoadProcess(cluster.url, tmp / "load")
        load.wait_acks(200)
        for r in range(args.rounds):
            old = cluster.leader()
            before = len(load.acks())
            t_kill = time.time()
            old.kill()
            cluster.leader(timeout=30)
            t_serving = time.time()
            load.wait_acks(200, after=t_kill)
            rows.append((r + 1, t_serving - t_kill, outage_after(load.acks(), t_kill), before))
            cluster.add_master()  # keep three
        summary = load.finish()
        acks = load.acks()
        bad = check_all_readable(cluster.url, acks)
    finally:
        if load is not None:
            load.kill()
        cluster.stop()
        etcd.stop()
    print(f"\nkill -9 of the leader under load (lease TTL {args.lease_ttl}s, 3 masters, 3 nodes)")
    print(
        "| kill | new leader serving (s) | client outage: longest gap between acks (s) | acked before kill |"
    )
    print("| ---: | ---: | ---: | ---: |")
    for r, serving, ack, before in rows:
        print(f"| {r} | {serving:.2f} | {ack:.2f} | {before} |")
    print(
        f"\nacknowledged puts: {len(acks)}; re-read with exact bytes: {len(acks) - bad}; "
        f"wrong or missing: {bad}; client reads ok/wrong/missing/failed: {summary['gets_ok']}/"
        f"{summary['gets_wrong']}/{summary['gets_missing']}/{summary['gets_failed']}; "
        f"failed puts (retried by the load): {summary['puts_failed']}"
    )


if __name__ == "__main__":
    main()
