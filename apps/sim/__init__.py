"""The offline simulator: cache-aware scheduling (Mooncake's Conductor) replayed over traces.

Why a package of its own, beside the router (:mod:`kvstore.router`) and the trace replayer
(:mod:`kvstore.replay`) rather than inside the master: nothing here runs in a master or touches the
data plane. It replays Mooncake-format traces through cost models, block caches and routers for
what-ifs at scales one machine cannot run (``python -m kvstore.sim TRACE``,
``bench/bench_scheduler.py``). The routing vocabulary it shares with the live router (cost model,
SLO classes, the router's policies) is :mod:`kvstore.routing`; the replayer also reads its
:class:`TraceRequest`. It imports only the core's errors and :mod:`kvstore.routing`: never
:mod:`kvstore.master`, :mod:`kvstore.client` or the router, so the replayer may import it, not
the reverse.

Modules, each owning one thing:

* :mod:`.trace` loads and validates Mooncake-format traces.
* :mod:`.slo` holds the default SLO class of trace requests.
* :mod:`.policies` holds block caches and eviction policies (LRU, LFU, length-aware) by name.
* :mod:`.replay` measures hit rates of one pool or of per-instance caches.
* :mod:`.cluster` is the state the scheduler reads.
* :mod:`.scheduler` holds the routers: the conductor and the baselines.
* :mod:`.simulator` is the discrete-event simulator (P/D: FIFO prefill, separate decode).
* :mod:`.engine` is a vLLM ``kv_both`` engine: continuous batching, step by step.
* :mod:`.kvboth` simulates such engines behind the live router's policies
  (:mod:`kvstore.routing.policy`, driven on the simulator's clock).
* :mod:`.report` turns results into tables and PNG plots.
"""

from .default_slo import DEFAULT_SLO
from .trace import TraceFormatError, TraceRequest, load_trace, parse_trace_lines

__all__ = [
    "DEFAULT_SLO",
    "TraceFormatError",
    "TraceRequest",
    "load_trace",
    "parse_trace_lines",
]
