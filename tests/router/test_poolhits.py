"""What the pool holds of a prompt, as the router asks it: no master, a master that does not
answer (a miss, then no new attempt until the retry delay has passed, on a fake clock), and
how many of the held tokens an engine loads."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest

from kvstore.client.adapters.vllm_config import salted_namespace
from kvstore.keys import block_keys
from kvstore.router.admission import EngineSlots
from kvstore.router.config import CPU_PRIOR
from kvstore.router.engines import Engine, EngineLoad
from kvstore.router.live_fit import EngineFit
from kvstore.router.metrics import RouterMetrics
from kvstore.router.poolhits import POOL_RETRY_S, PoolHit, PoolLookup
from kvstore.router.requests import ModelInfo
from tests.router.fake_engine import MODEL, write_model

#: A port nothing listens on: connecting to a master there is refused at once.
NO_MASTER = "127.0.0.1:9"


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def engine(block_size: int | None = 32) -> Engine:
    e = Engine("http://e", "both", EngineSlots(4, 0.7, FakeClock()), EngineFit(CPU_PRIOR))
    e.healthy, e.load = True, EngineLoad(block_size=block_size, num_blocks=1000)
    return e


def model(tmp_path: Path) -> ModelInfo:
    root = write_model(tmp_path / "model")
    return ModelInfo.load({"id": MODEL, "root": str(root), "max_model_len": 2048}, None)


@pytest.mark.parametrize(
    ("cached", "prompt", "loadable"),
    [
        (64, 100, 64),  # whole blocks held, prompt longer: all of them load
        (64, 64, 32),  # the whole prompt held: its last block holds the last token, computed
        (70, 100, 64),  # token-granular hit from the index: whole blocks load
        (0, 100, 0),
    ],
)
def test_an_engine_loads_whole_blocks_never_the_last_token(
    cached: int, prompt: int, loadable: int
) -> None:
    assert PoolHit.of(cached, prompt, 32, "lookup") == PoolHit(cached, loadable, "lookup")


def test_without_a_master_nothing_is_cached(tmp_path: Path) -> None:
    lookup = PoolLookup(None, RouterMetrics.create(), FakeClock())
    assert lookup.view is None
    got = asyncio.run(lookup.cached_tokens(model(tmp_path), list(range(100)), [engine()]))
    assert got == PoolHit(0, 0, "none")


def test_a_prompt_under_one_block_or_an_unknown_block_size_asks_nothing(tmp_path: Path) -> None:
    metrics = RouterMetrics.create()
    lookup = PoolLookup(NO_MASTER, metrics, FakeClock(), events=False)
    info = model(tmp_path)
    assert asyncio.run(lookup.cached_tokens(info, list(range(31)), [engine()])).source == "none"
    assert asyncio.run(lookup.cached_tokens(info, list(range(99)), [engine(None)])).source == (
        "none"
    )
    assert asyncio.run(lookup.cached_tokens(info, list(range(99)), [])).source == "none"
    assert metrics.registry.get_sample_value("kvstore_router_lookup_errors_total") == 0


def test_a_master_that_does_not_answer_is_a_miss_retried_after_the_delay(tmp_path: Path) -> None:
    metrics, clock = RouterMetrics.create(), FakeClock()
    lookup = PoolLookup(NO_MASTER, metrics, clock, events=False)
    info, engines, prompt = model(tmp_path), [engine()], list(range(100))

    def errors() -> float | None:
        return metrics.registry.get_sample_value("kvstore_router_lookup_errors_total")

    async def run() -> None:
        assert await lookup.cached_tokens(info, prompt, engines) == PoolHit(0, 0, "lookup")
        assert errors() == 1
        clock.now += POOL_RETRY_S / 2  # within the delay: no new connection attempt
        assert await lookup.cached_tokens(info, prompt, engines) == PoolHit(0, 0, "lookup")
        assert errors() == 1
        clock.now += POOL_RETRY_S  # past it: tried (and refused) again
        assert await lookup.cached_tokens(info, prompt, engines) == PoolHit(0, 0, "lookup")
        assert errors() == 2

    try:
        asyncio.run(run())
    finally:
        lookup.close()
    answers = "kvstore_router_pool_answers_total"
    assert metrics.registry.get_sample_value(answers, {"source": "lookup"}) == 3


class _RecordingView:
    """A synced pool view that records the namespace each question names (and holds nothing)."""

    def __init__(self) -> None:
        self.asked: list[tuple[bytes, list[bytes]]] = []

    def count_blocks(self, namespace: bytes, keys: list[bytes]) -> int:
        self.asked.append((namespace, list(keys)))
        return 0

    def close(self) -> None:
        pass


def test_a_cache_salt_asks_in_the_connectors_salted_namespace(tmp_path: Path) -> None:
    lookup = PoolLookup(NO_MASTER, RouterMetrics.create(), FakeClock(), salt="t", events=False)
    view = _RecordingView()
    lookup.view = view  # type: ignore[assignment]
    info, prompt = model(tmp_path), list(range(100))
    for salt in (None, "a", "b", "a"):
        asyncio.run(lookup.cached_tokens(info, prompt, [engine()], salt))
    base = info.namespace(32, "auto", dtype=None, salt="t")
    want = [base, *(salted_namespace(base, s) for s in ("a", "b", "a"))]
    assert [d for d, _ in view.asked] == [ns.digest for ns in want]
    assert view.asked[0][1] == block_keys(base, np.arange(96, dtype=np.uint32)), (
        "unsalted as before"
    )
    assert len({d for d, _ in view.asked}) == 3 and view.asked[1] == view.asked[3]
