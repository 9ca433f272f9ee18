"""The routing vocabulary: cost terms, SLO classes and the routing policies.

One package that the live router (:mod:`kvstore.router`) runs on polled engine load and the
simulator of ``kv_both`` engines (:mod:`kvstore.sim.kvboth`) runs on its virtual clock, so that
what the simulator predicts is what the router would do. No I/O and no clock of its own; it
imports only the core's errors, never the router or the simulator (they import it).

Modules, each owning one thing:

* :mod:`.cost`: :class:`~.cost.CostModel` (prefill, decode step, transfer) and the
  :class:`~.cost.CostTerms` an estimate reads.
* :mod:`.slo`: :class:`~.slo.SLOClass`, a class's TTFT and TBT targets.
* :mod:`.policy`: the TTFT estimate, the watermarks, the policies by name
  (:data:`~.policy.POLICIES`) and :func:`~.policy.choose`, with early rejection.
"""
