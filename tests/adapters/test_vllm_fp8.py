"""An FP8 KV cache (``--kv-cache-dtype fp8``) through the pool on real vLLM-CPU servers with the
real model: prefill saves its fp8 blocks (namespace dtype ``float8_e4m3``), decode loads them and
answers as a reference fp8 server without the connector, at temperature 0. Select with
``-m engine``; skipped where the vLLM virtualenv or the model is missing, and where the CPU has
neither AVX-512 nor AMX (vLLM-CPU's fp8 KV cache needs one of them and refuses to start).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.adapters.test_vllm import BS, LIBRARY, MAX_TOKENS, _ask
from tests.adapters.vllm_servers import (
    PoolServers,
    VLLMServer,
    assert_greedy_close,
    kv_config,
    kvstore_metric,
    missing_engine,
)
from tests.support import Cluster, start_master, wait_until


def missing_fp8_cpu() -> str | None:
    """Why this CPU cannot hold vLLM's fp8 KV cache, or None when it can (vLLM checks
    ``torch.cpu._is_avx512_supported()`` or AMX tiles; the kernel's CPU flags say the same)."""
    try:
        flags = set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return None  # (not Linux: let vLLM decide)
    if flags & {"avx512f", "amx_tile"}:
        return None
    return "vLLM-CPU's fp8 KV cache needs x86 with AVX-512 or AMX; this CPU has neither"


pytestmark = [
    pytest.mark.engine,
    pytest.mark.timeout(900),
    pytest.mark.skipif(missing_engine() is not None, reason=str(missing_engine())),
    pytest.mark.skipif(missing_fp8_cpu() is not None, reason=str(missing_fp8_cpu())),
]

FP8 = ["--kv-cache-dtype", "fp8"]


class Trio(PoolServers):
    def __init__(self, tmp: Path) -> None:
        self.cluster = Cluster(tmp, start_master())
        self.cluster.add_node("1GiB")
        addr = self.cluster.address
        self.ref = VLLMServer(tmp / "ref.log", None, cpu=0, extra_args=FP8)
        self.p = VLLMServer(tmp / "p.log", kv_config("kv_producer", addr), cpu=1, extra_args=FP8)
        self.d = VLLMServer(
            tmp / "d.log",
            kv_config("kv_consumer", addr),
            cpu=0,
            prefix_caching=False,
            extra_args=FP8,
        )
        self.servers = (self.ref, self.p, self.d)


@pytest.fixture(scope="module")
def trio(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Trio]:
    yield from Trio(Path(tmp_path_factory.mktemp("vllm-fp8"))).serve()


def test_decode_loads_fp8_blocks_and_answers_as_the_fp8_reference(trio: Trio) -> None:
    prompt = trio.ref.tokenize(_ask("When does the library close on weekdays?", LIBRARY))
    full = (len(prompt) - 1) // BS * BS
    want = trio.ref.complete_top(prompt, MAX_TOKENS)
    trio.p.complete(prompt, 1)
    wait_until(
        lambda: kvstore_metric(trio.p, "saved_tokens") >= len(prompt) // BS * BS,
        timeout=30,
        interval=0.2,
        what="prefill's fp8 blocks saved",
    )
    assert_greedy_close(trio.d.complete_top(prompt, MAX_TOKENS), want)
    wait_until(
        lambda: kvstore_metric(trio.d, "loaded_tokens") >= full,
        timeout=30,
        interval=0.2,
        what="decode's loaded_tokens",
    )
    assert kvstore_metric(trio.d, "loaded_tokens") == full
    assert kvstore_metric(trio.d, "load_errors") == 0
    assert "torch.uint8" in trio.d.log(), "the cache was fp8 (vLLM keeps it as bytes)"
