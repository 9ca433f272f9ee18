"""Mooncake Store's Python API on kvstore: the same user script passes against real Mooncake and
against kvstore; each method against a real cluster; bad input typed; a dead node never yields
wrong bytes."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from kvstore.client.compat import mooncake as mc
from kvstore.client.compat.mooncake import (
    BufferHandle,
    ErrorCodes,
    MooncakeDistributedStore,
    ReplicateConfig,
)
from kvstore.errors import InvalidRequestError
from kvstore.processes import terminate
from tests.etcd_harness import etcd, ha_factory  # noqa: F401 - fixtures
from tests.support import wait_until

CONTRACT = Path(__file__).with_name("mooncake_contract.py")
MOONCAKE_WHEEL = "mooncake-transfer-engine-non-cuda==0.3.13.post1"
#: The real wheel's venv, made once per machine (the wheel is ~100 MB); rebuilt when broken.
MOONCAKE_VENV = Path(os.environ.get("KVSTORE_MOONCAKE_VENV", "/tmp/kvstore-mooncake-venv"))


def _run_contract(python: str, address: str, metadata: str, env: dict[str, str]) -> str:
    out = subprocess.run(
        [python, str(CONTRACT), address, metadata],
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, **env},
    )
    assert out.returncode == 0 and "contract ok" in out.stdout, out.stdout + out.stderr[-4000:]
    return out.stdout


def test_contract_script_passes_on_kvstore_through_the_import_alias(
    cluster_factory, tmp_path: Path
) -> None:
    """An unmodified program that imports ``mooncake.store`` runs on kvstore via the alias."""
    cluster = cluster_factory(num_nodes=1)
    alias = tmp_path / "alias"
    done = subprocess.run(
        [sys.executable, "-m", "kvstore.client.compat.mooncake", "--install-alias",
         "--target", str(alias)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert (alias / "mooncake" / "store.py").exists()
    # The script passes Mooncake's own master address; KVSTORE_MASTER points it at kvstore.
    _run_contract(
        sys.executable,
        "127.0.0.1:1",
        "http://127.0.0.1:1/metadata",
        {"PYTHONPATH": str(alias), "KVSTORE_MASTER": cluster.address},
    )
    assert mc.uninstall_alias(alias) is True
    assert not (alias / "mooncake").exists()
    assert mc.uninstall_alias(alias) is False


# ---------------------------------------------------------------- the real Mooncake
def _mooncake_python() -> str:
    """The real wheel's Python, installing it on first use; skips with the reason otherwise."""
    libs = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True).stdout
    if "libibverbs.so.1" not in libs:
        pytest.skip("Debian libibverbs1 is not installed: Mooncake's wheel cannot load")
    python = MOONCAKE_VENV / "bin" / "python"
    check = [str(python), "-c", "import mooncake.store, numpy"]
    if python.exists() and subprocess.run(check, capture_output=True).returncode == 0:
        return str(python)
    shutil.rmtree(MOONCAKE_VENV, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "venv", str(MOONCAKE_VENV)], check=True)
    pip = subprocess.run(
        [str(python), "-m", "pip", "install", "-q", MOONCAKE_WHEEL, "numpy"],
        capture_output=True,
        text=True,
        timeout=900,
    )
    if pip.returncode != 0 or subprocess.run(check, capture_output=True).returncode != 0:
        pytest.skip(f"{MOONCAKE_WHEEL} is not installable here: {pip.stderr[-500:]}")
    return str(python)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_port(port: int, proc: subprocess.Popen, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"mooncake process exited with {proc.returncode}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 1):
            return
        time.sleep(0.05)  # polling a port for readiness, bounded by the deadline
    raise TimeoutError(f"nothing listens on port {port}")


_STORAGE = """
import signal, sys, threading
from mooncake.store import MooncakeDistributedStore
store = MooncakeDistributedStore()
rc = store.setup("127.0.0.1", sys.argv[2], 256 << 20, 16 << 20, "tcp", "", sys.argv[1])
print("storage ready" if rc == 0 else f"setup failed {rc}", flush=True)
stop = threading.Event()
signal.signal(signal.SIGTERM, lambda *_: stop.set())
stop.wait()
store.close()
"""


@contextlib.contextmanager
def _mooncake_cluster(python: str, tmp: Path) -> Iterator[tuple[str, str]]:
    """``mooncake_master`` with its HTTP metadata server, plus one storage process."""
    rpc, http, metrics = _free_port(), _free_port(), _free_port()
    master_bin = Path(python).parent / "mooncake_master"
    log = (tmp / "master.log").open("w")
    master = subprocess.Popen(
        [str(master_bin), f"--rpc_port={rpc}", "--rpc_address=127.0.0.1",
         "--enable_http_metadata_server=true", "--http_metadata_server_host=127.0.0.1",
         f"--http_metadata_server_port={http}", f"--metrics_port={metrics}"],
        stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    storage = None
    try:
        _wait_port(rpc, master)
        _wait_port(http, master)
        address, metadata = f"127.0.0.1:{rpc}", f"http://127.0.0.1:{http}/metadata"
        script = tmp / "storage.py"
        script.write_text(_STORAGE)
        slog = tmp / "storage.log"
        storage = subprocess.Popen(
            [python, str(script), address, metadata],
            stdout=slog.open("w"),
            stderr=subprocess.STDOUT,
        )
        wait_until(
            lambda: "storage ready" in slog.read_text() or storage.poll() is not None,
            timeout=60,
            what="mooncake storage process",
        )
        assert "storage ready" in slog.read_text(), slog.read_text()[-2000:]
        yield address, metadata
    finally:
        if storage is not None:
            terminate(storage, timeout=15)
        terminate(master, timeout=15)
        log.close()


def _torch_for(python: str, tmp: Path) -> dict[str, str]:
    """``PYTHONPATH`` that lends this interpreter's torch to the wheel's venv (same Python), so
    the contract's tensor methods run against the wheel too; empty where it cannot."""
    probe = [python, "-c", "import sys; print(sys.version_info[:2])"]
    theirs = subprocess.run(probe, capture_output=True, text=True).stdout.strip()
    if theirs != str(sys.version_info[:2]):
        return {}
    lent = tmp / "lent-torch"
    lent.mkdir()
    for name in ("torch", "torchgen", "sympy", "mpmath", "networkx", "jinja2", "markupsafe",
                 "filelock", "fsspec"):  # fmt: skip
        module = __import__(name)
        (lent / name).symlink_to(Path(module.__file__).parent)
    return {"PYTHONPATH": str(lent)}


def test_contract_script_passes_on_real_mooncake(tmp_path: Path) -> None:
    """The same script, unchanged, against the real wheel: the codes asserted are Mooncake's."""
    python = _mooncake_python()
    with _mooncake_cluster(python, tmp_path) as (address, metadata):
        lent = _torch_for(python, tmp_path)
        out = _run_contract(python, address, metadata, lent)
    assert not lent or "torch is not importable" not in out  # the tensor methods ran too


# ---------------------------------------------------------------- methods one by one
@pytest.fixture
def store(cluster_factory) -> Iterator[MooncakeDistributedStore]:
    cluster = cluster_factory()
    s = MooncakeDistributedStore()
    assert s.setup("127.0.0.1", "", 0, 16 << 20, "tcp", "", cluster.address) == 0
    yield s
    s.close()


def test_setup_reports_codes_and_follows_etcd(ha_factory) -> None:  # noqa: F811
    s = MooncakeDistributedStore()
    assert s.health_check() == 1
    assert s.put("k", b"v") == ErrorCodes.INTERNAL_ERROR  # not set up: no exception
    assert s.setup("127.0.0.1", "", 0, 0, "tcp", "", "") == ErrorCodes.INVALID_PARAMS
    assert s.setup("127.0.0.1", "", 0, 0, "tcp", "", "127.0.0.1:1") == ErrorCodes.RPC_FAIL
    cluster = ha_factory(num_masters=1, num_nodes=1)
    # The master found through etcd, given either as the master or as the metadata server.
    assert s.setup({"local_hostname": "h1", "metadata_server": cluster.url}) == 0
    assert re.fullmatch(r"h1:\d+", s.get_hostname())  # the wheel's host:port form
    assert s.health_check() == 0
    assert s.put("e/k", b"through etcd") == 0
    assert s.get("e/k") == b"through etcd"
    assert s.close() == 0
    assert s.health_check() == 1


def test_init_all_and_upserts_from_buffers(cluster_factory, monkeypatch) -> None:
    cluster = cluster_factory(num_nodes=1)
    monkeypatch.setenv("KVSTORE_MASTER", cluster.address)  # init_all has no address argument
    s = MooncakeDistributedStore()
    assert s.init_all("tcp", "", 16 << 20) == 0
    try:
        a = np.frombuffer(b"first-value-----second-value----", dtype=np.uint8).copy()
        assert s.put_from("u", a.ctypes.data, 16) == 0
        assert s.put_from("u", a.ctypes.data + 16, 16) == 0  # kept: Mooncake's put rule
        assert s.get("u") == b"first-value-----"
        assert s.upsert_from("u", a.ctypes.data + 16, 16) == 0  # replaced
        assert s.get("u") == b"second-value----"
        assert s.batch_upsert_from(["u", "v"], [a.ctypes.data] * 2, [16, 8]) == [0, 0]
        assert s.get_batch(["u", "v"]) == [b"first-value-----", b"first-va"]
        assert s.upsert_batch(["u"], [b"x"]) == 0 and s.get("u") == b"x"
        assert s.upsert("", b"x") == ErrorCodes.INVALID_PARAMS
    finally:
        s.close()


def test_bad_input_gets_codes_and_stores_nothing(store: MooncakeDistributedStore) -> None:
    assert store.put("", b"v") == ErrorCodes.INVALID_PARAMS
    with pytest.raises(TypeError):  # the wheel's binding refuses what is not bytes-like
        store.put("k", 12345)
    assert store.put("k" * 600, b"v") == ErrorCodes.INVALID_PARAMS  # past kvstore's key limit
    assert store.put_from("k", 0, 10) == ErrorCodes.INVALID_PARAMS
    with pytest.raises(TypeError):  # a negative size is not a uint64 to the wheel's binding
        store.put_from("k", 4096, -1)
    assert store.get_into("k", 0, 10) == ErrorCodes.INVALID_PARAMS
    assert store.batch_put_from(["a", "b"], [1], [1, 2]) == [ErrorCodes.INVALID_PARAMS] * 2
    assert store.batch_get_into(["a"], [1, 2], [1]) == [ErrorCodes.INVALID_PARAMS]
    assert store.put_batch(["a"], [b"1", b"2"]) == ErrorCodes.INVALID_PARAMS
    with pytest.raises(TypeError):
        store.put_parts("k", b"a", 5)
    assert store.put_tensor("k", [1, 2]) == ErrorCodes.INVALID_PARAMS
    assert store.register_buffer(0, 10) == ErrorCodes.INVALID_PARAMS
    with pytest.raises(TypeError):
        store.remove_by_regex(None)  # type: ignore[arg-type]
    assert store.batch_is_exist(["k", "a", "b"]) == [0, 0, 0]


def test_buffers_batches_and_multi_buffers_round_trip(store: MooncakeDistributedStore) -> None:
    rng = np.random.default_rng(7)
    src = rng.integers(0, 256, 1 << 20, dtype=np.uint8)
    dst = np.zeros_like(src)
    p, q = src.ctypes.data, dst.ctypes.data
    assert store.register_buffer(p, src.nbytes) == 0
    assert store.register_buffer(q, dst.nbytes) == 0
    keys = [f"m/{i}" for i in range(8)]
    size = 64 << 10
    assert store.batch_put_from(keys, [p + i * size for i in range(8)], [size] * 8) == [0] * 8
    assert store.batch_get_into(keys, [q + i * size for i in range(8)], [size] * 8) == [size] * 8
    assert np.array_equal(src[: 8 * size], dst[: 8 * size])
    # An object from three scattered pieces, read back into three other pieces.
    pieces = [(p + 1000, 100), (p + 50_000, 3000), (p + 900_000, 7)]
    rc = store.batch_put_from_multi_buffers(
        ["mb"], [[a for a, _ in pieces]], [[n for _, n in pieces]]
    )
    assert rc == [0]
    want = np.concatenate([src[1000:1100], src[50_000:53_000], src[900_000:900_007]])
    assert store.get("mb") == want.tobytes()
    dst[:] = 0
    outs = [(q + 10, 7), (q + 5000, 3000), (q + 200_000, 100)]
    got = store.batch_get_into_multi_buffers(
        ["mb", "nope"], [[a for a, _ in outs], [q]], [[n for _, n in outs], [10]]
    )
    assert got == [3107, ErrorCodes.OBJECT_NOT_FOUND]
    back = np.concatenate([dst[10:17], dst[5000:8000], dst[200_000:200_100]])
    assert np.array_equal(back, want)
    assert store.unregister_buffer(p) == 0 and store.unregister_buffer(q) == 0


def test_put_batch_of_mixed_sizes_stores_every_key(store: MooncakeDistributedStore) -> None:
    """A KV engine's batch: blocks and metadata of several sizes, spread over two nodes."""
    sizes = [4096, 65536, 200_000]
    for n in (2, 9, 65):
        keys = [f"mixed/{n}/{i}" for i in range(n)]
        values = [os.urandom(sizes[i % 3]) for i in range(n)]
        assert store.put_batch(keys, values) == 0
        assert store.get_batch(keys) == values


def test_handles_tensors_sizes_and_replicas(cluster_factory) -> None:
    cluster = cluster_factory(num_nodes=2)
    s = MooncakeDistributedStore()
    assert s.setup("h", "", 0, 16 << 20, "tcp", "", cluster.address) == 0
    try:
        cfg = ReplicateConfig()
        cfg.replica_num = 2
        assert s.put("r2", b"x" * 5000, cfg) == 0
        assert len(s.client.locate("r2").locations) == 2
        h = s.get_buffer("r2")
        assert isinstance(h, BufferHandle) and h.size() == 5000 and h.ptr() != 0
        assert bytes(memoryview(h)) == b"x" * 5000
        for dtype in (torch.float16, torch.bfloat16, torch.int64, torch.float32):
            t = torch.arange(24).to(dtype).reshape(2, 3, 4)
            assert s.put_tensor(f"t/{dtype}", t) == 0
            back = s.get_tensor(f"t/{dtype}")
            assert back.dtype == dtype and torch.equal(back, t)
        assert s.batch_put_tensor(["t/a", "t/b"], [torch.ones(3), torch.zeros(0)]) == [0, 0]
        a, b, miss = s.batch_get_tensor(["t/a", "t/b", "t/none"])
        assert torch.equal(a, torch.ones(3)) and b.numel() == 0 and miss is None
        s.put("raw", b"not a tensor")
        assert s.get_tensor("raw") is None
        assert s.get_size("t/a") > 12
        assert s.upsert_parts("raw", b"a", b"b") == 0 and s.get("raw") == b"ab"
        assert s.batch_remove(["raw", "raw"]) == [0, ErrorCodes.OBJECT_NOT_FOUND]
    finally:
        s.close()


def test_a_killed_node_gives_misses_never_wrong_bytes(cluster_factory) -> None:
    cluster = cluster_factory(num_nodes=2)
    s = MooncakeDistributedStore()
    assert s.setup("h", "", 0, 16 << 20, "tcp", "", cluster.address) == 0
    try:
        keys = [f"k/{i}" for i in range(32)]
        vals = [bytes([i]) * 40_000 for i in range(32)]
        assert s.put_batch(keys, vals) == 0
        cluster.nodes[0].kill()
        buf = np.zeros(40_000 * 32, dtype=np.uint8)
        got = s.batch_get_into(keys, [buf.ctypes.data + i * 40_000 for i in range(32)],
                               [40_000] * 32)  # fmt: skip
        lost = [i for i, n in enumerate(got) if n < 0]
        assert lost, "one of two nodes died: some keys must be gone"
        for i, n in enumerate(got):
            if n >= 0:
                assert n == 40_000 and bytes(buf[i * 40_000 : (i + 1) * 40_000]) == vals[i]
        for i, data in enumerate(s.get_batch(keys)):
            assert data in (b"", vals[i])
    finally:
        s.close()


def test_install_alias_refuses_a_real_mooncake_package(tmp_path: Path) -> None:
    real = tmp_path / "mooncake"
    real.mkdir()
    (real / "__init__.py").write_text("# the real wheel\n")
    with pytest.raises(InvalidRequestError):
        mc.install_alias(tmp_path)
    assert (real / "__init__.py").read_text() == "# the real wheel\n"
    assert mc.uninstall_alias(tmp_path) is False  # not ours: left alone
    assert mc.main(["--install-alias", "--target", str(tmp_path)]) == 2


# ---------------------------------------------------------------- get_tensor's bad headers
def _tensor_object(header: object, body: bytes) -> bytes:
    """A ``put_tensor`` object by hand: kvstore's magic, then ``header`` as JSON, then ``body``."""
    head = json.dumps(header).encode()
    return b"KVT1" + struct.pack("<I", len(head)) + head + body


@pytest.mark.parametrize(
    ("name", "raw"),
    [
        ("shape beyond the body", _tensor_object({"dtype": "float32", "shape": [4, 4]}, bytes(16))),
        ("body beyond the shape", _tensor_object({"dtype": "float32", "shape": [2]}, bytes(16))),
        ("negative shape", _tensor_object({"dtype": "float32", "shape": [-2, -2]}, bytes(16))),
        ("fractional shape", _tensor_object({"dtype": "float32", "shape": [1.5]}, bytes(4))),
        ("list header", _tensor_object(["float32", [2]], bytes(8))),
        ("unknown dtype", _tensor_object({"dtype": "float33", "shape": [2]}, bytes(8))),
        ("torch attribute as dtype", _tensor_object({"dtype": "Tensor", "shape": [2]}, bytes(8))),
        ("body not a multiple of the dtype", _tensor_object({"dtype": "int64", "shape": [1]}, bytes(7))),
        ("header past the object", b"KVT1" + struct.pack("<I", 1000) + b"{}"),
        ("header not JSON", b"KVT1" + struct.pack("<I", 3) + b"\xff\xfe{" + bytes(8)),
        ("magic only", b"KVT1"),
    ],
)  # fmt: skip
def test_get_tensor_of_a_bad_header_is_none_and_spares_the_batch(
    store: MooncakeDistributedStore, name: str, raw: bytes
) -> None:
    """Mooncake's contract: None for what cannot be returned, per key in a batch."""
    assert store.put("bad", raw) == 0
    assert store.put_tensor("good/1", torch.arange(3)) == 0
    assert store.put_tensor("good/2", torch.ones(2, 2)) == 0
    assert store.get_tensor("bad") is None, name
    first, bad, second = store.batch_get_tensor(["good/1", "bad", "good/2"])
    assert bad is None, name
    assert torch.equal(first, torch.arange(3)) and torch.equal(second, torch.ones(2, 2))
    buf = np.zeros(4096, dtype=np.uint8)
    assert store.get_tensor_into("bad", buf.ctypes.data, buf.nbytes) is None, name
    assert store.put_tensor_from("bad/copy", store.get_buffer("bad").ptr(), len(raw)) == (
        ErrorCodes.INVALID_PARAMS
    )


def test_tensor_variants_follow_the_wheel(store: MooncakeDistributedStore) -> None:
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    assert store.put_tensor("t/cx", torch.ones(2, dtype=torch.complex64)) == -600
    assert store.put_tensor("t/0d", torch.tensor(7.0)) == 0
    assert tuple(store.get_tensor("t/0d").shape) == (1,)  # the wheel stores 0-d as (1,)
    assert store.pub_tensor("t/p", t) == 0 and store.upsert_pub_tensor("t/p", t * 2) == 0
    assert torch.equal(store.get_tensor("t/p"), t * 2)
    buf = np.zeros(1 << 16, dtype=np.uint8)
    view = store.get_tensor_into("t/p", buf.ctypes.data, buf.nbytes)
    assert torch.equal(view, t * 2)
    view[0, 0] = 99.0  # a view of the caller's buffer, not a copy
    assert store.put_tensor_from("t/from", buf.ctypes.data, store.get_size("t/p")) == 0
    assert store.get_tensor("t/from")[0, 0].item() == 99.0
    assert store.batch_put_tensor_from(["t/x"], [buf.ctypes.data], [10]) == [-600]


# ---------------------------------------------------------------- get_into_ranges
def test_get_into_ranges_follows_the_wheel(store: MooncakeDistributedStore) -> None:
    assert store.put("r/a", bytes(range(100))) == 0
    buf = np.zeros(4096, dtype=np.uint8)
    p = buf.ctypes.data
    args = ([p], [["r/a", "r/miss"]], [[[0, 10], [20]]], [[[5, 90], [0]]], [[[4, 20], [1]]])
    assert store.get_into_ranges(*args) == [[[-600, -600], [-600]]]  # not registered
    assert store.register_buffer(p, buf.nbytes) == 0
    assert store.get_into_ranges(*args) == [[[4, -600], [-704]]]  # past the object, a miss
    assert bytes(buf[:4]) == bytes([5, 6, 7, 8])
    assert store.get_into_ranges([p + 4090], [["r/a"]], [[[0, 2]]], [[[0, 0]]], [[[6, 6]]]) == [
        [[6, -600]]  # the second range ends past the registered buffer
    ]
    assert store.get_into_ranges([p, p], [["r/a"]], [[[0]]], [[[0]]], [[[1]]]) == [
        [[-600]],
        [[-600]],
    ]
    with pytest.raises(TypeError):
        store.get_into_ranges([p], [["r/a"]], [[[0]]], [[[-1]]], [[[1]]])
    with pytest.raises(TypeError):
        store.get_into_ranges([p], [[5]], [[[0]]], [[[0]]], [[[1]]])  # type: ignore[list-item]


# ---------------------------------------------------------------- setup, buffers, close
def test_setup_config_sizes_are_read_as_the_wheel_reads_them(cluster_factory) -> None:
    cluster = cluster_factory(num_nodes=1)
    base = {"local_hostname": "h", "metadata_server": "http://unused", "global_segment_size": 0,
            "master_server_addr": cluster.address}  # fmt: skip
    # Each row was measured on the wheel: (config entries, setup's answer).
    table = [
        ({"global_segment_size": "50%"}, -600), ({"local_buffer_size": "50%"}, -600),
        ({"global_segment_size": "16MiB"}, -600), ({"global_segment_size": "16MB16"}, -600),
        ({"global_segment_size": True}, -600), ({"global_segment_size": None}, -600),
        ({"global_segment_size": -1}, -600), ({"global_segment_size": "-16MB"}, -600),
        ({"global_segment_size": "16.0"}, -600), ({"global_segment_size": "1KB"}, -600),
        ({"global_segment_size": "15.9M"}, -600), ({"local_buffer_size": 1000}, -600),
        ({"local_buffer_size": 1.0}, -600), ({"local_buffer_size": "1.0001TB"}, -600),
        ({"local_hostname": ""}, -600), ({"metadata_server": ""}, -600),
        ({"protocol": "TCP"}, -1), ({"protocol": "nvlink"}, -1),
        ({"global_segment_size": "16MB"}, 0), ({"global_segment_size": " 16 mb "}, 0),
        ({"global_segment_size": "1.5GB"}, 0), ({"global_segment_size": ".5g"}, 0),
        ({"global_segment_size": 16 << 20}, 0), ({"global_segment_size": "0.0"}, 0),
        ({"local_buffer_size": "1 kb"}, 0), ({"local_buffer_size": 0}, 0),
        ({"protocol": "rdma"}, 0), ({"local_hostname": 5}, 0),
    ]  # fmt: skip
    for extra, want in table:
        s = MooncakeDistributedStore()
        assert s.setup({**base, **extra}) == want, extra
        s.close()
    s = MooncakeDistributedStore()
    with pytest.raises(TypeError):
        s.setup("h", "", "16MB", 0, "tcp", "", cluster.address)  # type: ignore[arg-type]
    assert s.setup("h", "", 1 << 20, 0, "tcp", "", cluster.address) == -600  # below 16 MiB
    assert s.setup("h:4242", "", 0, 1000, "tcp", "", cluster.address) == 0  # positional: no floor
    assert s.get_hostname() == "h:4242"
    assert s.init_all("tcp", "", 16 << 20) == -600  # already set up
    s.close()


def test_a_store_without_a_local_buffer_refuses_copying_verbs(cluster_factory) -> None:
    cluster = cluster_factory(num_nodes=1)
    writer, s = MooncakeDistributedStore(), MooncakeDistributedStore()
    assert writer.setup("w", "", 0, 16 << 20, "tcp", "", cluster.address) == 0
    assert s.setup("z", "", 0, 0, "tcp", "", cluster.address) == 0
    try:
        assert writer.put("z/k", b"abc") == 0 and writer.put_tensor("z/t", torch.ones(2)) == 0
        assert s.put("z/a", b"x") == -600 and s.put_batch(["z/a"], [b"x"]) == -600
        assert s.upsert("z/k", b"y") == -600 and s.put_parts("z/a", b"x") == -600
        assert s.put_tensor("z/b", torch.ones(2)) == -200  # the wheel's tensor puts answer -200
        assert s.is_exist("z/a") == 0 and s.get("z/k") == b"abc"[:0]
        assert s.get_buffer("z/k") is None and s.get_tensor("z/t") is None
        buf = np.zeros(1024, dtype=np.uint8)
        assert s.put_from("z/c", buf.ctypes.data, 10) == 0  # zero-copy verbs need no buffer
        assert s.get_into("z/k", buf.ctypes.data, 1024) == 3
        assert torch.equal(s.get_tensor_into("z/t", buf.ctypes.data, 1024), torch.ones(2))
    finally:
        s.close()
        writer.close()


def test_close_leaves_what_the_client_stored_readable(cluster_factory) -> None:
    """kvstore's storage nodes hold the objects, not the client (unlike Mooncake, where a
    closing client's own segment goes with it): a deliberate, documented difference."""
    cluster = cluster_factory(num_nodes=1)
    writer, reader = MooncakeDistributedStore(), MooncakeDistributedStore()
    assert writer.setup("w", "", 64 << 20, 16 << 20, "tcp", "", cluster.address) == 0
    assert reader.setup("r", "", 0, 16 << 20, "tcp", "", cluster.address) == 0
    try:
        cfg = ReplicateConfig()
        cfg.preferred_segment = writer.get_hostname()
        assert writer.put("c/own", b"kept", cfg) == 0
        assert writer.close() == 0
        assert reader.get("c/own") == b"kept" and reader.is_exist("c/own") == 1
    finally:
        reader.close()
