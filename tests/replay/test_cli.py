"""``kvstore replay``: bad input is one line and exit status 2; a run prints and writes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvstore.cli import main
from kvstore.errors import InvalidRequestError
from kvstore.replay.cli import parse_slice, slo_from_args
from tests.replay.fake_openai import FakeOpenAI

GOOD = '{"timestamp": 0, "input_length": 600, "output_length": 50, "hash_ids": [0, 1]}\n'
GOOD2 = '{"timestamp": 500, "input_length": 700, "output_length": 60, "hash_ids": [0, 2]}\n'
GOOD3 = '{"timestamp": 900, "input_length": 1100, "output_length": 9, "hash_ids": [0, 1, 3]}\n'


@pytest.mark.parametrize(("text", "expected"), [("0:20", (0, 20)), (":5", (0, 5)), ("3:4", (3, 4))])
def test_parse_slice(text: str, expected: tuple[int, int]) -> None:
    assert parse_slice(text) == expected


@pytest.mark.parametrize("text", ["5", "a:b", "4:4", "5:2", "-1:3", "1:2:3"])
def test_bad_slices(text: str) -> None:
    with pytest.raises(InvalidRequestError):
        parse_slice(text)


def test_slo_classes_and_overrides() -> None:
    assert slo_from_args("critical", None, None).name == "critical"
    custom = slo_from_args("batch", 2.0, None)
    assert (custom.ttft_s, custom.tbt_s) == (2.0, 1.0)
    with pytest.raises(InvalidRequestError):
        slo_from_args("gold", None, None)
    with pytest.raises(InvalidRequestError):
        slo_from_args("batch", -1.0, None)


def _trace(tmp_path: Path, text: str) -> str:
    path = tmp_path / "trace.jsonl"
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize(
    ("make", "flags", "needle"),
    [
        (lambda p: str(p / "missing.jsonl"), [], "cannot read trace"),
        (lambda p: _trace(p, GOOD + "{not json\n"), [], "line 2: not valid JSON"),
        (lambda p: _trace(p, GOOD + GOOD2), ["--slice", "1:9"], "past the end"),
        (lambda p: _trace(p, GOOD), ["--slice", "x"], "expected START:END"),
        (lambda p: _trace(p, GOOD), ["--requests", "0"], "--requests must be >= 1"),
        (lambda p: _trace(p, GOOD), ["--block-tokens", "0"], "block_tokens"),
    ],
)
def test_bad_input_is_one_line_and_status_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], make, flags: list[str], needle: str
) -> None:
    # the router is never asked: input is checked first (nothing listens on port 9)
    argv = ["replay", make(tmp_path), "--router", "http://127.0.0.1:9", "--requests", "2"]
    if "--requests" in flags or "--slice" in flags:
        argv = argv[:-2]
    status = main([*argv, *flags, "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert status == 2
    assert needle in err
    assert err.count("\n") == 1 and err.startswith("kvstore replay: ")
    assert not (tmp_path / "out").exists()


def test_bad_router_url_is_status_2(tmp_path: Path) -> None:
    argv = ["replay", _trace(tmp_path, GOOD), "--router", "localhost:8000", "--requests", "1"]
    assert main(argv) == 2


def test_the_console_script_exits_2_on_a_missing_trace(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "kvstore", "replay", str(tmp_path / "nope"), "--router", "http://x"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().startswith("kvstore replay: cannot read trace")


def _replay_three(tmp_path: Path, *extra: str) -> tuple[int, Path]:
    """``kvstore replay`` of three good requests against a fake endpoint, at full speed;
    returns the exit status and the ``--out`` folder."""
    trace = _trace(tmp_path, GOOD + GOOD2 + GOOD3)
    out = tmp_path / "out"
    with FakeOpenAI() as server:
        argv = ["replay", trace, "--router", server.url, "--requests", "3", "--time-scale", "0"]
        status = main([*argv, *extra, "--out", str(out)])
    return status, out


def test_a_run_prints_tables_and_writes_results(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    status, out = _replay_three(tmp_path, "--concurrency", "1", "--simulate")
    printed = capsys.readouterr().out
    assert status == 0
    assert "TTFT p50/p90/p99 ms" in printed and "hit rate (router)" in printed
    assert "simulated" in printed and "rel. error" in printed
    body = json.loads((out / "results.json").read_text())
    assert len(body["requests"]) == 3 and body["summary"]["num_ok"] == 3
    assert body["prediction"]["goodput_rps"] > 0
    for name in ("latency_cdf.png", "timeline.png", "engine_load.png", "ttft_fit.png"):
        assert (out / name).stat().st_size > 1000


def test_a_kv_both_simulation_fits_the_step_model(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    sim = ["--simulate", "--engine-model", "kv_both", "--instances", "1"]
    status, out = _replay_three(tmp_path, "--policy", "least-loaded", *sim)
    printed = capsys.readouterr().out
    assert status == 0
    assert "1 kv_both engines, policy least-loaded" in printed
    assert "fitted (kv_both engine): step =" in printed
    body = json.loads((out / "results.json").read_text())
    assert body["step_model"]["step_base_s"] > 0
    assert body["prediction"]["mean_ttft_s"] > 0
