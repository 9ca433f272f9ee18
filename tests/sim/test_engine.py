"""The kv_both engine model: steps, batching and prefix hits, on hand-computed cases."""

from __future__ import annotations

import pytest

from kvstore.errors import InvalidRequestError
from kvstore.sim.engine import (
    EngineConfig,
    EngineRequest,
    KvBothEngine,
    StepCost,
    hit_tokens,
)
from kvstore.sim.policies import BlockCache

COST = StepCost(step_base_s=0.01, decode_s_per_seq=0.002, prefill_s_per_token=0.0001)


def run_steps(engine: KvBothEngine, now_s: float, max_steps: int = 100) -> list[float]:
    """Run the engine until it is idle; returns each step's end time."""
    ends = []
    for _ in range(max_steps):
        plan = engine.start_step()
        if plan is None:
            return ends
        now_s += plan.duration_s
        ends.append(now_s)
        engine.end_step()
    raise AssertionError("engine did not go idle")


def test_step_time_is_base_plus_decodes_plus_prefill_and_load_tokens() -> None:
    cost = StepCost(0.01, 0.002, 0.0001, load_s_per_token=1e-5)
    assert cost.step_s(3, 200, 64) == pytest.approx(0.01 + 0.006 + 0.02 + 0.00064)
    assert cost.prefill_s(100) == pytest.approx(0.02)


@pytest.mark.parametrize(
    "kwargs",
    [{"step_base_s": -1.0}, {"prefill_s_per_token": float("nan")}, {"decode_s_per_seq": True}],
)
def test_step_cost_refuses_bad_parameters(kwargs: dict[str, object]) -> None:
    with pytest.raises(InvalidRequestError):
        StepCost(**kwargs)  # type: ignore[arg-type]


def test_engine_config_refuses_bad_sizes() -> None:
    with pytest.raises(InvalidRequestError):
        EngineConfig(max_num_seqs=0)
    with pytest.raises(InvalidRequestError):
        EngineConfig(cache_blocks=-1)


@pytest.mark.parametrize(
    ("blocks", "prompt", "expected"),
    [(0, 100, 0), (3, 100, 96), (4, 100, 96), (2, 64, 32), (2, 65, 64), (5, 1, 0)],
)
def test_hit_is_whole_blocks_and_leaves_the_last_token(
    blocks: int, prompt: int, expected: int
) -> None:
    assert hit_tokens(blocks, prompt, 32) == expected


def test_one_request_prefills_in_one_step_then_decodes_one_token_per_step() -> None:
    engine = KvBothEngine(EngineConfig(COST))
    request = EngineRequest(0, (1, 2, 3, 4), prompt_tokens=100, output_tokens=3)
    engine.add(request)
    plan = engine.start_step()
    assert plan is not None
    assert plan.duration_s == pytest.approx(0.01 + 100 * 0.0001)
    first, finished = engine.end_step()
    assert first == [request] and finished == []
    assert run_steps(engine, 0.02) == pytest.approx([0.032, 0.044])
    assert not engine.has_work


def test_a_prefill_joins_the_running_decode_in_one_step() -> None:
    # A (100 tokens, 3 out) starts alone; B (50 tokens, 2 out) arrives during A's prefill.
    engine = KvBothEngine(EngineConfig(COST))
    a = EngineRequest(0, (), 100, 3)
    b = EngineRequest(1, (), 50, 2)
    engine.add(a)
    assert engine.start_step().duration_s == pytest.approx(0.02)  # type: ignore[union-attr]
    engine.add(b)
    assert engine.end_step() == ([a], [])
    plan = engine.start_step()
    assert plan is not None
    assert plan.decode == (a,) and plan.prefill == ((b, 50),)
    assert plan.duration_s == pytest.approx(0.01 + 0.002 + 50 * 0.0001)
    assert engine.end_step() == ([b], [])
    plan = engine.start_step()
    assert plan is not None and plan.duration_s == pytest.approx(0.01 + 2 * 0.002)
    assert engine.end_step() == ([], [a, b])


def test_max_num_seqs_holds_prompts_back_and_the_token_budget_chunks_them() -> None:
    engine = KvBothEngine(EngineConfig(COST, max_num_seqs=1, max_num_batched_tokens=64))
    a = EngineRequest(0, (), 100, 1)
    b = EngineRequest(1, (), 10, 1)
    engine.add(a)
    engine.add(b)
    plan = engine.start_step()
    assert plan is not None and plan.prefill == ((a, 64),) and list(engine.waiting) == [b]
    assert engine.end_step() == ([], [])
    plan = engine.start_step()
    assert plan is not None and plan.prefill == ((a, 36),)
    assert engine.end_step() == ([a], [a])
    plan = engine.start_step()
    assert plan is not None and plan.prefill == ((b, 10),)


def test_a_cached_prefix_skips_prefill_locally_and_costs_its_load_from_the_pool() -> None:
    cost = StepCost(0.01, 0.002, 0.0001, load_s_per_token=1e-5)
    pool = BlockCache(None)
    first_engine = KvBothEngine(EngineConfig(cost), pool)
    other_engine = KvBothEngine(EngineConfig(cost), pool)
    keys = (1, 2, 3, 4)
    first_engine.add(EngineRequest(0, keys, 100, 1))
    run_steps(first_engine, 0.0)
    # Its 3 whole blocks are now in its own cache and in the pool.
    again = EngineRequest(1, keys, 100, 1)
    first_engine.add(again)
    plan = first_engine.start_step()
    assert plan is not None and plan.prefill == ((again, 4),) and plan.loaded_tokens == 0
    assert plan.duration_s == pytest.approx(0.01 + 4 * 0.0001)
    assert again.local_tokens == 96 and again.cached_tokens == 96
    elsewhere = EngineRequest(2, keys, 100, 1)
    other_engine.add(elsewhere)
    plan = other_engine.start_step()
    assert plan is not None and plan.prefill == ((elsewhere, 4),) and plan.loaded_tokens == 96
    assert plan.duration_s == pytest.approx(0.01 + 4 * 0.0001 + 96 * 1e-5)
    assert elsewhere.local_tokens == 0 and elsewhere.cached_tokens == 96
