"""The verbs wrapper: the memory-region table, addresses and GIDs (pure), and the real verbs
path where a device exists (marked ``rdma``)."""

from __future__ import annotations

import pytest

from kvstore import rdma
from kvstore.errors import InvalidRequestError, OutOfRangeError, TransportUnavailableError
from tests.support import has_rdma_device


def region(name: str, addr: int, length: int) -> rdma.MemoryRegion:
    return rdma.MemoryRegion(name, addr, length, lkey=7, rkey=9)


def test_region_table_bookkeeping() -> None:
    t = rdma.MemoryRegionTable()
    t.add(region("arena", 0x1000, 0x1000))
    t.add(region("staging", 0x2000, 0x100))  # adjacent, not overlapping
    assert len(t) == 2
    assert t.locate(0x1800, 0x800).name == "arena"
    assert t.remote_address("arena", 0x10, 0x20) == (0x1010, 9)
    with pytest.raises(OutOfRangeError):
        t.locate(0x1F00, 0x200)  # spans two regions
    with pytest.raises(OutOfRangeError):
        t.remote_address("arena", 0xFF0, 0x20)
    with pytest.raises(InvalidRequestError):
        t.remote_address("missing", 0, 1)
    assert t.remove("staging").name == "staging"
    with pytest.raises(InvalidRequestError):
        t.remove("staging")


@pytest.mark.parametrize(
    "bad",
    [
        region("arena", 0x1800, 0x10),  # overlaps
        region("arena2", 0x0, 0x1001),  # overlaps the start
        region("arena", 0x9000, 0x10),  # duplicate name
        region("empty", 0x9000, 0),
    ],
)
def test_region_table_refuses(bad: rdma.MemoryRegion) -> None:
    t = rdma.MemoryRegionTable()
    t.add(region("arena", 0x1000, 0x1000))
    with pytest.raises(InvalidRequestError):
        t.add(bad)
    assert len(t) == 1


def test_gid_text_is_what_pyverbs_parses() -> None:
    gid = bytes.fromhex("fe800000000000000202c9fffe000001")
    assert rdma.gid_text(gid) == "fe80:0000:0000:0000:0202:c9ff:fe00:0001"
    try:
        rdma.import_pyverbs()
    except TransportUnavailableError as err:
        pytest.skip(f"pyverbs not installed: {err.message}")
    from pyverbs.addr import GID

    assert GID(rdma.gid_text(gid)).gid == rdma.gid_text(gid)


def test_address_of_sees_slices_and_read_only_buffers() -> None:
    buf = bytearray(64)
    whole = memoryview(buf)
    assert rdma.address_of(whole[16:]) == rdma.address_of(whole) + 16
    assert rdma.address_of(memoryview(bytes(8))) > 0
    with pytest.raises(InvalidRequestError):
        rdma.address_of(whole[:0])


@pytest.mark.rdma
@pytest.mark.skipif(not has_rdma_device(), reason="no RDMA device on this host")
def test_loopback_rdma_read_and_write() -> None:  # pragma: no cover - needs hardware
    settings = rdma.RdmaConfig.from_env()
    device = rdma.first_device("test", settings)
    assert device is not None
    ctx = rdma.VerbsContext(device, settings)
    try:
        a, b = rdma.RcQueuePair(ctx), rdma.RcQueuePair(ctx)
        src = memoryview(bytearray(b"x" * 4096))
        dst = memoryview(bytearray(4096))
        ra = ctx.register("src", src, remote=True)
        rb = ctx.register("dst", dst, remote=True)
        a.connect(b.endpoint(1), 2)
        b.connect(a.endpoint(2), 1)
        b.run([rdma.RdmaOp(False, rb.addr, rb.lkey, 4096, ra.addr, ra.rkey)])
        assert bytes(dst) == bytes(src)
        src[:] = b"y" * 4096
        a.run([rdma.RdmaOp(True, ra.addr, ra.lkey, 4096, rb.addr, rb.rkey)])
        assert bytes(dst) == bytes(src)
        a.close()
        b.close()
    finally:
        ctx.close()
