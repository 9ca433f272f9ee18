"""A ``kv_both`` engine with continuous batching: prefill and decode on one core, step by step.

vLLM's v1 scheduler (and SGLang's) runs one loop per engine: every step takes each running
sequence one token further and admits waiting prompts while there is room, so the prefill of a
new prompt and the decode of the running ones share the step. This module is that loop, as
the simulator runs it for one engine (``kvboth.py`` runs several behind a router):

* **A step.** First the running sequences: one still in prefill (a prompt longer than the
  token budget) takes its next chunk, every other one decodes one token. Then waiting prompts
  are admitted in arrival order while fewer than ``max_num_seqs`` run and tokens are left in
  ``max_num_batched_tokens``; a prompt that does not fit whole takes a chunk (chunked prefill).
* **Its time** = ``step_base_s + decode_s_per_seq * decoding + prefill_s_per_token * prefill
  tokens + load_s_per_token * tokens loaded from the pool``. Fitted per run
  (``kvstore.replay.fit.fit_step_model``).
* **Cached tokens** skip prefill. On admission a prompt's leading whole blocks are looked up in
  the engine's own prefix cache and in the pool (vLLM's connector is asked for what follows
  the local hit); the longer hit is used, and the pool's blocks beyond the local ones cost the
  load term. At most ``prompt - 1`` tokens hit, in whole blocks (the last token is always
  computed: its logits give the first output token), as vLLM's ``max_cache_hit_length``.
* **Tokens.** A sequence whose prompt is complete at the end of a step emits its first token
  then (TTFT); a decoding one emits one token per step. A sequence leaves after its last token.
* **Caches.** When a prompt is complete its whole blocks enter the engine's prefix cache (an
  LRU of ``cache_blocks`` blocks, vLLM's KV cache size) and the shared pool (the connector
  saves them). Simplification: the cache does not pin the blocks of running sequences, so
  their use of KV memory does not shrink it.

No clock of its own: :meth:`KvBothEngine.start_step` plans a step and says how long it takes,
:meth:`KvBothEngine.end_step` applies it at the time the caller gives.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field, fields

from kvstore.errors import InvalidRequestError

from .policies import BlockCache, BlockKey


@dataclass(frozen=True, slots=True)
class StepCost:
    """Time of one continuous-batching step.

    Attributes:
        step_base_s: fixed cost of a step (scheduling, reading the weights, sampling).
        decode_s_per_seq: extra time per sequence that decodes a token in the step.
        prefill_s_per_token: extra time per prompt token computed in the step.
        load_s_per_token: extra time per prompt token loaded from the pool in the step.
        request_overhead_s: delay between a request's arrival and its entering the engine's
            queue (router, HTTP, tokenizing); it adds to TTFT only, not to steps.

    Raises:
        InvalidRequestError: on creation, for a negative or non-finite parameter, or a step
            that takes no time at all.
    """

    step_base_s: float = 0.03
    decode_s_per_seq: float = 0.005
    prefill_s_per_token: float = 0.001
    load_s_per_token: float = 0.0
    request_overhead_s: float = 0.0

    def __post_init__(self) -> None:
        for item in fields(self):
            value = getattr(self, item.name)
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise InvalidRequestError(f"step cost {item.name} must be a number")
            if not math.isfinite(value) or value < 0:
                raise InvalidRequestError(
                    f"step cost {item.name} must be finite and >= 0, got {value}"
                )
        if self.step_base_s + self.decode_s_per_seq <= 0 or (
            self.step_base_s + self.prefill_s_per_token <= 0
        ):
            raise InvalidRequestError("step cost: a step must take time")

    def step_s(self, num_decode: int, num_prefill_tokens: int, num_loaded_tokens: int = 0) -> float:
        """Time of one step.

        Args:
            num_decode: sequences decoding one token in it.
            num_prefill_tokens: prompt tokens computed in it.
            num_loaded_tokens: prompt tokens loaded from the pool in it.

        Returns:
            Seconds.
        """
        return (
            self.step_base_s
            + max(num_decode, 0) * self.decode_s_per_seq
            + max(num_prefill_tokens, 0) * self.prefill_s_per_token
            + max(num_loaded_tokens, 0) * self.load_s_per_token
        )

    def prefill_s(self, num_tokens: int) -> float:
        """A prompt's prefill alone on an idle engine (one step, no decodes beside it)."""
        return self.step_s(0, max(num_tokens, 1))


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """One ``kv_both`` engine.

    Attributes:
        cost: its step times.
        max_num_seqs: most sequences in a step (vLLM ``--max-num-seqs``).
        max_num_batched_tokens: most tokens in a step, decodes and prefill chunks together
            (vLLM ``--max-num-batched-tokens``).
        cache_blocks: blocks its prefix cache holds (vLLM's KV cache in blocks; ``None``
            unlimited, 0 no prefix caching).
        block_size_tokens: tokens per block (vLLM ``--block-size``; the pool's block too).

    Raises:
        InvalidRequestError: on creation, for sizes below 1 or a negative cache.
    """

    cost: StepCost = field(default_factory=StepCost)
    max_num_seqs: int = 4
    max_num_batched_tokens: int = 2048
    cache_blocks: int | None = None
    block_size_tokens: int = 32

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1 or self.block_size_tokens < 1:
            raise InvalidRequestError(
                "max_num_seqs, max_num_batched_tokens and block_size_tokens must be >= 1"
            )
        if self.cache_blocks is not None and self.cache_blocks < 0:
            raise InvalidRequestError(f"cache_blocks must be >= 0 or None, got {self.cache_blocks}")


@dataclass(slots=True)
class EngineRequest:
    """One request on an engine (vLLM's ``Request`` as the scheduler tracks it).

    Attributes:
        index: the request's index in the trace.
        block_keys: its prompt's block keys.
        prompt_tokens: prompt length.
        output_tokens: tokens to generate (>= 1).
        computed_tokens: prompt tokens done (cached or computed).
        generated_tokens: output tokens emitted.
        local_tokens: prompt tokens hit in the engine's own cache (set on admission).
        cached_tokens: prompt tokens not computed (local or pool, set on admission).
        admitted: admitted into the running batch.
    """

    index: int
    block_keys: tuple[BlockKey, ...]
    prompt_tokens: int
    output_tokens: int
    computed_tokens: int = 0
    generated_tokens: int = 0
    local_tokens: int = 0
    cached_tokens: int = 0
    admitted: bool = False


@dataclass(frozen=True, slots=True)
class StepPlan:
    """What one step does.

    Attributes:
        duration_s: its time.
        decode: sequences decoding one token.
        prefill: ``(sequence, tokens computed)`` for each prompt chunk.
        loaded_tokens: prompt tokens loaded from the pool.
    """

    duration_s: float
    decode: tuple[EngineRequest, ...]
    prefill: tuple[tuple[EngineRequest, int], ...]
    loaded_tokens: int


def hit_tokens(blocks: int, prompt_tokens: int, block_size: int) -> int:
    """Tokens a hit of ``blocks`` leading blocks saves: whole blocks, at most ``prompt - 1``.

    Args:
        blocks: leading blocks held.
        prompt_tokens: prompt length (>= 1).
        block_size: tokens per block.

    Returns:
        Tokens.
    """
    usable = max(prompt_tokens - 1, 0) // block_size
    return min(blocks, usable) * block_size


class KvBothEngine:
    """One engine's queue, running batch and prefix cache (see the module docstring).

    Args:
        config: its sizes and step cost.
        pool: the shared pool's blocks, or None when there is none.
    """

    def __init__(self, config: EngineConfig, pool: BlockCache | None = None) -> None:
        self.config = config
        self.pool = pool
        self.cache = BlockCache(config.cache_blocks, "lru")
        self.waiting: deque[EngineRequest] = deque()
        self.running: list[EngineRequest] = []
        self.plan: StepPlan | None = None
        self.busy_s = 0.0

    @property
    def busy(self) -> bool:
        """A step is under way."""
        return self.plan is not None

    @property
    def has_work(self) -> bool:
        """Something is running or waiting."""
        return bool(self.running or self.waiting)

    def add(self, sequence: EngineRequest) -> None:
        """Queue a request (vLLM's waiting queue); it is admitted at a step's start."""
        self.waiting.append(sequence)

    def local_hit_tokens(self, block_keys: tuple[BlockKey, ...], prompt_tokens: int) -> int:
        """Tokens of a prompt its own prefix cache holds (what the router sees by KV events)."""
        blocks = self.cache.match_prefix(block_keys)
        return hit_tokens(blocks, prompt_tokens, self.config.block_size_tokens)

    def pool_hit_tokens(self, block_keys: tuple[BlockKey, ...], prompt_tokens: int) -> int:
        """Tokens of a prompt the pool holds (0 without a pool)."""
        if self.pool is None:
            return 0
        blocks = self.pool.match_prefix(block_keys)
        return hit_tokens(blocks, prompt_tokens, self.config.block_size_tokens)

    def start_step(self) -> StepPlan | None:
        """Plan the next step (admitting waiting prompts); None when there is nothing to run.

        Returns:
            The plan, kept until :meth:`end_step`.
        """
        assert self.plan is None, "a step is already under way"
        config = self.config
        budget = config.max_num_batched_tokens
        decode: list[EngineRequest] = []
        prefill: list[tuple[EngineRequest, int]] = []
        for sequence in self.running:
            if budget <= 0:
                break
            left = sequence.prompt_tokens - sequence.computed_tokens
            if left > 0:
                chunk = min(left, budget)
                prefill.append((sequence, chunk))
                budget -= chunk
            else:
                decode.append(sequence)
                budget -= 1
        loaded = 0
        while self.waiting and len(self.running) < config.max_num_seqs and budget > 0:
            sequence = self.waiting.popleft()
            loaded += self._admit(sequence)
            chunk = min(sequence.prompt_tokens - sequence.computed_tokens, budget)
            prefill.append((sequence, chunk))
            budget -= chunk
            self.running.append(sequence)
        if not decode and not prefill:
            return None
        duration = config.cost.step_s(len(decode), sum(c for _, c in prefill), loaded)
        self.plan = StepPlan(duration, tuple(decode), tuple(prefill), loaded)
        self.busy_s += duration
        return self.plan

    def _admit(self, sequence: EngineRequest) -> int:
        """Look the prompt up in the local cache and the pool; returns tokens to load."""
        local = self.local_hit_tokens(sequence.block_keys, sequence.prompt_tokens)
        pool = self.pool_hit_tokens(sequence.block_keys, sequence.prompt_tokens)
        if local:
            self.cache.access(sequence.block_keys[: local // self.config.block_size_tokens])
        sequence.local_tokens = local
        sequence.cached_tokens = max(local, pool)
        sequence.computed_tokens = sequence.cached_tokens
        sequence.admitted = True
        return max(pool - local, 0)

    def end_step(self) -> tuple[list[EngineRequest], list[EngineRequest]]:
        """Apply the step under way.

        Returns:
            ``(first, finished)``: sequences that emitted their first token in this step, and
            sequences that emitted their last (one may be in both).
        """
        plan = self.plan
        assert plan is not None, "no step is under way"
        self.plan = None
        first: list[EngineRequest] = []
        for sequence in plan.decode:
            sequence.generated_tokens += 1
        for sequence, chunk in plan.prefill:
            sequence.computed_tokens += chunk
            if sequence.computed_tokens >= sequence.prompt_tokens:
                sequence.generated_tokens = 1
                first.append(sequence)
                whole = sequence.prompt_tokens // self.config.block_size_tokens
                keys = sequence.block_keys[:whole]
                if keys:
                    self.cache.access(keys)
                    if self.pool is not None:
                        self.pool.access(keys)
        finished = [s for s in self.running if s.generated_tokens >= s.output_tokens]
        if finished:
            self.running = [s for s in self.running if s.generated_tokens < s.output_tokens]
        return first, finished
