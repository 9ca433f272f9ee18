"""One system's side of the side-by-side benchmark (run by bench_peers.py, never alone).

Runs the same workloads against kvstore, Mooncake Store, Mooncake's API on kvstore
(``kvstore.client.compat.mooncake``, driven by the very same ``Mooncake`` class below), Redis
or "plain-tcp" (:class:`PlainTcp`, the limit: bench/plain_tcp_server.py answering each request
with ``sendall`` of the bytes; buffer rows only) and prints one JSON line per
row: ``{"workload", "size", "gbps", "gbps_mean", "p50_us", "keys_s"}`` (``gbps``: bytes per
operation over the median operation time; ``gbps_mean``: over the mean; ``keys_s``: keys per
operation over the median time).

Reads of the headline rows touch **distinct keys, each once** (what a decode engine does with
the KV blocks a prefill wrote): no location cache or read lease can help them. The rows marked
``[hot key]`` reread one key again and again (they flatter caches and leases; kept apart).
Rows ``kv: ...`` are a prompt's KV blocks (:func:`run_kv`).
``--fill N`` instead puts N tiny objects and exits (the orchestrator measures the master's
memory around it). ``--sweep N`` instead runs the short 1 MiB workload of the Mooncake settings
sweep (:func:`run_sweep`). ``--client-segment`` / ``--client-buffer`` set a Mooncake client's
own segment and local buffer. It runs under the Python that has the system's
client: the repo's venv for kvstore (and plain-tcp), the throwaway peers venv for Mooncake and
Redis. It uses only numpy and that client, so it must not import anything else from this repository.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import struct
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

SIZES = [("4KiB", 4 << 10), ("64KiB", 64 << 10), ("1MiB", 1 << 20), ("16MiB", 16 << 20)]
BATCH = 16
ROW_BUDGET = 64 << 20  # bytes moved per timed row (fewer iterations for large objects)


class Kvstore:
    def __init__(self, address: str, shm: bool, strict: bool) -> None:
        from kvstore.client import Client

        self.c = Client.connect(address, shm=shm, lease_reads=not strict, blanks=not strict)

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

    def batch_put(self, keys: list[str], values: list[bytes]) -> None:
        errors = [e for e in self.c.batch_put(keys, values) if e is not None]
        if errors:
            raise RuntimeError(f"batch_put: {errors[0]!r}")

    def count(self) -> int | None:
        return int(self.c.stats()["num_objects"])

    def batch_get(self, keys: list[str]) -> list[bytes]:
        out = self.c.batch_get(keys)
        bad = [r for r in out if not isinstance(r, bytes)]
        if bad:
            raise RuntimeError(f"batch_get: {bad[0]!r}")
        return out

    def remove(self, keys: list[str]) -> None:
        for lo in range(0, len(keys), 10_000):
            self.c.batch_remove(keys[lo : lo + 10_000])

    def kvcache(self, name: str, layers: int, heads: int, dim: int) -> Any:
        """A :class:`KVCache` of one model's shape (float16: bf16's bytes, numpy has no bf16)."""
        from kvstore.client import KVCache, Namespace

        ns = Namespace(name, "float16", layers, heads, dim, block_size=KV_BLOCK_TOKENS)
        return KVCache(self.c, ns)

    def close(self) -> None:
        self.c.close()


class Mooncake:
    def __init__(
        self,
        address: str,
        metadata: str,
        compat: bool = False,
        segment: int = 0,
        local_buffer: int = 512 << 20,
    ) -> None:
        if compat:  # Mooncake's API served by kvstore: the same calls below, another store
            from kvstore.client.compat.mooncake import MooncakeDistributedStore
        else:
            from mooncake.store import MooncakeDistributedStore

        self.s = MooncakeDistributedStore()
        # segment (global_segment_size) 0 by default: this client contributes no memory, objects
        # live in the storage process and every read is remote; a client segment makes some
        # reads local (a labelled variant of the sweep only). local_buffer: staging for put/get
        # of bytes objects.
        rc = self.s.setup("127.0.0.1", metadata, segment, local_buffer, "tcp", "", address)
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

    def batch_put(self, keys: list[str], values: list[bytes]) -> None:
        rc = self.s.put_batch(keys, values)
        if rc != 0:
            raise RuntimeError(f"mooncake put_batch: {rc}")

    def batch_get(self, keys: list[str]) -> list[bytes]:
        return list(self.s.get_batch(keys))

    def count(self) -> int | None:
        return None  # (no cheap count in Mooncake's client API)

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

    def batch_put(self, keys: list[str], values: list[bytes]) -> None:
        self.r.mset(dict(zip(keys, values, strict=True)))

    def batch_get(self, keys: list[str]) -> list[bytes]:
        return self.r.mget(keys)

    def count(self) -> int | None:
        return int(self.r.dbsize())

    def remove(self, keys: list[str]) -> None:
        for lo in range(0, len(keys), 10_000):
            self.r.delete(*keys[lo : lo + 10_000])

    def close(self) -> None:
        self.r.close()


class PlainTcp:
    """The limit: bench/plain_tcp_server.py over one TCP connection, TCP_NODELAY, no index,
    no metadata. ``get_into`` sends an 11-byte request and receives the bytes straight into the
    buffer; ``put_from`` sends the request and the bytes in one ``sendmsg`` and waits for a
    4-byte ack; batches pipeline their 16 requests (send all, then receive all). Keys are not
    sent: the server holds one object per (slot, size), a batch's objects in slots 0-15, single
    objects in slot 16, so the bytes can still be verified. Buffer rows only."""

    BUFFERS_ONLY = True
    HEADER = struct.Struct("<cHQ")
    SINGLE = BATCH  # the slot of single-object puts and gets
    ACK = 4

    def __init__(self, address: str) -> None:
        host, port = address.rsplit(":", 1)
        self.sock = socket.create_connection((host, int(port)))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._acks = memoryview(bytearray(self.ACK * BATCH))

    def register(self, arr: np.ndarray) -> None:
        pass

    def release(self) -> None:
        pass

    def _send(self, parts: list[bytes | np.ndarray]) -> None:
        """All of ``parts`` with as few ``sendmsg`` calls as the kernel allows (no joining)."""
        views = [memoryview(p).cast("B") for p in parts]
        while views:
            n = self.sock.sendmsg(views)
            while views and n >= len(views[0]):
                n -= len(views.pop(0))
            if views:
                views[0] = views[0][n:]

    def _recv(self, view: memoryview) -> None:
        got = 0
        while got < len(view):
            # MSG_WAITALL: the kernel fills the rest in one call unless a signal cuts it short.
            n = self.sock.recv_into(view[got:], len(view) - got, socket.MSG_WAITALL)
            if n == 0:
                raise RuntimeError("plain-tcp server closed the connection")
            got += n

    def put_from(self, key: str, arr: np.ndarray) -> None:
        self._send([self.HEADER.pack(b"P", self.SINGLE, arr.nbytes), arr])
        self._recv(self._acks[: self.ACK])

    def get_into(self, key: str, arr: np.ndarray) -> None:
        self.sock.sendall(self.HEADER.pack(b"G", self.SINGLE, arr.nbytes))
        self._recv(memoryview(arr).cast("B"))

    def batch_put_from(self, keys: list[str], arrs: list[np.ndarray]) -> None:
        parts: list[bytes | np.ndarray] = []
        for j, a in enumerate(arrs):
            parts += [self.HEADER.pack(b"P", j, a.nbytes), a]
        self._send(parts)
        self._recv(self._acks[: self.ACK * len(arrs)])

    def batch_get_into(self, keys: list[str], arrs: list[np.ndarray]) -> None:
        self.sock.sendall(b"".join(self.HEADER.pack(b"G", j, a.nbytes) for j, a in enumerate(arrs)))
        for a in arrs:
            self._recv(memoryview(a).cast("B"))

    def remove(self, keys: list[str]) -> None:
        pass

    def close(self) -> None:
        self.sock.close()


def timed(fn: Callable[[int], object], iters: int, warmup: int = 2) -> list[float]:
    for i in range(warmup):
        fn(-1 - i)
    out = []
    for i in range(iters):
        t0 = time.perf_counter()
        fn(i)
        out.append(time.perf_counter() - t0)
    return out


def emit(workload: str, label: str, per_op_bytes: int, samples: list[float], keys: int = 1) -> None:
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
                "keys_s": keys / float(np.percentile(s, 50)),
            }
        ),
        flush=True,
    )


def run(store: Any, tag: str) -> None:
    # A buffers-only store (plain-tcp) gets the buffer rows only: no bytes put/get, no hot-key,
    # KV-cache or metadata rows (it has no keys to cache and no index to measure).
    full = not getattr(store, "BUFFERS_ONLY", False)
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

        def batch_keys(i: int, p: str = p) -> list[str]:
            return [f"{p}/bp/{i * BATCH + j}" for j in range(BATCH)]

        # Writes: a new key each time (timed() warms up with i = -1, -2: keys of their own).
        if full:
            emit("put", label, size, timed(lambda i: store.put(f"{p}/put/{i}", raw), iters))
        emit("put_from", label, size, timed(lambda i: store.put_from(f"{p}/pf/{i}", value), iters))
        emit(
            f"batch_put_from x{BATCH}",
            label,
            size * BATCH,
            timed(lambda i: store.batch_put_from(batch_keys(i), vals), b_iters),
        )
        # Reads, headline: distinct keys, each read once (``get`` reads what ``put`` wrote,
        # ``get_into`` what ``put_from`` wrote; all hold the same bytes).
        if full:
            got: list[bytes] = []
            emit("get", label, size, timed(lambda i: got.append(store.get(f"{p}/put/{i}")), iters))
            if any(g != raw for g in got):
                raise SystemExit(f"{tag}: get returned other bytes at {label}")
            got.clear()
        emit("get_into", label, size, timed(lambda i: store.get_into(f"{p}/pf/{i}", buf), iters))
        if not np.array_equal(buf, value):
            raise SystemExit(f"{tag}: get_into returned other bytes at {label}")
        emit(
            f"batch_get_into x{BATCH}",
            label,
            size * BATCH,
            timed(lambda i: store.batch_get_into(batch_keys(i), bufs), b_iters),
        )
        if not all(np.array_equal(a, b) for a, b in zip(bufs, vals, strict=True)):
            raise SystemExit(f"{tag}: batch_get_into returned other bytes at {label}")
        if full:
            single = (f"{p}/pf/0", raw, value, buf)
            run_hot(store, tag, label, iters, b_iters, single, batch_keys(0), bufs)
        written = [f"{p}/{kind}/{i}" for kind in ("put", "pf") for i in range(-2, iters)]
        written += [k for i in range(-2, b_iters) for k in batch_keys(i)]
        store.remove(written)
        store.release()
    if full:
        run_kv(store, tag)
        run_metadata(store, tag)


def run_hot(
    store: Any,
    tag: str,
    label: str,
    iters: int,
    b_iters: int,
    single: tuple[str, bytes, np.ndarray, np.ndarray],
    hot: list[str],
    bufs: list[np.ndarray],
) -> None:
    """Reads, hot key: one key (one batch) reread every time. ``single``: the size's first
    ``put_from`` key, its bytes and array, and the buffer to read them into."""
    probe, raw, value, buf = single
    size = len(raw)
    emit("get [hot key]", label, size, timed(lambda i: store.get(probe), iters))
    if store.get(probe) != raw:
        raise SystemExit(f"{tag}: get returned other bytes at {label}")
    emit("get_into [hot key]", label, size, timed(lambda i: store.get_into(probe, buf), iters))
    if not np.array_equal(buf, value):
        raise SystemExit(f"{tag}: get_into returned other bytes at {label}")
    emit(
        f"batch_get_into x{BATCH} [hot keys]",
        label,
        size * BATCH,
        timed(lambda i: store.batch_get_into(hot, bufs), b_iters),
    )


def run_sweep(store: Any, tag: str, n: int) -> None:
    """The Mooncake settings sweep's short workload, 1 MiB objects only: ``put_from`` ``n``
    distinct keys, then ``get_into`` each once; ``batch_put_from`` x16 of ``n`` distinct keys
    in all, then ``batch_get_into`` x16 of each batch once. Bytes verified."""
    size, label = 1 << 20, "1MiB"
    b_iters = max(3, n // BATCH)
    rng = np.random.default_rng(2)
    value = rng.integers(0, 256, size, dtype=np.uint8)
    buf = np.empty(size, dtype=np.uint8)
    vals = [rng.integers(0, 256, size, dtype=np.uint8) for _ in range(BATCH)]
    bufs = [np.empty(size, dtype=np.uint8) for _ in range(BATCH)]
    for a in (value, buf, *vals, *bufs):
        store.register(a)
    p = f"{tag}/sweep"

    def batch_keys(i: int) -> list[str]:
        return [f"{p}/bp/{i * BATCH + j}" for j in range(BATCH)]

    emit("put_from", label, size, timed(lambda i: store.put_from(f"{p}/pf/{i}", value), n))
    emit("get_into", label, size, timed(lambda i: store.get_into(f"{p}/pf/{i}", buf), n))
    if not np.array_equal(buf, value):
        raise SystemExit(f"{tag}: get_into returned other bytes (sweep)")
    emit(
        f"batch_put_from x{BATCH}",
        label,
        size * BATCH,
        timed(lambda i: store.batch_put_from(batch_keys(i), vals), b_iters),
    )
    emit(
        f"batch_get_into x{BATCH}",
        label,
        size * BATCH,
        timed(lambda i: store.batch_get_into(batch_keys(i), bufs), b_iters),
    )
    if not all(np.array_equal(a, b) for a, b in zip(bufs, vals, strict=True)):
        raise SystemExit(f"{tag}: batch_get_into returned other bytes (sweep)")
    store.remove([f"{p}/pf/{i}" for i in range(-2, n)])
    store.remove([k for i in range(-2, b_iters) for k in batch_keys(i)])
    store.release()


META_BATCH = 1000
META_SIZE = 16
META_ITERS = 30
#: KV-cache level rows: (model, layers, KV heads, head dim) at 2 bytes an element, 64-token
#: blocks: Llama-3-8B's block is 8 MiB, SmolLM2-135M's 1.4 MiB.
KV_SHAPES = [("Llama-3-8B", 32, 8, 128), ("SmolLM2-135M", 30, 3, 64)]
KV_BLOCK_TOKENS = 64
KV_BLOCKS = 8  # a 512-token prompt
#: Timed prompts per KV row: at least KV_ITERS, and enough for KV_ROW_BUDGET bytes (a SmolLM2
#: prompt is 11 MiB, ~5 ms: four of them gave medians 20% apart from run to run).
KV_ITERS = 4
KV_ROW_BUDGET = 192 << 20


def run_kv(store: Any, tag: str) -> None:
    """A prompt's KV blocks, each prompt new (stores) and each read once (loads): the raw
    ``batch_put_from`` / ``batch_get_into`` of its blocks on every system and, on kvstore,
    ``KVCache.store`` / ``KVCache.load`` of the same bytes from the model's per-layer K and V
    tensors (block keys, the prefix index, per-plane checksums, the layer-major <-> block-major
    copies included). Rows are ``kv: ...``, sized by the KV bytes of one prompt."""
    rng = np.random.default_rng(1)
    for label, layers, heads, dim in KV_SHAPES:
        tokens = KV_BLOCKS * KV_BLOCK_TOKENS
        block = 2 * layers * heads * dim * 2 * KV_BLOCK_TOKENS
        total = block * KV_BLOCKS
        iters = max(KV_ITERS, KV_ROW_BUDGET // total)
        vals = [rng.integers(0, 256, block, dtype=np.uint8) for _ in range(KV_BLOCKS)]
        bufs = [np.empty(block, dtype=np.uint8) for _ in range(KV_BLOCKS)]
        for a in (*vals, *bufs):
            store.register(a)
        p = f"{tag}/kv/{label}"

        def keys(i: int, p: str = p) -> list[str]:
            return [f"{p}/{i}/{j}" for j in range(KV_BLOCKS)]

        emit(
            "kv: batch_put_from",
            label,
            total,
            timed(lambda i: store.batch_put_from(keys(i), vals), iters),
        )
        emit(
            "kv: batch_get_into",
            label,
            total,
            timed(lambda i: store.batch_get_into(keys(i), bufs), iters),
        )
        if not all(np.array_equal(a, b) for a, b in zip(bufs, vals, strict=True)):
            raise SystemExit(f"{tag}: kv batch_get_into returned other bytes for {label}")
        store.remove([k for i in range(-2, iters) for k in keys(i)])
        store.release()
        if not hasattr(store, "kvcache"):
            continue
        # A namespace of this process's own: every kvstore client of a run shares one pool
        # and one tag, and a prompt another one stored would be no new prompt here.
        kv = store.kvcache(f"{tag}/{label}/{os.getpid()}", layers, heads, dim)

        def kv_tensor() -> np.ndarray:
            return rng.standard_normal((tokens, heads, dim), dtype=np.float32).astype(np.float16)

        layers_in = [(kv_tensor(), kv_tensor()) for _ in range(layers)]
        layers_out = [(np.empty_like(k), np.empty_like(v)) for k, v in layers_in]

        def prompt(i: int, label: str = label) -> np.ndarray:
            return np.random.default_rng([i + 10, len(label)]).integers(0, 50_000, tokens)

        def kv_store(i: int) -> None:
            if kv.store(prompt(i), layers_in) != tokens:
                raise SystemExit(f"{tag}: KVCache.store stored part of a new prompt ({label})")

        def kv_load(i: int) -> None:
            if kv.load(prompt(i), layers_out) != tokens:
                raise SystemExit(f"{tag}: KVCache.load found part of a stored prompt ({label})")

        emit("kv: KVCache.store", label, total, timed(kv_store, iters))
        emit("kv: KVCache.load", label, total, timed(kv_load, iters))
        for (k, v), (k2, v2) in zip(layers_in, layers_out, strict=True):
            if not (np.array_equal(k, k2) and np.array_equal(v, v2)):
                raise SystemExit(f"{tag}: KVCache.load returned other KV for {label}")


def run_metadata(store: Any, tag: str) -> None:
    """``batch_put`` / ``batch_get`` of 1,000 tiny objects: what the metadata path sustains."""
    vals = [bytes([i % 251]) * META_SIZE for i in range(META_BATCH)]

    def keys(i: int) -> list[str]:
        return [f"{tag}/meta/{i}/{j}" for j in range(META_BATCH)]

    def put(i: int) -> None:
        store.batch_put(keys(i), vals)

    def get(i: int) -> None:
        if store.batch_get(keys(i)) != vals:
            raise SystemExit(f"{tag}: batch_get returned other bytes")

    label = f"{META_BATCH}x{META_SIZE}B"
    emit("batch_put", label, META_BATCH * META_SIZE, timed(put, META_ITERS), keys=META_BATCH)
    emit("batch_get", label, META_BATCH * META_SIZE, timed(get, META_ITERS), keys=META_BATCH)
    store.remove([k for i in range(-2, META_ITERS) for k in keys(i)])


def fill(store: Any, tag: str, n: int) -> None:
    """Put ``n`` objects of 16 bytes (1,000 a batch); print how long it took and how many
    objects the store holds afterwards (None where its client cannot count them cheaply)."""
    t0 = time.perf_counter()
    val = b"x" * META_SIZE
    for lo in range(0, n, META_BATCH):
        ks = [f"{tag}/fill/{i}" for i in range(lo, min(n, lo + META_BATCH))]
        store.batch_put(ks, [val] * len(ks))
    seconds = time.perf_counter() - t0
    print(json.dumps({"filled": n, "seconds": seconds, "present": store.count()}), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "system",
        choices=[
            "kvstore",
            "kvstore-strict",
            "kvstore-shm",
            "kvstore-mcapi",
            "mooncake",
            "redis",
            "plain-tcp",
        ],
    )
    ap.add_argument("--address", required=True)
    ap.add_argument("--metadata", default="")
    ap.add_argument("--tag", default="run")
    ap.add_argument("--fill", type=int, default=0, help="only put this many 16 B objects")
    ap.add_argument(
        "--sweep", type=int, default=0, help="only the 1 MiB sweep workload, this many objects"
    )
    ap.add_argument(
        "--client-segment", type=int, default=0, help="Mooncake: the client's own segment, bytes"
    )
    ap.add_argument(
        "--client-buffer", type=int, default=512 << 20, help="Mooncake: local_buffer_size, bytes"
    )
    args = ap.parse_args()
    if args.system == "kvstore-mcapi":
        store: Any = Mooncake(args.address, args.metadata, compat=True)
    elif args.system.startswith("kvstore"):
        # kvstore and kvstore-shm: lease reads (the KV-cache setting: block keys are content
        # hashes) and blanks; kvstore-strict: every read and every put starts at the master,
        # like Mooncake's.
        store = Kvstore(
            args.address,
            shm=args.system == "kvstore-shm",
            strict=args.system == "kvstore-strict",
        )
    elif args.system == "mooncake":
        store = Mooncake(
            args.address,
            args.metadata,
            segment=args.client_segment,
            local_buffer=args.client_buffer,
        )
    elif args.system == "plain-tcp":
        store = PlainTcp(args.address)
    else:
        store = Redis(args.address)
    try:
        if args.fill:
            fill(store, args.tag, args.fill)
        elif args.sweep:
            run_sweep(store, args.tag, args.sweep)
        else:
            run(store, args.tag)
    finally:
        store.close()
    sys.stdout.flush()


if __name__ == "__main__":
    main()
