"""``kvstore replay`` against one real vLLM server (SmolLM2-135M-Instruct, CPU).

Six requests from the start of the conversation trace, one at a time: every one completes,
TTFTs are positive, the report files exist, and the prompts that share hash ids really shared a
prefix in the engine (vLLM's ``vllm:prefix_cache_hits`` grows by at least the trace's ideal
reuse). Skipped where the vLLM virtualenv or the model is missing, like the other engine tests.

``tests/data/conversation_trace_head.jsonl`` is the first 12 lines of Mooncake's FAST'25
``conversation_trace.jsonl`` (Apache-2.0, kvcache-ai/Mooncake, FAST25-release/traces/).
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.adapters.vllm_servers import VLLMServer, missing_engine

pytestmark = [
    pytest.mark.engine,
    pytest.mark.timeout(600),
    pytest.mark.skipif(missing_engine() is not None, reason=str(missing_engine())),
]

TRACE = Path(__file__).resolve().parents[1] / "data" / "conversation_trace_head.jsonl"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VLLMServer]:
    tmp = tmp_path_factory.mktemp("replay-vllm")
    with VLLMServer(tmp / "vllm.log", None, cpu=0, block_size=32) as srv:
        srv.wait_ready()
        yield srv


def _hits(server: VLLMServer) -> float:
    return server.metrics().get("vllm:prefix_cache_hits", 0.0)


def test_replay_six_requests(server: VLLMServer, tmp_path: Path) -> None:
    out = tmp_path / "out"
    hits_before = _hits(server)
    argv = [sys.executable, "-m", "kvstore", "replay", str(TRACE), "--router", server.url]
    argv += ["--requests", "6", "--concurrency", "1", "--max-output", "4", "--max-prompt", "512"]
    argv += ["--simulate", "--out", str(out)]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "TTFT p50/p90/p99 ms" in proc.stdout and "simulated" in proc.stdout
    body = json.loads((out / "results.json").read_text())
    requests = body["requests"]
    assert len(requests) == 6
    assert all(r["outcome"] == "ok" for r in requests), requests
    assert all(r["ttft_s"] > 0 for r in requests)
    assert all(r["output_tokens"] == r["max_tokens"] for r in requests)
    for name in ("latency_cdf.png", "timeline.png", "engine_load.png", "ttft_fit.png"):
        assert (out / name).stat().st_size > 1000
    # Every request of the slice starts with hash id 0: each after the first can reuse its
    # 32-token block, and vLLM's own prefix cache must have served at least that much.
    ideal = sum(r["ideal_cached_tokens"] for r in requests)
    assert ideal >= 5 * 32
    assert _hits(server) - hits_before >= ideal
