from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.errors import InvalidRequestError
from kvstore.sim.trace import (
    TraceFormatError,
    load_trace,
    num_blocks_for,
    parse_trace_lines,
)

from .factories import synthetic_trace, trace_line

GOOD = trace_line(0, 1000, [0, 1])  # 1000 tokens = 2 blocks of 512


@pytest.mark.parametrize(
    ("bad_line", "fragment"),
    [
        ("", "blank line"),
        ("{not json", "not valid JSON"),
        ("[1, 2]", "expected a JSON object"),
        (json.dumps({"timestamp": 1, "input_length": 5, "output_length": 1}), "hash_ids"),
        (json.dumps({"input_length": 5, "output_length": 1, "hash_ids": [0]}), "timestamp"),
        (trace_line(1, -5, []), "'input_length' must be >= 1"),
        (trace_line(1, 0, []), "'input_length' must be >= 1"),
        (trace_line(1, 100, [0], output_length=-1), "'output_length' must be >= 1"),
        (trace_line(-1, 100, [0]), "'timestamp' must be >= 0"),
        (trace_line(1, 100.5, [0]), "'input_length' must be an integer"),  # type: ignore[arg-type]
        (trace_line(1, True, [0]), "'input_length' must be an integer"),  # type: ignore[arg-type]
        (trace_line(1, 1000, [0]), "hash_ids has 1 ids but input_length 1000 needs"),
        (trace_line(1, 100, [0, 1]), "hash_ids has 2 ids"),
        (trace_line(1, 100, [-3]), "hash_ids[0] must be a non-negative integer"),
        (trace_line(1, 100, ["a"]), "hash_ids[0] must be a non-negative integer"),  # type: ignore[list-item]
        (
            json.dumps({"timestamp": 1, "input_length": 5, "output_length": 1, "hash_ids": 3}),
            "must be a list",
        ),
        (
            trace_line(1, 1000, [5, 1]),
            "hash_ids[1] = 1 follows 5 here but followed 0 on an earlier line",
        ),
        (trace_line(1, 1000, [1, 2]), "hash_ids[0] = 1 starts the prompt here but followed 0"),
    ],
)
def test_bad_line_names_the_line(bad_line: str, fragment: str) -> None:
    with pytest.raises(TraceFormatError) as info:
        parse_trace_lines([GOOD, GOOD, bad_line, GOOD], source="t.jsonl")
    assert info.value.line_no == 3
    assert "t.jsonl line 3" in str(info.value)
    assert fragment in str(info.value)
    assert isinstance(info.value, InvalidRequestError)


def test_unsorted_timestamps_name_the_line() -> None:
    lines = [trace_line(10, 100, [0]), trace_line(20, 100, [0]), trace_line(15, 100, [0])]
    with pytest.raises(TraceFormatError, match=r"line 3: timestamp 15 is earlier than .* 20"):
        parse_trace_lines(lines)


@pytest.mark.parametrize("lines", [[], iter(())])
def test_empty_trace_is_an_error(lines) -> None:
    with pytest.raises(TraceFormatError, match="empty trace"):
        parse_trace_lines(lines)


def test_equal_timestamps_and_shared_prefixes_are_fine() -> None:
    requests = parse_trace_lines([GOOD, trace_line(0, 1500, [0, 1, 2]), trace_line(0, 10, [7])])
    assert [r.request_id for r in requests] == [0, 1, 2]
    assert requests[1].hash_ids == (0, 1, 2)
    assert requests[2].arrival_s == 0.0


def test_load_trace_from_file_with_limit_and_errors(tmp_path) -> None:
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join([GOOD, GOOD, "oops"]) + "\n")
    assert len(load_trace(path, limit=2)) == 2
    with pytest.raises(TraceFormatError, match=rf"{path} line 3: not valid JSON"):
        load_trace(path)
    with pytest.raises(InvalidRequestError, match="limit"):
        load_trace(path, limit=0)


@pytest.mark.parametrize(("tokens", "blocks"), [(1, 1), (512, 1), (513, 2), (6758, 14)])
def test_num_blocks_for(tokens: int, blocks: int) -> None:
    assert num_blocks_for(tokens) == blocks


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), num=st.integers(1, 60))
def test_synthetic_traces_round_trip(seed: int, num: int) -> None:
    requests = synthetic_trace(seed, num)
    lines = [
        trace_line(r.timestamp_ms, r.input_length, list(r.hash_ids), r.output_length)
        for r in requests
    ]
    assert parse_trace_lines(lines, block_size=4) == requests


def test_real_trace_loads(real_trace) -> None:
    assert len(real_trace) == 12_031
    assert all(len(r.hash_ids) == num_blocks_for(r.input_length) for r in real_trace)
