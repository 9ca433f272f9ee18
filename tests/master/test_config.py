"""The master's timeouts and limits: validated on creation."""

from __future__ import annotations

import pytest

from kvstore.errors import InvalidRequestError
from kvstore.master.config import MasterConfig


@pytest.mark.parametrize(
    "kwargs",
    [
        {"put_timeout_s": 0},
        {"node_ttl_s": -1},
        {"heartbeat_interval_s": 0},
        {"heartbeat_interval_s": 5, "node_ttl_s": 5},
        {"max_batch": 0},
        {"max_object_bytes": 0},
        {"event_ring_events": 0},
        {"event_ring_blocks": 0},
    ],
)
def test_bad_settings_are_refused(kwargs: dict[str, float]) -> None:
    with pytest.raises(InvalidRequestError):
        MasterConfig(**kwargs)  # type: ignore[arg-type]


def test_check_batch() -> None:
    config = MasterConfig(max_batch=2)
    config.check_batch([1, 2])
    with pytest.raises(InvalidRequestError, match="batch of 3 exceeds the limit of 2"):
        config.check_batch([1, 2, 3])
