"""``kvstore replay``: replay a Mooncake-format trace against a live OpenAI endpoint.

Modules, each owning one thing:

* :mod:`.workload` turns trace requests into scaled requests and token-id prompts in which
  equal ``hash_ids`` are equal token prefixes.
* :mod:`.loadgen` sends them at their (scaled) arrival times, streaming, and times every token.
* :mod:`.metrics` computes percentiles, SLO attainment, goodput and hit rates.
* :mod:`.fit` fits the scheduler's cost model to a measured run and simulates the same slice.
* :mod:`.report` prints the tables and writes the PNG plots and the raw JSON.
* :mod:`.cli` is the ``kvstore replay`` subcommand.
"""

from .loadgen import RequestResult, run_replay
from .summary import ReplaySummary, summarize
from .workload import ReplayRequest, build_requests, synthesize_prompt

__all__ = [
    "ReplayRequest",
    "ReplaySummary",
    "RequestResult",
    "build_requests",
    "run_replay",
    "summarize",
    "synthesize_prompt",
]
