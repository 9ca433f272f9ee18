"""Shared fixtures: the real trace, skipped with the reason when it is absent."""

from __future__ import annotations

import pytest

from kvstore.sim.trace import TraceRequest, load_trace

from .factories import TRACE_PATH


@pytest.fixture(scope="session")
def real_trace() -> list[TraceRequest]:
    """The Mooncake conversation trace (12,031 requests)."""
    if not TRACE_PATH.is_file():
        pytest.skip(f"real trace not found at {TRACE_PATH.resolve()} (shared/data is not here)")
    return load_trace(TRACE_PATH)
