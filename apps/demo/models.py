"""Small causal LMs built from configs (no downloads), and loading real ones from a local folder.

Random weights give near-ties between the top logits, and a near-tie lets float rounding (a
prompt computed in one pass vs. in two chunks) flip a greedy token. The tiny models therefore
initialise with a large ``initializer_range`` (0.25 instead of 0.02): the logits then spread
over several units, so the gap between the best and second-best token is far above float32
rounding (~1e-6). Tests also check that gap (:func:`greedy_margins`) before comparing tokens, so a
seed that did produce a near-tie would fail loudly rather than flakily. Weights depend only on
the seed: two processes that build the same model get bit-identical weights
(:func:`weights_digest` checks it).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import xxhash

from kvstore.errors import InvalidRequestError

VOCAB = 512  # byte-level prompts (0..255) fit, with room to spare
INIT_RANGE = 0.25
# No end-of-sequence token: generation runs for exactly max_new_tokens (comparable lengths).
_NO_SPECIAL_TOKENS = {"bos_token_id": None, "eos_token_id": None, "pad_token_id": None}


def _llama(max_context: int, init_range: float | None) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,  # grouped-query attention: 4 query heads per KV head
        max_position_embeddings=max_context,
        initializer_range=init_range or INIT_RANGE,
        tie_word_embeddings=False,
        **_NO_SPECIAL_TOKENS,
    )
    return LlamaForCausalLM(cfg)


def _gpt2(max_context: int, init_range: float | None) -> Any:
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(
        vocab_size=VOCAB,
        n_embd=64,
        n_layer=2,
        n_head=4,
        n_positions=max_context,
        initializer_range=init_range or INIT_RANGE,
        **_NO_SPECIAL_TOKENS,
    )
    return GPT2LMHeadModel(cfg)


def _llama_small(max_context: int, init_range: float | None) -> Any:
    """A larger one for benchmarks: compute per token closer to a real (if small) model."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=512,
        intermediate_size=1536,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=max_context,
        initializer_range=init_range or 0.05,
        tie_word_embeddings=False,
        **_NO_SPECIAL_TOKENS,
    )
    return LlamaForCausalLM(cfg)


#: Model builders by name (policy table: add a line to add a model).
TINY_MODELS: dict[str, Callable[[int, float | None], Any]] = {
    "tiny-llama": _llama,
    "tiny-gpt2": _gpt2,
    "small-llama": _llama_small,
}


def build_model(
    name: str,
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    max_context: int = 4096,
    init_range: float | None = None,
) -> Any:
    """A model by name: one of :data:`TINY_MODELS` (random weights from ``seed``) or a local
    folder holding a saved transformers model (``save_pretrained``; nothing is downloaded).

    Args:
        name: a :data:`TINY_MODELS` name or a folder.
        seed: weight seed (tiny models).
        dtype: parameter dtype.
        max_context: context length (tiny models).
        init_range: weight scale (tiny models; default :data:`INIT_RANGE`, see the module doc).

    Returns:
        The model in eval mode.

    Raises:
        InvalidRequestError: an unknown name.
    """
    if name in TINY_MODELS:
        torch.manual_seed(seed)
        model = TINY_MODELS[name](max_context, init_range)
    elif Path(name).is_dir():
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(name, local_files_only=True)
    else:
        raise InvalidRequestError(
            f"unknown model {name!r}: one of {sorted(TINY_MODELS)} or a folder"
        )
    model = model.to(dtype).eval()
    model.config.attn_implementation = "eager"
    return model


def weights_digest(model: Any) -> str:
    """xxh3_64 over every parameter's bytes, in name order (16 hex digits)."""
    h = xxhash.xxh3_64()
    for name, p in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(p.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def greedy_margins(logits: torch.Tensor) -> torch.Tensor:
    """Per row, best logit minus second best (how far a greedy choice is from a tie)."""
    top = logits.float().topk(2, dim=-1).values
    return top[..., 0] - top[..., 1]
