"""Hugging Face transformers glue: a causal LM's KV cache <-> the pool's per-layer ``(K, V)``.

Written against transformers 5.24 (pinned in pyproject): models take ``cache=`` and return
``.cache``, a :class:`~transformers.DynamicCache` whose layers hold ``keys``/``values`` shaped
``[batch, kv_heads, tokens, head_dim]``. The pool's layout is ``[tokens, kv_heads, head_dim]``
per layer (batch 1), so moving between them is one transpose copy per layer and tensor.

Works for any decoder whose attention goes through ``Cache.update`` per layer (Llama-style GQA,
GPT-2, Qwen, Mistral, ...). Sliding-window and hybrid (linear-attention) layers are refused.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import transformers
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from kvstore.errors import InvalidRequestError, KVTimeoutError
from kvstore.keys import Namespace

#: The transformers version the adapters are written and tested against (pinned in pyproject).
SUPPORTED_TRANSFORMERS = "5.24.0"
if not transformers.__version__.startswith("5."):
    raise ImportError(
        f"kvstore.client.adapters needs transformers 5.x (tested: {SUPPORTED_TRANSFORMERS}); "
        f"found {transformers.__version__}"
    )

_DTYPE_NAMES = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32"}
NAME_TO_DTYPE = {v: k for k, v in _DTYPE_NAMES.items()}
FP8 = "float8_e4m3"


@dataclass(frozen=True, slots=True)
class ModelShape:
    """What the pool must agree on with a model: its KV geometry, dtype and context length."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    max_context: int


def model_shape(model: Any) -> ModelShape:
    """Read a causal LM's KV geometry from its config.

    Raises:
        InvalidRequestError: a model whose KV the adapters cannot move (sliding window, hybrid
            layers, an unsupported dtype).
    """
    cfg = model.config.get_text_config(decoder=True)
    layer_types = getattr(cfg, "layer_types", None)
    if layer_types and any(t != "full_attention" for t in layer_types):
        raise InvalidRequestError(
            f"only full-attention layers are supported, got {set(layer_types)}"
        )
    if getattr(cfg, "sliding_window", None):
        raise InvalidRequestError("sliding-window attention is not supported")
    num_layers = cfg.num_hidden_layers
    num_heads = cfg.num_attention_heads
    num_kv_heads = getattr(cfg, "num_key_value_heads", None) or num_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // num_heads
    dtype = next(model.parameters()).dtype
    if dtype not in _DTYPE_NAMES:
        raise InvalidRequestError(f"model dtype {dtype} is not supported")
    max_context = getattr(cfg, "max_position_embeddings", None) or cfg.n_positions
    return ModelShape(num_layers, num_kv_heads, head_dim, _DTYPE_NAMES[dtype], int(max_context))


def namespace_for(
    model: Any, name: str, *, block_size: int = 64, kv_dtype: str | None = None, **extra: Any
) -> Namespace:
    """The namespace a model's KV lives in.

    Args:
        model: the causal LM.
        name: the namespace's ``model`` (weights identity: two models with different weights
            must never share it).
        block_size: tokens per block.
        kv_dtype: the stored dtype; default the model's own. ``"float8_e4m3"`` stores FP8.
        extra: other :class:`Namespace` fields (salt, tp_rank, ...).

    Returns:
        The namespace.
    """
    shape = model_shape(model)
    return Namespace(
        model=name,
        dtype=kv_dtype or shape.dtype,
        num_layers=shape.num_layers,
        num_kv_heads=shape.num_kv_heads,
        head_dim=shape.head_dim,
        block_size=block_size,
        **extra,
    )


def check_namespace(model: Any, namespace: Namespace) -> ModelShape:
    """Refuse a namespace whose geometry or dtype does not match the model.

    Returns:
        The model's shape.

    Raises:
        InvalidRequestError: layers, KV heads, head size or dtype differ (a wrong namespace
            would load KV of another shape or precision: never allowed).
    """
    shape = model_shape(model)
    want = (shape.num_layers, shape.num_kv_heads, shape.head_dim)
    got = (namespace.num_layers, namespace.num_kv_heads, namespace.head_dim)
    if want != got:
        raise InvalidRequestError(
            f"namespace (layers, kv heads, head dim) = {got} does not match the model's {want}"
        )
    if namespace.dtype not in (shape.dtype, FP8):
        raise InvalidRequestError(
            f"namespace dtype {namespace.dtype} does not match the model's {shape.dtype} "
            f"(or {FP8} with scales)"
        )
    return shape


def cache_layers(
    cache: Any, start: int = 0, stop: int | None = None
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per-layer ``(K, V)`` of tokens ``[start, stop)`` of a batch-1 cache, pool layout.

    Returns:
        Contiguous ``[tokens, kv_heads, head_dim]`` tensors (copies).

    Raises:
        InvalidRequestError: not a single-sequence cache.
    """
    out = []
    for layer in cache.layers:
        k, v = layer.keys, layer.values
        if k is None or k.dim() != 4 or k.shape[0] != 1:
            raise InvalidRequestError("expected a filled batch-1 cache")
        out.append(
            (
                k[0, :, start:stop].transpose(0, 1).contiguous(),
                v[0, :, start:stop].transpose(0, 1).contiguous(),
            )
        )
    return out


def _engine_layout(x: torch.Tensor) -> torch.Tensor:
    return x.transpose(0, 1).unsqueeze(0)


def build_cache(model: Any, layers: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> DynamicCache:
    """A :class:`DynamicCache` holding the given per-layer ``(K, V)`` (pool layout).

    Raises:
        InvalidRequestError: a layer count or token counts that disagree.
    """
    cache = DynamicCache(config=model.config)
    if len(layers) != len(cache.layers):
        raise InvalidRequestError(f"{len(layers)} layers given; the model has {len(cache.layers)}")
    lengths = {k.shape[0] for k, _ in layers} | {v.shape[0] for _, v in layers}
    if len(lengths) != 1:
        raise InvalidRequestError(f"layers hold different token counts: {sorted(lengths)}")
    if lengths == {0}:
        return cache
    for i, (k, v) in enumerate(layers):
        cache.layers[i].update(_engine_layout(k), _engine_layout(v))
    return cache


class _PipelinedLayer(DynamicLayer):
    """A cache layer whose prefix KV is still arriving: ``update`` waits for it.

    ``get_seq_length`` reports the announced prefix length before the data is there, so the
    model builds positions and masks for the right length up front.
    """

    def __init__(self, owner: PipelinedCache, index: int) -> None:
        super().__init__()
        self._owner = owner
        self._index = index

    def get_seq_length(self) -> int:
        if not self.is_initialized:
            return self._owner.num_tokens
        return super().get_seq_length()

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            k, v = self._owner.wait_layer(self._index)
            if k.shape[0]:
                super().update(_engine_layout(k), _engine_layout(v))
        return super().update(key_states, value_states, *args, **kwargs)


class PipelinedCache(DynamicCache):
    """A cache that the model can start using while later layers are still being loaded.

    A loader thread iterates ``source`` (``(layer, K, V)`` in layer order, pool layout, as
    :meth:`kvstore.client.KVCache.load_layers` yields them) and hands each layer over; the
    model's forward waits, at layer ``i``, only for layer ``i``. So computing layer ``i`` overlaps
    the transfer of layer ``i + 1``.

    Args:
        model: the causal LM (for the layer count).
        source: the per-layer iterator; its exception (a lost or corrupt block) is re-raised by
            :meth:`finish`.
        num_tokens: how many prefix tokens the source delivers (every layer the same).
        timeout: seconds to wait for any one layer.
    """

    def __init__(self, model: Any, source: Any, num_tokens: int, timeout: float = 60.0) -> None:
        super().__init__(config=model.config)
        self.num_tokens = num_tokens
        self.timeout = timeout
        self.layers = [_PipelinedLayer(self, i) for i in range(len(self.layers))]
        self._arrived: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * len(self.layers)
        self._cond = threading.Condition()
        self._error: BaseException | None = None
        self._done = False
        self.started_at = time.perf_counter()
        self.loaded_at = 0.0  # when the loader ended (perf_counter)
        self.stall_s = 0.0  # time the model spent waiting for a layer
        self._thread = threading.Thread(target=self._pump, args=(source,), daemon=True)
        self._thread.start()

    def _pump(self, source: Any) -> None:
        try:
            for layer, k, v in source:
                # Detach from the caller's buffer: the tensors become the cache's own.
                item = (
                    torch.as_tensor(k)[: self.num_tokens],
                    torch.as_tensor(v)[: self.num_tokens],
                )
                with self._cond:
                    self._arrived[layer] = item
                    self._cond.notify_all()
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer, re-raised there
            with self._cond:
                self._error = exc
        finally:
            with self._cond:
                self._done = True
                self.loaded_at = time.perf_counter()
                self._cond.notify_all()

    def wait_layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Block until layer ``index`` has arrived.

        Raises:
            KVTimeoutError: it did not arrive in time.
            The loader's exception, if it stopped before this layer.
        """
        with self._cond:
            waited = time.perf_counter()
            ok = self._cond.wait_for(
                lambda: self._arrived[index] is not None or self._done, self.timeout
            )
            self.stall_s += time.perf_counter() - waited
            item = self._arrived[index]
            if item is None:
                if self._error is not None:
                    raise self._error
                if not ok:
                    raise KVTimeoutError(f"layer {index} of the prefix did not arrive in time")
                raise InvalidRequestError(f"the loader ended before layer {index}")
            if item[0].shape[0] != self.num_tokens:
                raise InvalidRequestError(
                    f"layer {index} brought {item[0].shape[0]} tokens; {self.num_tokens} announced"
                )
            return item

    def finish(self) -> None:
        """Wait for the loader to end; re-raise its failure (the forward's result is then void)."""
        self._thread.join(self.timeout)
        if self._thread.is_alive():
            raise KVTimeoutError("the prefix loader did not finish in time")
        if self._error is not None:
            raise self._error


@torch.inference_mode()
def forward(
    model: Any, tokens: Sequence[int] | torch.Tensor, cache: Any
) -> tuple[torch.Tensor, Any]:
    """Run ``tokens`` (the uncached part of a prompt) through the model on top of ``cache``.

    Returns:
        (logits ``[len(tokens), vocab]`` in float32, the updated cache).
    """
    ids = torch.as_tensor(tokens, dtype=torch.long).reshape(1, -1)
    out = model(input_ids=ids, cache=cache, use_cache=True)
    return out.logits[0].float(), out.cache
