"""One system's side of the side-by-side benchmark (run by bench_peers.py, never alone).

Runs the same workloads against kvstore, Mooncake Store, Mooncake's API on kvstore
(``kvstore.client.compat.mooncake``, driven by the very same ``Mooncake`` class below) or Redis
and prints one JSON line per
row: ``{"workload", "size", "gbps", "gbps_mean", "p50_us"}`` (``gbps``: bytes per operation over
the median operation time; ``gbps_mean``: over the mean). It runs under the Python that has the system's
client: the repo's venv for kvstore, the throwaway peers venv for Mooncake and Redis. It uses
only numpy and that client, so it must not import anything else from this repository.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

SIZES = [("4KiB", 4 << 10), ("64KiB", 64 << 10), ("1MiB", 1 << 20), ("16MiB", 16 << 20)]
BATCH = 16
ROW_BUDGET = 64 << 20  # bytes moved per timed row (fewer iterations for large objects)


class Kvstore:
    def __init__(self, address: str, shm: bool, lease_reads: bool) -> None:
        from kvstore.client import Client

        self.c = Client.connect(address, shm=shm, lease_reads=lease_reads)

    def register(self, arr: np.ndarray) -> None:
        pass

    def release(self) -> None:
        pass

    def put(self, key: str, value: bytes) -> None:
        self.c.put(key, value)

    def get(self, key: str) -> bytes:
        return self.c.get(key)

    def put_from(self, key: str, arr: np.ndarray) -> None:
        self.c.put(key, arr)

    def get_into(self, key: str, arr: np.ndarray) -> None:
        self.c.get_into(key, arr)

    def batch_put_from(self, keys: list[str], arrs: list[np.ndarray]) -> None:
        errors = [e for e in self.c.batch_put(keys, arrs) if e is not None]
        if errors:
            raise RuntimeError(f"batch_put: {errors[0]!r}")

    def batch_get_into(self, keys: list[str], arrs: list[np.ndarray]) -> None:
        for r in self.c.batch_get_into(keys, arrs):
            if not isinstance(r, int):
                raise RuntimeError(f"batch_get_into: {r!r}")

    def remove(self, keys: list[str]) -> None:
        self.c.batch_remove(keys)

    def close(self) -> None:
        self.c.close()


class Mooncake:
    def __init__(self, address: str, metadata: str, compat: bool = False) -> None:
        if compat:  # Mooncake's API served by kvstore: the same calls below, another store
            from kvstore.client.compat.mooncake import MooncakeDistributedStore
        else:
            from mooncake.store import MooncakeDistributedStore

        self.s = MooncakeDistributedStore()
        # global_segment_size=0: this client contributes no memory; objects live in the storage
        # process. local_buffer_size: staging for put/get of bytes objects.
        rc = self.s.setup("127.0.0.1", metadata, 0, 512 << 20, "tcp", "", address)
        if rc != 0:
            raise RuntimeError(f"mooncake setup failed: {rc}")

        self._registered: list[int] = []

    def register(self, arr: np.ndarray) -> None:
        rc = self.s.register_buffer(arr.ctypes.data, arr.nbytes)
        if rc != 0:
            raise RuntimeError(f"mooncake register_buffer: {rc}")
        self._registered.append(arr.ctypes.data)

    def release(self) -> None:
        # Before the arrays are freed: their addresses may come back for the next size's arrays.
        for addr in self._registered:
            self.s.unregister_buffer(addr)
        self._registered.clear()

    def _check(self, rc: int, what: str) -> None:
        if rc != 0:
            raise RuntimeError(f"mooncake {what}: {rc}")

    def put(self, key: str, value: bytes) -> None:
        self._check(self.s.put(key, value), "put")

    def get(self, key: str) -> bytes:
        return self.s.get(key)

    def put_from(self, key: str, arr: np.ndarray) -> None:
        self._check(self.s.put_from(key, arr.ctypes.data, arr.nbytes), "put_from")

    def get_into(self, key: str, arr: np.ndarray) -> None:
        n = self.s.get_into(key, arr.ctypes.data, arr.nbytes)
        if n != arr.nbytes:
            raise RuntimeError(f"mooncake get_into: {n}")

    def batch_put_from(self, keys: list[str], arrs: list[np.ndarray]) -> None:
        rcs = self.s.batch_put_from(keys, [a.ctypes.data for a in arrs], [a.nbytes for a in arrs])
        if any(rc != 0 for rc in rcs):
            raise RuntimeError(f"mooncake batch_put_from: {rcs}")

    def batch_get_into(self, keys: list[str], arrs: list[np.ndarray]) -> None:
        ns = self.s.batch_get_into(keys, [a.ctypes.data for a in arrs], [a.nbytes for a in arrs])
        if any(n != a.nbytes for n, a in zip(ns, arrs, strict=True)):
            raise RuntimeError(f"mooncake batch_get_into: {ns}")

    def remove(self, keys: list[str]) -> None:
        for k in keys:
            self.s.remove(k)  # may refuse while a read lease is held: memory is sized for it

    def close(self) -> None:
        self.s.close()


class Redis:
    def __init__(self, address: str) -> None:
        import redis

        host, port = address.rsplit(":", 1)
        self.r = redis.Redis(host=host, port=int(port))
        self.r.ping()

    def register(self, arr: np.ndarray) -> None:
        pass

    def release(self) -> None:
        pass

    def put(self, key: str, value: bytes) -> None:
        self.r.set(key, value)

    def get(self, key: str) -> bytes:
        return self.r.get(key)

    def put_from(self, key: str, arr: np.ndarray) -> None:
        self.r.set(key, memoryview(arr))

    def get_into(self, key: str, arr: np.ndarray) -> None:
        arr[:] = np.frombuffer(self.r.get(key), dtype=np.uint8)  # redis-py has no get_into

    def batch_put_from(self, keys: list[str], arrs: list[np.ndarray]) -> None:
        self.r.mset({k: memoryview(a) for k, a in zip(keys, arrs, strict=True)})

    def batch_get_into(self, keys: list[str], arrs: list[np.ndarray]) -> None:
        for v, a in zip(self.r.mget(keys), arrs, strict=True):
            a[:] = np.frombuffer(v, dtype=np.uint8)

    def remove(self, keys: list[str]) -> None:
        self.r.delete(*keys)

    def close(self) -> None:
        self.r.close()


def timed(fn: Callable[[int], object], iters: int, warmup: int = 2) -> list[float]:
    for i in range(warmup):
        fn(-1 - i)
    out = []
    for i in range(iters):
        t0 = time.perf_counter()
        fn(i)
        out.append(time.perf_counter() - t0)
    return out


def emit(workload: str, label: str, per_op_bytes: int, samples: list[float]) -> None:
    s = np.array(samples)
    print(
        json.dumps(
            {
                "workload": workload,
                "size": label,
                "gbps_mean": per_op_bytes * len(s) / s.sum() / 1e9,
                # Bytes per op over the median op time: robust to other jobs on a shared machine.
                "gbps": per_op_bytes / float(np.percentile(s, 50)) / 1e9,
                "p50_us": float(np.percentile(s, 50) * 1e6),
            }
        ),
        flush=True,
    )


def run(store: Any, tag: str) -> None:
    rng = np.random.default_rng(0)
    for label, size in SIZES:
        iters = max(8, min(1500, ROW_BUDGET // size))
        b_iters = max(3, min(200, ROW_BUDGET // (size * BATCH)))
        value = rng.integers(0, 256, size, dtype=np.uint8)
        raw = value.tobytes()
        buf = np.empty(size, dtype=np.uint8)
        vals = [rng.integers(0, 256, size, dtype=np.uint8) for _ in range(BATCH)]
        bufs = [np.empty(size, dtype=np.uint8) for _ in range(BATCH)]
        for a in (value, buf, *vals, *bufs):
            store.register(a)
        p = f"{tag}/{label}"
        used: list[str] = []

        def key(kind: str, i: int, p: str = p) -> str:
            k = f"{p}/{kind}/{i}"
            used.append(k)
            return k

        emit("put", label, size, timed(lambda i: store.put(key("put", i), raw), iters))
        emit("put_from", label, size, timed(lambda i: store.put_from(key("pf", i), value), iters))
        probe = key("pf", 0)
        emit("get", label, size, timed(lambda i: store.get(probe), iters))
        if store.get(probe) != raw:
            raise SystemExit(f"{tag}: get returned other bytes at {label}")
        emit("get_into", label, size, timed(lambda i: store.get_into(probe, buf), iters))
        if not np.array_equal(buf, value):
            raise SystemExit(f"{tag}: get_into returned other bytes at {label}")

        def batch_keys(i: int) -> list[str]:
            return [key("bp", i * BATCH + j) for j in range(BATCH)]

        emit(
            f"batch_put_from x{BATCH}",
            label,
            size * BATCH,
            timed(lambda i: store.batch_put_from(batch_keys(i), vals), b_iters),
        )
        keys = [f"{p}/bp/{j}" for j in range(BATCH)]
        emit(
            f"batch_get_into x{BATCH}",
            label,
            size * BATCH,
            timed(lambda i: store.batch_get_into(keys, bufs), b_iters),
        )
        if not all(np.array_equal(a, b) for a, b in zip(bufs, vals, strict=True)):
            raise SystemExit(f"{tag}: batch_get_into returned other bytes at {label}")
        store.remove(sorted(set(used)))
        store.release()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "system",
        choices=["kvstore", "kvstore-strict", "kvstore-shm", "kvstore-mcapi", "mooncake", "redis"],
    )
    ap.add_argument("--address", required=True)
    ap.add_argument("--metadata", default="")
    ap.add_argument("--tag", default="run")
    args = ap.parse_args()
    if args.system == "kvstore-mcapi":
        store: Any = Mooncake(args.address, args.metadata, compat=True)
    elif args.system.startswith("kvstore"):
        # kvstore and kvstore-shm: lease reads (the KV-cache setting: block keys are content
        # hashes); kvstore-strict: every read asks the master, like Mooncake's.
        store = Kvstore(
            args.address,
            shm=args.system == "kvstore-shm",
            lease_reads=args.system != "kvstore-strict",
        )
    elif args.system == "mooncake":
        store = Mooncake(args.address, args.metadata)
    else:
        store = Redis(args.address)
    try:
        run(store, args.tag)
    finally:
        store.close()
    sys.stdout.flush()


if __name__ == "__main__":
    main()
