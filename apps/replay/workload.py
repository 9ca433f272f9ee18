"""Scaled requests and synthetic prompts with the trace's prefix structure.

A trace request names its prompt only by ``hash_ids``: one id per 512-token block, chained, so
equal ids mean equal prefixes. Here every id maps, deterministically, to a block of
``block_tokens`` token ids drawn from a generator seeded with ``(seed, id)`` (numpy's
``SeedSequence``: the same in every process, never Python's ``hash()``). A prompt is the
concatenation of its blocks' tokens, the last block cut to the scaled length of the trace's
last (partial) block. So two requests that share their first ``k`` ids share their first
``k * block_tokens`` prompt tokens, and requests with different ids differ in that block.

Prompts are sent as token ids (``/v1/completions`` accepts ``prompt: [ids]``), so no tokenizer
can merge or split them: a block is exactly ``block_tokens`` tokens for the engine too, and with
vLLM's ``--block-size`` equal to ``block_tokens`` a shared id is a shared KV block.

Scaling, so that a trace made for a GPU cluster fits a small machine:

* prompt: ``block_tokens`` tokens per 512-token block (the last block in proportion), then at
  most ``max_prompt_tokens`` (whole blocks are dropped from the end: a cut prefix is a prefix);
* output: ``output_length * length_scale`` tokens (at least 1), at most ``max_output_tokens``;
* arrival: ``(timestamp - first timestamp of the slice) * time_scale`` (0.5 is twice as fast).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvstore.errors import InvalidRequestError
from kvstore.sim.trace import MOONCAKE_BLOCK_SIZE, TraceRequest

#: Token ids are drawn from this range: clear of SmolLM2's special tokens (ids below 17) and
#: inside every vocabulary of 40k ids or more.
TOKEN_ID_LOW = 1000
TOKEN_ID_HIGH = 40_000


@dataclass(frozen=True, slots=True)
class ScaleConfig:
    """How trace requests become requests for a small machine.

    Attributes:
        block_tokens: prompt tokens per hash id (vLLM's ``--block-size`` should match).
        length_scale: factor on output lengths (default: ``block_tokens / 512``).
        max_output_tokens: cap on generated tokens per request.
        max_prompt_tokens: cap on prompt tokens (keeps prompts inside ``--max-model-len``).
        time_scale: factor on arrival times (0.5 replays twice as fast, 0 all at once).
        seed: picks the token contents; a new seed gives the same structure, new prompts.

    Raises:
        InvalidRequestError: on creation, for a value out of range.
    """

    block_tokens: int = 32
    length_scale: float | None = None
    max_output_tokens: int = 32
    max_prompt_tokens: int = 2048
    time_scale: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.block_tokens < 1:
            raise InvalidRequestError(f"block_tokens must be >= 1, got {self.block_tokens}")
        if self.length_scale is not None and not (
            math.isfinite(self.length_scale) and self.length_scale > 0
        ):
            raise InvalidRequestError(f"length_scale must be > 0, got {self.length_scale}")
        if self.max_output_tokens < 1:
            raise InvalidRequestError(
                f"max_output_tokens must be >= 1, got {self.max_output_tokens}"
            )
        if self.max_prompt_tokens < 1:
            raise InvalidRequestError(
                f"max_prompt_tokens must be >= 1, got {self.max_prompt_tokens}"
            )
        if not (math.isfinite(self.time_scale) and self.time_scale >= 0):
            raise InvalidRequestError(f"time_scale must be >= 0, got {self.time_scale}")
        if self.seed < 0:
            raise InvalidRequestError(f"seed must be >= 0, got {self.seed}")

    @property
    def output_scale(self) -> float:
        """The factor on output lengths actually used."""
        if self.length_scale is not None:
            return self.length_scale
        return self.block_tokens / MOONCAKE_BLOCK_SIZE


@dataclass(frozen=True, slots=True)
class ReplayRequest:
    """One scaled request, ready to send.

    Attributes:
        request_id: the trace line's 0-based index.
        arrival_s: when to send it, seconds after the replay starts.
        hash_ids: the ids of the blocks the prompt holds (fewer than the trace's if cut).
        prompt_tokens: prompt length in tokens.
        max_tokens: tokens to generate.
    """

    request_id: int
    arrival_s: float
    hash_ids: tuple[int, ...]
    prompt_tokens: int
    max_tokens: int


def scale_request(request: TraceRequest, t0_ms: int, config: ScaleConfig) -> ReplayRequest:
    """Scale one trace request (see the module docstring).

    Args:
        request: the trace request (512-token blocks).
        t0_ms: the timestamp that becomes time 0 (the slice's first).
        config: the scaling.

    Returns:
        The scaled request.
    """
    num_blocks = len(request.hash_ids)
    last_block = request.input_length - MOONCAKE_BLOCK_SIZE * (num_blocks - 1)
    last_scaled = round(last_block * config.block_tokens / MOONCAKE_BLOCK_SIZE)
    last_scaled = min(max(last_scaled, 1), config.block_tokens)
    prompt_tokens = (num_blocks - 1) * config.block_tokens + last_scaled
    prompt_tokens = min(prompt_tokens, config.max_prompt_tokens)
    kept = -(-prompt_tokens // config.block_tokens)
    max_tokens = max(1, round(request.output_length * config.output_scale))
    return ReplayRequest(
        request_id=request.request_id,
        arrival_s=(request.timestamp_ms - t0_ms) / 1000.0 * config.time_scale,
        hash_ids=request.hash_ids[:kept],
        prompt_tokens=prompt_tokens,
        max_tokens=min(max_tokens, config.max_output_tokens),
    )


def build_requests(requests: Sequence[TraceRequest], config: ScaleConfig) -> list[ReplayRequest]:
    """Scale a slice of a trace; its first request arrives at time 0.

    Args:
        requests: the slice, in trace order.
        config: the scaling.

    Returns:
        The scaled requests, in the same order.

    Raises:
        InvalidRequestError: for an empty slice.
    """
    if not requests:
        raise InvalidRequestError("the slice holds no requests")
    t0_ms = requests[0].timestamp_ms
    return [scale_request(r, t0_ms, config) for r in requests]


def block_tokens_for(hash_id: int, block_tokens: int, seed: int = 0) -> np.ndarray:
    """The token ids of block ``hash_id`` (the same in every process).

    Args:
        hash_id: the trace's block id (>= 0).
        block_tokens: tokens per block.
        seed: the content seed.

    Returns:
        ``block_tokens`` token ids (int64).
    """
    rng = np.random.default_rng([seed, hash_id])
    return rng.integers(TOKEN_ID_LOW, TOKEN_ID_HIGH, block_tokens, dtype=np.int64)


def synthesize_prompt(
    hash_ids: Sequence[int], prompt_tokens: int, block_tokens: int, seed: int = 0
) -> list[int]:
    """The prompt of a request: its blocks' tokens, cut to ``prompt_tokens``.

    Args:
        hash_ids: the request's block ids, ``ceil(prompt_tokens / block_tokens)`` of them.
        prompt_tokens: prompt length (>= 1).
        block_tokens: tokens per block.
        seed: the content seed.

    Returns:
        The token ids.

    Raises:
        InvalidRequestError: when the ids do not fit the length.
    """
    if prompt_tokens < 1 or len(hash_ids) != -(-prompt_tokens // block_tokens):
        raise InvalidRequestError(
            f"{len(hash_ids)} block ids do not fit a prompt of {prompt_tokens} tokens "
            f"in blocks of {block_tokens}"
        )
    blocks = [block_tokens_for(h, block_tokens, seed) for h in hash_ids]
    return [int(t) for t in np.concatenate(blocks)[:prompt_tokens]]


def ideal_cached_tokens(requests: Sequence[ReplayRequest], block_tokens: int) -> list[int]:
    """Prompt tokens each request could reuse from the ones before it, with one unlimited cache
    shared by every engine and each request served before the next arrives.

    Only whole blocks count (engines cache whole blocks), and the last prompt token is always
    computed (an engine needs its logits), so a request never reuses its whole prompt.

    Args:
        requests: the scaled requests, in order.
        block_tokens: tokens per block.

    Returns:
        Reusable tokens per request.
    """
    seen: set[int] = set()
    out = []
    for request in requests:
        hit = 0
        for hash_id in request.hash_ids:
            if hash_id not in seen:
                break
            hit += 1
        whole_blocks = (request.prompt_tokens - 1) // block_tokens
        out.append(min(hit, whole_blocks) * block_tokens)
        # NOTE: a cut last block is cached only when whole; a partial one is not reusable.
        num_full = request.prompt_tokens // block_tokens
        seen.update(request.hash_ids[:num_full])
    return out
