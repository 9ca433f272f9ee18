"""The ready record every daemon prints, and the one parser that reads it."""

from __future__ import annotations

import json
import os

import pytest

from kvstore.processes import READY_PREFIXES, parse_ready, ready_line


@pytest.mark.parametrize("role", sorted(READY_PREFIXES))
def test_a_ready_line_round_trips(role: str) -> None:
    line = ready_line(role, control="127.0.0.1:7700", tiers={"nvme": 1 << 30}, shm=False)
    assert line.startswith(READY_PREFIXES[role] + " {")
    assert "\n" not in line
    record = parse_ready(line + "\n")
    assert record == {
        "role": role,
        "pid": os.getpid(),
        "control": "127.0.0.1:7700",
        "tiers": {"nvme": 1 << 30},
        "shm": False,
    }
    assert parse_ready(line, role) == record


def test_the_human_prefixes_stay_what_waits_match() -> None:
    """Waits written against the old lines (``kvstore master ready`` ...) still match."""
    assert ready_line("master").startswith("kvstore master ready")
    assert ready_line("node").startswith("kvstore node ready")
    assert ready_line("up").startswith("kvstore up: ready")


@pytest.mark.parametrize(
    "line",
    [
        "",
        "kvstore master stopped",
        "kvstore up: embedded cluster ready",
        "kvstore master ready: control=127.0.0.1:1 admin=http://127.0.0.1:2",  # the old form
        "kvstore master ready: {not json",
        'kvstore master ready: ["a list"]',
        'kvstore master ready: {"role": "node", "pid": 1}',  # a record under another's prefix
    ],
)
def test_anything_else_is_not_a_ready_record(line: str) -> None:
    assert parse_ready(line) is None


def test_a_role_filter() -> None:
    line = ready_line("node", id="node-1", data="127.0.0.1:9")
    assert parse_ready(line, "master") is None
    assert parse_ready(line, "node") == json.loads(line.split(" ", 3)[3])
