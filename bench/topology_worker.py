"""The two ends ``bench/bench_topology.py`` runs on test-bed hosts (each in its host's namespace).

``serve PORT``: a plain TCP server: each request is 8 bytes (a size, big-endian), each answer that
many bytes. It gives the path's own limit beside each store row.

``measure JSON``: on the reader's host, against one cluster (whose one node sits on the host
under test): puts distinct keys, then reads each once with ``get_into``; stores prompts with
``KVCache.store``, then loads each once (the first reads of four keys warm the
connections and mappings first); times a TCP request/response of each size against the
``serve`` end on the node's host. Prints one JSON object.
"""

from __future__ import annotations

import json
import os
import socket
import struct
import sys
import time

import numpy as np

from kvstore.client import Client, KVCache
from kvstore.keys import Namespace

#: The prompts' geometry: 16-token blocks of 4 layers x 8 heads x 128 (fp16): 256 KiB a block.
NAMESPACE = Namespace(
    model="topology-bench", dtype="float16", num_layers=4, num_kv_heads=8, head_dim=128,
    block_size=16,
)  # fmt: skip


def serve(port: int) -> None:
    srv = socket.create_server(("0.0.0.0", port))
    print("serving", flush=True)
    payload = bytes(64 << 20)
    while True:
        conn, _ = srv.accept()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with conn:
            while head := conn.recv(8, socket.MSG_WAITALL):
                (size,) = struct.unpack(">Q", head)
                conn.sendall(memoryview(payload)[:size])


def _tcp_mbps(address: str, size: int, count: int) -> float:
    host, port = address.rsplit(":", 1)
    buf = bytearray(size)
    with socket.create_connection((host, int(port))) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        t0 = time.perf_counter()
        for _ in range(count):
            s.sendall(struct.pack(">Q", size))
            view, got = memoryview(buf), 0
            while got < size:
                got += s.recv_into(view[got:])
        return size * count / (time.perf_counter() - t0) / 1e6


def measure(ask: dict) -> dict:
    out: dict = {}
    with Client.connect(ask["master"], timeout=30.0) as c:
        for label, size, count in ask["reads"]:
            keys = [f"{ask['tag']}/{label}/{i}" for i in range(count)]
            for i in range(0, count, 16):
                errs = c.batch_put(keys[i : i + 16], [os.urandom(size)] * len(keys[i : i + 16]))
                assert all(e is None for e in errs), errs
            buf = bytearray(size)
            for k in keys[:4]:  # connections and mappings made; these four are read again below
                c.get_into(k, buf)
            t0 = time.perf_counter()
            for k in keys:  # each key once: every read asks the master, then the node
                c.get_into(k, buf)
            elapsed = time.perf_counter() - t0
            out[label] = {
                "mbps": size * count / elapsed / 1e6,
                "us_per_op": elapsed / count * 1e6,
                "tcp_mbps": _tcp_mbps(ask["tcp"], size, count),
            }
        kv = KVCache(c, NAMESPACE)
        ns = NAMESPACE
        tokens_per_prompt, num_prompts = ask["prompt_tokens"], ask["prompts"]
        shape = (tokens_per_prompt, ns.num_kv_heads, ns.head_dim)
        layers = [(np.ones(shape, np.float16), np.ones(shape, np.float16))] * ns.num_layers
        prompts = [
            np.arange(tokens_per_prompt, dtype=np.uint32) + p * tokens_per_prompt + ask["seed"]
            for p in range(num_prompts)
        ]
        for p in prompts:
            kv.store(p, layers)
        dest = [(np.empty(shape, np.float16), np.empty(shape, np.float16))] * ns.num_layers
        t0 = time.perf_counter()
        for p in prompts:
            assert kv.load(p, dest) == tokens_per_prompt
        elapsed = time.perf_counter() - t0
        size = 2 * ns.num_layers * tokens_per_prompt * ns.num_kv_heads * ns.head_dim * 2
        out["load"] = {
            "mbps": size * num_prompts / elapsed / 1e6,
            "us_per_op": elapsed / num_prompts * 1e6,
            "tcp_mbps": _tcp_mbps(ask["tcp"], size, num_prompts),
            "bytes": size,
        }
    return out


if __name__ == "__main__":
    if sys.argv[1] == "serve":
        serve(int(sys.argv[2]))
    else:
        print(json.dumps(measure(json.loads(sys.argv[2]))))
