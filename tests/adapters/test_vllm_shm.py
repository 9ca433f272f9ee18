"""The vLLM connector reading the pool in place: the node on this host offers its DRAM arena
(``--shm``), and a loading server copies each block straight from it into vLLM's cache, with no
staging copy (``Client.read_in_place``).

Two ``kv_both`` servers, the real model, temperature 0: A computes a prompt (and saves it), B
loads it; B's output must equal A's token for token. ``tests/adapters/test_vllm.py`` runs its
pool without ``--shm`` (its readers go over TCP, the staging path), so both paths are covered.
Select with ``-m engine``.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.adapters.test_vllm import BS, LIBRARY, MAX_TOKENS, _ask, _corrupt_block
from tests.adapters.vllm_servers import VLLMServer, kv_config, missing_engine
from tests.support import Cluster, start_master, wait_until

pytestmark = [
    pytest.mark.engine,
    pytest.mark.timeout(900),
    pytest.mark.skipif(missing_engine() is not None, reason=str(missing_engine())),
]


class Pair:
    def __init__(self, tmp: Path) -> None:
        self.cluster = Cluster(tmp, start_master())
        self.cluster.add_node("1GiB", extra=("--shm",))
        addr = self.cluster.address
        self.a = VLLMServer(tmp / "a.log", kv_config("kv_both", addr), cpu=1)
        self.b = VLLMServer(tmp / "b.log", kv_config("kv_both", addr), cpu=0)

    def close(self) -> None:
        for s in (self.a, self.b):
            s.stop()
        self.cluster.stop()


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    p = Pair(Path(tmp_path_factory.mktemp("vllm-shm")))
    try:
        p.a.wait_ready()
        p.b.wait_ready()
        yield p
    finally:
        p.close()


def _metric(server: VLLMServer, name: str) -> float:
    return server.metrics().get(f"vllm:kvstore_{name}", 0.0)


def _wait_above(server: VLLMServer, name: str, above: float) -> float:
    value = [0.0]

    def moved() -> bool:
        value[0] = _metric(server, name)
        return value[0] > above

    wait_until(moved, timeout=30, interval=0.2, what=f"{name} > {above}")
    return value[0]


def test_b_loads_the_prompt_in_place_and_answers_as_a(pair: Pair) -> None:
    prompt = pair.a.tokenize(_ask("Which stops does the morning express make?"))
    out = pair.a.complete(prompt, MAX_TOKENS)  # computed, and saved into the pool
    tokens, nbytes, in_place = (
        _metric(pair.b, n) for n in ("loaded_tokens", "loaded_bytes", "loaded_in_place_bytes")
    )
    assert pair.b.complete(prompt, MAX_TOKENS) == out
    loaded = _wait_above(pair.b, "loaded_tokens", tokens) - tokens
    assert loaded == (len(prompt) - 1) // BS * BS, "B loaded every full block but the last's"
    moved = _metric(pair.b, "loaded_bytes") - nbytes
    assert moved > 0
    assert _metric(pair.b, "loaded_in_place_bytes") - in_place == moved, (
        "every block came straight from shared memory"
    )


def test_a_corrupt_block_in_shared_memory_is_refused_and_recomputed(pair: Pair) -> None:
    prompt = pair.a.tokenize(_ask("Can I borrow films?", LIBRARY))
    out = pair.a.complete(prompt, MAX_TOKENS)
    _corrupt_block(pair.cluster.address, prompt, (len(prompt) - 1) // BS - 2)
    errors = _metric(pair.b, "load_errors")
    assert pair.b.complete(prompt, MAX_TOKENS) == out
    assert _wait_above(pair.b, "load_errors", errors) > errors
    assert "failed to load" in pair.b.log()
