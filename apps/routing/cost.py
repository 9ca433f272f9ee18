"""The cost model: how long prefill, a decode step and a KV transfer take.

Every parameter is explicit, has a unit in its name, and is checked when the model is built.
The defaults describe one LLaMA2-70B-class instance on 8 GPUs (GQA, 80 layers, 8 KV heads of
128 dims, fp16 KV), the setting of Mooncake's paper; ``docs/scheduler.md`` derives each number.

Formulas (``n`` new tokens, ``c`` cached tokens already in the instance's KV):

* prefill time      = ``prefill_base_s + n * prefill_s_per_token
  + n * (c + n / 2) * prefill_s_per_token_pair``  (linear layers + causal attention)
* decode step time  = ``decode_base_s + b * decode_s_per_seq + t * decode_s_per_kv_token``
  for a batch of ``b`` sequences holding ``t`` KV tokens in all
* transfer time     = ``transfer_latency_s + tokens * kv_bytes_per_token / transfer_bytes_per_s``
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Protocol

from kvstore.errors import InvalidRequestError


class CostTerms(Protocol):
    """The three timings a routing estimate reads of an engine (:mod:`.policy`).

    :class:`CostModel` is the router's (a prior, then fitted per engine); the simulator of
    ``kv_both`` engines gives its step model in these terms, so both run one estimate.
    """

    def prefill_s(self, new_tokens: int, cached_tokens: int = 0) -> float:
        """Seconds to compute ``new_tokens`` on top of ``cached_tokens`` already present."""
        ...

    def decode_step_s(self, batch_size: int, kv_tokens: int) -> float:
        """Seconds of one decode step of ``batch_size`` sequences holding ``kv_tokens``."""
        ...

    def transfer_s(self, tokens: int) -> float:
        """Seconds to load the KV of ``tokens`` tokens from the pool (0 for none)."""
        ...


@dataclass(frozen=True, slots=True)
class CostModel:
    """Timing of one prefill or decode instance and of the network between them.

    Attributes:
        block_size_tokens: tokens per KV block (512 in Mooncake's traces).
        prefill_base_s: fixed cost of one prefill (launch, scheduling, sampling).
        prefill_s_per_token: linear-layer time per new token (~2 x params FLOPs / throughput).
        prefill_s_per_token_pair: attention time per (new token, earlier token) pair.
        decode_base_s: fixed cost of one decode step (reading the weights once).
        decode_s_per_seq: extra step time per sequence in the batch.
        decode_s_per_kv_token: extra step time per KV token read by the step.
        kv_bytes_per_token: KV cache size of one token, all layers.
        transfer_bytes_per_s: bandwidth from the pool (or prefill) to an instance.
        transfer_latency_s: fixed cost of one transfer.

    Raises:
        InvalidRequestError: on creation, for a non-finite or negative parameter, a zero
            bandwidth or block size, or a model in which work takes no time at all.
    """

    block_size_tokens: int = 512
    prefill_base_s: float = 0.02
    prefill_s_per_token: float = 1.2e-4
    prefill_s_per_token_pair: float = 2.2e-9
    decode_base_s: float = 0.010
    decode_s_per_seq: float = 1.0e-4
    decode_s_per_kv_token: float = 2.0e-8
    kv_bytes_per_token: int = 327_680
    transfer_bytes_per_s: float = 25e9
    transfer_latency_s: float = 0.001

    def __post_init__(self) -> None:
        for field in fields(self):
            value = getattr(self, field.name)
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise InvalidRequestError(f"cost model {field.name} must be a number")
            if not math.isfinite(value) or value < 0:
                raise InvalidRequestError(
                    f"cost model {field.name} must be finite and >= 0, got {value}"
                )
        if self.block_size_tokens < 1 or not isinstance(self.block_size_tokens, int):
            raise InvalidRequestError("cost model block_size_tokens must be an integer >= 1")
        if self.transfer_bytes_per_s <= 0:
            raise InvalidRequestError("cost model transfer_bytes_per_s must be > 0")
        if self.prefill_base_s + self.prefill_s_per_token <= 0:
            raise InvalidRequestError("cost model: prefill must take time")
        if self.decode_base_s + self.decode_s_per_seq <= 0:
            raise InvalidRequestError("cost model: a decode step must take time")

    def prefill_s(self, new_tokens: int, cached_tokens: int = 0) -> float:
        """Time to prefill ``new_tokens`` on top of ``cached_tokens`` already present.

        Args:
            new_tokens: tokens to compute (>= 0).
            cached_tokens: tokens whose KV is already in the instance (>= 0).

        Returns:
            Seconds.
        """
        n = max(new_tokens, 0)
        c = max(cached_tokens, 0)
        return (
            self.prefill_base_s
            + n * self.prefill_s_per_token
            + n * (c + n / 2) * self.prefill_s_per_token_pair
        )

    def decode_step_s(self, batch_size: int, kv_tokens: int) -> float:
        """Time of one decode step (one token for each of ``batch_size`` sequences).

        Args:
            batch_size: sequences in the batch (>= 0).
            kv_tokens: KV tokens the batch holds in all (>= 0).

        Returns:
            Seconds.
        """
        return (
            self.decode_base_s
            + max(batch_size, 0) * self.decode_s_per_seq
            + max(kv_tokens, 0) * self.decode_s_per_kv_token
        )

    def transfer_s(self, tokens: int) -> float:
        """Time to move the KV of ``tokens`` tokens; zero tokens cost nothing.

        Args:
            tokens: tokens of KV to move (>= 0).

        Returns:
            Seconds.
        """
        if tokens <= 0:
            return 0.0
        return (
            self.transfer_latency_s + tokens * self.kv_bytes_per_token / self.transfer_bytes_per_s
        )
