"""The vLLM connector's worker side on every KV-cache layout vLLM 0.32 registers.

Caches are allocated by vLLM's own code on the CPU (``tests/adapters/vllm_layouts_driver.py``,
run in the vLLM virtualenv); blocks saved from one layout into a real pool (a master and a node,
real processes) are loaded into another layout and must equal their source bit for bit, as each
backend's kernels read them, with every other block of the destination left as it was. A
corrupt block is refused and reported for recompute; caches that cannot share (TP size, dtype,
MLA or not) miss; a layout the connector cannot serve is refused with one line naming it and its
backend. Select with ``-m engine``; skipped where the vLLM virtualenv is missing.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.adapters.vllm_servers import REPO_ROOT, vllm_python
from tests.support import Cluster, start_master

pytestmark = [
    pytest.mark.engine,
    pytest.mark.timeout(600),
    pytest.mark.skipif(not vllm_python().exists(), reason=f"no vLLM virtualenv at {vllm_python()}"),
]

LAYOUTS = ("LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC")
DST_IDS = [1, 8, 9, 3]


def _view(layout: str, backend: str, dtype: str = "bfloat16", **extra: Any) -> dict[str, Any]:
    return {"form": "view", "layout": layout, "backend": backend, "dtype": dtype, **extra}


def _pair(layout: str, dtype: str = "bfloat16") -> dict[str, Any]:
    return {"form": "pair", "layout": layout, "backend": "FLASH_ATTN", "dtype": dtype}


CPU = _view("LBHNC", "CPU_ATTN")
#: name -> (source cache, destination cache, extra case fields)
CASES: dict[str, tuple[dict[str, Any], dict[str, Any], dict[str, Any]]] = {
    **{f"flash-{x}-to-cpu": (_view(x, "FLASH_ATTN"), CPU, {}) for x in LAYOUTS},
    **{f"cpu-to-flashinfer-{x}": (CPU, _view(x, "FLASHINFER"), {}) for x in LAYOUTS},
    "pair-NHD-to-BLNHC-fp16": (
        _pair("NHD", "float16"),
        _view("BLNHC", "FLASH_ATTN", "float16"),
        {},
    ),
    "flex-LBNHC-to-pair-HND-fp16": (
        _view("LBNHC", "FLEX_ATTENTION", "float16"),
        _pair("HND", "float16"),
        {},
    ),
    "fp8-LBNHC-to-BLHNC": (
        _view("LBNHC", "FLASH_ATTN", "fp8"),
        _view("BLHNC", "FLASHINFER", "fp8"),
        {},
    ),
    "mla-cpu-to-flashmla-BLHNC": (
        _view("LBHNC", "CPU_MLA", mla=True),
        _view("BLHNC", "FLASHMLA", mla=True),
        {},
    ),
    "mla-fp8-LBNHC-to-LHBNC": (
        _view("LBNHC", "TRITON_MLA", "fp8", mla=True),
        _view("LHBNC", "CUTLASS_MLA", "fp8", mla=True),
        {},
    ),
    "corrupt": (CPU, _view("BLHNC", "FLASH_ATTN"), {"corrupt": 1}),
    "tp2-to-tp1-misses": (
        _view("LBHNC", "FLASH_ATTN", tp_size=2),
        _view("LBHNC", "FLASH_ATTN"),
        {},
    ),
    "tp2-rank1-to-rank0-misses": (
        _view("LBHNC", "FLASH_ATTN", tp_size=2, tp_rank=1),
        _view("LBHNC", "FLASH_ATTN", tp_size=2, tp_rank=0),
        {},
    ),
    "tp2-rank1-shares": (
        _view("BLHNC", "FLASH_ATTN", tp_size=2, tp_rank=1),
        _view("LBHNC", "CPU_ATTN", tp_size=2, tp_rank=1),
        {},
    ),
    "fp16-to-bf16-misses": (_view("LBHNC", "FLASH_ATTN", "float16"), CPU, {}),
    "cpu-attn-LBNHC-refused": (CPU, _view("LBNHC", "CPU_ATTN"), {}),
    "unknown-backend-refused": (CPU, _view("LBHNC", "B12X"), {}),
}
MISSES = {"tp2-to-tp1-misses", "tp2-rank1-to-rank0-misses", "fp16-to-bf16-misses"}
REFUSED = {
    "cpu-attn-LBNHC-refused": "KV cache layout LBNHC of backend CPU_ATTN is not supported",
    "unknown-backend-refused": "attention backend B12X",
}


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, dict[str, Any]]]:
    """Every case, in one run of the driver (vLLM's import is the slow part) on one pool."""
    cluster = Cluster(Path(tmp_path_factory.mktemp("vllm-layouts")), start_master())
    try:
        cluster.add_node("256MiB")
        specs = [
            {"master": cluster.address, "src": src, "dst": dst, "seed": i, **extra}
            for i, (src, dst, extra) in enumerate(CASES.values())
        ]
        proc = subprocess.run(
            [str(vllm_python()), "-m", "tests.adapters.vllm_layouts_driver", json.dumps(specs)],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=540,
            check=False,
        )
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULTS ")]
        assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-3000:]
        yield dict(zip(CASES, json.loads(lines[-1].removeprefix("RESULTS ")), strict=True))
    finally:
        cluster.stop()


@pytest.mark.parametrize(
    "name", [n for n in CASES if n not in MISSES | REFUSED.keys() | {"corrupt"}]
)
def test_blocks_saved_from_one_layout_load_bit_exact_into_another(
    results: dict[str, dict[str, Any]], name: str
) -> None:
    r = results[name]
    assert r.get("failed") == [], r
    assert r["exact"] and r["num_exact"] == 3 * len(DST_IDS), r
    assert r["untouched"], "a block the load did not name changed"


def test_a_corrupt_block_is_refused_and_reported_for_recompute(
    results: dict[str, dict[str, Any]],
) -> None:
    r = results["corrupt"]
    assert r["failed"] == [DST_IDS[1]], r
    assert r["exact"] and r["num_exact"] == 3 * (len(DST_IDS) - 1), r
    assert r["untouched"], "the refused block's bytes reached the cache"


@pytest.mark.parametrize("name", sorted(MISSES))
def test_caches_that_cannot_share_miss(results: dict[str, dict[str, Any]], name: str) -> None:
    r = results[name]
    assert r["failed"] == sorted(DST_IDS), r
    assert r["untouched"], r


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_a_layout_it_cannot_serve_is_refused_in_one_line(
    results: dict[str, dict[str, Any]], name: str
) -> None:
    message = results[name].get("refused", "")
    assert REFUSED[name] in message and "\n" not in message, results[name]
