"""Mooncake Store's Python API, as a user program sees it: one script, two stores.

Run (never by pytest directly; tests/client/compat/test_mooncake.py runs it):
    python mooncake_contract.py MASTER_ADDRESS METADATA_URL

It imports ``mooncake.store`` and nothing from this repository, so the same file runs under the
real wheel (``mooncake-transfer-engine-non-cuda``, against ``mooncake_master`` and a storage
process) and under kvstore's compat layer (through the ``mooncake`` alias package, against a
kvstore cluster). Every assertion is a return value Mooncake 0.3.13 gives. Every public method
of the wheel is named: either the script calls it (``CALLED`` is checked at the end) or it is in
``SKIPPED`` with the reason, the list docs/engines/mooncake.md documents. Where kvstore's
lease rule differs (remove right after a read), both answers are accepted. Prints
``contract ok``.
"""

from __future__ import annotations

import socket
import sys
from typing import Any

import numpy as np
from mooncake.store import MooncakeDistributedStore, ReplicateConfig

INTERNAL_ERROR = -1
NO_AVAILABLE_HANDLE = -200
INVALID_PARAMS = -600
OBJECT_NOT_FOUND = -704
OBJECT_HAS_LEASE = -706

#: Every public method of ``MooncakeDistributedStore`` in the 0.3.13.post1 wheel.
WHEEL_METHODS = frozenset(
    [
        "alloc_from_mem_pool",
        "allocate_and_mount_segment",
        "batch_get_buffer",
        "batch_get_into",
        "batch_get_into_multi_buffer_ranges",
        "batch_get_into_multi_buffers",
        "batch_get_replica_desc",
        "batch_get_session_end",
        "batch_get_session_start",
        "batch_get_tensor",
        "batch_get_tensor_into",
        "batch_get_tensor_into_cuda",
        "batch_get_tensor_with_parallelism",
        "batch_get_tensor_with_parallelism_into",
        "batch_get_tensor_with_tp",
        "batch_get_tensor_with_tp_into",
        "batch_is_exist",
        "batch_pub_tensor",
        "batch_pub_tensor_with_tp",
        "batch_put_from",
        "batch_put_from_multi_buffer_ranges",
        "batch_put_from_multi_buffers",
        "batch_put_session_end",
        "batch_put_session_revoke",
        "batch_put_session_start",
        "batch_put_tensor",
        "batch_put_tensor_from",
        "batch_put_tensor_with_parallelism",
        "batch_put_tensor_with_parallelism_from",
        "batch_put_tensor_with_tp",
        "batch_put_tensor_with_tp_from",
        "batch_remove",
        "batch_replica_clear",
        "batch_upsert_from",
        "batch_upsert_pub_tensor",
        "batch_upsert_tensor",
        "batch_upsert_tensor_from",
        "batch_upsert_tensor_with_parallelism",
        "batch_upsert_tensor_with_parallelism_from",
        "close",
        "create_copy_task",
        "create_move_task",
        "get",
        "get_batch",
        "get_buffer",
        "get_hostname",
        "get_into",
        "get_into_ranges",
        "get_offload_rpc_read_count",
        "get_replica_desc",
        "get_size",
        "get_tensor",
        "get_tensor_into",
        "get_tensor_into_cuda",
        "get_tensor_with_parallelism",
        "get_tensor_with_parallelism_into",
        "get_tensor_with_tp",
        "get_tensor_with_tp_into",
        "health_check",
        "init_all",
        "is_exist",
        "load_tensor_from_safetensor",
        "mount_segment",
        "pub_tensor",
        "pub_tensor_with_tp",
        "put",
        "put_batch",
        "put_from",
        "put_from_with_metadata",
        "put_parts",
        "put_tensor",
        "put_tensor_from",
        "put_tensor_with_parallelism",
        "put_tensor_with_parallelism_from",
        "put_tensor_with_tp",
        "put_tensor_with_tp_from",
        "query_task",
        "register_buffer",
        "remove",
        "remove_all",
        "remove_by_regex",
        "save_tensor_to_safetensor",
        "setup",
        "setup_dummy",
        "unmount_and_free_segment",
        "unmount_local_disk_segment",
        "unmount_segment",
        "unregister_buffer",
        "upsert",
        "upsert_batch",
        "upsert_from",
        "upsert_parts",
        "upsert_pub_tensor",
        "upsert_tensor",
        "upsert_tensor_from",
        "upsert_tensor_with_parallelism",
        "upsert_tensor_with_parallelism_from",
    ]
)

_SEGMENTS = "segment mounting and SSD offload: kvstore's storage nodes own memory and disks"
_SESSIONS = "put/get sessions (reserve, then ranged transfers): not covered by the drop-in"
_TASKS = "replica copy/move tasks and replica clearing: kvstore's master places replicas"
_DESCRIPTORS = "Mooncake's ReplicaDescriptor types; kvstore's answer is store.client.locate"
_TP = "tensor-parallel and 'parallelism' tensor variants: not covered by the drop-in"
_CUDA = "CUDA tensors: the wheel here is the non-CUDA build and the machine has no GPU"
_DUMMY = "the dummy client that borrows a real client's memory over IPC: no kvstore counterpart"
_SAFETENSORS = "safetensors files: not covered by the drop-in"

#: The wheel's methods this script does not call, each with the reason (docs/engines/mooncake.md lists them).
SKIPPED: dict[str, str] = {
    "alloc_from_mem_pool": _DUMMY,
    "setup_dummy": _DUMMY,
    "allocate_and_mount_segment": _SEGMENTS,
    "mount_segment": _SEGMENTS,
    "unmount_segment": _SEGMENTS,
    "unmount_and_free_segment": _SEGMENTS,
    "unmount_local_disk_segment": _SEGMENTS,
    "batch_get_replica_desc": _DESCRIPTORS,
    "get_replica_desc": _DESCRIPTORS,
    "batch_get_session_start": _SESSIONS,
    "batch_get_session_end": _SESSIONS,
    "batch_put_session_start": _SESSIONS,
    "batch_put_session_end": _SESSIONS,
    "batch_put_session_revoke": _SESSIONS,
    "batch_get_into_multi_buffer_ranges": _SESSIONS,
    "batch_put_from_multi_buffer_ranges": _SESSIONS,
    "batch_replica_clear": _TASKS,
    "create_copy_task": _TASKS,
    "create_move_task": _TASKS,
    "query_task": _TASKS,
    "get_tensor_into_cuda": _CUDA,
    "batch_get_tensor_into_cuda": _CUDA,
    "load_tensor_from_safetensor": _SAFETENSORS,
    "save_tensor_to_safetensor": _SAFETENSORS,
    **{name: _TP for name in WHEEL_METHODS if "_with_tp" in name or "_with_parallelism" in name},
}

#: The wheel's methods this script called (through :class:`Recorder`).
CALLED: set[str] = set()


class Recorder:
    """A store whose method calls are noted in CALLED (so the script proves what it covers)."""

    def __init__(self, store: Any) -> None:
        self._store = store

    def __getattr__(self, name: str) -> Any:
        CALLED.add(name)
        return getattr(self._store, name)


def eq(got: object, want: object, what: str) -> None:
    if got != want:
        raise AssertionError(f"{what}: got {got!r}, want {want!r}")


def raises(exc: type[BaseException], fn: Any, what: str) -> None:
    try:
        fn()
    except exc:
        return
    raise AssertionError(f"{what}: no {exc.__name__}")


def new_store() -> Recorder:
    return Recorder(MooncakeDistributedStore())


def check_api_surface() -> None:
    public = {n for n in dir(MooncakeDistributedStore) if not n.startswith("_")}
    if "mooncake-alias" not in (sys.modules["mooncake"].__doc__ or ""):
        # The real wheel: its API must be the one named here.
        eq(sorted(public ^ WHEEL_METHODS), [], "the wheel's public methods")
    missing = sorted(WHEEL_METHODS - set(SKIPPED) - public)
    eq(missing, [], "methods the drop-in lacks")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def check_setup(address: str, metadata: str) -> None:
    """Config-dict sizes, hostnames and protocols, accepted and refused as the wheel does."""
    base = {"local_hostname": "127.0.0.1", "metadata_server": metadata,
            "master_server_addr": address, "global_segment_size": 0}  # fmt: skip
    refused = [
        {"global_segment_size": "50%"}, {"global_segment_size": "16MiB"},
        {"global_segment_size": -1}, {"global_segment_size": "abc"},
        {"global_segment_size": True}, {"global_segment_size": None},
        {"global_segment_size": 16.0}, {"global_segment_size": "1023"},
        {"global_segment_size": "1KB"}, {"global_segment_size": (16 << 20) - 1},
        {"local_buffer_size": "50%"}, {"local_buffer_size": 1000},
        {"local_buffer_size": "1.0001TB"}, {"local_buffer_size": -5},
        {"local_hostname": ""}, {"metadata_server": ""},
    ]  # fmt: skip
    for extra in refused:
        eq(new_store().setup({**base, **extra}), INVALID_PARAMS, f"setup {extra}")
    eq(new_store().setup({**base, "protocol": "TCP"}), INTERNAL_ERROR, "setup protocol TCP")
    eq(new_store().setup({**base, "protocol": "bogus"}), INTERNAL_ERROR, "setup bad protocol")
    accepted = [
        {"local_buffer_size": "16MB"}, {"local_buffer_size": " 1 kb "},
        {"global_segment_size": "0", "local_buffer_size": 16 << 20},
        {"global_segment_size": 0.0, "local_buffer_size": "16.5 M"},
    ]  # fmt: skip
    for extra in accepted:
        s = new_store()
        eq(s.setup({**base, **extra}), 0, f"setup {extra}")
        host, _, port = s.get_hostname().rpartition(":")
        eq((host, port.isdigit()), ("127.0.0.1", True), "get_hostname is host:port")
        eq(s.close(), 0, "close")
    named = f"127.0.0.1:{free_port()}"
    s = new_store()
    eq(s.setup(named, metadata, 0, 16 << 20, "tcp", "", address), 0, "setup with a port")
    eq(s.get_hostname(), named, "get_hostname keeps a given port")
    eq(s.init_all("tcp", "", 16 << 20), INVALID_PARAMS, "init_all on a set-up store")
    eq(s.health_check(), 0, "health_check")
    eq(s.close(), 0, "close")
    s = new_store()
    eq(s.setup("127.0.0.1", metadata, 1 << 20, 16 << 20, "tcp", "", address), INVALID_PARAMS,
       "global segment below 16 MiB")  # fmt: skip
    raises(TypeError, lambda: s.setup("127.0.0.1", metadata, -1, 0, "tcp", "", address),
           "negative positional size")  # fmt: skip
    raises(TypeError, lambda: s.setup("127.0.0.1", metadata, "16MB", 0, "tcp", "", address),
           "text positional size")  # fmt: skip


def check_local_buffer(address: str, metadata: str, writer: Recorder) -> None:
    """The copying verbs stage through the local buffer; the zero-copy ones need none."""
    eq(writer.put("lb/small", b"abc"), 0, "writer put")
    s = new_store()
    eq(s.setup("127.0.0.1", metadata, 0, 0, "tcp", "", address), 0, "setup, no local buffer")
    buf = np.zeros(1 << 16, dtype=np.uint8)
    p = buf.ctypes.data
    eq(s.put("lb/a", b"x"), INVALID_PARAMS, "put without a local buffer")
    eq(s.put_batch(["lb/a"], [b"x"]), INVALID_PARAMS, "put_batch without a local buffer")
    eq(s.put_parts("lb/a", b"x", b"y"), INVALID_PARAMS, "put_parts without a local buffer")
    eq(s.upsert("lb/a", b"x"), INVALID_PARAMS, "upsert without a local buffer")
    eq(s.is_exist("lb/a"), 0, "nothing stored without a local buffer")
    eq(s.get("lb/small"), b"", "get without a local buffer")
    eq(s.get_batch(["lb/small"]), [b""], "get_batch without a local buffer")
    eq(s.get_buffer("lb/small"), None, "get_buffer without a local buffer")
    eq(s.put_from("lb/b", p, 3), 0, "put_from without a local buffer")
    eq(s.get_into("lb/small", p + 100, 100), 3, "get_into without a local buffer")
    eq(s.get_size("lb/small"), 3, "get_size without a local buffer")
    eq(s.close(), 0, "close")

    s = new_store()
    eq(s.setup("127.0.0.1", metadata, 0, 1 << 20, "tcp", "", address), 0, "setup, 1 MiB buffer")
    eq(s.put("lb/1m", bytes(1 << 20)), 0, "put of the local buffer's size")
    eq(s.put("lb/1m+1", bytes((1 << 20) + 1)), INVALID_PARAMS, "put past the local buffer")
    eq(s.put_batch(["lb/c1", "lb/c2"], [bytes(600 << 10)] * 2), INVALID_PARAMS,
       "put_batch past the local buffer")  # fmt: skip
    eq(s.batch_is_exist(["lb/c1", "lb/c2"]), [0, 0], "a refused batch stores nothing")
    eq(s.put_parts("lb/pp", bytes(600 << 10), bytes(600 << 10)), INVALID_PARAMS,
       "put_parts past the local buffer")  # fmt: skip
    eq([s.put(k, bytes(600 << 10)) for k in ("lb/d1", "lb/d2")], [0, 0], "two puts that fit")
    eq([len(v) for v in s.get_batch(["lb/d1", "lb/d2", "lb/small"])], [600 << 10, 0, 3],
       "get_batch stages keys in order while they fit")  # fmt: skip
    eq([None if b is None else b.size() for b in s.batch_get_buffer(["lb/d1", "lb/d2"])],
       [600 << 10, None], "batch_get_buffer stages keys in order")  # fmt: skip
    eq(s.upsert_batch(["lb/d1", "lb/d2"], [bytes(600 << 10)] * 2), INVALID_PARAMS,
       "upsert_batch past the local buffer")  # fmt: skip
    eq(s.close(), 0, "close")


def check_ranges(s: Recorder, base: int, buf: np.ndarray) -> None:
    """get_into_ranges: per buffer, per key, per range a byte count or a code."""
    eq(s.put("r/a", bytes(range(100))), 0, "put r/a")
    eq(s.put("r/b", bytes(range(100, 200))), 0, "put r/b")
    buf[:] = 0
    got = s.get_into_ranges([base], [["r/a", "r/b"]], [[[0], [10]]], [[[5], [0]]], [[[4], [3]]])
    eq(got, [[[4], [3]]], "get_into_ranges")
    eq(bytes(buf[:13]), bytes([5, 6, 7, 8, 0, 0, 0, 0, 0, 0, 100, 101, 102]), "ranges bytes")
    got = s.get_into_ranges([base, base + 1000], [["r/a"], ["r/b", "r/a"]],
                            [[[0, 100]], [[0], [50]]], [[[0, 50]], [[0], [99]]],
                            [[[10, 20]], [[3], [2]]])  # fmt: skip
    eq(got, [[[10, 20]], [[3], [-600]]], "two buffers, a range past the object")
    eq(bytes(buf[100:120]), bytes(range(50, 70)), "second range bytes")
    eq(bytes(buf[1000:1003]), bytes([100, 101, 102]), "second buffer bytes")
    got = s.get_into_ranges([base], [["r/miss", "r/a"]], [[[0, 9], [20]]], [[[0, 0], [0]]],
                            [[[4, 4], [0]]])  # fmt: skip
    eq(got, [[[OBJECT_NOT_FOUND, OBJECT_NOT_FOUND], [0]]], "a missing key, an empty range")
    end = buf.nbytes
    eq(s.get_into_ranges([base], [["r/a"]], [[[end - 10, end - 9]]], [[[0, 0]]], [[[10, 10]]]),
       [[[10, INVALID_PARAMS]]], "a range past the registered buffer")  # fmt: skip
    unregistered = np.zeros(256, dtype=np.uint8)
    eq(s.get_into_ranges([unregistered.ctypes.data], [["r/a", "r/miss"]], [[[0], [0]]],
                         [[[0], [0]]], [[[1], [1]]]),
       [[[INVALID_PARAMS], [INVALID_PARAMS]]], "an unregistered buffer")  # fmt: skip
    eq(s.get_into_ranges([base, base], [["r/a"]], [[[0, 1, 2]]], [[[0]]], [[[1]]]),
       [[[INVALID_PARAMS] * 3], [[INVALID_PARAMS]]], "top-level lengths differ")  # fmt: skip
    eq(s.get_into_ranges([base], [["r/a", "r/b"]], [[[0]]], [[[0], [0]]], [[[1], [1]]]),
       [[[INVALID_PARAMS], [INVALID_PARAMS]]], "per-buffer lengths differ")  # fmt: skip
    eq(s.get_into_ranges([base], [["r/a"]], [[[0, 5]]], [[[0, 5]]], [[[5]]]),
       [[[INVALID_PARAMS, INVALID_PARAMS]]], "per-key lengths differ")  # fmt: skip
    eq(s.get_into_ranges([], [], [], [], []), [], "no buffers")
    eq(s.get_into_ranges([base], [[]], [[]], [[]], [[]]), [[]], "a buffer without keys")
    raises(TypeError, lambda: s.get_into_ranges([base], [["r/a"]], [[[0]]], [[[-1]]], [[[1]]]),
           "a negative offset")  # fmt: skip
    raises(TypeError, lambda: s.get_into_ranges([base], [["r/a"]], [[[0]]], [[[0]]], [[[1.0]]]),
           "a float size")  # fmt: skip


def check_tensors(s: Recorder, base: int) -> None:
    try:
        import torch
    except ImportError:
        print("torch is not importable: the tensor methods were not run", flush=True)
        CALLED.update(n for n in WHEEL_METHODS if "tensor" in n and n not in SKIPPED)
        return
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    eq(s.put_tensor("ct/t", t), 0, "put_tensor")
    eq(s.put_tensor("ct/t", t * 2), 0, "put_tensor duplicate")
    back = s.get_tensor("ct/t")
    eq((back.dtype, tuple(back.shape), bool(torch.equal(back, t))),
       (torch.float32, (3, 4), True), "get_tensor")  # fmt: skip
    eq(s.get_tensor("ct/miss"), None, "get_tensor miss")
    eq(s.upsert_tensor("ct/t", t * 2), 0, "upsert_tensor")
    eq(bool(torch.equal(s.get_tensor("ct/t"), t * 2)), True, "get_tensor after upsert")
    eq(s.put_tensor("ct/n", [1, 2]), INVALID_PARAMS, "put_tensor of a list")
    eq(s.put_tensor("ct/cx", torch.ones(2, dtype=torch.complex64)), INVALID_PARAMS, "complex")
    for dtype in (torch.bfloat16, torch.bool, torch.float8_e4m3fn, torch.uint16, torch.int8):
        eq(s.put_tensor(f"ct/d/{dtype}", torch.zeros(3, dtype=dtype)), 0, f"put_tensor {dtype}")
        eq(s.get_tensor(f"ct/d/{dtype}").dtype, dtype, f"get_tensor {dtype}")
    eq(s.put_tensor("ct/0d", torch.tensor(5.0)), 0, "put_tensor of a 0-d tensor")
    eq(tuple(s.get_tensor("ct/0d").shape), (1,), "a 0-d tensor comes back with shape (1,)")
    eq(s.put_tensor("ct/empty", torch.zeros(0)), 0, "put_tensor empty")
    eq(tuple(s.get_tensor("ct/empty").shape), (0,), "get_tensor empty")
    eq(s.put("ct/raw", b"not a tensor at all, just some bytes here"), 0, "put raw")
    eq(s.get_tensor("ct/raw"), None, "get_tensor of raw bytes")
    eq(s.batch_put_tensor(["ct/b1", "ct/b2"], [t, torch.ones(2)]), [0, 0], "batch_put_tensor")
    eq(s.batch_put_tensor(["ct/b3"], [t, t]), [INVALID_PARAMS], "batch_put_tensor lengths")
    eq(s.batch_put_tensor(["ct/b4", "ct/b5"], [t, "x"]), [0, INVALID_PARAMS],
       "batch_put_tensor with a non-tensor")  # fmt: skip
    got = s.batch_get_tensor(["ct/b1", "ct/miss", "ct/raw", "ct/b2"])
    eq([None if g is None else tuple(g.shape) for g in got], [(3, 4), None, None, (2,)],
       "batch_get_tensor: None per key that cannot be returned")  # fmt: skip
    eq(s.batch_get_tensor([]), [], "batch_get_tensor of no keys")
    eq(s.batch_upsert_tensor(["ct/b1", "ct/b6"], [torch.zeros(2), torch.zeros(3)]), [0, 0],
       "batch_upsert_tensor")  # fmt: skip
    cfg = ReplicateConfig()
    cfg.replica_num = 1
    eq(s.pub_tensor("ct/p1", t, cfg), 0, "pub_tensor")
    eq(s.upsert_pub_tensor("ct/p1", t * 3, cfg), 0, "upsert_pub_tensor")
    eq(bool(torch.equal(s.get_tensor("ct/p1"), t * 3)), True, "get after upsert_pub_tensor")
    eq(s.batch_pub_tensor(["ct/p2", "ct/p3"], [t, t], cfg), [0, 0], "batch_pub_tensor")
    eq(s.batch_upsert_pub_tensor(["ct/p2"], [t * 4], cfg), [0], "batch_upsert_pub_tensor")
    into = s.get_tensor_into("ct/p2", base, 8192)
    eq(bool(torch.equal(into, t * 4)), True, "get_tensor_into")
    eq(s.get_tensor_into("ct/p2", base, 40), None, "get_tensor_into a small buffer")
    eq(s.get_tensor_into("ct/miss", base, 8192), None, "get_tensor_into miss")
    eq(s.get_tensor_into("ct/raw", base, 8192), None, "get_tensor_into raw bytes")
    got = s.batch_get_tensor_into(["ct/p2", "ct/miss", "ct/b2"], [base, base + 8192, base + 16384],
                                  [8192, 8192, 8192])  # fmt: skip
    eq([None if g is None else tuple(g.shape) for g in got], [(3, 4), None, (2,)],
       "batch_get_tensor_into")  # fmt: skip
    size = s.get_size("ct/p2")
    eq(s.get_tensor_into("ct/p2", base, 8192) is not None, True, "tensor object in the buffer")
    eq(s.put_tensor_from("ct/tf", base, size), 0, "put_tensor_from get_tensor_into's buffer")
    eq(bool(torch.equal(s.get_tensor("ct/tf"), t * 4)), True, "get after put_tensor_from")
    eq(s.upsert_tensor_from("ct/tf", base, size), 0, "upsert_tensor_from")
    eq(s.batch_put_tensor_from(["ct/tf2"], [base], [size]), [0], "batch_put_tensor_from")
    eq(s.batch_upsert_tensor_from(["ct/tf2"], [base], [size]), [0], "batch_upsert_tensor_from")
    eq(bool(torch.equal(s.get_tensor("ct/tf2"), t * 4)), True, "get after the tensor_from batch")
    eq(s.batch_put_tensor_from(["ct/tf3"], [base], [size, size]), [INVALID_PARAMS],
       "batch_put_tensor_from lengths")  # fmt: skip


def main() -> None:
    address, metadata = sys.argv[1], sys.argv[2]
    check_api_surface()
    check_setup(address, metadata)
    s = new_store()
    # global_segment_size 0: this process stores nothing itself (the storage process does).
    eq(s.setup("127.0.0.1", metadata, 0, 64 << 20, "tcp", "", address), 0, "setup")
    check_local_buffer(address, metadata, s)

    # misses and empty keys
    eq(s.is_exist("c/miss"), 0, "is_exist miss")
    eq(s.get("c/miss"), b"", "get miss")
    eq(s.get_size("c/miss"), OBJECT_NOT_FOUND, "get_size miss")
    eq(s.remove("c/miss"), OBJECT_NOT_FOUND, "remove miss")
    eq(s.get_buffer("c/miss"), None, "get_buffer miss")
    eq((s.get(""), s.is_exist(""), s.get_size(""), s.remove("")),
       (b"", 0, OBJECT_NOT_FOUND, OBJECT_NOT_FOUND), "the empty key")  # fmt: skip
    eq(s.get_batch([]), [b""], "get_batch of no keys")
    eq((s.batch_get_buffer([]), s.batch_is_exist([]), s.batch_get_into([], [], [])),
       ([], [], []), "batches of no keys")  # fmt: skip

    # put / get, duplicates keep the first value, empty values refused, bad types raise
    eq(s.put("c/a", b"hello"), 0, "put")
    eq(s.put("c/a", b"other value"), 0, "put duplicate")
    eq(s.get("c/a"), b"hello", "get after duplicate put")
    eq(s.put("c/empty", b""), INVALID_PARAMS, "put empty")
    eq(s.is_exist("c/empty"), 0, "empty not stored")
    eq(s.get_size("c/a"), 5, "get_size")
    eq(s.is_exist("c/a"), 1, "is_exist")
    eq(s.batch_is_exist(["c/a", "c/miss"]), [1, 0], "batch_is_exist")
    eq(s.put(b"c/bytes-key", b"v"), 0, "put with a bytes key")
    eq(s.get("c/bytes-key"), b"v", "get of a bytes key")
    raises(TypeError, lambda: s.put("c/int", 12345), "put of an int")
    raises(TypeError, lambda: s.put("c/none", None), "put of None")
    raises(TypeError, lambda: s.put("c/str", "text"), "put of a str")
    cfg = ReplicateConfig()
    cfg.replica_num = 1
    eq(s.put("c/cfg", memoryview(b"with config"), cfg), 0, "put with ReplicateConfig")
    eq(s.get("c/cfg"), b"with config", "get put with config")
    eq(s.upsert("c/a", b"replaced"), 0, "upsert")
    eq(s.get("c/a"), b"replaced", "get after upsert")

    # registered buffers: put_from / get_into
    buf = np.zeros(1 << 16, dtype=np.uint8)
    src = np.random.default_rng(1).integers(0, 256, 4096, dtype=np.uint8)
    buf[:4096] = src
    base = buf.ctypes.data
    eq(s.register_buffer(base, buf.nbytes), 0, "register_buffer")
    eq(s.register_buffer(base, buf.nbytes), INVALID_PARAMS, "register_buffer twice")
    eq(s.unregister_buffer(base + 12345), INVALID_PARAMS, "unregister unknown")
    eq(s.put_from("c/pf", base, 4096), 0, "put_from")
    eq(s.put_from("c/pf", base + 8192, 100), 0, "put_from duplicate")
    eq(s.upsert_from("c/pf2", base, 10), 0, "upsert_from new")
    eq(s.upsert_from("c/pf2", base + 10, 10), 0, "upsert_from replaces")
    eq(s.get("c/pf2"), src[10:20].tobytes(), "get after upsert_from")
    raises(TypeError, lambda: s.put_from("c/neg", base, -1), "put_from of a negative size")
    eq(s.get_into("c/pf", base + 8192, 4096), 4096, "get_into")
    eq(bytes(buf[8192 : 8192 + 4096]), src.tobytes(), "get_into bytes")
    eq(s.get_into("c/pf", base + 16384, 100), INVALID_PARAMS, "get_into too small")
    eq(s.get_into("c/pf", base + 16384, 8192), 4096, "get_into larger buffer")
    eq(s.get_into("c/miss", base + 16384, 100), OBJECT_NOT_FOUND, "get_into miss")
    buf[40000:40010] = np.frombuffer(b"0123456789", dtype=np.uint8)
    buf[40100:40105] = np.frombuffer(b"meta!", dtype=np.uint8)
    eq(s.put_from_with_metadata("c/fm", base + 40000, base + 40100, 10, 5), 0,
       "put_from_with_metadata")  # fmt: skip
    eq(s.get("c/fm"), b"meta!0123456789", "metadata first, then the data")
    eq(s.put_from_with_metadata("c/fm0", base + 40000, base + 40100, 0, 5), 0,
       "put_from_with_metadata of no data")  # fmt: skip
    eq(s.is_exist("c/fm0"), 0, "no data: nothing stored")
    eq(s.get_offload_rpc_read_count(), 0, "get_offload_rpc_read_count")

    # batches
    sizes = [1000, 2000, 3000]
    eq(s.batch_put_from(["c/b0", "c/b1", "c/b2"], [base, base + 1000, base + 3000], sizes),
       [0, 0, 0], "batch_put_from")  # fmt: skip
    eq(s.batch_put_from(["c/x", "c/y"], [base], [1, 2]), [INVALID_PARAMS] * 2,
       "batch_put_from lengths")  # fmt: skip
    eq(s.batch_upsert_from(["c/b0", "c/bu"], [base + 1, base], [999, 5]), [0, 0],
       "batch_upsert_from")  # fmt: skip
    eq(s.get("c/b0"), src[1:1000].tobytes(), "get after batch_upsert_from")
    dst = [base + 20000, base + 22000, base + 26000, base + 30000]
    got = s.batch_get_into(["c/b1", "c/b1", "c/miss", "c/b2"], dst, [1000, 4000, 100, 10])
    eq(got, [INVALID_PARAMS, 2000, OBJECT_NOT_FOUND, INVALID_PARAMS], "batch_get_into")
    eq(bytes(buf[22000:24000]), src[1000:3000].tobytes(), "batch_get_into bytes")
    eq(s.batch_get_into(["c/b1"], [base, base], [1]), [INVALID_PARAMS], "batch_get_into lengths")
    eq(s.put_parts("c/parts", b"ab", bytearray(b"cd"), memoryview(b"ef")), 0, "put_parts")
    eq(s.get("c/parts"), b"abcdef", "get put_parts")
    eq(s.put_parts("c/parts-none"), 0, "put_parts of nothing")
    eq(s.put_parts("c/parts-empty", b""), 0, "put_parts of an empty part")
    eq(s.batch_is_exist(["c/parts-none", "c/parts-empty"]), [0, 0], "no bytes, nothing stored")
    raises(TypeError, lambda: s.put_parts("c/parts-int", b"a", 5), "put_parts of an int")
    eq(s.upsert_parts("c/parts", b"x", b"y"), 0, "upsert_parts")
    eq(s.get("c/parts"), b"xy", "get after upsert_parts")
    eq(s.put_batch(["c/x1", "c/x2"], [b"1", b"22"]), 0, "put_batch")
    eq(s.put_batch(["c/x3"], [b"1", b"2"]), INVALID_PARAMS, "put_batch lengths")
    eq(s.put_batch(["c/dd", "c/dd"], [b"1", b"2"]), 0, "put_batch of one key twice")
    eq(s.get("c/dd"), b"1", "the first of a key twice in a batch")
    eq(s.upsert_batch(["c/x1", "c/x4"], [b"9", b"44"]), 0, "upsert_batch")
    eq(s.get_batch(["c/x1", "c/miss", "c/x2", "c/x4"]), [b"9", b"", b"22", b"44"], "get_batch")
    h = s.get_buffer("c/x2")
    eq((h.size(), bytes(memoryview(h))), (2, b"22"), "get_buffer")
    eq([None if b is None else b.size() for b in s.batch_get_buffer(["c/x1", "c/miss"])],
       [1, None], "batch_get_buffer")  # fmt: skip
    got = s.batch_put_from_multi_buffers(["c/mb"], [[base, base + 100]], [[3, 4]])
    eq(got, [0], "batch_put_from_multi_buffers")
    eq(s.get("c/mb"), src[0:3].tobytes() + src[100:104].tobytes(), "get multi-buffer object")
    eq(s.batch_put_from_multi_buffers(["c/mb2"], [[base], [base]], [[1], [1]]),
       [INVALID_PARAMS], "batch_put_from_multi_buffers lengths")  # fmt: skip
    got = s.batch_get_into_multi_buffers(["c/mb", "c/miss"], [[base + 50000, base + 50100],
                                         [base + 50200]], [[2, 5], [10]])  # fmt: skip
    eq(got, [7, OBJECT_NOT_FOUND], "batch_get_into_multi_buffers")
    eq(bytes(buf[50000:50002]) + bytes(buf[50100:50105]), s.get("c/mb"), "scattered bytes")
    eq(s.batch_get_into_multi_buffers(["c/mb"], [[base], [base]], [[1], [1]]),
       [INVALID_PARAMS], "batch_get_into_multi_buffers lengths")  # fmt: skip

    check_ranges(s, base, buf)
    check_tensors(s, base)

    # removal
    eq(s.put("c/r1", b"x"), 0, "put r1")
    eq(s.remove("c/r1"), 0, "remove unread key")
    eq(s.is_exist("c/r1"), 0, "removed")
    eq(s.put_batch(["c/r2", "c/r3"], [b"x", b"y"]), 0, "put r2 r3")
    eq(s.batch_remove(["c/r2", "c/r3", "c/miss"]), [0, 0, OBJECT_NOT_FOUND], "batch_remove")
    rc = s.remove("c/a")  # read just now: Mooncake holds a read lease, kvstore does not
    if rc not in (0, OBJECT_HAS_LEASE):
        raise AssertionError(f"remove of a just-read key: {rc}")
    eq(s.put_batch(["c/rx/1", "c/rx/2", "c/ry/1"], [b"1", b"2", b"3"]), 0, "put rx")
    eq(s.remove_by_regex("^c/rx/"), 2, "remove_by_regex")
    eq(s.batch_is_exist(["c/rx/1", "c/rx/2", "c/ry/1"]), [0, 0, 1], "after remove_by_regex")
    eq(s.remove_by_regex("^nothing-matches"), 0, "remove_by_regex none")
    eq(s.remove_by_regex("(["), INVALID_PARAMS, "remove_by_regex bad pattern")
    raises(TypeError, lambda: s.remove_by_regex(None), "remove_by_regex of None")

    # a client that held no segment closes: what it stored stays readable by the others
    w = new_store()
    eq(w.setup("127.0.0.1", metadata, 0, 16 << 20, "tcp", "", address), 0, "setup writer")
    eq(w.put("c/from-closed", b"still here"), 0, "writer put")
    eq(w.close(), 0, "writer close")
    eq(s.get("c/from-closed"), b"still here", "read after the writer closed")

    eq(s.put("c/ra", b"z"), 0, "put ra")
    n = s.remove_all()
    if n < 1:  # at least c/ra (never read); Mooncake keeps the ones under a read lease
        raise AssertionError(f"remove_all removed {n}")
    eq(s.is_exist("c/ra"), 0, "after remove_all")

    eq(s.unregister_buffer(base), 0, "unregister_buffer")
    eq(s.unregister_buffer(base), INVALID_PARAMS, "unregister twice")
    eq(s.close(), 0, "close")
    eq(s.close(), 0, "close twice")
    eq(sorted(WHEEL_METHODS - set(SKIPPED) - CALLED), [], "wheel methods the script never called")
    eq(sorted(set(SKIPPED) & CALLED), [], "skipped methods the script called")
    print("contract ok", flush=True)


if __name__ == "__main__":
    main()
