"""The router's configuration: what it refuses on creation."""

from __future__ import annotations

import pytest

from kvstore.errors import InvalidRequestError
from kvstore.router.config import RouterConfig


def test_an_unknown_policy_is_refused() -> None:
    with pytest.raises(InvalidRequestError, match="unknown policy"):
        RouterConfig(engines=("http://a",), policy="random")
