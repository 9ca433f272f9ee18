"""Reading an engine's ``/metrics``: what a vLLM server writes, and what the router refuses."""

from __future__ import annotations

import pytest

from kvstore.router.engines import EngineAnswerError, EngineLoad
from tests.router.fake_engine import metrics_text


def test_a_vllm_metrics_body_is_read() -> None:
    load = EngineLoad.from_metrics(metrics_text(running="2", waiting="1", usage="0.25"))
    assert (load.num_running, load.num_waiting, load.kv_usage) == (2, 1, 0.25)
    assert (load.block_size, load.num_blocks, load.cache_dtype) == (32, 1000, "auto")
    assert load.ignored == ()


@pytest.mark.parametrize(
    "gauges",
    [
        {"running": "NaN"},
        {"running": "+Inf"},
        {"waiting": "Inf"},
        {"usage": "-Inf"},
        {"usage": "nan"},
        {"running": "-1"},
    ],
)
def test_a_gauge_that_is_not_a_finite_count_is_a_malformed_answer(gauges: dict[str, str]) -> None:
    with pytest.raises(EngineAnswerError):
        EngineLoad.from_metrics(metrics_text(**gauges))


@pytest.mark.parametrize("block_size", ["0", "00", "-32", "32.0", "abc", "\u00b2", "\u0663", ""])
def test_a_block_size_that_is_not_a_positive_integer_reads_as_unknown(block_size: str) -> None:
    load = EngineLoad.from_metrics(metrics_text(block_size=block_size))
    assert load.block_size is None and load.num_blocks == 1000
    (why,) = load.ignored
    assert "block_size" in why and repr(block_size) in why
