"""vLLM's per-request ``cache_salt`` in the connector: a salted request's blocks live in a salted
namespace, so requests of different salts (or none) never share a pool block, requests of one
salt do, and unsalted keys are what they were before salts were read (a fixed vector).

The scheduler side runs with vLLM's own ``Request`` in the vLLM virtualenv
(``vllm_salt_driver.py``); the worker side saves and loads through a real pool (a master and a
node, real processes) without vLLM.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from kvstore.client.adapters.vllm_config import (
    ConnectorConfig,
    engine_namespace,
    salted_namespace,
)
from kvstore.client.adapters.vllm_layouts import CacheGeometry
from kvstore.client.adapters.vllm_pool import Counters, Pool, Transfer
from kvstore.client.adapters.vllm_worker import KVStoreWorker
from kvstore.client.client import Client
from kvstore.client.kvcache import KVCache
from kvstore.errors import InvalidRequestError
from kvstore.keys import Namespace, block_keys
from tests.adapters.vllm_servers import REPO_ROOT, vllm_python
from tests.support import Cluster, start_master

L, H, N, D, B = 3, 2, 16, 64, 8
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(L)]
TOKENS = np.arange(3 * N, dtype=np.uint32) * 7 % 1000
#: The unsalted keys of TOKENS in _namespace(), computed before the connector read cache_salt.
UNSALTED_KEYS = [
    "2da290ab95e689723e6a4cc2de8fa6f4",
    "7444986f095f490f45277e4ec2668f3a",
    "4caf058d9c12c0cfdffd071ae1cf2469",
]


def _namespace(salt: str | None = None, model: str = "tiny-salt") -> Namespace:
    return engine_namespace(
        served_model=model,
        revision=None,
        kv_dtype="bfloat16",
        num_layers=L,
        num_kv_heads=H,
        head_dim=D,
        block_size=N,
        salt=salt,
    )


def _keys(ns: Namespace, tokens: np.ndarray = TOKENS) -> list[str]:
    return [k.hex() for k in block_keys(ns, tokens)]


# ------------------------------------------------------------------ keys
def test_salts_part_keys_and_no_salt_keeps_them() -> None:
    ns = _namespace()
    assert salted_namespace(ns, None) is ns
    assert _keys(salted_namespace(ns, None)) == UNSALTED_KEYS
    keys = {s: _keys(salted_namespace(ns, s)) for s in ("a", "b")}
    assert keys["a"] == _keys(salted_namespace(ns, "a")), "one salt, one set of keys"
    every = [UNSALTED_KEYS[0], keys["a"][0], keys["b"][0]]
    assert len(set(every)) == 3, "no block of one salt (or none) is another's"
    assert not set(keys["a"]) & set(keys["b"]) and not set(keys["a"]) & set(UNSALTED_KEYS)


def test_request_salt_extends_the_engine_salt() -> None:
    tenant = _namespace(salt="t")
    both = salted_namespace(tenant, "a")
    assert both.salt == "t/a"
    distinct = {tenant.digest, both.digest, salted_namespace(_namespace(), "a").digest}
    assert len(distinct) == 3, "an engine salt and a request salt never stand for each other"
    with pytest.raises(InvalidRequestError):
        salted_namespace(tenant, "")


# ------------------------------------------------------------------ scheduler (vLLM's Request)
@pytest.mark.skipif(not vllm_python().exists(), reason=f"no vLLM virtualenv at {vllm_python()}")
def test_scheduler_looks_up_loads_and_saves_in_the_request_salt() -> None:
    proc = subprocess.run(
        [str(vllm_python()), "-m", "tests.adapters.vllm_salt_driver"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    salts = [lk["salt"] for lk in got["lookups"]]
    assert salts == [None, "/a", "/b", "/a"], "each lookup in its request's namespace"
    keys = [lk["keys"] for lk in got["lookups"]]
    assert keys[0] == UNSALTED_KEYS, "an unsalted request's keys are unchanged"
    assert keys[1] == keys[3] and len({keys[0][0], keys[1][0], keys[2][0]}) == 3
    # The stand-in pool holds the first block for salt "a" only: only "a" requests load it.
    assert got["offered"] == {"none": 0, "a": N, "b": 0, "a2": N}
    assert got["loads"] == {"a": "a", "a2": "a"}
    saves = got["saves"]
    assert saves == {"none": [None, 0], "a": ["a", 1], "b": ["b", 0], "a2": ["a", 1]}
    assert "unseen" not in saves, "a request of unknown salt is never saved"


# ------------------------------------------------------------------ worker (a real pool)
@pytest.fixture(scope="module")
def master(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    cluster = Cluster(Path(tmp_path_factory.mktemp("vllm-salt")), start_master())
    try:
        cluster.add_node("64MiB")
        yield cluster.address
    finally:
        cluster.stop()


def _worker(master: str, seed: int) -> tuple[KVStoreWorker, dict[str, torch.Tensor]]:
    geo = CacheGeometry(H, N, D)
    cfg = ConnectorConfig.from_extra({"master": master})
    ns = _namespace(model="tiny-salt-worker")
    counters = Counters()
    worker = KVStoreWorker(cfg, ns, NAMES, Pool(cfg, ns, counters), counters)
    gen = torch.Generator().manual_seed(seed)
    raw = torch.randint(-30000, 30000, (L, B, H, N, 2 * D), generator=gen, dtype=torch.int16)
    caches = {n: raw[i].view(torch.bfloat16) for i, n in enumerate(NAMES)}
    worker.register_kv_caches(caches, "FLASH_ATTN", geo)
    return worker, caches


def _load(master: str, salt: str | None) -> tuple[set[int], bool]:
    """Load TOKENS' blocks with ``salt``: the failed block ids, and whether the loaded blocks
    equal the saved ones (seed 1)."""
    worker, caches = _worker(master, 2)
    ids = [4, 5, 6]
    worker.start_load_kv([Transfer("r", TOKENS, 0, ids, salt)])
    for n in NAMES:
        worker.wait_for_layer_load(n)
    worker.wait_for_save()
    failed = worker.get_block_ids_with_load_errors()
    worker.close()
    other, source = _worker(master, 1)  # (seed 1: the saved blocks' bytes)
    other.close()
    same = all(
        torch.equal(caches[n][ids].view(torch.int16), source[n][:3].view(torch.int16))
        for n in NAMES
    )
    return failed, same


def test_worker_saves_and_loads_in_the_request_salt(master: str) -> None:
    saver, _ = _worker(master, 1)
    saves = [Transfer("r", TOKENS, 0, [0, 1, 2], "a")]
    with torch.inference_mode():
        for n in NAMES:
            saver.save_kv_layer(saves, n)
    saver.wait_for_save()
    saver.close()

    base = _namespace(model="tiny-salt-worker")
    with Client.connect(master) as client:
        held = {
            salt: KVCache(client, salted_namespace(base, salt)).lookup(TOKENS)
            for salt in (None, "a", "b")
        }
    assert held == {None: 0, "a": len(TOKENS), "b": 0}, "saved under salt a only"

    assert _load(master, "a") == (set(), True), "one salt shares its blocks"
    assert _load(master, "b")[0] == {4, 5, 6}, "another salt finds none: recomputed"
    assert _load(master, None)[0] == {4, 5, 6}, "nor does an unsalted request"
