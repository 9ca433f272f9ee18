"""The vLLM KV connector under real vLLM servers, the real model, temperature 0.

One vLLM server without the connector is the reference; every output through the pool must
equal its output token for token. Servers are shared by the whole module (each start costs
tens of seconds here) and started at most three at a time; each is stopped by its process
group. Select with ``-m engine``; skipped where the vLLM virtualenv or the model is missing.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvstore.client import Client
from kvstore.client.kvcache import KVCache
from kvstore.keys import Namespace
from tests.adapters.vllm_servers import (
    VLLMServer,
    assert_greedy_close,
    kv_config,
    missing_engine,
    model_dir,
)
from tests.support import Cluster, start_master, wait_until

pytestmark = [
    pytest.mark.engine,
    pytest.mark.timeout(900),
    pytest.mark.skipif(missing_engine() is not None, reason=str(missing_engine())),
]

BS = 32
MAX_TOKENS = 8
SYSTEM = (
    "You are a careful assistant for a railway company. Answer briefly and precisely. "
    "Timetables: the morning express leaves the north station at seven, stops at the river "
    "bridge, the old market and the university, and reaches the harbour at eight fifteen. "
    "The evening train leaves the harbour at six and returns by the same stops. Tickets cost "
    "four euros, children travel free, bicycles need a reservation, and dogs travel at half "
    "price. Delays over twenty minutes are refunded at any ticket office. "
)


LIBRARY = (
    "You help visitors of a small town library. The library opens at nine and closes at "
    "five, except on Sundays. Members may borrow six books for three weeks; films for one "
    "week. Late returns cost ten cents a day. The reading room is on the first floor, the "
    "children's corner next to the entrance, and the archive may be visited by appointment. "
)


def _ask(question: str, system: str = SYSTEM) -> str:
    return f"<|im_start|>system\n{system * 3}<|im_end|>\n<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"


def _loaded(server: VLLMServer) -> float:
    return server.metrics().get("vllm:kvstore_loaded_tokens", 0.0)


def _wait_metric(server: VLLMServer, name: str, above: float) -> float:
    """Poll /metrics until the counter passes ``above`` (stats reach it after the step)."""
    value = [0.0]

    def moved() -> bool:
        value[0] = server.metrics().get(name, 0.0)
        return value[0] > above

    wait_until(moved, timeout=30, interval=0.2, what=f"{name} > {above}")
    return value[0]


class Engines:
    """The module's pool and servers; started and stopped in stages to bound memory."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.cluster = Cluster(tmp, start_master())
        # Reads go over TCP (no --shm): a SIGKILLed node then really is gone for its readers.
        self.node = self.cluster.add_node("1GiB")
        self.servers: dict[str, VLLMServer] = {}
        self.reference_outputs: dict[tuple[int, ...], list[int]] = {}

    def start(self, **specs: tuple[dict | None, int]) -> None:
        for name, (kv, cpu) in specs.items():
            self.servers[name] = VLLMServer(self.tmp / f"{name}.log", kv, cpu=cpu)
        for name in specs:
            self.servers[name].wait_ready()

    def stop(self, *names: str) -> None:
        for name in names:
            server = self.servers.pop(name, None)
            if server is not None:
                server.stop()

    def reference(self, prompt: list[int]) -> list[int]:
        key = tuple(prompt)
        if key not in self.reference_outputs:
            self.reference_outputs[key] = self.servers["ref"].complete(prompt, MAX_TOKENS)
        return self.reference_outputs[key]

    def close(self) -> None:
        self.stop(*list(self.servers))
        self.cluster.stop()


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engines]:
    e = Engines(Path(tmp_path_factory.mktemp("vllm")))
    try:
        addr = e.cluster.address
        e.start(
            ref=(None, 0),
            p=(kv_config("kv_producer", addr), 1),
            # D loads asynchronously; the kv_both servers below use the default (layer-wise).
            d=(kv_config("kv_consumer", addr, load_mode="async"), 0),
        )
        yield e
    finally:
        e.close()


@pytest.fixture(scope="module")
def prompts(engines: Engines) -> dict[str, list[int]]:
    ref = engines.servers["ref"]
    out = {
        name: ref.tokenize(_ask(q))
        for name, q in {
            "cold": "When does the morning express reach the harbour?",
            "shared": "How much does a ticket for a dog cost?",
            "both": "Do bicycles need a reservation on the evening train?",
            "both2": "Which stops does the evening train make?",
            "restart": "Are children charged for tickets?",
            "corrupt": "What happens when a train is more than twenty minutes late?",
            "nodekill": "Where does the morning express stop first?",
            "nomaster": "What does a ticket cost for an adult?",
            "salted": "Is there a train on Sunday mornings?",
        }.items()
    }
    out["garbage"] = ref.tokenize(
        "<|im_start|>user\n" + "Tell me about the moon and the stars. " * 20 + "<|im_end|>\n"
    )
    assert len(out["cold"]) > 8 * BS, "prompts span many blocks"
    # A prompt whose every full block the pool will hold before D ever sees it: the first
    # whole blocks of a longer prompt P prefills (plus one token, computed by D).
    # Its own system prompt: D holds none of it locally.
    long = ref.tokenize(_ask("When is the archive open to visitors?", LIBRARY))
    cut = (len(long) // BS - 1) * BS + 1
    out["full_long"], out["full"] = long, long[:cut]
    return out


def _pd(engines: Engines, prompt: list[int]) -> tuple[list[int], float]:
    """The two-step request: prefill on P (max_tokens=1), then the request on D. Returns D's
    output and the tokens D loaded from the pool for it."""
    p, d = engines.servers["p"], engines.servers["d"]
    before = _loaded(d)
    p.complete(prompt, max_tokens=1)
    out = d.complete(prompt, MAX_TOKENS)
    return out, before


# ------------------------------------------------------------------ P/D
def test_pd_cold_prompt_equals_reference(engines: Engines, prompts: dict[str, list[int]]) -> None:
    prompt = prompts["cold"]
    out, before = _pd(engines, prompt)
    assert out == engines.reference(prompt)
    offered = (len(prompt) - 1) // BS * BS
    assert _wait_metric(engines.servers["d"], "vllm:kvstore_loaded_tokens", before) - before == (
        offered
    ), "D loaded every full block but the one holding the last token"


def test_pd_prompt_sharing_a_prefix_equals_reference(
    engines: Engines, prompts: dict[str, list[int]]
) -> None:
    prompt = prompts["shared"]
    saved_before = engines.servers["p"].metrics().get("vllm:kvstore_saved_tokens", 0.0)
    out, before = _pd(engines, prompt)
    assert out == engines.reference(prompt)
    # D holds the shared system prompt itself (vLLM's own cache): it loads only the rest.
    loaded = _wait_metric(engines.servers["d"], "vllm:kvstore_loaded_tokens", before) - before
    assert 0 < loaded < (len(prompt) - 1) // BS * BS
    saved = engines.servers["p"].metrics().get("vllm:kvstore_saved_tokens", 0.0) - saved_before
    assert 0 < saved < len(prompt) // BS * BS, "P saved only the blocks the pool lacked"


def test_pd_fully_cached_prompt_needs_no_prefill(
    engines: Engines, prompts: dict[str, list[int]]
) -> None:
    p, d = engines.servers["p"], engines.servers["d"]
    p.complete(prompts["full_long"], max_tokens=1)  # stores every full block of "full"
    prompt = prompts["full"]
    before = _loaded(d)
    out = d.complete(prompt, MAX_TOKENS)  # no prefill step on P for this one
    assert out == engines.reference(prompt)
    loaded = _wait_metric(d, "vllm:kvstore_loaded_tokens", before) - before
    assert loaded == len(prompt) - 1, "every token but the last came from the pool"


def test_pd_cache_salt_keeps_pool_blocks_apart(
    engines: Engines, prompts: dict[str, list[int]]
) -> None:
    """vLLM's ``cache_salt`` (OpenAI body field): P's blocks saved under one salt are no pool
    hit for another salt nor for an unsalted request, and a hit for the same salt."""
    p, d = engines.servers["p"], engines.servers["d"]
    prompt = prompts["salted"]
    saved = p.metrics().get("vllm:kvstore_saved_tokens", 0.0)
    p.complete(prompt, max_tokens=1, cache_salt="tenant-a")
    assert _wait_metric(p, "vllm:kvstore_saved_tokens", saved) > saved
    before = _loaded(d)
    # D's own prefix cache is salted as well, so each of these misses locally too. (Up to a
    # near tie: D recomputes two of the three, batched unlike the reference.)
    want = engines.servers["ref"].complete_top(prompt, MAX_TOKENS)
    for salt in ("tenant-b", None, "tenant-a"):
        extra = {} if salt is None else {"cache_salt": salt}
        assert_greedy_close(d.complete_top(prompt, MAX_TOKENS, **extra), want)
    loaded = _wait_metric(d, "vllm:kvstore_loaded_tokens", before) - before
    # All of it is tenant-a's second request: the other two loaded nothing.
    assert loaded == (len(prompt) - 1) // BS * BS


# ------------------------------------------------------------------ kv_both
def test_second_kv_both_server_reuses_the_first_ones_prefix(
    engines: Engines, prompts: dict[str, list[int]]
) -> None:
    engines.stop("p", "d")
    addr = engines.cluster.address
    engines.start(a=(kv_config("kv_both", addr), 1), b=(kv_config("kv_both", addr), 0))
    a, b = engines.servers["a"], engines.servers["b"]
    for name in ("both", "both2"):
        prompt = prompts[name]
        assert a.complete(prompt, MAX_TOKENS) == engines.reference(prompt)
        before = _loaded(b)
        assert b.complete(prompt, MAX_TOKENS) == engines.reference(prompt)
        assert _wait_metric(b, "vllm:kvstore_loaded_tokens", before) > before, (
            "B computed only what the pool did not hold"
        )


def test_restarted_server_loads_from_the_warm_pool(
    engines: Engines, prompts: dict[str, list[int]]
) -> None:
    prompt = prompts["restart"]
    assert engines.servers["a"].complete(prompt, MAX_TOKENS) == engines.reference(prompt)
    engines.stop("a")
    engines.start(a=(kv_config("kv_both", engines.cluster.address), 1))
    a = engines.servers["a"]
    # Every full block now comes from the pool and only the last few tokens are computed: a
    # split of the prompt that moves bf16 logits in their last bits, enough to turn a near tie
    # here (on one host, from the landed code on). So: equal, or parting at a near tie.
    got = a.complete_top(prompt, MAX_TOKENS)
    assert_greedy_close(got, engines.servers["ref"].complete_top(prompt, MAX_TOKENS))
    assert _wait_metric(a, "vllm:kvstore_loaded_tokens", 0.0) >= (len(prompt) - 1) // BS * BS - BS


# ------------------------------------------------------------------ failures
def _namespace() -> Namespace:
    """The namespace the servers derive (see KVStoreConnector): SmolLM2, bf16, block 32."""
    import json

    cfg = json.loads((model_dir() / "config.json").read_text())
    heads = cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    return Namespace(
        model="smollm2",
        dtype="bfloat16",
        num_layers=cfg["num_hidden_layers"],
        num_kv_heads=heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"],
        block_size=BS,
    )


def _corrupt_block(address: str, tokens: list[int], block: int) -> None:
    """Flip bytes of one stored block in the node's shared-memory arena, behind the store."""
    with Client.connect(address) as c:
        kv = KVCache(c, _namespace())
        keys = kv.block_object_keys(tokens)
        assert kv.lookup(tokens) >= (block + 1) * BS, "the block is in the pool"
        info = c.locate(keys[block])
        kv.close()
    loc = info.locations[0]
    arena = Path("/dev/shm") / f"kvstore-{loc.node_id}.arena"
    assert arena.exists(), f"no arena file {arena}"
    with open(arena, "r+b") as f:
        f.seek(loc.grant.offset + 1000)
        raw = bytearray(f.read(64))
        f.seek(loc.grant.offset + 1000)
        f.write(bytes(b ^ 0x5A for b in raw))


def test_corrupt_block_is_refused_and_recomputed(
    engines: Engines, prompts: dict[str, list[int]]
) -> None:
    a, b = engines.servers["a"], engines.servers["b"]
    prompt = prompts["corrupt"]
    assert a.complete(prompt, MAX_TOKENS) == engines.reference(prompt)  # saves it
    # B holds the system prompt locally; corrupt a block past it, which B must load.
    _corrupt_block(engines.cluster.address, prompt, (len(prompt) - 1) // BS - 1)
    errors = b.metrics().get("vllm:kvstore_load_errors", 0.0)
    assert b.complete(prompt, MAX_TOKENS) == engines.reference(prompt)
    assert _wait_metric(b, "vllm:kvstore_load_errors", errors) > errors
    assert "failed to load" in b.log()


def test_loaded_kv_is_what_the_server_uses(engines: Engines, prompts: dict[str, list[int]]) -> None:
    """The other negative control: well-formed blocks (valid checksums) of the wrong KV make
    the output differ, so an equal output above really came from the loaded KV."""
    import numpy as np
    import torch

    b = engines.servers["b"]
    prompt = prompts["garbage"]
    with Client.connect(engines.cluster.address) as c:
        kv = KVCache(c, _namespace())
        n = (len(prompt) - 1) // BS
        rng = np.random.default_rng(0)
        values = torch.from_numpy(rng.standard_normal((n, kv.block_nbytes // 2)) * 2)
        assert kv.put_blocks(prompt, 0, values.to(torch.bfloat16).view(torch.uint8).numpy()) == n
        kv.close()
    before = _loaded(b)
    assert b.complete(prompt, MAX_TOKENS) != engines.reference(prompt)
    assert _wait_metric(b, "vllm:kvstore_loaded_tokens", before) - before == n * BS


def test_node_killed_then_master_gone_outputs_still_equal(
    engines: Engines, prompts: dict[str, list[int]]
) -> None:
    a, b = engines.servers["a"], engines.servers["b"]
    prompt = prompts["nodekill"]
    assert a.complete(prompt, MAX_TOKENS) == engines.reference(prompt)
    errors = b.metrics().get("vllm:kvstore_load_errors", 0.0)
    os.kill(engines.node.pid, signal.SIGKILL)  # the master still lists its blocks
    engines.node.proc.wait(timeout=10)
    assert b.complete(prompt, MAX_TOKENS) == engines.reference(prompt)
    assert _wait_metric(b, "vllm:kvstore_load_errors", errors) > errors

    engines.cluster.master.kill()
    prompt = prompts["nomaster"]
    assert a.complete(prompt, MAX_TOKENS) == engines.reference(prompt)
    assert b.complete(prompt, MAX_TOKENS) == engines.reference(prompt)
    assert _wait_metric(b, "vllm:kvstore_pool_unavailable", 0.0) > 0
    assert b.log().count("unreachable") >= 1
