"""KVStoreHiCacheStorage with SGLang 0.5.23's real HiCacheStorage, loader and HiCacheFile.

Runs in ``.venv-sglang`` (``make test`` runs this folder there); in the project's ``.venv``,
which has no SGLang, it skips.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

sglang = pytest.importorskip(
    "sglang", reason="SGLang lives in .venv-sglang: `make sglang-test` runs these tests there"
)

import torch  # noqa: E402
from sglang.srt.mem_cache.hicache_storage import (  # noqa: E402
    HiCacheFile,
    HiCacheStorage,
    HiCacheStorageConfig,
    PoolHitPolicy,
    PoolName,
    PoolTransfer,
)
from sglang.srt.mem_cache.storage import StorageBackendFactory  # noqa: E402

from kvstore.client import Client  # noqa: E402
from kvstore.client.adapters.sglang import KVStoreHiCacheStorage  # noqa: E402
from kvstore.errors import InvalidRequestError  # noqa: E402
from tests.engines_sglang.sglang_pools import MHAHostPool, MLAHostPool  # noqa: E402
from tests.integration.test_tenants import QUICK, SECRET, wait_for_nodes  # noqa: E402
from tests.support import create_tenant  # noqa: E402

MODULE = "kvstore.client.adapters.sglang"


def config(
    master: str,
    *,
    mla: bool = False,
    page_first: bool = False,
    tp_rank: int = 0,
    tp_size: int = 1,
    model: str = "org/model-7b",
    metrics: bool = False,
    **extra,
) -> HiCacheStorageConfig:
    return HiCacheStorageConfig(
        tp_rank=tp_rank,
        tp_size=tp_size,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=mla,
        enable_storage_metrics=metrics,
        is_page_first_layout=page_first,
        model_name=model,
        extra_config={
            "backend_name": "kvstore",
            "module_path": MODULE,
            "class_name": "KVStoreHiCacheStorage",
            "interface_v1": 1,
            "master": master,
            **extra,
        },
    )


def make(cfg: HiCacheStorageConfig, pool=None) -> HiCacheStorage:
    """The backend as SGLang's cache controller makes it: factory, then the pool."""
    backend = StorageBackendFactory.create_backend("dynamic", cfg, pool)
    if pool is not None:
        backend.register_mem_pool_host(pool)
    return backend


def fill(pool, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    pool.kv_buffer.copy_(torch.randn(pool.kv_buffer.shape, generator=g).to(pool.dtype))


def indices(pages: list[int], page_size: int) -> torch.Tensor:
    return torch.cat([torch.arange(p * page_size, (p + 1) * page_size) for p in pages])


def page_bytes(pool, page: int) -> bytes:
    return pool.get_data_page(page * pool.page_size, flat=True).view(torch.uint8).numpy().tobytes()


@pytest.fixture
def cluster(cluster_factory):
    return cluster_factory(num_nodes=1)


def test_sglang_loads_it_through_its_dynamic_backend(cluster) -> None:
    pool = MHAHostPool("layer_first")
    backend = make(config(cluster.address), pool)
    assert type(backend) is KVStoreHiCacheStorage and isinstance(backend, HiCacheStorage)
    assert backend.mem_pool_host is pool
    assert backend.get_stats() is None
    backend.close()


LAYOUTS = [
    (MHAHostPool, "layer_first"),
    (MHAHostPool, "page_first"),
    (MHAHostPool, "page_first_direct"),
    (MLAHostPool, "layer_first"),
    (MLAHostPool, "page_first"),
    (MLAHostPool, "page_first_direct"),
]


@pytest.mark.parametrize(("pool_cls", "layout"), LAYOUTS)
def test_v1_round_trip_is_bit_exact(cluster, pool_cls, layout) -> None:
    mla = pool_cls is MLAHostPool
    cfg = config(cluster.address, mla=mla, page_first=layout != "layer_first")
    src, dst = pool_cls(layout), pool_cls(layout)
    fill(src, 1)
    writer, reader = make(cfg, src), make(cfg, dst)  # two backends: as two SGLang servers
    keys = [f"h{i:02d}" for i in range(6)]
    assert writer.batch_set_v1(keys, indices([3, 0, 7, 8, 15, 1], src.page_size)) == [True] * 6
    # A page is one object holding the pool's flat data page.
    with Client.connect(cluster.address) as c:
        assert c.get(writer.prefix + "h00") == page_bytes(src, 3)
    got = reader.batch_get_v1(keys + ["missing"], indices([5, 6, 9, 10, 11, 2, 4], dst.page_size))
    assert got == [True] * 6 + [False]
    for s, d in zip([3, 0, 7, 8, 15, 1], [5, 6, 9, 10, 11, 2], strict=True):
        assert page_bytes(dst, d) == page_bytes(src, s)
    assert page_bytes(dst, 4) == bytes(len(page_bytes(dst, 4)))  # the miss wrote nothing
    # The tensor path reads the same objects (SGLang without interface_v1).
    page = reader.get("h02", dst.get_dummy_flat_data_page())
    assert page.view(torch.uint8).numpy().tobytes() == page_bytes(src, 7)
    # Writing again is a no-op that reports success.
    assert writer.batch_set_v1(keys[:2], indices([9, 9], src.page_size)) == [True, True]
    assert reader.batch_get_v1(["h00"], indices([0], dst.page_size)) == [True]
    assert page_bytes(dst, 0) == page_bytes(src, 3)
    writer.close()
    reader.close()


def test_batch_exists_counts_leading_hits(cluster) -> None:
    pool = MHAHostPool("page_first")
    fill(pool, 2)
    b = make(config(cluster.address, page_first=True), pool)
    assert b.batch_set_v1(["a", "b", "d"], indices([0, 1, 2], pool.page_size)) == [True] * 3
    assert b.batch_exists(["a", "b", "c", "d"]) == 2
    assert b.batch_exists(["a", "b", "d"]) == 3
    assert b.batch_exists(["c", "a"]) == 0
    assert b.batch_exists([]) == 0
    assert b.exists("d") and not b.exists("c")
    b.close()


def _same(a, b) -> bool:
    """Equal return values: tensors by bytes, everything else by ==."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.view(torch.uint8).numpy().tobytes() == b.view(torch.uint8).numpy().tobytes()
        )
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def test_same_answers_as_sglangs_hicachefile(cluster, tmp_path: Path) -> None:
    """The same calls on HiCacheFile and on kvstore: same return values, same bytes."""
    pool = MHAHostPool("layer_first")
    fill(pool, 3)
    swa = MHAHostPool("layer_first", layer_num=1)
    fill(swa, 4)
    ours = make(config(cluster.address), pool)
    cfg = config(cluster.address, file_storage_path=str(tmp_path / "hicache"))
    theirs = HiCacheFile(cfg)
    for b in (ours, theirs):
        b.register_mem_pool_host(pool)
        b.register_mem_host_pool_v2(pool, PoolName.KV)
        b.register_mem_host_pool_v2(swa, PoolName.SWA)
    pages = [pool.get_data_page(i * pool.page_size) for i in range(8)]
    dummy = pool.get_dummy_flat_data_page

    calls = [
        ("exists", lambda b: b.exists("p0")),
        ("get miss", lambda b: b.get("p0", dummy())),
        ("set", lambda b: b.set("p0", pages[0])),
        ("set again", lambda b: b.set("p0", pages[1])),
        ("get hit", lambda b: b.get("p0", dummy())),
        ("batch_set", lambda b: b.batch_set(["p1", "p2", "p4"], pages[1:3] + pages[4:5])),
        ("batch_get partial", lambda b: b.batch_get(["p0", "p1", "p3", "p4"], [dummy() for _ in range(4)])),
        ("batch_exists partial", lambda b: b.batch_exists(["p0", "p1", "p2", "p3", "p4"])),
        ("batch_exists all", lambda b: b.batch_exists(["p0", "p1", "p2"])),
        ("batch_exists none", lambda b: b.batch_exists(["p9", "p0"])),
        ("exists hit", lambda b: b.exists("p4")),
        ("v2 set", lambda b: b.batch_set_v2([
            PoolTransfer(PoolName.KV, host_indices=indices([5, 6], 4), keys=["q0", "q1"]),
            PoolTransfer(PoolName.SWA, host_indices=indices([5], 4), keys=["q1"]),
        ])),
        ("v2 exists", lambda b: b.batch_exists_v2(["q0", "q1", "q2"], [
            PoolTransfer(PoolName.SWA, keys=["q1"], hit_policy=PoolHitPolicy.TRAILING_PAGES),
        ])),
        ("v2 exists all-pages", lambda b: b.batch_exists_v2(["q0", "q1"], [
            PoolTransfer(PoolName.SWA, keys=["q0", "q1"], hit_policy=PoolHitPolicy.ALL_PAGES),
        ])),
        ("v2 get", lambda b: b.batch_get_v2([
            PoolTransfer(PoolName.KV, host_indices=indices([10, 11, 12], 4), keys=["q0", "q1", "q9"]),
            PoolTransfer(PoolName.SWA, host_indices=indices([10], 4), keys=["q1"]),
        ])),
        ("v2 bad indices", lambda b: b.batch_get_v2([
            PoolTransfer(PoolName.KV, host_indices=indices([10], 4), keys=["q0", "q1"]),
        ])),
        ("clear", lambda b: b.clear()),
        ("exists after clear", lambda b: b.batch_exists(["p0", "p1"])),
        ("get after clear", lambda b: b.get("p0", dummy())),
    ]  # fmt: skip
    for name, call in calls:
        a, b = call(ours), call(theirs)
        assert _same(a, b), f"{name}: kvstore {a!r} vs HiCacheFile {b!r}"
    # The v2 reads landed the same bytes in the host pool (both backends read into one pool).
    assert page_bytes(pool, 10) == page_bytes(pool, 5)
    ours.close()


def test_mla_keeps_one_copy_for_all_tp_ranks_and_namespaces_isolate(cluster) -> None:
    pool = MLAHostPool("page_first")
    fill(pool, 5)
    r0 = make(config(cluster.address, mla=True, page_first=True, tp_rank=0, tp_size=2), pool)
    r1 = make(config(cluster.address, mla=True, page_first=True, tp_rank=1, tp_size=2), pool)
    assert r0.prefix == r1.prefix
    assert r0.batch_set_v1(["m0", "m1"], indices([0, 1], 4)) == [True, True]
    assert r1.batch_exists(["m0", "m1"]) == 2
    mha = [config(cluster.address, page_first=True, tp_rank=r, tp_size=2) for r in (0, 1)]
    others = [
        *mha,
        config(cluster.address, mla=True, page_first=True, model="org/other"),
        config(cluster.address, mla=True, page_first=True, salt="tenant-b"),
        config(cluster.address, mla=True, page_first=False),
    ]
    prefixes = {r0.prefix}
    for cfg in others:
        b = make(cfg, pool)
        assert b.batch_exists(["m0"]) == 0
        prefixes.add(b.prefix)
        b.close()
    assert len(prefixes) == 1 + len(others)
    r0.close()
    r1.close()


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])  # scattered, in place
def test_a_node_killed_mid_batch_gives_misses_never_wrong_bytes(cluster_factory, layout) -> None:
    cluster = cluster_factory(num_nodes=2)
    src, dst = MHAHostPool(layout, size=256), MHAHostPool(layout, size=256)
    fill(src, 6)
    cfg = config(cluster.address, page_first=layout == "page_first")
    w, r = make(cfg, src), make(cfg, dst)
    keys = [f"k{i}" for i in range(64)]
    everything = indices(list(range(64)), 4)
    assert w.batch_set_v1(keys, everything) == [True] * 64
    w.close()
    assert r.batch_get_v1(keys[:1], indices([0], 4)) == [True]  # connected and warm
    dst.kv_buffer.zero_()
    killer = threading.Thread(target=cluster.nodes[0].kill)
    killer.start()  # the node dies while this batch is in flight (or just before it)
    during = r.batch_get_v1(keys, everything)
    killer.join()
    for i, hit in enumerate(during):
        if hit:
            assert page_bytes(dst, i) == page_bytes(src, i)
    dst.kv_buffer.zero_()
    after = r.batch_get_v1(keys, everything)
    assert not all(after), "about half the pages were on the dead node"
    for i, hit in enumerate(after):
        if hit:
            assert page_bytes(dst, i) == page_bytes(src, i)
        elif layout == "layer_first":  # a scattered read touches nothing on a miss
            assert page_bytes(dst, i) == bytes(len(page_bytes(dst, i)))
    r.close()


def test_bad_input_is_typed_and_changes_nothing(cluster) -> None:
    with pytest.raises(InvalidRequestError):
        make(config(""), None)
    for bad in ({"replicas": 0}, {"replicas": "2"}, {"salt": ""}, {"timeout": -1}, {"token": 5}):
        with pytest.raises(InvalidRequestError):
            make(config(cluster.address, **bad), None)
    with pytest.raises(InvalidRequestError):
        KVStoreHiCacheStorage({"master": cluster.address}, {})  # type: ignore[arg-type]
    pool = MHAHostPool("page_first")
    fill(pool, 7)
    b = make(config(cluster.address, page_first=True), None)
    with pytest.raises(InvalidRequestError):  # no host pool registered yet
        b.batch_set_v1(["x"], indices([0], 4))
    b.register_mem_pool_host(pool)
    with pytest.raises(InvalidRequestError):  # 2 keys, 1 page of indices
        b.batch_set_v1(["x", "y"], indices([0], 4))
    with pytest.raises(InvalidRequestError):
        b.batch_set_v1(["x"], [0, 1, 2, 3])  # type: ignore[arg-type]
    with pytest.raises(InvalidRequestError):
        b.batch_exists([b"x"])  # type: ignore[list-item]
    with pytest.raises(InvalidRequestError):
        b.batch_exists("x")  # type: ignore[arg-type]
    with pytest.raises(InvalidRequestError):
        b.set("x", [1, 2, 3])
    with pytest.raises(InvalidRequestError):
        b.get("x", pool.kv_buffer[0, 0:4].transpose(0, 1))  # not contiguous
    with pytest.raises(InvalidRequestError):
        b.batch_set(["x", "y"], [pool.get_data_page(0)])
    assert b.batch_exists(["x", "y"]) == 0
    # A page of another size is a miss, not a partial hit.
    assert b.set("z", torch.zeros(10, dtype=torch.bfloat16))
    assert b.get("z", pool.get_dummy_flat_data_page()) is None
    assert b.batch_get_v1(["z"], indices([1], 4)) == [False]
    b.close()


def test_get_stats_reports_pages_and_bandwidth(cluster) -> None:
    pool = MLAHostPool("layer_first")
    fill(pool, 8)
    b = make(config(cluster.address, mla=True, metrics=True), pool)
    assert b.batch_set_v1(["s0", "s1"], indices([0, 1], 4)) == [True, True]
    assert b.batch_get_v1(["s0", "s1", "s2"], indices([2, 3, 4], 4)) == [True, True, False]
    stats = b.get_stats()
    assert stats.backup_pgs == [2] and stats.prefetch_pgs == [3]
    assert stats.backup_bandwidth[0] > 0 and stats.prefetch_bandwidth[0] > 0
    assert b.get_stats().prefetch_pgs == []  # reset by each call, as SGLang expects
    b.close()


def test_a_logical_only_anchor_pool_moves_nothing(cluster) -> None:
    """Hybrid models' KV anchor pool holds no bytes (v2 side pools carry them): as SGLang's
    Mooncake backend does, v1 calls on it report every page done and store nothing."""

    class Anchor:
        kv_buffer = None
        page_size = 4

    b = make(config(cluster.address), Anchor())
    assert b.batch_set_v1(["a", "b"], indices([0, 1], 4)) == [True, True]
    assert b.batch_get_v1(["a"], indices([0], 4)) == [True]
    assert b.batch_exists(["a"]) == 0
    b.close()


def test_two_tenants_never_share_pages(cluster_factory, tmp_path: Path) -> None:
    """SGLang's L3 keys ignore its cache salt (SGLang issue 37160); with kvstore the store keeps
    tenants apart: two servers with two tenants' tokens never read each other's pages."""
    secret = SECRET
    (tmp_path / "token").write_text(secret + "\n")
    flags = ("--token-file", str(tmp_path / "token"))
    cluster = cluster_factory(num_nodes=2, master_args=(*flags, *QUICK), node_args=flags)

    token_a, token_b = (create_tenant(cluster.admin, secret, n) for n in ("acme", "bolt"))
    wait_for_nodes(cluster, token_a, token_b)  # they learn the tokens at their next heartbeat
    src_a, src_b, dst = (MHAHostPool("layer_first") for _ in range(3))
    fill(src_a, 1)
    fill(src_b, 2)
    a = make(config(cluster.address, token=token_a), src_a)
    b = make(config(cluster.address, token=token_b), src_b)
    b_reader = make(config(cluster.address, token=token_b), dst)
    keys = [f"h{i:02d}" for i in range(4)]
    assert a.batch_set_v1(keys, indices([0, 1, 2, 3], src_a.page_size)) == [True] * 4
    assert b.batch_exists(keys) == 0
    assert b_reader.batch_get_v1(keys, indices([0, 1, 2, 3], dst.page_size)) == [False] * 4
    assert page_bytes(dst, 0) == bytes(len(page_bytes(dst, 0)))  # nothing of A's came in
    # B writes the same keys: its own pages; each tenant reads back its own bytes.
    assert b.batch_set_v1(keys, indices([4, 5, 6, 7], src_b.page_size)) == [True] * 4
    assert b_reader.batch_get_v1(keys, indices([0, 1, 2, 3], dst.page_size)) == [True] * 4
    assert page_bytes(dst, 0) == page_bytes(src_b, 4)
    a_reader = make(config(cluster.address, token=token_a), dst)
    assert a_reader.batch_get_v1(keys[:1], indices([8], dst.page_size)) == [True]
    assert page_bytes(dst, 8) == page_bytes(src_a, 0)
    for backend in (a, b, b_reader, a_reader):
        backend.close()
