"""Failover under load: etcd + 3 masters + 3 nodes + a client process with a steady put/get load.

Scenarios (``--scenarios``, comma-separated, in this order):

- ``cut``: the leader loses etcd (a real partition: its only way to etcd crosses a veth pair
  between two network namespaces, and the far end goes down) while clients still reach it;
  another master must take over, and the cut one must become a standby once the link heals;
- ``pause-1``, ``pause-3``, ``pause-6``: etcd frozen (SIGSTOP) for that many seconds, then resumed;
- ``restart``: etcd stopped, down for 3 s, started again on the same ports and data;
- ``kill``: ``--rounds`` kill -9 of the leader.

Prints, per fault, the time until exactly one master serves with every node, the client's longest
pause between acknowledged puts, and at the end re-reads every acknowledged object.

    .venv/bin/python bench/bench_failover.py [--rounds 3] [--lease-ttl 2] [--scenarios ...]
    [--markdown]

``--markdown`` also writes the tables into docs/benchmarks.md (see bench/markdown.py).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import markdown  # noqa: E402
from tests.etcd_harness import (  # noqa: E402
    EtcdProcess,
    HACluster,
    LoadProcess,
    check_all_readable,
    master_says,
    outage_after,
    wait_settled,
)
from tests.support import Daemon, wait_until  # noqa: E402

ALL = "cut,pause-1,pause-3,pause-6,restart,kill"


def epoch_of(m: Daemon) -> int:
    said = [re.search(r"leading: epoch=(\d+)", ln) for ln in m.lines]
    return max((int(s.group(1)) for s in said if s), default=0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--lease-ttl", type=int, default=2)
    ap.add_argument("--scenarios", default=ALL)
    ap.add_argument("--markdown", action="store_true", help="write into docs/benchmarks.md")
    args = ap.parse_args()
    scenarios = [s for s in args.scenarios.split(",") if s]
    tmp = Path(tempfile.mkdtemp(prefix="kvstore-failover-"))
    etcd = EtcdProcess(tmp / "etcd")
    cluster = HACluster(
        tmp,
        etcd,
        ("--lease-ttl", str(args.lease_ttl), "--heartbeat-interval", "0.5", "--node-ttl", "4"),
    )
    link = None
    cut_note = ""
    if "cut" in scenarios:
        try:
            from tests.netns import CuttableLink

            link = CuttableLink(etcd.client_port, tag=os.getpid() % 4096)
        except BaseException as exc:  # pytest's skip: no network namespaces here
            cut_note = f"cut: skipped ({exc})"
            scenarios.remove("cut")
    kills: list[tuple[int, float, float, int]] = []
    faults: list[tuple[str, ...]] = []
    load = None
    try:
        cluster.add_master(link.endpoint if link is not None else None)
        cluster.leader()
        for _ in range(2):
            cluster.add_master()
        for _ in range(3):
            cluster.add_node()
        load = LoadProcess(cluster.url, tmp / "load")
        load.wait_acks(200)
        for name in scenarios:
            if name == "kill":
                for r in range(args.rounds):
                    old = wait_settled(cluster)
                    before = len(load.acks())
                    t_kill = time.time()
                    old.kill()
                    cluster.leader(timeout=30)
                    t_serving = time.time()
                    load.wait_acks(200, after=t_kill)
                    kills.append(
                        (r + 1, t_serving - t_kill, outage_after(load.acks(), t_kill), before)
                    )
                    cluster.add_master()  # keep three
                continue
            old = wait_settled(cluster)
            epoch = epoch_of(old)
            t0 = time.time()
            if name == "cut":
                assert link is not None and old is cluster.masters[0], "the cut master leads"
                link.cut()
                new = wait_settled(cluster, timeout=60, cut_off=old)
                t_serving = t_heal = time.time()
                link.heal()
                wait_until(lambda: master_says(old) == "standby", timeout=30, what="a standby")
                after_back, standby = "-", f"{time.time() - t_heal:.2f}"
            else:
                if name.startswith("pause-"):
                    etcd.pause(float(name.split("-")[1]))
                else:
                    etcd.restart(downtime_s=3.0)
                t_heal = time.time()
                new = wait_settled(cluster, timeout=60)
                t_serving = time.time()
                after_back, standby = f"{t_serving - t_heal:.2f}", "-"
            load.wait_acks(100, after=t_serving)
            changed = "yes" if new is not old or epoch_of(new) != epoch else "no"
            faults.append(
                (
                    name,
                    f"{t_heal - t0:.2f}",
                    after_back,
                    f"{t_serving - t0:.2f}",
                    f"{outage_after(load.acks(), t0):.2f}",
                    changed,
                    standby,
                )
            )
        summary = load.finish()
        acks = load.acks()
        bad = check_all_readable(cluster.url, acks)
    finally:
        if load is not None:
            load.kill()
        cluster.stop()
        etcd.stop()
        if link is not None:
            link.close()
    fault_head = f"etcd faults under load (lease TTL {args.lease_ttl}s, 3 masters, 3 nodes)"
    fault_table = [
        "| fault | fault lasted (s) | one leader serving, after etcd was back (s) | "
        "from the fault's start (s) | client outage: longest gap between acks (s) | "
        "new leader or term | cut leader a standby after the link healed (s) |",
        "| --- | ---: | ---: | ---: | ---: | --- | ---: |",
        *(f"| {' | '.join(row)} |" for row in faults),
    ]
    print(f"\n{fault_head}")
    print("\n".join(fault_table))
    if cut_note:
        print(cut_note)
    kill_head = f"kill -9 of the leader under load (lease TTL {args.lease_ttl}s)"
    kill_table = [
        "| kill | new leader serving (s) | client outage: longest gap between acks (s) "
        "| acked before kill |",
        "| ---: | ---: | ---: | ---: |",
        *(f"| {r} | {serving:.2f} | {ack:.2f} | {before} |" for r, serving, ack, before in kills),
    ]
    if kills:
        print(f"\n{kill_head}")
        print("\n".join(kill_table))
    reread = (
        f"acknowledged puts: {len(acks)}; re-read with exact bytes: {len(acks) - bad}; "
        f"wrong or missing: {bad}; client reads ok/wrong/missing/failed: {summary['gets_ok']}/"
        f"{summary['gets_wrong']}/{summary['gets_missing']}/{summary['gets_failed']}; "
        f"failed puts (retried by the load): {summary['puts_failed']}"
    )
    print(f"\n{reread}")
    if args.markdown:
        # The page's tables need a blank line above them; the terminal's text has none.
        parts = [fault_head, "\n".join(fault_table)] if faults else []
        parts += [cut_note] if cut_note else []
        parts += [kill_head, "\n".join(kill_table)] if kills else []
        parts += [reread, f"Load average {os.getloadavg()[0]:.1f}."]
        markdown.write_table("failover", "\n\n".join(parts))


if __name__ == "__main__":
    main()
