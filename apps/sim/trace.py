"""Request traces in Mooncake's format: load, validate, and name the line that is wrong.

One JSON object a line::

    {"timestamp": 0, "input_length": 6758, "output_length": 500, "hash_ids": [0, 1, 2]}

``timestamp`` is milliseconds from the start of the trace, lengths are tokens, and ``hash_ids``
holds one id per ``block_size``-token block of the prompt (the last block may be partial), so
``len(hash_ids) == ceil(input_length / block_size)``. Ids are chained: equal ids mean equal
prefixes up to and including that block, so an id always has the same predecessor. Every rule
here is checked; a bad line raises :class:`TraceFormatError` naming the source and line number,
and nothing is skipped.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

from kvstore.errors import InvalidRequestError

#: Tokens per block in Mooncake's published traces.
MOONCAKE_BLOCK_SIZE = 512

_REQUIRED_FIELDS = ("timestamp", "input_length", "output_length", "hash_ids")


class TraceFormatError(InvalidRequestError):
    """A trace that breaks the format. ``line_no`` is 1-based, 0 for the trace as a whole."""

    def __init__(self, source: str, line_no: int, problem: str) -> None:
        self.source = source
        self.line_no = line_no
        self.problem = problem
        where = f"{source} line {line_no}" if line_no else source
        super().__init__(f"{where}: {problem}")


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request of a trace.

    Attributes:
        request_id: 0-based position in the trace (line number - 1).
        timestamp_ms: arrival, milliseconds from the start of the trace.
        input_length: prompt tokens (>= 1).
        output_length: generated tokens (>= 1; the first comes out of prefill).
        hash_ids: chained block ids of the prompt, one per block.
    """

    request_id: int
    timestamp_ms: int
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]

    @property
    def arrival_s(self) -> float:
        return self.timestamp_ms / 1000.0


def num_blocks_for(input_length: int, block_size: int = MOONCAKE_BLOCK_SIZE) -> int:
    """Blocks a prompt of ``input_length`` tokens occupies (the last may be partial)."""
    return -(-input_length // block_size)


def _int_field(obj: dict, name: str, minimum: int, fail: Callable[[str], NoReturn]) -> int:
    value = obj[name]
    if not isinstance(value, int) or isinstance(value, bool):
        fail(f"{name!r} must be an integer, got {type(value).__name__} {value!r:.40}")
    if value < minimum:
        fail(f"{name!r} must be >= {minimum}, got {value}")
    return value


def parse_trace_lines(
    lines: Iterable[str], *, source: str = "<trace>", block_size: int = MOONCAKE_BLOCK_SIZE
) -> list[TraceRequest]:
    """Parse and validate trace lines.

    Args:
        lines: the text lines of the trace (with or without their newlines).
        source: what to call the trace in error messages (usually its path).
        block_size: tokens per hash id.

    Returns:
        The requests in trace order, ``request_id`` = line number - 1.

    Raises:
        TraceFormatError: for a blank or non-JSON line, a missing or mistyped field, a negative
            or zero length, ``hash_ids`` that do not fit ``input_length``, an id whose chain
            contradicts an earlier line, a timestamp earlier than the line before, or no lines.
    """
    if block_size < 1:
        raise InvalidRequestError(f"block_size must be >= 1, got {block_size}")
    requests: list[TraceRequest] = []
    # NOTE: parent_of[id] is the id before it in its chain (-1 for a first block); a chained id
    # has exactly one parent, which is what "equal ids mean equal prefixes" requires.
    parent_of: dict[int, int] = {}
    last_timestamp = -1
    line_no = 0
    for line_no, raw in enumerate(lines, start=1):

        def fail(problem: str, _line_no: int = line_no) -> NoReturn:
            raise TraceFormatError(source, _line_no, problem)

        text = raw.strip()
        if not text:
            fail("blank line (every line must be one JSON object)")
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as exc:
            raise TraceFormatError(source, line_no, f"not valid JSON: {exc.msg}") from None
        if not isinstance(obj, dict):
            fail(f"expected a JSON object, got {type(obj).__name__}")
        missing = [name for name in _REQUIRED_FIELDS if name not in obj]
        if missing:
            fail(f"missing field(s) {', '.join(missing)}")
        timestamp = _int_field(obj, "timestamp", 0, fail)
        input_length = _int_field(obj, "input_length", 1, fail)
        output_length = _int_field(obj, "output_length", 1, fail)
        raw_ids = obj["hash_ids"]
        if not isinstance(raw_ids, list):
            fail(f"'hash_ids' must be a list, got {type(raw_ids).__name__}")
        expected = num_blocks_for(input_length, block_size)
        if len(raw_ids) != expected:
            fail(
                f"hash_ids has {len(raw_ids)} ids but input_length {input_length} needs "
                f"ceil({input_length}/{block_size}) = {expected}"
            )
        parent = -1
        for position, block_id in enumerate(raw_ids):
            if not isinstance(block_id, int) or isinstance(block_id, bool) or block_id < 0:
                fail(f"hash_ids[{position}] must be a non-negative integer, got {block_id!r:.40}")
            known = parent_of.setdefault(block_id, parent)
            if known != parent:
                here = "starts the prompt" if parent < 0 else f"follows {parent}"
                before = "started a prompt" if known < 0 else f"followed {known}"
                fail(
                    f"hash_ids[{position}] = {block_id} {here} here but {before} on an "
                    "earlier line: chained ids must always have the same prefix"
                )
            parent = block_id
        if timestamp < last_timestamp:
            fail(f"timestamp {timestamp} is earlier than the previous line's {last_timestamp}")
        last_timestamp = timestamp
        requests.append(
            TraceRequest(line_no - 1, timestamp, input_length, output_length, tuple(raw_ids))
        )
    if not requests:
        raise TraceFormatError(source, 0, "empty trace: no requests")
    return requests


def load_trace(
    path: str | Path, *, block_size: int = MOONCAKE_BLOCK_SIZE, limit: int | None = None
) -> list[TraceRequest]:
    """Load and validate a trace file.

    Args:
        path: a JSONL file in Mooncake's format.
        block_size: tokens per hash id.
        limit: read only the first ``limit`` lines (a slice for quick runs).

    Returns:
        The requests in trace order.

    Raises:
        TraceFormatError: see :func:`parse_trace_lines`.
        InvalidRequestError: for a ``limit`` below 1.
        OSError: when the file cannot be read.
    """
    if limit is not None and limit < 1:
        raise InvalidRequestError(f"limit must be >= 1, got {limit}")
    path = Path(path)
    with path.open(encoding="utf-8") as handle:
        if limit is None:
            return parse_trace_lines(handle, source=str(path), block_size=block_size)
        head = []
        for line in handle:
            head.append(line)
            if len(head) >= limit:
                break
        return parse_trace_lines(head, source=str(path), block_size=block_size)
