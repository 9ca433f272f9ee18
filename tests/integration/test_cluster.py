"""A master, storage nodes and client processes over real sockets."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from kvstore import protocol
from kvstore.client import Client
from kvstore.errors import (
    InvalidRequestError,
    KeyNotFoundError,
    KVStoreError,
    NodeUnavailableError,
    NoSpaceError,
)
from tests.support import wait_until

SIZES = [0, 1, 63, 64, 65, 4096, 65536 + 7, 1 << 20, (3 << 20) + 5, 16 << 20, 64 << 20]


def test_round_trips_of_random_sizes_across_two_nodes(cluster_factory) -> None:
    cluster = cluster_factory(num_nodes=2, dram="160MiB")
    rng = np.random.default_rng(1)
    with Client.connect(cluster.address) as c:
        for i, size in enumerate(SIZES):
            value = rng.integers(0, 256, size, dtype=np.uint8).tobytes()
            c.put(f"obj/{i}", value)
            assert c.get(f"obj/{i}") == value
            buf = bytearray(size + 10)
            assert c.get_into(f"obj/{i}", buf) == size
            assert bytes(buf[:size]) == value
        nodes = c.stats()["nodes"]
        assert len(nodes) == 2
        assert all(seg["used_bytes"] > 0 for n in nodes for seg in n["segments"]), (
            "placement used one node only"
        )


def test_batches_report_per_key(cluster_factory) -> None:
    cluster = cluster_factory(num_nodes=2, dram="32MiB")
    with Client.connect(cluster.address) as c:
        keys = [f"b/{i}" for i in range(200)]
        values = [os.urandom(random.Random(i).randrange(0, 20000)) for i in range(200)]
        assert c.batch_put(keys, values) == [None] * 200
        assert c.batch_get(keys) == values
        bufs = [bytearray(len(v)) for v in values]
        assert c.batch_get_into(keys, bufs) == [len(v) for v in values]
        assert [bytes(b) for b in bufs] == values
        assert c.batch_exists([*keys[:3], "missing"]) == [True, True, True, False]

        mixed = c.batch_get(["b/1", "missing", ""])
        assert mixed[0] == values[1]
        assert isinstance(mixed[1], KeyNotFoundError)
        assert isinstance(mixed[2], InvalidRequestError)

        small = c.batch_get_into(["b/5", "b/6"], [bytearray(0), bytearray(len(values[6]))])
        assert isinstance(small[0], InvalidRequestError) or len(values[5]) == 0
        assert small[1] == len(values[6])

        # Too big for any node: that key fails, the others land.
        res = c.batch_put(["fits", "huge"], [b"x" * 100, bytes(40 << 20)])
        assert res[0] is None and isinstance(res[1], NoSpaceError)
        assert not c.exists("huge")


def test_numpy_and_torch_buffers(cluster_factory) -> None:
    torch = pytest.importorskip("torch")
    cluster = cluster_factory(num_nodes=1, dram="64MiB")
    with Client.connect(cluster.address) as c:
        arr = np.random.default_rng(0).standard_normal((64, 8, 128)).astype(np.float16)
        c.put("np", arr)
        out = np.empty_like(arr)
        assert c.get_into("np", out) == arr.nbytes
        assert np.array_equal(out, arr)
        for dtype in (torch.float16, torch.bfloat16, torch.float32):
            t = torch.randn(16, 4, 32).to(dtype)
            c.put(f"t/{dtype}", t)
            dest = torch.empty_like(t)
            assert c.get_into(f"t/{dtype}", dest) == t.numel() * t.element_size()
            assert torch.equal(dest, t)
        with pytest.raises(InvalidRequestError):
            c.put("nc", torch.randn(8, 8).t())  # not contiguous


def test_overwrite_replaces_and_frees_old_space(cluster_factory) -> None:
    """Overwrite semantics: the last committed put wins; the old version's space is freed
    (once the read lease of the get before it has ended)."""
    cluster = cluster_factory(num_nodes=1, dram="16MiB", master_args=("--lease", "0.2"))
    with Client.connect(cluster.address) as c:
        for round_ in range(6):  # 6 x 4 MiB > 16 MiB: only works if old versions are freed
            value = bytes([round_]) * (4 << 20)
            c.put("same", value)
            assert c.get("same") == value
            wait_until(lambda: c.stats()["used_bytes"] == 4 << 20, what="old version freed")
        c.remove("same")
        wait_until(lambda: c.stats()["used_bytes"] == 0, what="removed object freed")
        with pytest.raises(KeyNotFoundError):
            c.get("same")
        with pytest.raises(KeyNotFoundError):
            c.remove("same")


WRITER = textwrap.dedent(
    """
    import hashlib, sys
    from kvstore.client import Client
    addr, wid, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    c = Client.connect(addr)
    for i in range(n):
        v = hashlib.sha256(f"{wid}/{i}".encode()).digest() * (1 + (i * 37) % 500)
        c.put(f"w{wid}/{i}", v)
    keys = [f"w{wid}/{i}" for i in range(n)]
    vals = [hashlib.sha256(k[1:].encode()).digest() for k in keys]
    got = c.batch_get(keys)
    assert all(g == v * (1 + (i * 37) % 500) for i, (g, v) in enumerate(zip(got, vals))), "bad read-back"
    c.close()
    print("ok")
    """
)


def test_concurrent_writer_processes(cluster_factory) -> None:
    cluster = cluster_factory(num_nodes=2, dram="64MiB")
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", WRITER, cluster.address, str(w), "150"],
            stdout=subprocess.PIPE,
            text=True,
        )
        for w in range(4)
    ]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [0] * 4, outs
    with Client.connect(cluster.address) as c:
        assert c.stats()["num_objects"] == 600


def test_kill_9_of_a_node(cluster_factory) -> None:
    cluster = cluster_factory(
        num_nodes=2, dram="32MiB", master_args=("--node-ttl", "1.0", "--heartbeat-interval", "0.2")
    )
    victim = cluster.nodes[0]
    victim_data = victim.field("data")
    with Client.connect(cluster.address) as c:
        keys = [f"k/{i}" for i in range(100)]
        values = [os.urandom(1000 + i) for i in range(100)]
        assert c.batch_put(keys, values) == [None] * 100
        infos = c._reads.locate([k.encode() for k in keys])
        on_victim = {
            k
            for k, info in zip(keys, infos, strict=True)
            if f"{info.locations[0].host}:{info.locations[0].port}" == victim_data
        }
        assert 0 < len(on_victim) < 100

        victim.kill()
        # Right after the kill: the victim's keys fail cleanly, never with wrong bytes.
        got = c.batch_get(keys)
        for k, v, g in zip(keys, values, got, strict=True):
            if k in on_victim:
                assert isinstance(g, NodeUnavailableError | KeyNotFoundError), g
            else:
                assert g == v
        # Once the master notices, the victim's keys are plain misses and puts go to the survivor.
        wait_until(lambda: c.stats()["num_nodes"] == 1, timeout=15, what="node declared dead")
        got = c.batch_get(keys)
        for k, v, g in zip(keys, values, got, strict=True):
            assert isinstance(g, KeyNotFoundError) if k in on_victim else g == v
        assert c.batch_put(["after/1", "after/2"], [b"a", b"b"]) == [None, None]
        assert c.batch_get(["after/1", "after/2"]) == [b"a", b"b"]


def test_interrupted_put_stays_invisible_and_space_returns(cluster_factory) -> None:
    cluster = cluster_factory(num_nodes=1, dram="16MiB", master_args=("--put-timeout", "1.0"))
    with Client.connect(cluster.address) as c:
        # A writer that allocates, sends half its bytes, and vanishes.
        ctl = protocol.FramedSocket.connect(*cluster.address.split(":"), timeout=5)
        ticket = ctl.call("put_start", {"keys": [b"torn"], "sizes": [8 << 20]})[0]
        assert ticket[0] == 0
        loc = ticket[1][1][0]
        data = protocol.FramedSocket.connect(loc[1], loc[2], timeout=5)
        frame = protocol.encode_request(1, "write", {"items": [[loc[3], 0, 8 << 20, 0]]}, 8 << 20)
        data.send_frame(frame, [bytes(4 << 20)])
        data.close()
        ctl.close()

        assert not c.exists("torn")
        with pytest.raises(KeyNotFoundError):
            c.get("torn")
        assert c.stats()["num_pending"] == 1
        wait_until(lambda: c.stats()["num_pending"] == 0, timeout=10, what="pending put reclaimed")
        assert c.stats()["used_bytes"] == 0
        assert c.stats()["num_reclaimed"] == 1
        # The space is really back: a put the size of the whole arena fits.
        c.put("whole", bytes(16 << 20))
        assert not c.exists("torn")


def test_errors_are_typed(cluster_factory) -> None:
    cluster = cluster_factory(num_nodes=1, dram="8MiB")
    with Client.connect(cluster.address) as c:
        with pytest.raises(InvalidRequestError):
            c.put("", b"x")
        with pytest.raises(InvalidRequestError):
            c.put("k" * 512, b"x")
        with pytest.raises(InvalidRequestError):
            c.put("k", 12345)
        with pytest.raises(NoSpaceError):
            c.put("k", bytes(9 << 20))
        with pytest.raises(KeyNotFoundError):
            c.get("nothing")
        with pytest.raises(InvalidRequestError):
            c.get_into("nothing", b"read-only")
    with pytest.raises(KVStoreError):
        Client.connect("127.0.0.1:1", timeout=2)
    with pytest.raises(InvalidRequestError):
        Client.connect("no-port-here")


def test_only_node_dying_under_a_put_says_node_unavailable(cluster_factory) -> None:
    """The only node dies after the master placed the batch on it: the keys fail with
    NodeUnavailableError (the truth), not the NoSpaceError of the retry that had nowhere to go."""
    cluster = cluster_factory(
        num_nodes=1, dram="16MiB", master_args=("--node-ttl", "60", "--heartbeat-interval", "0.2")
    )
    with Client.connect(cluster.address) as c:
        assert c.batch_put(["warm"], [b"x"]) == [None]  # the data connection exists
        cluster.nodes[0].kill()
        # --node-ttl 60: the master still places on the dead node; its write fails.
        assert c.stats()["num_nodes"] == 1
        got = c.batch_put([f"k/{i}" for i in range(8)], [os.urandom(4096)] * 8)
        assert all(isinstance(g, NodeUnavailableError) for g in got), got
        assert not c.exists("k/0")
