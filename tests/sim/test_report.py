from __future__ import annotations

import pytest

from kvstore.sim.__main__ import main
from kvstore.sim.report import capacity_label, format_table

from .factories import synthetic_trace, trace_line


def write_trace(path, requests) -> None:
    path.write_text(
        "\n".join(
            trace_line(r.timestamp_ms, r.input_length, list(r.hash_ids), r.output_length)
            for r in requests
        )
        + "\n"
    )


def test_format_table() -> None:
    text = format_table(["a", "bb"], [[1, 0.5], ["xyz", float("nan")]])
    assert text.splitlines() == [
        "|   a |    bb |",
        "|-----|-------|",
        "|   1 | 0.500 |",
        "| xyz |   nan |",
    ]


@pytest.mark.parametrize(("blocks", "label"), [(None, "unlimited"), (1000, "1k"), (1500, "1500")])
def test_capacity_label(blocks, label: str) -> None:
    assert capacity_label(blocks) == label


def test_cli_prints_tables_and_writes_plots(tmp_path, capsys) -> None:
    trace = tmp_path / "t.jsonl"
    write_trace(trace, synthetic_trace(2, 150, block_size=512))
    out = tmp_path / "plots"
    status = main(
        [
            str(trace),
            "--prefill",
            "2",
            "--decode",
            "2",
            "--hit-rates",
            "--ablation",
            "--out",
            str(out),
        ]
    )
    assert status == 0
    printed = capsys.readouterr().out
    assert (
        "150 requests" in printed and "conductor -reject" in printed and "length-aware" in printed
    )
    for name in ("ttft_cdf.png", "goodput.png", "instance_load.png", "hit_rate.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_names_the_bad_line(tmp_path, capsys) -> None:
    trace = tmp_path / "bad.jsonl"
    trace.write_text(trace_line(0, 100, [0]) + "\n" + trace_line(5, 100, [0, 1]) + "\n")
    assert main([str(trace)]) == 2
    assert "bad.jsonl line 2: hash_ids has 2 ids" in capsys.readouterr().err


def test_cli_rejects_unknown_routers(tmp_path, capsys) -> None:
    trace = tmp_path / "t.jsonl"
    write_trace(trace, synthetic_trace(2, 5, block_size=512))
    assert main([str(trace), "--routers", "conductor,random"]) == 2
    assert "unknown router(s) random" in capsys.readouterr().err
