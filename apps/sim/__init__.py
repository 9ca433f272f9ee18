"""The offline simulator: cache-aware scheduling (Mooncake's Conductor) replayed over traces.

Why a package of its own, beside the router (:mod:`kvstore.router`) and the trace replayer
(:mod:`kvstore.replay`) rather than inside the master: nothing here runs in a master or touches the
data plane. It replays Mooncake-format traces through cost models, block caches and routers for
what-ifs at scales one machine cannot run (``python -m kvstore.sim TRACE``,
``bench/bench_scheduler.py``), and lends the live router and the replayer their shared vocabulary
(:class:`CostModel`, :class:`SLOClass`, :class:`TraceRequest`). It imports only the core's errors:
never :mod:`kvstore.master`, :mod:`kvstore.client` or the router, so the router and the replayer
may import it, not the reverse.

Modules, each owning one thing:

* :mod:`.trace` loads and validates Mooncake-format traces.
* :mod:`.cost` is the cost model (prefill, decode step, transfer).
* :mod:`.slo` holds SLO classes.
* :mod:`.policies` holds block caches and eviction policies (LRU, LFU, length-aware) by name.
* :mod:`.replay` measures hit rates of one pool or of per-instance caches.
* :mod:`.cluster` is the state the scheduler reads.
* :mod:`.scheduler` holds the routers: the conductor and the baselines.
* :mod:`.simulator` is the discrete-event simulator (P/D: FIFO prefill, separate decode).
* :mod:`.engine` is a vLLM ``kv_both`` engine: continuous batching, step by step.
* :mod:`.kvboth` simulates such engines behind the live router's policies.
* :mod:`.report` turns results into tables and PNG plots.
"""

from .cost import CostModel
from .slo import DEFAULT_SLO, SLOClass
from .trace import TraceFormatError, TraceRequest, load_trace, parse_trace_lines

__all__ = [
    "DEFAULT_SLO",
    "CostModel",
    "SLOClass",
    "TraceFormatError",
    "TraceRequest",
    "load_trace",
    "parse_trace_lines",
]
