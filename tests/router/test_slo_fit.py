"""SLO classes of the router (config file, API keys, header) and the timing fits."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvstore.errors import InvalidRequestError
from kvstore.router.admission import EngineSlots
from kvstore.router.engines import EngineLoad, make_engines
from kvstore.router.live_fit import EngineFit, LineFit
from kvstore.router.slo_classes import SLOPolicy
from kvstore.routing.cost import CostModel


def _slots() -> EngineSlots:
    return EngineSlots(4, 0.7, lambda: 0.0)


TOML = """
default_class = "standard"
promote_fraction = 0.5

[[classes]]
name = "critical"
ttft_s = 0.3
tbt_s = 0.02

[[classes]]
name = "standard"
ttft_s = 5.0
tbt_s = 0.2

[api_keys]
"sk-a" = "critical"
"""


def test_defaults_have_the_three_classes_in_priority_order() -> None:
    policy = SLOPolicy()
    assert [c.name for c in policy.classes] == ["critical", "standard", "batch"]
    prio, critical = policy.get("critical")
    assert prio == 0 and critical.ttft_s == 0.3 and critical.tbt_s == 0.02


@pytest.mark.parametrize(
    ("headers", "want"),
    [
        ({}, "standard"),
        ({"X-SLO-Class": "critical"}, "critical"),
        ({"Authorization": "Bearer sk-a"}, "critical"),
        ({"Authorization": "Bearer sk-a", "X-SLO-Class": "standard"}, "critical"),  # key wins
        ({"Authorization": "Bearer other"}, "standard"),
    ],
)
def test_classify_by_api_key_then_header(
    tmp_path: Path, headers: dict[str, str], want: str
) -> None:
    path = tmp_path / "slo.toml"
    path.write_text(TOML)
    policy = SLOPolicy.load(path)
    assert policy.promote_fraction == 0.5
    assert policy.classify(headers)[1].name == want


@pytest.mark.parametrize(
    "data",
    [
        {"classes": []},
        {"classes": [{"name": "a", "ttft_s": 1, "tbt_s": 1}], "default_class": "b"},
        {"api_keys": {"k": "gold"}},
        {"promote_fraction": 1.5},
        {"classes": [{"name": "a", "ttft_s": -1, "tbt_s": 1}]},
        {"classes": [{"name": "a", "ttft_s": 1}]},
        {"colour": "blue"},
    ],
)
def test_bad_configs_are_refused(tmp_path: Path, data: dict[str, object]) -> None:
    path = tmp_path / "slo.json"
    path.write_text(json.dumps(data))
    with pytest.raises(InvalidRequestError):
        SLOPolicy.load(path)


def test_an_unknown_header_class_is_refused() -> None:
    with pytest.raises(InvalidRequestError, match="gold"):
        SLOPolicy().classify({"X-SLO-Class": "gold"})


def test_line_fit_needs_three_distinct_points_and_recovers_the_line() -> None:
    fit = LineFit()
    fit.add(100, 0.15)
    fit.add(100, 0.15)
    fit.add(200, 0.25)
    assert fit.solve() is None
    for n in (300, 400, 800):
        fit.add(n, 0.05 + n * 1e-3)
    a, b = fit.solve() or (0, 0)
    assert a == pytest.approx(0.05) and b == pytest.approx(1e-3)


def test_engine_fit_replaces_the_prior_terms_it_measured() -> None:
    prior = CostModel(prefill_base_s=1.0, prefill_s_per_token=1.0, decode_base_s=1.0)
    fit = EngineFit(prior)
    assert fit.cost() == prior
    for n in (10, 20, 40):
        fit.prefill.add(n, 0.01 + n * 0.002)
    cost = fit.cost()
    assert cost.prefill_s(100) == pytest.approx(0.21)
    assert cost.decode_base_s == 1.0  # not measured: the prior stands


METRICS = """# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="smollm2"} 2.0
vllm:num_requests_waiting{engine="0",model_name="smollm2"} 1.0
vllm:kv_cache_usage_perc{engine="0",model_name="smollm2"} 0.25
vllm:cache_config_info{block_size="32",cache_dtype="auto",engine="0",num_gpu_blocks="1456"} 1.0
vllm:inter_token_latency_seconds_sum{engine="0",model_name="smollm2"} 3.5
vllm:inter_token_latency_seconds_count{engine="0",model_name="smollm2"} 70.0
vllm:kvstore_loaded_bytes_total{engine="0",model_name="smollm2"} 4.0e+06
vllm:kvstore_load_seconds_total{engine="0",model_name="smollm2"} 0.5
"""


def test_vllm_metrics_are_read() -> None:
    load = EngineLoad.from_metrics(METRICS)
    assert (load.num_running, load.num_waiting, load.kv_usage) == (2, 1, 0.25)
    assert (load.block_size, load.num_blocks, load.cache_dtype) == (32, 1456, "auto")
    assert (load.itl_sum_s, load.itl_count) == (3.5, 70.0)
    assert (load.loaded_bytes, load.load_seconds) == (4e6, 0.5)


def test_measured_load_bandwidth_replaces_the_transfer_prior() -> None:
    prior = CostModel(kv_bytes_per_token=1000, transfer_bytes_per_s=1e9, transfer_latency_s=0.0)
    fit = EngineFit(prior)
    fit.transfer.add(500_000, 0.1)  # under a MiB loaded: the prior stands
    assert fit.cost().transfer_bytes_per_s == 1e9
    fit.transfer.add(1_500_000, 0.3)
    fit.transfer.add(0, 0.0)  # a poll that saw no load is not a sample
    assert fit.cost().transfer_bytes_per_s == pytest.approx(5e6)
    assert fit.cost().transfer_s(1000) == pytest.approx(0.2)


def test_engine_polls_feed_the_bandwidth_fit() -> None:
    engine = make_engines([("both", "http://e")], lambda: EngineFit(CostModel()), _slots)[0]
    before = EngineLoad.from_metrics(METRICS)
    engine.observe(before, [], 0.9, 0.7)  # the first poll: totals since the engine started
    after = EngineLoad(loaded_bytes=before.loaded_bytes + 2e6, load_seconds=before.load_seconds + 1)
    engine.observe(after, [], 0.9, 0.7)
    assert engine.fit.cost().transfer_bytes_per_s == pytest.approx(2e6)
