"""The pinned staging pool and the CUDA staging flow, CPU-only: the pool gets a plain CPU
allocator and the staging a CPU copier, and "device tensors" are CPU tensors marked as such.
The real CUDA path is tested in tests/integration/test_cuda_staging.py (marked ``gpu``)."""

from __future__ import annotations

import random
import threading
from typing import Any

import numpy as np
import pytest
import torch

from kvstore.client import Client
from kvstore.client.staging import CudaStaging, PinnedPool, is_cuda_tensor
from kvstore.errors import InvalidRequestError, KeyNotFoundError

KIB = 1 << 10


class Allocator:
    """Plain CPU tensors, counted; fails on demand."""

    def __init__(self) -> None:
        self.sizes: list[int] = []
        self.fail = False

    def __call__(self, n: int) -> torch.Tensor:
        if self.fail:
            raise RuntimeError("out of pinned memory")
        self.sizes.append(n)
        return torch.empty(n, dtype=torch.uint8)


class CpuCopier:
    """Copies at once and records what it did, so tests see copies and waits."""

    def __init__(self, log: list[str]) -> None:
        self.log = log

    def copy(self, dst: Any, src: Any) -> None:
        dst.copy_(src)
        self.log.append(f"copy {src.numel()}")

    def synchronize(self) -> None:
        self.log.append("sync")


def device(t: torch.Tensor) -> torch.Tensor:
    t._fake_cuda = True  # type: ignore[attr-defined]
    return t


def is_fake_device(obj: Any) -> bool:
    return bool(getattr(obj, "_fake_cuda", False))


def pool(capacity: int = 1 << 20, **kw: Any) -> tuple[PinnedPool, Allocator]:
    alloc = Allocator()
    kw.setdefault("min_class_bytes", 4 * KIB)
    kw.setdefault("max_class_bytes", 256 * KIB)
    return PinnedPool(capacity, allocate=alloc, **kw), alloc


def staging(p: PinnedPool, log: list[str]) -> CudaStaging:
    return CudaStaging(p, is_device=is_fake_device, copier=lambda: CpuCopier(log))


# ---------------------------------------------------------------- the pool
@pytest.mark.parametrize(
    ("n", "cls"),
    [(0, 4 * KIB), (1, 4 * KIB), (4 * KIB, 4 * KIB), (4 * KIB + 1, 8 * KIB), (200 * KIB, 256 * KIB),
     (256 * KIB, 256 * KIB), (256 * KIB + 1, None)],
)  # fmt: skip
def test_size_classes(n: int, cls: int | None) -> None:
    p, _ = pool()
    assert p.size_class(n) == cls


def test_buffers_are_reused_per_class() -> None:
    p, alloc = pool()
    a = p.acquire(5 * KIB)
    assert a.data.numel() == 5 * KIB and a.buffer.numel() == 8 * KIB and a.pooled
    buf = a.buffer
    p.release(a)
    b = p.acquire(7 * KIB)  # same class: the same buffer again, no allocation
    assert b.buffer is buf and alloc.sizes == [8 * KIB]
    c = p.acquire(7 * KIB)  # the class's only buffer is lent: a new one
    assert c.buffer is not buf and alloc.sizes == [8 * KIB, 8 * KIB]
    p.release(b)
    p.release(c)
    assert p.held_bytes == p.free_bytes == 16 * KIB


def test_large_objects_get_a_one_off_buffer_that_is_not_kept() -> None:
    p, alloc = pool()
    big = p.acquire(300 * KIB)
    assert not big.pooled and big.buffer.numel() == 300 * KIB and p.held_bytes == 0
    p.release(big)
    assert p.free_bytes == 0 and p.num_one_off == 1 and alloc.sizes == [300 * KIB]


def test_the_bound_drops_free_buffers_then_lends_one_off() -> None:
    p, _ = pool(capacity=64 * KIB)
    small = [p.acquire(4 * KIB) for _ in range(4)]  # 16 KiB held
    for s in small:
        p.release(s)
    big = p.acquire(64 * KIB)  # needs the free 4 KiB buffers gone to fit
    assert big.pooled and p.held_bytes == 64 * KIB and p.free_bytes == 0
    extra = p.acquire(4 * KIB)  # everything is lent: one-off, the bound holds
    assert not extra.pooled and p.held_bytes == 64 * KIB
    p.release(extra)
    p.release(big)
    assert p.held_bytes == 64 * KIB and p.free_bytes == 64 * KIB
    p.clear()
    assert p.held_bytes == 0


def test_a_failed_allocation_reserves_nothing() -> None:
    p, alloc = pool()
    alloc.fail = True
    with pytest.raises(RuntimeError):
        p.acquire(4 * KIB)
    assert p.held_bytes == 0
    alloc.fail = False
    p.release(p.acquire(4 * KIB))
    assert p.held_bytes == 4 * KIB


def test_bad_input_is_a_typed_error() -> None:
    p, _ = pool()
    with pytest.raises(InvalidRequestError):
        p.acquire(-1)
    lease = p.acquire(1)
    p.release(lease)
    with pytest.raises(InvalidRequestError):
        p.release(lease)
    assert p.free_bytes == 4 * KIB  # the second release changed nothing
    with pytest.raises(InvalidRequestError):
        PinnedPool(allocate=Allocator(), min_class_bytes=3000)
    with pytest.raises(InvalidRequestError):
        PinnedPool(allocate=Allocator(), min_class_bytes=8 * KIB, max_class_bytes=4 * KIB)


def test_threads_never_share_a_buffer_or_pass_the_bound() -> None:
    p, _ = pool(capacity=128 * KIB)
    lent: set[int] = set()
    lent_lock = threading.Lock()
    errors: list[str] = []

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        for _ in range(300):
            lease = p.acquire(rng.choice([1, 4 * KIB, 9 * KIB, 40 * KIB, 300 * KIB]))
            key = lease.buffer.data_ptr()
            with lent_lock:
                if key in lent:
                    errors.append("one buffer lent twice")
                lent.add(key)
            if p.held_bytes > p.capacity_bytes:
                errors.append(f"held {p.held_bytes} > {p.capacity_bytes}")
            lease.data.fill_(seed)
            if not bool((lease.data == seed).all()):
                errors.append("buffer written by another thread")
            with lent_lock:
                lent.discard(key)
            p.release(lease)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads)
    assert errors == []
    assert p.held_bytes == p.free_bytes <= p.capacity_bytes


# ---------------------------------------------------------------- the staging flow
def test_puts_copy_each_device_tensor_once_and_wait_once() -> None:
    p, _ = pool()
    log: list[str] = []
    s = staging(p, log)
    host = torch.arange(10, dtype=torch.int32)
    devs = [device(torch.arange(n, dtype=torch.float16)) for n in (3, 5000)]
    with s.puts([devs[0], host, devs[1]]) as out:
        assert out[1] is host  # host buffers pass through untouched
        assert torch.equal(out[0], devs[0].view(torch.uint8))
        assert torch.equal(out[2], devs[1].view(torch.uint8))
        assert p.free_bytes == 0
    assert log == ["copy 6", "copy 10000", "sync"]
    assert p.free_bytes == p.held_bytes == 4 * KIB + 16 * KIB  # all given back


def test_gets_copy_only_what_was_read() -> None:
    p, _ = pool()
    log: list[str] = []
    s = staging(p, log)
    devs = [device(torch.full((100,), 7, dtype=torch.uint8)) for _ in range(3)]
    with s.gets(devs) as staged:
        for b in staged.buffers:
            b.fill_(9)
        staged.finish([40, KeyNotFoundError("gone"), 100])
    assert log == ["copy 40", "copy 100", "sync"]
    assert devs[0][:40].eq(9).all() and devs[0][40:].eq(7).all()
    assert devs[1].eq(7).all()  # a failed key leaves its tensor untouched
    assert devs[2].eq(9).all()
    assert p.free_bytes == p.held_bytes


def test_buffers_go_back_on_error_and_strided_tensors_pass_through() -> None:
    p, _ = pool()
    log: list[str] = []
    s = staging(p, log)
    strided = device(torch.zeros(8, 8)[:, 0])
    with pytest.raises(RuntimeError), s.puts([device(torch.ones(8)), strided]) as out:
        assert out[1] is strided  # left for as_bytes_view to reject for its key
        raise RuntimeError("the write failed")
    with pytest.raises(RuntimeError), s.gets([device(torch.ones(8))]):
        raise RuntimeError("the read failed")
    assert p.free_bytes == p.held_bytes > 0


def test_is_cuda_tensor_without_cuda() -> None:
    assert not is_cuda_tensor(torch.ones(2))
    assert not is_cuda_tensor(b"x") and not is_cuda_tensor(np.ones(2))


# ---------------------------------------------------------------- through the client
def test_client_stages_device_tensors_through_a_real_cluster(cluster_factory) -> None:
    """The client's hooks with a CPU stand-in for CUDA: per-key errors stay per key."""
    cluster = cluster_factory()
    log: list[str] = []
    p, _ = pool(capacity=4 << 20, max_class_bytes=1 << 20)
    rng = np.random.default_rng(3)
    data = [torch.from_numpy(rng.integers(0, 256, n, dtype=np.uint8)) for n in (1, 4096, 3 << 20)]
    with Client.connect(cluster.address) as c:
        c._staging = staging(p, log)
        values = [device(d.clone()) for d in data]
        strided = device(torch.zeros(64, 2, dtype=torch.uint8)[:, 0])
        results = c.batch_put(["a", "b", "c", "d"], [*values, strided])
        assert results[:3] == [None, None, None]
        assert isinstance(results[3], InvalidRequestError)
        assert not c.exists("d")
        assert log == ["copy 1", "copy 4096", f"copy {3 << 20}", "sync"]
        log.clear()
        outs = [device(torch.zeros(d.numel() + 10, dtype=torch.uint8)) for d in data]
        missing = device(torch.full((8,), 5, dtype=torch.uint8))
        got = c.batch_get_into(["a", "b", "c", "nope"], [*outs, missing])
        assert got[:3] == [d.numel() for d in data] and isinstance(got[3], KeyNotFoundError)
        for d, o in zip(data, outs, strict=True):
            assert torch.equal(o[: d.numel()], d) and o[d.numel() :].eq(0).all()
        assert missing.eq(5).all()
        assert log == ["copy 1", "copy 4096", f"copy {3 << 20}", "sync"]
        one = device(torch.zeros(4096, dtype=torch.uint8))
        assert c.get_into("b", one) == 4096 and torch.equal(one, data[1])
        assert c.read_located(c.locate("a"), one) == 1 and one[0] == data[0][0]
        c.put("e", device(data[1].clone()))
        assert c.get("e") == data[1].numpy().tobytes()
    assert p.free_bytes == p.held_bytes and p.num_one_off == 2  # the 3 MiB object, put and get
