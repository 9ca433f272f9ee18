"""Cache-aware scheduling (Mooncake's Conductor) and a trace-driven simulator.

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
