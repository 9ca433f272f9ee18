"""The router's state without a socket: its engines, its policy and what it exports."""

from __future__ import annotations

import pytest
from prometheus_client import generate_latest

from kvstore.router.config import RouterConfig
from kvstore.router.state import RouterState
from kvstore.routing.policy import POLICIES


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_the_router_exports_its_policy(name: str) -> None:
    state = RouterState(RouterConfig(engines=("http://a", "http://b"), policy=name))
    assert state.policy.name == name
    text = generate_latest(state.metrics.registry).decode()
    assert f'kvstore_router_policy_info{{policy="{name}"}} 1.0' in text
