"""Prompt synthesis and scaling: equal hash ids are equal token prefixes, in every process."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvstore.errors import InvalidRequestError
from kvstore.replay.workload import (
    ScaleConfig,
    block_tokens_for,
    build_requests,
    ideal_cached_tokens,
    scale_request,
    synthesize_prompt,
)
from kvstore.sim.trace import TraceRequest

BT = 32


def trace_request(
    hash_ids: tuple[int, ...],
    input_length: int,
    output_length: int = 100,
    ts: int = 0,
    rid: int = 0,
) -> TraceRequest:
    return TraceRequest(rid, ts, input_length, output_length, hash_ids)


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def test_equal_hash_id_prefixes_give_identical_token_prefixes() -> None:
    a = synthesize_prompt([0, 1, 2, 3], 4 * BT, BT)
    b = synthesize_prompt([0, 1, 2, 9], 4 * BT, BT)
    c = synthesize_prompt([0, 5], 2 * BT, BT)
    assert a[: 3 * BT] == b[: 3 * BT]
    assert common_prefix(a, b) < 4 * BT  # the fourth block differs
    assert a[:BT] == c[:BT]
    assert common_prefix(a, c) < 2 * BT


def test_distinct_first_blocks_differ_and_seeds_change_contents() -> None:
    assert block_tokens_for(1, BT).tolist() != block_tokens_for(2, BT).tolist()
    assert block_tokens_for(1, BT, seed=0).tolist() != block_tokens_for(1, BT, seed=1).tolist()
    tokens = synthesize_prompt([7], 20, BT)
    assert len(tokens) == 20
    assert all(1000 <= t < 40_000 for t in tokens)


def test_prompt_must_fit_its_blocks() -> None:
    with pytest.raises(InvalidRequestError):
        synthesize_prompt([0, 1], 20, BT)  # 20 tokens is one block, not two
    with pytest.raises(InvalidRequestError):
        synthesize_prompt([], 0, BT)


def test_deterministic_across_processes() -> None:
    code = (
        "from kvstore.replay.workload import synthesize_prompt;"
        "print(synthesize_prompt([0, 14, 15], 80, 32))"
    )
    outs = {
        subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            check=True,
            env={"PYTHONHASHSEED": str(seed), "PATH": ""},
        ).stdout
        for seed in (1, 2)
    }
    assert len(outs) == 1
    assert outs.pop().strip() == str(synthesize_prompt([0, 14, 15], 80, 32))


@pytest.mark.parametrize(
    ("input_length", "num_blocks", "expected_prompt"),
    [
        (512, 1, 32),  # one full block
        (513, 2, 33),  # a 1-token last block still keeps one token
        (6758, 14, 13 * 32 + 6),  # a last block of 102 tokens -> round(6.375) = 6
        (1024 + 256, 3, 2 * 32 + 16),
    ],
)
def test_prompt_lengths_scale_by_block(
    input_length: int, num_blocks: int, expected_prompt: int
) -> None:
    request = trace_request(tuple(range(num_blocks)), input_length)
    expected = expected_prompt
    scaled = scale_request(request, 0, ScaleConfig(block_tokens=BT, max_prompt_tokens=10_000))
    assert scaled.prompt_tokens == expected
    assert len(scaled.hash_ids) == num_blocks
    assert len(synthesize_prompt(scaled.hash_ids, scaled.prompt_tokens, BT)) == expected


def test_caps_cut_whole_blocks_and_outputs() -> None:
    request = trace_request(tuple(range(10)), 5000, output_length=500)
    scaled = scale_request(request, 0, ScaleConfig(max_prompt_tokens=100, max_output_tokens=8))
    assert scaled.prompt_tokens == 100
    assert scaled.hash_ids == (0, 1, 2, 3)  # ceil(100 / 32)
    assert scaled.max_tokens == 8
    # default output scale is block_tokens / 512: 500 * 32 / 512 = 31.25 -> 31
    assert scale_request(request, 0, ScaleConfig(max_output_tokens=100)).max_tokens == 31
    assert scale_request(request, 0, ScaleConfig(length_scale=0.001)).max_tokens == 1


@pytest.mark.parametrize(
    ("time_scale", "expected"),
    [(1.0, [0.0, 3.0, 7.5]), (0.5, [0.0, 1.5, 3.75]), (0.0, [0.0, 0.0, 0.0])],
)
def test_time_scaling_from_the_first_request(time_scale: float, expected: list[float]) -> None:
    trace = [trace_request((i,), 100, ts=ts, rid=i) for i, ts in enumerate((1000, 4000, 8500))]
    scaled = build_requests(trace, ScaleConfig(time_scale=time_scale))
    assert [r.arrival_s for r in scaled] == pytest.approx(expected)
    assert [r.request_id for r in scaled] == [0, 1, 2]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"block_tokens": 0},
        {"length_scale": 0.0},
        {"max_output_tokens": 0},
        {"max_prompt_tokens": 0},
        {"time_scale": -1.0},
        {"time_scale": float("inf")},
        {"seed": -1},
    ],
)
def test_bad_scale_config_is_refused(kwargs: dict) -> None:
    with pytest.raises(InvalidRequestError):
        ScaleConfig(**kwargs)


def test_empty_slice_is_refused() -> None:
    with pytest.raises(InvalidRequestError):
        build_requests([], ScaleConfig())


def test_ideal_cached_tokens_follow_the_prefix_structure() -> None:
    trace = [
        trace_request((0, 1, 2), 1536, rid=0),
        trace_request((0, 1, 3), 1536, rid=1),  # shares two blocks
        trace_request((0, 1, 2), 1536, rid=2),  # the whole prompt seen: all but the last block
        trace_request((4,), 512, rid=3),  # nothing shared
        trace_request((0, 5), 600, rid=4),  # shares one block
    ]
    scaled = build_requests(trace, ScaleConfig())
    assert ideal_cached_tokens(scaled, BT) == [0, 64, 64, 0, 32]
