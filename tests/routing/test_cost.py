from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.errors import InvalidRequestError
from kvstore.routing.cost import CostModel

COST = CostModel()


@pytest.mark.parametrize(
    ("change", "fragment"),
    [
        ({"prefill_s_per_token": -1e-4}, "prefill_s_per_token must be finite and >= 0"),
        ({"decode_base_s": float("nan")}, "decode_base_s must be finite"),
        ({"transfer_bytes_per_s": float("inf")}, "transfer_bytes_per_s must be finite"),
        ({"transfer_bytes_per_s": 0}, "transfer_bytes_per_s must be > 0"),
        ({"block_size_tokens": 0}, "block_size_tokens"),
        ({"block_size_tokens": 1.5}, "block_size_tokens"),
        ({"kv_bytes_per_token": True}, "must be a number"),
        ({"prefill_s_per_token": "fast"}, "must be a number"),
        ({"prefill_base_s": 0, "prefill_s_per_token": 0}, "prefill must take time"),
        ({"decode_base_s": 0, "decode_s_per_seq": 0}, "decode step must take time"),
    ],
)
def test_bad_parameters_are_rejected(change: dict, fragment: str) -> None:
    with pytest.raises(InvalidRequestError, match=fragment):
        CostModel(**change)


def test_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        COST.prefill_base_s = 1.0  # type: ignore[misc]


@pytest.mark.parametrize(
    ("new", "cached", "expected"),
    [
        (0, 0, 0.02),
        (1000, 0, 0.02 + 1000 * 1.2e-4 + 1000 * 500 * 2.2e-9),
        (1000, 4000, 0.02 + 1000 * 1.2e-4 + 1000 * 4500 * 2.2e-9),
    ],
)
def test_prefill_formula(new: int, cached: int, expected: float) -> None:
    assert COST.prefill_s(new, cached) == pytest.approx(expected)


def test_transfer_and_decode_formulas() -> None:
    assert COST.transfer_s(0) == 0.0
    assert COST.transfer_s(1000) == pytest.approx(0.001 + 1000 * 327_680 / 25e9)
    assert COST.decode_step_s(0, 0) == pytest.approx(0.010)
    assert COST.decode_step_s(10, 100_000) == pytest.approx(0.010 + 10 * 1e-4 + 100_000 * 2e-8)


@settings(deadline=None)
@given(
    new=st.integers(0, 200_000),
    cached=st.integers(0, 200_000),
    extra=st.integers(1, 10_000),
)
def test_monotone(new: int, cached: int, extra: int) -> None:
    assert COST.prefill_s(new + extra, cached) > COST.prefill_s(new, cached)
    assert COST.prefill_s(new, cached + extra) >= COST.prefill_s(new, cached)
    # reusing cached tokens never costs more than computing them
    assert COST.prefill_s(new, cached + extra) <= COST.prefill_s(new + extra, cached)
    assert COST.transfer_s(new + extra) > COST.transfer_s(new)
    assert COST.decode_step_s(new % 512 + 1, cached) > COST.decode_step_s(new % 512, cached)
