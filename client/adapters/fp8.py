"""FP8 (E4M3) transfer compression for a model's KV: static scales, one per (layer, head).

K and V each get one float32 scale per (layer, KV head), calibrated once per model: the per-head
absolute maximum of K and V over a fixed calibration prompt (pseudo-random tokens from a seed),
times a headroom factor, maps onto E4M3's largest value 448. This is how serving engines run an
FP8 KV cache (vLLM's per-head ``k_scale``/``v_scale``): the scales belong to the model, not to a
block, so every block keeps the plain layout ``[tokens, kv_heads, head_dim]`` of one-byte
elements and token-granular reads keep working. Values beyond the calibrated range saturate.

The scales must be identical wherever a block is written or read. They depend only on the
weights and the calibration seed, and their digest is part of the namespace's ``model``
(``<model>+fp8:<digest>``): workers whose scales differ never share a block.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import xxhash

from kvstore.errors import InvalidRequestError

#: Largest finite float8 E4M3 ("fn") value.
E4M3_MAX = 448.0
DEFAULT_HEADROOM = 2.0
CALIBRATION_TOKENS = 256


def head_amax(x: torch.Tensor) -> torch.Tensor:
    """Per-head absolute maximum of ``[tokens, heads, head_dim]`` (float32, ``[heads]``)."""
    return x.detach().float().abs().amax(dim=(0, 2))


def scales_from_amax(amax: torch.Tensor, headroom: float = 1.0) -> torch.Tensor:
    """Scales that map ``headroom * amax`` onto the largest E4M3 value (never zero)."""
    return (amax.float() * headroom / E4M3_MAX).clamp_min(torch.finfo(torch.float32).tiny)


def quantize_e4m3(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Quantise ``[tokens, heads, head_dim]`` to float8 E4M3 with one scale per head.

    Values beyond the scale saturate at +-448 * scale (never NaN or inf).

    Returns:
        A ``torch.float8_e4m3fn`` tensor of the same shape.

    Raises:
        InvalidRequestError: ``scale`` is not ``[heads]`` of positive finite values.
    """
    if x.dim() != 3 or scale.shape != (x.shape[1],):
        raise InvalidRequestError(
            f"x must be [tokens, heads, dim] and scale [heads]; got {tuple(x.shape)}, {tuple(scale.shape)}"
        )
    scale = scale.float()
    if not bool(torch.isfinite(scale).all()) or not bool((scale > 0).all()):
        raise InvalidRequestError("scales must be positive and finite")
    y = (x.float() / scale[None, :, None]).clamp(-E4M3_MAX, E4M3_MAX)
    return y.to(torch.float8_e4m3fn)


def dequantize_e4m3(
    q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Inverse of :func:`quantize_e4m3`: ``float(q) * scale[h]``, cast to ``dtype``."""
    return (q.float() * scale.float()[None, :, None]).to(dtype)


@dataclass(frozen=True)
class Fp8Scales:
    """Per-(layer, head) scales: ``k`` and ``v`` are float32 ``[num_layers, num_kv_heads]``."""

    k: torch.Tensor
    v: torch.Tensor

    @property
    def digest(self) -> str:
        h = xxhash.xxh3_64()
        h.update(self.k.float().contiguous().numpy().tobytes())
        h.update(self.v.float().contiguous().numpy().tobytes())
        return h.hexdigest()

    def model_name(self, base: str) -> str:
        """The namespace ``model`` for blocks quantised with these scales."""
        return f"{base}+fp8:{self.digest}"


@torch.inference_mode()
def calibrate(
    model: Any,
    *,
    seed: int = 0,
    num_tokens: int = CALIBRATION_TOKENS,
    headroom: float = DEFAULT_HEADROOM,
) -> Fp8Scales:
    """Scales from the model's K/V over a fixed pseudo-random prompt (deterministic).

    Args:
        model: the causal LM.
        seed: the calibration prompt's seed.
        num_tokens: calibration prompt length (at most the model's context).
        headroom: the range covered beyond the observed maximum (values past it saturate).

    Returns:
        The scales.
    """
    cfg = model.config.get_text_config(decoder=True)
    vocab = cfg.vocab_size
    context = getattr(cfg, "max_position_embeddings", None) or getattr(cfg, "n_positions", None)
    num_tokens = min(num_tokens, context or num_tokens)
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (1, num_tokens), generator=gen)
    cache = model(input_ids=ids, use_cache=True).cache
    ks, vs = [], []
    for layer in cache.layers:
        ks.append(scales_from_amax(layer.keys[0].float().abs().amax(dim=(1, 2)), headroom))
        vs.append(scales_from_amax(layer.values[0].float().abs().amax(dim=(1, 2)), headroom))
    return Fp8Scales(torch.stack(ks), torch.stack(vs))


def _check(scales: Fp8Scales, num_layers: int) -> None:
    if scales.k.shape[0] != num_layers or scales.v.shape[0] != num_layers:
        raise InvalidRequestError(f"scales cover {scales.k.shape[0]} layers; {num_layers} given")


def quantize_layers(
    layers: Sequence[tuple[torch.Tensor, torch.Tensor]], scales: Fp8Scales
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per-layer ``(K, V)`` ``[tokens, heads, dim]`` -> float8 E4M3 tensors of the same shape."""
    _check(scales, len(layers))
    return [
        (quantize_e4m3(k, scales.k[i]), quantize_e4m3(v, scales.v[i]))
        for i, (k, v) in enumerate(layers)
    ]


def dequantize_layer(
    layer: int, k: torch.Tensor, v: torch.Tensor, scales: Fp8Scales, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's FP8 ``(K, V)`` back to ``dtype``."""
    return (
        dequantize_e4m3(k, scales.k[layer], dtype),
        dequantize_e4m3(v, scales.v[layer], dtype),
    )
