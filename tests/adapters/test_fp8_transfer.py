"""FP8 (E4M3, per-(layer, head) scales) through the pool: measured error, half the bytes.

Exactness is not expected; the figures (printed with ``-s``) on tiny-gpt2 and tiny-llama at a
realistic weight scale (0.05): per-element error within E4M3's 2**-4 relative step, the logit
difference, and greedy-token agreement with the unquantised model over a few prompts.
"""

from __future__ import annotations

import pytest
import torch

from kvstore.client import Client, KVCache
from kvstore.client.adapters.fp8 import calibrate, dequantize_layer, quantize_layers
from kvstore.demo import hf
from kvstore.demo.models import build_model
from kvstore.demo.workers import DecodeWorker, PrefillWorker

BS = 16


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("name", ["tiny-gpt2", "tiny-llama"])
def test_fp8_error_bounds_and_greedy_agreement(name: str) -> None:
    model = build_model(name, init_range=0.05)
    scales = calibrate(model)
    worst_rel, worst_logit, agree, total = 0.0, 0.0, 0, 0
    for seed in range(4):
        tok = prompt(6 * BS, seed)
        full, cache = hf.forward(model, tok, None)
        layers = hf.cache_layers(cache, 0, 5 * BS)
        deq = [
            dequantize_layer(i, k, v, scales, torch.float32)
            for i, (k, v) in enumerate(quantize_layers(layers, scales))
        ]
        for (k, v), (kq, vq) in zip(layers, deq, strict=True):
            for x, y in ((k, kq), (v, vq)):
                big = x.abs() > x.abs().amax() * 2**-6
                worst_rel = max(worst_rel, float(((y - x).abs() / x.abs())[big].max()))
        logits, _ = hf.forward(model, tok[5 * BS :], hf.build_cache(model, deq))
        worst_logit = max(worst_logit, float((logits - full[5 * BS :]).abs().max()))
        agree += int((logits.argmax(-1) == full[5 * BS :].argmax(-1)).sum())
        total += BS
    print(
        f"\n{name}: rel err <= {worst_rel:.4f}, |dlogit| <= {worst_logit:.4f}, agree {agree}/{total}"
    )
    assert worst_rel <= 2**-4 + 1e-6  # E4M3 rounding; no value saturated at this headroom
    assert worst_logit < 0.5
    assert agree >= 0.9 * total


def test_fp8_namespace_moves_a_quarter_of_float32_and_decodes(pool: Client) -> None:
    model = build_model("tiny-gpt2", init_range=0.05)
    scales = calibrate(model)
    assert calibrate(model).digest == scales.digest, "calibration is deterministic"
    ns32 = hf.namespace_for(model, "gpt2", block_size=BS)
    ns8 = hf.namespace_for(model, scales.model_name("gpt2"), block_size=BS, kv_dtype=hf.FP8)
    kv32, kv8 = KVCache(pool, ns32), KVCache(pool, ns8)
    tok = prompt(6 * BS + 3, 9)
    p32 = PrefillWorker(model, kv32).prefill(tok)
    p8 = PrefillWorker(model, kv8, fp8_scales=scales).prefill(tok)
    assert p8.num_stored == p32.num_stored == 6 * BS
    assert p8.bytes_stored * 4 == p32.bytes_stored  # and half of float16's
    d8 = DecodeWorker(model, kv8, fp8_scales=scales).generate(tok, 8, first_token=p8.first_token)
    d32 = DecodeWorker(model, kv32).generate(tok, 8, first_token=p32.first_token)
    assert d8.num_loaded == 6 * BS and d8.bytes_loaded * 4 == d32.bytes_loaded
    agree = sum(a == b for a, b in zip(d8.tokens, d32.tokens, strict=True))
    print(f"\nfp8 decode agrees with float32 on {agree}/8 tokens")
    assert agree >= 6
