"""Put / get_into of CUDA tensors through the store, over TCP and shm (needs a CUDA GPU).

Run:  .venv/bin/python bench/bench_cuda.py [--quick] [--markdown]

Starts an embedded cluster (``kvstore up``, storage node in a separate process) once plain and
once with ``--shm``, then from this process puts and reads back CUDA tensors of 1, 16 and 64 MiB,
single and in batches of 8, verifying the bytes, and prints one table of GB/s. The host columns
are the same workloads with numpy buffers, so the cost of staging (one D2H per put, one H2D per
get through pinned memory, see kvstore.client.staging) reads off directly. Exits 0 with a line
saying so where no CUDA device exists. ``--markdown`` also writes the table into
docs/benchmarks.md (see bench/markdown.py); without a CUDA device the page is left as it is.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

sys.path.append(str(Path(__file__).resolve().parents[1]))  # for bench.markdown

from bench import markdown  # noqa: E402
from kvstore.cli.embedded import EmbeddedCluster  # noqa: E402
from kvstore.client import Client  # noqa: E402

SIZES = [("1MiB", 1 << 20), ("16MiB", 16 << 20), ("64MiB", 64 << 20)]
BATCH = 8


def gbps(fn: Callable[[], object], num_bytes: int, iters: int) -> float:
    """Bytes per second (1e9) over ``iters`` calls, after two warm-up calls."""
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return num_bytes * iters / (time.perf_counter() - t0) / 1e9


def measure(c: Client, label: str, size: int, iters: int) -> dict[str, float]:
    """GB/s of each workload at one size, bytes checked after each."""
    gen = torch.Generator(device="cuda").manual_seed(size)
    dev = torch.randint(0, 256, (size,), dtype=torch.uint8, device="cuda", generator=gen)
    dev_out = torch.empty_like(dev)
    host = dev.cpu().numpy()
    host_out = np.empty_like(host)
    keys = [f"bench/cuda/{label}/{i}" for i in range(BATCH)]
    devs = [dev.roll(i) for i in range(BATCH)]
    dev_outs = [torch.empty_like(dev) for _ in range(BATCH)]
    b_iters = max(2, iters // BATCH)
    out: dict[str, float] = {}
    out["cuda put"] = gbps(lambda: c.put("k", dev), size, iters)
    out["cuda get_into"] = gbps(lambda: c.get_into("k", dev_out), size, iters)
    assert torch.equal(dev_out, dev), "cuda bytes differ"
    out["host put"] = gbps(lambda: c.put("h", host), size, iters)
    out["host get_into"] = gbps(lambda: c.get_into("h", host_out), size, iters)
    assert np.array_equal(host_out, host), "host bytes differ"
    out[f"cuda batch_put x{BATCH}"] = gbps(lambda: c.batch_put(keys, devs), size * BATCH, b_iters)
    out[f"cuda batch_get_into x{BATCH}"] = gbps(
        lambda: c.batch_get_into(keys, dev_outs), size * BATCH, b_iters
    )
    assert all(torch.equal(a, b) for a, b in zip(devs, dev_outs, strict=True)), "batch differs"
    c.batch_remove([*keys, "k", "h"])
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="fewer iterations")
    ap.add_argument("--markdown", action="store_true", help="write into docs/benchmarks.md")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_cuda: no CUDA device here (torch.cuda.is_available() is False); nothing run")
        return 0
    scale = 0.25 if args.quick else 1.0
    rows: list[tuple[str, str, str, float]] = []
    for transport, extra in (("tcp", []), ("shm", ["--shm"])):
        with (
            tempfile.TemporaryDirectory() as tmp,
            EmbeddedCluster(tmp, "2GiB", extra) as cluster,
            Client.connect(cluster.address) as c,
        ):
            for label, size in SIZES:
                iters = max(4, int(scale * (512 << 20) // size))
                for name, value in measure(c, label, size, iters).items():
                    rows.append((transport, name, label, value))
    print(f"device: {torch.cuda.get_device_name()}")
    print("| transport | workload                  | size  |    GB/s |")
    print("|-----------|---------------------------|-------|---------|")
    for transport, name, label, value in rows:
        print(f"| {transport:<9} | {name:<25} | {label:<5} | {value:7.2f} |")
    if args.markdown:
        table = markdown.table(
            ["transport", "workload", "size", "GB/s"],
            [(transport, name, label, f"{value:.2f}") for transport, name, label, value in rows],
        )
        note = (
            f"{torch.cuda.get_device_name()}; `kvstore up` (node in its own process), plain and "
            f"`--shm`; bytes verified; load average {os.getloadavg()[0]:.1f}."
        )
        markdown.write_table("cuda", f"{table}\n\n{note}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
