"""Least-squares fits of cost-model terms to timings the router measures on live engines.

Prefill: seconds ~ ``prefill_base_s + uncached_tokens * prefill_s_per_token`` from each prefill
step the router timed on an engine that had nothing else in flight from the router. Decode:
mean time between tokens ~ ``decode_base_s + batch * decode_s_per_seq`` from vLLM's own
inter-token latency and running-request gauges. Pool transfer: bytes per second from the
kvstore connector's own counters on vLLM's ``/metrics`` (``vllm:kvstore_loaded_bytes_total``
over ``vllm:kvstore_load_seconds_total``: read from the pool and copy into the paged cache).
Until a fit has enough samples, the prior (the CLI's default cost model) stands.
"""

from __future__ import annotations

import dataclasses
from collections import deque

import numpy as np

from kvstore.routing.cost import CostModel

#: Samples a fit remembers: the engine's recent behaviour, not its whole life.
WINDOW = 64
#: Distinct x values needed before a line is fitted (two points make a line; three check it).
MIN_DISTINCT = 3
#: Bytes loaded (in the window) before the measured bandwidth replaces the prior's.
MIN_LOADED_BYTES = 1 << 20


class LineFit:
    """``y ~ a + b * x`` by least squares over the last :data:`WINDOW` samples.

    A ``deque`` with ``maxlen`` keeps the window: appends drop the oldest in O(1).
    """

    def __init__(self, window: int = WINDOW) -> None:
        self._samples: deque[tuple[float, float]] = deque(maxlen=window)

    def add(self, x: float, y: float) -> None:
        """Record one sample (``y`` seconds at ``x``)."""
        self._samples.append((float(x), float(y)))

    def __len__(self) -> int:
        return len(self._samples)

    def solve(self) -> tuple[float, float] | None:
        """The fitted ``(a, b)``, both clamped to >= 0, or None with too few distinct ``x``.

        Returns:
            Intercept and slope, or None.
        """
        if len({x for x, _ in self._samples}) < MIN_DISTINCT:
            return None
        xs = np.array([x for x, _ in self._samples])
        ys = np.array([y for _, y in self._samples])
        design = np.stack([np.ones_like(xs), xs], axis=1)
        (a, b), *_ = np.linalg.lstsq(design, ys, rcond=None)
        return max(float(a), 0.0), max(float(b), 0.0)


class BandwidthFit:
    """Bytes per second of the loads an engine made from the pool, over the last
    :data:`WINDOW` polls that saw a load (a ``deque`` with ``maxlen``: O(1) appends)."""

    def __init__(self, window: int = WINDOW) -> None:
        self._samples: deque[tuple[float, float]] = deque(maxlen=window)

    def add(self, num_bytes: float, seconds: float) -> None:
        """Record the bytes loaded and the seconds spent loading since the last poll."""
        if num_bytes > 0 and seconds > 0:
            self._samples.append((float(num_bytes), float(seconds)))

    def solve(self) -> float | None:
        """The window's bytes over its seconds, or None below :data:`MIN_LOADED_BYTES`.

        Returns:
            Bytes per second, or None.
        """
        num_bytes = sum(b for b, _ in self._samples)
        seconds = sum(s for _, s in self._samples)
        if num_bytes < MIN_LOADED_BYTES or seconds <= 0:
            return None
        return num_bytes / seconds


@dataclasses.dataclass(slots=True)
class EngineFit:
    """The fits of one engine, applied on top of a prior cost model.

    Attributes:
        prior: the cost model before (and beside) any measurement.
        prefill: uncached tokens -> prefill seconds.
        decode: running batch size -> seconds between tokens.
        transfer: the engine's measured load bandwidth from the pool.
    """

    prior: CostModel
    prefill: LineFit = dataclasses.field(default_factory=LineFit)
    decode: LineFit = dataclasses.field(default_factory=LineFit)
    transfer: BandwidthFit = dataclasses.field(default_factory=BandwidthFit)

    def cost(self) -> CostModel:
        """The prior with every fitted term replaced by its fit.

        Returns:
            A cost model (the attention pair term is dropped once prefill is fitted: the
            line already absorbs it at the prompt lengths measured).
        """
        model = self.prior
        line = self.prefill.solve()
        if line is not None and line[0] + line[1] > 0:
            model = dataclasses.replace(
                model,
                prefill_base_s=line[0],
                prefill_s_per_token=line[1],
                prefill_s_per_token_pair=0.0,
            )
        line = self.decode.solve()
        if line is not None and line[0] + line[1] > 0:
            model = dataclasses.replace(
                model, decode_base_s=line[0], decode_s_per_seq=line[1], decode_s_per_kv_token=0.0
            )
        bandwidth = self.transfer.solve()
        if bandwidth is not None:
            model = dataclasses.replace(model, transfer_bytes_per_s=bandwidth)
        return model
