"""Prefill and decode workers around a transformers causal LM, sharing KV through the pool.

- :class:`PrefillWorker`: looks the prompt up, loads the cached prefix, computes only the
  uncached tokens, samples the first token, stores the new full blocks.
- :class:`DecodeWorker`: loads the prompt's KV from the pool layer by layer (the model starts on
  layer ``i`` while ``i + 1`` is in flight), recomputes only what the pool lacks, and decodes
  greedily.

Both degrade, never corrupt: a miss, a shorter hit, a block lost mid-load or a corrupt block ends
in recomputing (``fell_back`` says so), never in a token computed from wrong KV. A namespace that
does not match the model and a prompt beyond the model's context are refused up front.

Each worker is one object per process; requests run one at a time.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kvstore.client.adapters.fp8 import Fp8Scales, dequantize_layer, quantize_layers
from kvstore.client.kvcache import KVCache
from kvstore.demo import hf
from kvstore.errors import InvalidRequestError, KVStoreError
from kvstore.keys import DTYPE_BYTES, as_token_array


@dataclass(slots=True)
class PrefillResult:
    """What one prefill did. Times in seconds; ``ttft_s`` ends when the first token is known.

    ``load_s`` runs until the prefix loader ended; pipelined, it overlaps ``compute_s`` (the
    forward over the uncached tokens), so ``ttft_s < load_s + compute_s`` shows the hidden part.
    """

    num_tokens: int
    num_cached: int  # prefix tokens loaded from the pool
    num_computed: int
    num_stored: int  # tokens newly written to the pool (whole blocks)
    first_token: int
    ttft_s: float
    load_s: float
    compute_s: float
    store_s: float
    bytes_loaded: int
    bytes_stored: int
    fell_back: bool = False
    load_exposed_s: float = 0.0  # load time not hidden behind compute (all of it when batched)


@dataclass(slots=True)
class DecodeResult:
    """What one decode did: the generated tokens (the first included) and where the KV came from."""

    tokens: list[int]
    num_loaded: int  # prompt tokens whose KV came from the pool
    num_recomputed: int  # prompt tokens the decode side computed itself
    ttft_s: float  # until the KV is in place and the first decode step is done
    load_s: float
    bytes_loaded: int
    fell_back: bool = False
    notes: list[str] = field(default_factory=list)


class _Worker:
    def __init__(self, model: Any, kv: KVCache, *, fp8_scales: Fp8Scales | None = None) -> None:
        self.model = model
        self.kv = kv
        self.shape = hf.check_namespace(model, kv.namespace)
        self.fp8 = kv.namespace.dtype == hf.FP8
        if self.fp8 and fp8_scales is None:
            raise InvalidRequestError("an FP8 namespace needs the model's FP8 scales")
        if self.fp8 and fp8_scales is not None:
            _check_fp8_namespace(kv.namespace.model, fp8_scales, self.shape.num_layers)
        self.scales = fp8_scales if self.fp8 else None
        self.model_dtype = hf.NAME_TO_DTYPE[self.shape.dtype]
        self.store_dtype = torch.float8_e4m3fn if self.fp8 else self.model_dtype
        self.token_bytes = (
            2 * self.shape.num_layers * self.shape.num_kv_heads * self.shape.head_dim
        ) * DTYPE_BYTES[kv.namespace.dtype]

    def _tokens(self, tokens: Any, extra: int = 0) -> torch.Tensor:
        tok = as_token_array(tokens)
        if len(tok) == 0:
            raise InvalidRequestError("empty prompt")
        if len(tok) + extra > self.shape.max_context:
            raise InvalidRequestError(
                f"prompt of {len(tok)} tokens (+{extra} to generate) exceeds the model's "
                f"context of {self.shape.max_context}"
            )
        vocab = self.model.config.get_text_config(decoder=True).vocab_size
        if int(tok.max()) >= vocab:
            raise InvalidRequestError(
                f"token id {int(tok.max())} is outside the vocabulary ({vocab})"
            )
        return torch.from_numpy(tok.astype("int64"))

    def _buffers(self, num_tokens: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        row = (num_tokens, self.shape.num_kv_heads, self.shape.head_dim)
        return [
            (torch.empty(row, dtype=self.store_dtype), torch.empty(row, dtype=self.store_dtype))
            for _ in range(self.shape.num_layers)
        ]

    def _to_model(
        self, layer: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.scales is None:
            return k, v
        return dequantize_layer(layer, k, v, self.scales, self.model_dtype)

    def _load(self, tokens: torch.Tensor) -> tuple[int, Any]:
        """Whole-prefix load (one batched read), then a cache built from it."""
        bufs = self._buffers(len(tokens))
        n = self.kv.load(tokens.numpy(), bufs)
        layers = [self._to_model(i, k[:n], v[:n]) for i, (k, v) in enumerate(bufs)]
        return n, hf.build_cache(self.model, layers)

    def _pipelined(self, tok: torch.Tensor) -> tuple[int, Any]:
        bufs = self._buffers(len(tok))
        source = iter(self.kv.load_layers(tok.numpy(), bufs))
        try:
            layer0, k0, v0 = next(source)
        except StopIteration:
            return 0, None  # nothing cached
        n = k0.shape[0]
        if n == 0:
            for _ in source:
                pass
            return 0, None
        converted = (
            (layer, *self._to_model(layer, k, v))
            for layer, k, v in itertools.chain([(layer0, k0, v0)], source)
        )
        return n, hf.PipelinedCache(self.model, converted, n)


def _check_fp8_namespace(name: str, scales: Fp8Scales, num_layers: int) -> None:
    if not name.endswith(f"+fp8:{scales.digest}"):
        raise InvalidRequestError(
            "an FP8 namespace's model must end with the scales' digest "
            f"(+fp8:{scales.digest}); use Fp8Scales.model_name()"
        )
    if tuple(scales.k.shape) != (num_layers, scales.k.shape[1]) or scales.k.shape != scales.v.shape:
        raise InvalidRequestError("FP8 scales do not match the model's layers")


class PrefillWorker(_Worker):
    """Computes a prompt's KV, reusing and extending what the pool holds.

    Args:
        model: a transformers causal LM (eval mode).
        kv: the pool's KV-cache view; its namespace must match the model (checked).
        fp8_scales: the model's scales when the namespace stores FP8.

    Raises:
        InvalidRequestError: the namespace does not match the model.
    """

    def prefill(
        self, tokens: Any, *, use_pool: bool = True, pipelined: bool = True
    ) -> PrefillResult:
        """Prefill one prompt.

        Args:
            tokens: the prompt's token ids.
            use_pool: False computes everything and touches no pool (the recompute baseline).
            pipelined: load the cached prefix layer by layer while the model computes the
                uncached tokens (else one batched load first).

        Returns:
            The first token and what was loaded, computed and stored.

        Raises:
            InvalidRequestError: an empty prompt, a token outside the vocabulary, a prompt
                beyond the model's context.
        """
        tok = self._tokens(tokens, extra=1)
        t0 = time.perf_counter()
        n, cache, fell_back, load_end = 0, None, False, t0
        if use_pool and len(tok) > 1:
            try:
                # Leave at least the last token to compute: its logits give the first token.
                n, cache = self._pipelined(tok[:-1]) if pipelined else self._load(tok[:-1])
            except KVStoreError:
                n, cache, fell_back = 0, None, True  # pool unreachable: recompute, still correct
            load_end = time.perf_counter()
        t_fwd = time.perf_counter()
        try:
            logits, cache = hf.forward(self.model, tok[n:], cache)
            exposed = t_fwd - t0
            if isinstance(cache, hf.PipelinedCache):
                cache.finish()  # a lost or corrupt block: the logits above are void
                load_end = cache.loaded_at
                exposed += cache.stall_s
        except KVStoreError:
            n, fell_back, exposed = 0, True, 0.0
            logits, cache = hf.forward(self.model, tok, None)
        first = int(logits[-1].argmax())
        t2 = time.perf_counter()
        stored = 0
        if use_pool:
            layers = hf.cache_layers(cache)
            if self.scales is not None:
                layers = quantize_layers(layers, self.scales)
            try:
                stored = self.kv.store(tok.numpy(), layers)
            except KVStoreError:
                fell_back = True  # the pool is a cache: failing to fill it changes no token
        t3 = time.perf_counter()
        t1 = load_end
        return PrefillResult(
            num_tokens=len(tok),
            num_cached=n,
            num_computed=len(tok) - n,
            num_stored=stored,
            first_token=first,
            ttft_s=t2 - t0,
            load_s=t1 - t0,
            compute_s=t2 - t_fwd,
            store_s=t3 - t2,
            bytes_loaded=n * self.token_bytes,
            bytes_stored=stored * self.token_bytes,
            fell_back=fell_back,
            load_exposed_s=exposed,
        )


class DecodeWorker(_Worker):
    """Generates from a prompt whose KV a prefill worker put in the pool.

    Args:
        model: a transformers causal LM (eval mode).
        kv: the pool's KV-cache view; its namespace must match the model (checked).
        fp8_scales: the model's scales when the namespace stores FP8.

    Raises:
        InvalidRequestError: the namespace does not match the model.
    """

    @torch.inference_mode()
    def generate(
        self,
        tokens: Any,
        max_new_tokens: int,
        *,
        first_token: int | None = None,
        pipelined: bool = True,
        use_pool: bool = True,
    ) -> DecodeResult:
        """Greedy-decode ``max_new_tokens`` tokens after the prompt.

        Args:
            tokens: the prompt.
            max_new_tokens: tokens to generate (at least 1).
            first_token: the prefill's first token; then the whole prompt's KV may come from the
                pool. Without it the last prompt token is always computed here.
            pipelined: load layer by layer overlapping compute (else one batched load first).
            use_pool: False recomputes the prompt (the colocated baseline).

        Returns:
            The generated tokens (``first_token`` first, when given) and load figures.

        Raises:
            InvalidRequestError: bad prompt, too long for the context, ``max_new_tokens < 1``.
        """
        if max_new_tokens < 1:
            raise InvalidRequestError("max_new_tokens must be at least 1")
        tok = self._tokens(tokens, extra=max_new_tokens)
        limit = len(tok) if first_token is not None else len(tok) - 1
        notes: list[str] = []
        t0 = time.perf_counter()
        n, cache, fell_back = 0, None, False
        if use_pool and limit > 0:
            try:
                n, cache = self._pipelined(tok[:limit]) if pipelined else self._load(tok[:limit])
            except KVStoreError as err:
                n, cache, fell_back = 0, None, True
                notes.append(f"load failed before compute: {err.message}")
        t_loaded = time.perf_counter()
        try:
            out, ttft = self._decode(tok, n, cache, first_token, max_new_tokens, t0)
        except KVStoreError as err:
            # The pipelined load failed after the model had used its layers (a lost or corrupt
            # block): everything computed from it is void. Recompute from the prompt alone.
            notes.append(f"load failed during compute, recomputed: {err.message}")
            fell_back = True
            n = 0
            out, ttft = self._decode(tok, 0, None, first_token, max_new_tokens, t0)
        return DecodeResult(
            tokens=out,
            num_loaded=n,
            num_recomputed=len(tok) - n,
            ttft_s=ttft,
            load_s=t_loaded - t0,
            bytes_loaded=n * self.token_bytes,
            fell_back=fell_back,
            notes=notes,
        )

    def _decode(
        self,
        tok: torch.Tensor,
        n: int,
        cache: Any,
        first_token: int | None,
        max_new_tokens: int,
        t0: float,
    ) -> tuple[list[int], float]:
        out: list[int] = []
        if n < len(tok):
            logits, cache = hf.forward(self.model, tok[n:], cache)
            nxt = int(logits[-1].argmax())
            out.append(nxt)
        else:
            assert first_token is not None, "a fully loaded prompt needs the prefill's first token"
            nxt = first_token
            out.append(nxt)
            if max_new_tokens > 1:  # this step runs while the later layers still arrive
                logits, cache = hf.forward(self.model, [nxt], cache)
                nxt = int(logits[-1].argmax())
                out.append(nxt)
        if isinstance(cache, hf.PipelinedCache):
            cache.finish()  # re-raises a lost or corrupt block: no token above is returned
        ttft = time.perf_counter() - t0
        while len(out) < max_new_tokens:
            logits, cache = hf.forward(self.model, [nxt], cache)
            nxt = int(logits[-1].argmax())
            out.append(nxt)
        return out, ttft


@torch.inference_mode()
def colocated_generate(model: Any, tokens: Sequence[int], max_new_tokens: int) -> list[int]:
    """The reference: transformers' own greedy ``generate`` on the whole prompt, in one process."""
    ids = torch.as_tensor(list(tokens), dtype=torch.long).reshape(1, -1)
    out = model.generate(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_new_tokens,
        min_new_tokens=max_new_tokens,
        do_sample=False,
        pad_token_id=0,
    )
    return out[0, ids.shape[1] :].tolist()
