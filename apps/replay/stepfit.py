"""Fit the ``kv_both`` engine model's step costs to a measured run.

The engine model (:mod:`kvstore.sim.engine`) says a step takes ``step_base_s +
decode_s_per_seq * decoding + prefill_s_per_token * prefill tokens``, and that a request
reaches its engine ``request_overhead_s`` after it was sent. A streamed run shows the steps
from outside: each engine emits one token per running sequence per step, so on one engine

* every gap between two tokens of a request is one step. Which requests it holds follows from
  their token times on that engine (the known concurrency): those that had their first token
  by the gap's start and their last at or after its end decoded in it; those whose first token
  came at its end (within ``tolerance_s``) had their prompt prefilled in it (their uncached
  tokens: prompt less the tokens the endpoint says were cached, else the trace's ideal);
* the TTFT of a request sent to an engine with nothing in flight is the overhead plus one step
  of its own prefill (and of any prompt whose first token came with it).

One least-squares fit over both kinds of rows gives the four coefficients, all kept
non-negative (every subset of them is tried and the best non-negative fit kept: exact
non-negative least squares for four unknowns). A busy run has few requests that found their
engine idle, typically the first ones, whose prefill also pays an engine's first-use costs:
with fewer than ``min_ttft_rows`` of them the TTFT rows are left out and the overhead is 0
(plain least squares, the mean, since the mean step is what queues and throughput follow). Requests of an unknown engine form one group.
The pool's load cost is not fitted (the run does not say which cached tokens came from the
pool and which from the engine's own cache): it stays at the ``load_s_per_token`` given.
"""

from __future__ import annotations

import itertools
import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvstore.errors import InvalidRequestError
from kvstore.sim.engine import StepCost

from .fit import uncached_tokens
from .loadgen import RequestResult

#: Token times closer than this are taken as the same step's end (stream jitter).
DEFAULT_TOLERANCE_S = 0.005

#: Fewest TTFTs on idle engines that the overhead is fitted from.
DEFAULT_MIN_TTFT_ROWS = 5

#: Smallest base a fitted step is given (the model refuses a step that takes no time).
_MIN_S = 1e-6


@dataclass(frozen=True, slots=True)
class StepFit:
    """The fitted step cost and what it rests on.

    Attributes:
        cost: the step cost.
        num_gap_rows: inter-token gaps used.
        num_ttft_rows: TTFTs on idle engines used.
        rmse: root mean squared residual, seconds.
    """

    cost: StepCost
    num_gap_rows: int
    num_ttft_rows: int
    rmse: float


def nonnegative_lstsq(a: np.ndarray, y: np.ndarray) -> np.ndarray:
    """``argmin |a x - y|`` over ``x >= 0``, by trying every subset of columns.

    Args:
        a: the design matrix (rows x k, k small: 2**k subsets are solved).
        y: the measurements.

    Returns:
        ``x`` (zeros for no rows).
    """
    k = a.shape[1]
    best = np.zeros(k)
    best_sse = float(np.sum(y**2))
    for size in range(1, k + 1):
        for columns in itertools.combinations(range(k), size):
            sub = a[:, columns]
            coef, *_ = np.linalg.lstsq(sub, y, rcond=None)
            if np.any(coef < 0):
                continue
            x = np.zeros(k)
            x[list(columns)] = coef
            sse = float(np.sum((y - a @ x) ** 2))
            if sse < best_sse - 1e-18:
                best, best_sse = x, sse
    return best


def step_rows(
    results: Sequence[RequestResult], tolerance_s: float = DEFAULT_TOLERANCE_S
) -> tuple[np.ndarray, np.ndarray, int]:
    """The fit's rows: ``[1 step, decoding, prefill tokens, overhead]`` and the seconds each took.

    Args:
        results: served requests with at least one token each.
        tolerance_s: token times this close count as one step's end.

    Returns:
        ``(design, seconds, num_gap_rows)``; the gap rows come first, then the TTFT rows.
    """
    groups: dict[str | None, list[RequestResult]] = defaultdict(list)
    for r in results:
        groups[r.engine].append(r)
    gaps: list[tuple[list[float], float]] = []
    ttfts: list[tuple[list[float], float]] = []
    eps = tolerance_s
    for group in groups.values():
        firsts = [r.sent_s + r.token_times_s[0] for r in group]
        lasts = [r.sent_s + r.token_times_s[-1] for r in group]
        own = [uncached_tokens(r) for r in group]
        for r in group:
            times = [r.sent_s + t for t in r.token_times_s]
            for a, b in itertools.pairwise(times):
                if b - a <= eps:
                    continue  # tokens delivered together: not a step of their own
                decoding = sum(
                    f <= a + eps and last >= b - eps for f, last in zip(firsts, lasts, strict=True)
                )
                prefill = sum(n for f, n in zip(firsts, own, strict=True) if a + eps < f <= b + eps)
                gaps.append(([1.0, float(decoding), float(prefill), 0.0], b - a))
        for i, r in enumerate(group):
            busy = any(
                j != i and o.sent_s <= r.sent_s and lasts[j] >= r.sent_s
                for j, o in enumerate(group)
            )
            if busy:
                continue
            together = sum(
                n
                for f, o, n in zip(firsts, group, own, strict=True)
                if abs(f - firsts[i]) <= eps and o.sent_s <= firsts[i]
            )
            ttfts.append(([1.0, 0.0, float(together), 1.0], r.token_times_s[0]))
    rows = gaps + ttfts
    design = np.array([x for x, _ in rows], dtype=float).reshape(len(rows), 4)
    seconds = np.array([y for _, y in rows], dtype=float)
    return design, seconds, len(gaps)


def fit_step_model(
    results: Sequence[RequestResult],
    tolerance_s: float = DEFAULT_TOLERANCE_S,
    load_s_per_token: float = 0.0,
    min_ttft_rows: int = DEFAULT_MIN_TTFT_ROWS,
) -> StepFit:
    """Fit :class:`StepCost` to a run (see the module docstring).

    Args:
        results: the run's results (only served ones are used).
        tolerance_s: token times this close count as one step's end.
        load_s_per_token: the pool's load cost per token (not fitted).
        min_ttft_rows: fewest idle-engine TTFTs to fit the overhead from (else it is 0).

    Returns:
        The fit.

    Raises:
        InvalidRequestError: when no request was served.
    """
    ok = [r for r in results if r.outcome == "ok" and r.token_times_s]
    if not ok:
        raise InvalidRequestError("no request was served: nothing to fit")
    design, seconds, num_gaps = step_rows(ok, tolerance_s)
    if seconds.size - num_gaps < min_ttft_rows:
        design, seconds = design[:num_gaps], seconds[:num_gaps]
    base, per_seq, per_token, overhead = nonnegative_lstsq(design, seconds)
    residual = seconds - design @ np.array([base, per_seq, per_token, overhead])
    rmse = float(np.sqrt(np.mean(residual**2))) if seconds.size else math.nan
    cost = StepCost(
        step_base_s=max(float(base), _MIN_S),
        decode_s_per_seq=float(per_seq),
        prefill_s_per_token=float(per_token),
        load_s_per_token=load_s_per_token,
        request_overhead_s=float(overhead),
    )
    return StepFit(cost, num_gaps, int(seconds.size) - num_gaps, rmse)
