"""Factories for traces: one line, a synthetic chained trace, and where the real one lives."""

from __future__ import annotations

import json
import random
from pathlib import Path

from kvstore.sim.trace import TraceRequest, parse_trace_lines

#: The repository root is two folders above this one; shared/ is its sibling.
TRACE_PATH = (
    Path(__file__).resolve().parents[2]
    / ".."
    / "shared"
    / "data"
    / "traces"
    / "conversation_trace.jsonl"
)


def trace_line(
    timestamp: int, input_length: int, hash_ids: list[int], output_length: int = 8
) -> str:
    """One trace line in Mooncake's format."""
    return json.dumps(
        {
            "timestamp": timestamp,
            "input_length": input_length,
            "output_length": output_length,
            "hash_ids": hash_ids,
        }
    )


def synthetic_trace(
    seed: int, num_requests: int, block_size: int = 4, num_roots: int = 5, gap_ms: int = 50
) -> list[TraceRequest]:
    """A chained trace: each request extends a random earlier prompt or starts a new one.

    Args:
        seed: the random seed (deterministic).
        num_requests: requests to make.
        block_size: tokens per block.
        num_roots: how many distinct first blocks exist.
        gap_ms: time between arrivals.

    Returns:
        Validated requests.
    """
    rng = random.Random(seed)
    next_id = 0
    prompts: list[list[int]] = []
    lines = []
    for index in range(num_requests):
        if prompts and rng.random() < 0.7:
            base = rng.choice(prompts)
            keep = rng.randint(1, len(base))
            ids = base[:keep]
        else:
            ids = []
        if not ids:
            ids = [rng.randrange(num_roots)]
        for _ in range(rng.randint(0, 4)):
            ids.append(num_roots + next_id)
            next_id += 1
        prompts.append(ids)
        input_length = (len(ids) - 1) * block_size + rng.randint(1, block_size)
        lines.append(trace_line(index * gap_ms, input_length, ids, rng.randint(1, 40)))
    return parse_trace_lines(lines, block_size=block_size)
