"""The transformers glue in one process: KV out of and back into a model, bit for bit, via the pool.

Exactness: logits computed on KV loaded from the pool equal those computed on the same KV kept in
process memory, bit for bit (the pool returns exactly what was stored). Tiny models, float32 and
float16, Llama-style GQA and GPT-2.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from kvstore.client import Client, KVCache
from kvstore.demo import hf
from kvstore.demo.models import build_model
from kvstore.demo.workers import DecodeWorker, PrefillWorker, colocated_generate
from kvstore.errors import InvalidRequestError, NodeUnavailableError
from kvstore.keys import Namespace

BS = 16


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gpt2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_logits_on_pool_kv_equal_logits_on_kv_kept_in_memory(
    pool: Client, name: str, dtype: torch.dtype
) -> None:
    model = build_model(name, dtype=dtype)
    ns = hf.namespace_for(model, f"{name}-{dtype}", block_size=BS)
    kv = KVCache(pool, ns)
    tokens = prompt(5 * BS + 3, seed=1)
    prefix, suffix = tokens[: 4 * BS], tokens[4 * BS :]
    _, cache = hf.forward(model, prefix, None)
    kept, _ = hf.forward(model, suffix, hf.build_cache(model, hf.cache_layers(cache)))
    assert kv.store(prefix, hf.cache_layers(cache)) == 4 * BS
    shape = (len(prefix), ns.num_kv_heads, ns.head_dim)
    bufs = [
        (torch.empty(shape, dtype=dtype), torch.empty(shape, dtype=dtype))
        for _ in range(ns.num_layers)
    ]
    assert kv.load(prefix, bufs) == 4 * BS
    loaded, _ = hf.forward(model, suffix, hf.build_cache(model, bufs))
    assert torch.equal(loaded, kept), "the pool returned other bytes than were stored"
    # And layer by layer, with the model starting before the last layer arrived.
    n = 4 * BS
    pipelined = hf.PipelinedCache(model, kv.load_layers(prefix, bufs), n)
    streamed, _ = hf.forward(model, suffix, pipelined)
    pipelined.finish()
    assert torch.equal(streamed, kept)
    kv.close()


def test_cache_round_trip_is_exact_and_checked() -> None:
    model = build_model("tiny-llama")
    _, cache = hf.forward(model, prompt(40, 2), None)
    layers = hf.cache_layers(cache)
    assert layers[0][0].shape == (40, 2, 16), "pool layout [tokens, kv heads, head dim]"
    rebuilt = hf.cache_layers(hf.build_cache(model, layers))
    assert all(torch.equal(a, b) for (a, _), (b, _) in zip(layers, rebuilt, strict=True))
    with pytest.raises(InvalidRequestError, match="layers"):
        hf.build_cache(model, layers[:-1])
    with pytest.raises(InvalidRequestError, match="token counts"):
        hf.build_cache(model, [(k, v[:-1]) for k, v in layers])


@pytest.mark.parametrize(
    "field, value",
    [("num_layers", 3), ("num_kv_heads", 8), ("head_dim", 32), ("dtype", "float16")],
)
def test_a_namespace_that_does_not_match_the_model_is_refused(
    pool: Client, field: str, value: object
) -> None:
    model = build_model("tiny-llama")
    good = hf.namespace_for(model, "m", block_size=BS).to_dict()
    bad = Namespace(**{**good, field: value})
    with pytest.raises(InvalidRequestError, match="does not match"):
        PrefillWorker(model, KVCache(pool, bad))


def test_fp8_namespace_without_matching_scales_is_refused(pool: Client) -> None:
    from kvstore.client.adapters.fp8 import calibrate

    model = build_model("tiny-gpt2")
    ns = hf.namespace_for(model, "gpt2", block_size=BS, kv_dtype=hf.FP8)
    with pytest.raises(InvalidRequestError, match="scales"):
        DecodeWorker(model, KVCache(pool, ns))
    with pytest.raises(InvalidRequestError, match="digest"):
        DecodeWorker(model, KVCache(pool, ns), fp8_scales=calibrate(model))


def test_prompts_beyond_the_context_or_vocabulary_are_refused(pool: Client) -> None:
    model = build_model("tiny-gpt2", max_context=64)
    kv = KVCache(pool, hf.namespace_for(model, "gpt2-short", block_size=BS))
    with pytest.raises(InvalidRequestError, match="context"):
        PrefillWorker(model, kv).prefill(prompt(65, 3))
    with pytest.raises(InvalidRequestError, match="context"):
        DecodeWorker(model, kv).generate(prompt(60, 3), max_new_tokens=5)
    with pytest.raises(InvalidRequestError, match="vocabulary"):
        PrefillWorker(model, kv).prefill([1, 2, 100_000])
    with pytest.raises(InvalidRequestError, match="empty"):
        PrefillWorker(model, kv).prefill([])


class _LosesABlockMidLoad:
    """A KVCache stand-in whose layer-wise load loses a block after the first layer."""

    def __init__(self, kv: KVCache) -> None:
        self.kv = kv
        self.namespace = kv.namespace

    def load_layers(self, tokens: np.ndarray, bufs: list) -> Iterator:
        for layer, k, v in self.kv.load_layers(tokens, bufs):
            if layer == 1:
                with torch.inference_mode():
                    k.fill_(1e4)  # what a half-read block looks like to the model
                yield layer, k, v
                raise NodeUnavailableError("node died mid-load")
            yield layer, k, v

    def load(self, tokens: np.ndarray, bufs: list) -> int:
        return 0

    def store(self, tokens: np.ndarray, layers: list) -> int:
        return self.kv.store(tokens, layers)


def test_a_block_lost_mid_load_falls_back_to_recompute_never_a_wrong_token(pool: Client) -> None:
    model = build_model("tiny-llama")
    kv = KVCache(pool, hf.namespace_for(model, "mid-load", block_size=BS))
    tokens = prompt(4 * BS + 5, 4)
    first = PrefillWorker(model, kv).prefill(tokens).first_token
    want = colocated_generate(model, tokens, 6)
    assert want[0] == first
    result = DecodeWorker(model, _LosesABlockMidLoad(kv)).generate(  # type: ignore[arg-type]
        tokens, 6, first_token=first
    )
    assert result.fell_back and result.num_loaded == 0
    assert result.tokens == want
    again = PrefillWorker(model, _LosesABlockMidLoad(kv)).prefill(tokens)  # type: ignore[arg-type]
    assert again.fell_back and again.num_cached == 0 and again.first_token == first
    # Blocks removed from the pool after the prefill: a shorter hit, the rest recomputed.
    from kvstore.keys import block_keys
    from kvstore.kvblocks import kv_object_key

    keys = block_keys(kv.namespace, tokens)
    pool.batch_remove([kv_object_key(kv.namespace.digest, k) for k in keys[2:]])
    result = DecodeWorker(model, kv).generate(tokens, 6, first_token=first)
    assert result.num_loaded == 2 * BS and result.tokens == want


def test_a_saved_model_folder_loads_with_the_same_weights(tmp_path: Path) -> None:
    from kvstore.demo.models import weights_digest

    model = build_model("tiny-gpt2", seed=3)
    model.save_pretrained(tmp_path / "m")
    again = build_model(str(tmp_path / "m"))
    assert weights_digest(again) == weights_digest(model)
    assert hf.model_shape(again) == hf.model_shape(model)
    with pytest.raises(InvalidRequestError, match="unknown model"):
        build_model(str(tmp_path / "missing"))


class _KillsTheNodeMidLoad:
    """The real KVCache, but the storage node is killed (SIGKILL, by PID) once layer 0 arrived
    (layer 1 is already in flight then; the later layers' reads fail)."""

    def __init__(self, kv: KVCache, node) -> None:
        self.kv = kv
        self.namespace = kv.namespace
        self.node = node

    def load_layers(self, tokens: np.ndarray, bufs: list) -> Iterator:
        for layer, k, v in self.kv.load_layers(tokens, bufs):
            yield layer, k, v
            if layer == 0:
                self.node.kill()


def test_a_node_killed_mid_load_means_recompute_never_a_wrong_token(cluster_factory) -> None:
    cluster = cluster_factory(num_nodes=1, dram="64MiB")
    model = build_model("tiny-llama")  # 4 layers: layer 2 is read after the kill
    with Client.connect(cluster.address, timeout=5) as client:
        kv = KVCache(client, hf.namespace_for(model, "killed", block_size=BS))
        tokens = prompt(6 * BS + 3, 6)
        first = PrefillWorker(model, kv).prefill(tokens).first_token
        want = colocated_generate(model, tokens, 6)
        result = DecodeWorker(model, _KillsTheNodeMidLoad(kv, cluster.nodes[0])).generate(  # type: ignore[arg-type]
            tokens, 6, first_token=first
        )
        assert result.fell_back and result.num_loaded == 0, result.notes
        assert result.tokens == want
        kv.close()
