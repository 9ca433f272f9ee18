"""Mooncake Store's Python API, as a user program sees it: one script, two stores.

Run (never by pytest directly; tests/client/compat/test_mooncake.py runs it):
    python mooncake_contract.py MASTER_ADDRESS METADATA_URL

It imports ``mooncake.store`` and nothing from this repository, so the same file runs under the
real wheel (``mooncake-transfer-engine-non-cuda``, against ``mooncake_master`` and a storage
process) and under kvstore's compat layer (through the ``mooncake`` alias package, against a
kvstore cluster). Every assertion is a return value Mooncake 0.3.13 gives; where kvstore's lease
rule differs (remove right after a read), both answers are accepted. Prints ``contract ok``.
"""

from __future__ import annotations

import sys

import numpy as np
from mooncake.store import MooncakeDistributedStore, ReplicateConfig

INVALID_PARAMS = -600
OBJECT_NOT_FOUND = -704
OBJECT_HAS_LEASE = -706


def eq(got: object, want: object, what: str) -> None:
    if got != want:
        raise AssertionError(f"{what}: got {got!r}, want {want!r}")


def main() -> None:
    address, metadata = sys.argv[1], sys.argv[2]
    s = MooncakeDistributedStore()
    # global_segment_size 0: this process stores nothing itself (the storage process does).
    eq(s.setup("127.0.0.1", metadata, 0, 64 << 20, "tcp", "", address), 0, "setup")

    # misses
    eq(s.is_exist("c/miss"), 0, "is_exist miss")
    eq(s.get("c/miss"), b"", "get miss")
    eq(s.get_size("c/miss"), OBJECT_NOT_FOUND, "get_size miss")
    eq(s.remove("c/miss"), OBJECT_NOT_FOUND, "remove miss")
    eq(s.get_buffer("c/miss"), None, "get_buffer miss")

    # put / get, duplicates keep the first value, empty values refused
    eq(s.put("c/a", b"hello"), 0, "put")
    eq(s.put("c/a", b"other value"), 0, "put duplicate")
    eq(s.get("c/a"), b"hello", "get after duplicate put")
    eq(s.put("c/empty", b""), INVALID_PARAMS, "put empty")
    eq(s.is_exist("c/empty"), 0, "empty not stored")
    eq(s.get_size("c/a"), 5, "get_size")
    eq(s.is_exist("c/a"), 1, "is_exist")
    eq(s.batch_is_exist(["c/a", "c/miss"]), [1, 0], "batch_is_exist")
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
    eq(s.get_into("c/pf", base + 8192, 4096), 4096, "get_into")
    eq(bytes(buf[8192 : 8192 + 4096]), src.tobytes(), "get_into bytes")
    eq(s.get_into("c/pf", base + 16384, 100), INVALID_PARAMS, "get_into too small")
    eq(s.get_into("c/pf", base + 16384, 8192), 4096, "get_into larger buffer")
    eq(s.get_into("c/miss", base + 16384, 100), OBJECT_NOT_FOUND, "get_into miss")

    # batches
    sizes = [1000, 2000, 3000]
    eq(s.batch_put_from(["c/b0", "c/b1", "c/b2"], [base, base + 1000, base + 3000], sizes),
       [0, 0, 0], "batch_put_from")  # fmt: skip
    dst = [base + 20000, base + 22000, base + 26000, base + 30000]
    got = s.batch_get_into(["c/b0", "c/b1", "c/miss", "c/b2"], dst, [1000, 4000, 100, 10])
    eq(got, [1000, 2000, OBJECT_NOT_FOUND, INVALID_PARAMS], "batch_get_into")
    eq(bytes(buf[20000:21000]), src[:1000].tobytes(), "batch_get_into bytes 0")
    eq(bytes(buf[22000:24000]), src[1000:3000].tobytes(), "batch_get_into bytes 1")
    eq(s.put_parts("c/parts", b"ab", bytearray(b"cd"), memoryview(b"ef")), 0, "put_parts")
    eq(s.get("c/parts"), b"abcdef", "get put_parts")
    eq(s.put_batch(["c/x1", "c/x2"], [b"1", b"22"]), 0, "put_batch")
    eq(s.get_batch(["c/x1", "c/miss", "c/x2"]), [b"1", b"", b"22"], "get_batch")
    h = s.get_buffer("c/x2")
    eq((h.size(), bytes(memoryview(h))), (2, b"22"), "get_buffer")
    eq([None if b is None else b.size() for b in s.batch_get_buffer(["c/x1", "c/miss"])],
       [1, None], "batch_get_buffer")  # fmt: skip

    # tensors (where torch is installed)
    try:
        import torch
    except ImportError:
        torch = None
    if torch is not None:
        t = torch.arange(12, dtype=torch.float32).reshape(3, 4)
        eq(s.put_tensor("c/t", t), 0, "put_tensor")
        back = s.get_tensor("c/t")
        eq((back.dtype, tuple(back.shape), bool(torch.equal(back, t))),
           (torch.float32, (3, 4), True), "get_tensor")  # fmt: skip
        eq(s.get_tensor("c/miss"), None, "get_tensor miss")

    # removal
    eq(s.put("c/r1", b"x"), 0, "put r1")
    eq(s.remove("c/r1"), 0, "remove unread key")
    eq(s.is_exist("c/r1"), 0, "removed")
    rc = s.remove("c/a")  # read just now: Mooncake holds a read lease, kvstore does not
    if rc not in (0, OBJECT_HAS_LEASE):
        raise AssertionError(f"remove of a just-read key: {rc}")
    eq(s.put_batch(["c/rx/1", "c/rx/2", "c/ry/1"], [b"1", b"2", b"3"]), 0, "put rx")
    eq(s.remove_by_regex("^c/rx/"), 2, "remove_by_regex")
    eq(s.batch_is_exist(["c/rx/1", "c/rx/2", "c/ry/1"]), [0, 0, 1], "after remove_by_regex")
    eq(s.remove_by_regex("^nothing-matches"), 0, "remove_by_regex none")
    eq(s.remove_by_regex("(["), INVALID_PARAMS, "remove_by_regex bad pattern")
    eq(s.put("c/ra", b"z"), 0, "put ra")
    n = s.remove_all()
    if n < 1:  # at least c/ra (never read); Mooncake keeps the ones under a read lease
        raise AssertionError(f"remove_all removed {n}")
    eq(s.is_exist("c/ra"), 0, "after remove_all")

    eq(s.unregister_buffer(base), 0, "unregister_buffer")
    eq(s.unregister_buffer(base), INVALID_PARAMS, "unregister twice")
    eq(s.close(), 0, "close")
    eq(s.close(), 0, "close twice")
    print("contract ok", flush=True)


if __name__ == "__main__":
    main()
