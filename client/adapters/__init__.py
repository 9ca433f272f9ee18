"""Engine adapters: prefill and decode workers around a Hugging Face causal LM.

``from kvstore.client.adapters import PrefillWorker, DecodeWorker`` (needs torch and
transformers, which the core SDK does not). See docs/adapters.md for the mapping onto vLLM's KV
connector and SGLang's HiCache storage.
"""

from kvstore.client.adapters.fp8 import Fp8Scales, calibrate
from kvstore.client.adapters.hf import build_cache, cache_layers, check_namespace, namespace_for
from kvstore.client.adapters.models import build_model, weights_digest
from kvstore.client.adapters.workers import (
    DecodeResult,
    DecodeWorker,
    PrefillResult,
    PrefillWorker,
    colocated_generate,
)

__all__ = [
    "DecodeResult",
    "DecodeWorker",
    "Fp8Scales",
    "PrefillResult",
    "PrefillWorker",
    "build_cache",
    "build_model",
    "cache_layers",
    "calibrate",
    "check_namespace",
    "colocated_generate",
    "namespace_for",
    "weights_digest",
]
