"""The load generator against an OpenAI-shaped endpoint of our own (headers, 429s, pacing)."""

from __future__ import annotations

import pytest

from kvstore.errors import InvalidRequestError
from kvstore.replay.loadgen import LoadConfig, request_body, resolve_model, run_replay
from kvstore.replay.summary import summarize
from kvstore.replay.workload import ScaleConfig, build_requests, ideal_cached_tokens
from kvstore.sim.default_slo import SLOClass
from kvstore.sim.trace import TraceRequest
from tests.replay.fake_openai import FakeOpenAI

SCALE = ScaleConfig(block_tokens=32, max_output_tokens=4, time_scale=0.0)
SLO = SLOClass("t", ttft_s=10.0, tbt_s=1.0)
TRACE = [
    TraceRequest(0, 0, 1536, 100, (0, 1, 2)),
    TraceRequest(1, 10, 1536, 100, (0, 1, 3)),
    TraceRequest(2, 20, 1024, 100, (0, 4)),
    TraceRequest(3, 30, 512, 100, (5,)),
]


def test_body_is_a_streamed_greedy_token_id_completion() -> None:
    body = request_body("m", [1, 2, 3], 5)
    assert body["prompt"] == [1, 2, 3]
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["temperature"] == 0 and body["ignore_eos"] is True and body["max_tokens"] == 5


@pytest.mark.parametrize(
    "kwargs",
    [{"targets": ()}, {"targets": ("ftp://x",)}, {"targets": ("http://x",), "concurrency": 0}],
)
def test_bad_load_config(kwargs: dict) -> None:
    with pytest.raises(InvalidRequestError):
        LoadConfig(model="m", **kwargs)


def test_headers_give_engine_load_and_the_measured_hit_rate() -> None:
    requests = build_requests(TRACE, SCALE)
    with FakeOpenAI() as server:
        assert resolve_model(server.url) == "fake-model"
        load = LoadConfig((server.url,), "fake-model", concurrency=1)
        results = run_replay(requests, SCALE, load, ideal_cached_tokens(requests, 32))
    assert [r.outcome for r in results] == ["ok"] * 4
    assert all(len(r.token_times_s) == 4 and r.ttft_s > 0 for r in results)
    assert server.max_in_flight == 1
    # the second prompt shares two blocks (64 tokens) with the first, the third one block
    assert [r.cached_tokens for r in results] == [0, 64, 32, 0]
    assert server.prompts[0][:64] == server.prompts[1][:64] != server.prompts[3][:64]
    summary = summarize(results, SLO)
    assert summary.hit_rate_source == "router"
    assert summary.hit_rate == pytest.approx(96 / (96 + 96 + 64 + 32))
    assert summary.hit_rate == pytest.approx(summary.ideal_hit_rate)
    assert summary.engine_load == {"engine-0": 2, "engine-1": 2}


def test_rejections_are_counted_and_the_replay_goes_on() -> None:
    requests = build_requests(TRACE, SCALE)
    with FakeOpenAI(headers=False, reject_every=2) as server:
        results = run_replay(requests, SCALE, LoadConfig((server.url,), "fake-model"))
    assert [r.outcome for r in results].count("rejected") == 2
    assert all(r.status == 429 for r in results if r.outcome == "rejected")
    summary = summarize(results, SLO)
    assert (summary.num_ok, summary.num_rejected, summary.num_errors) == (2, 2, 0)
    assert summary.hit_rate_source == "ideal"


def test_client_round_robin_over_several_targets() -> None:
    requests = build_requests(TRACE, SCALE)
    with FakeOpenAI(headers=False) as a, FakeOpenAI(headers=False) as b:
        results = run_replay(requests, SCALE, LoadConfig((a.url, b.url), "fake-model"))
    assert len(a.prompts) == len(b.prompts) == 2
    assert summarize(results, SLO).engine_load == {a.url: 2, b.url: 2}


def test_an_unreachable_target_is_an_error_per_request() -> None:
    with FakeOpenAI() as server:
        url = server.url
    requests = build_requests(TRACE[:2], SCALE)
    results = run_replay(requests, SCALE, LoadConfig((url,), "m", timeout_s=10))
    assert [r.outcome for r in results] == ["error", "error"]
    with pytest.raises(InvalidRequestError):
        resolve_model(url, timeout_s=10)
