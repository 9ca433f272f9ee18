"""The simulator's default SLO class (the class itself is :class:`kvstore.routing.slo.SLOClass`)."""

from __future__ import annotations

from kvstore.routing.slo import SLOClass

#: The class trace requests get unless told otherwise. Prompts in the conversation trace reach
#: 126k tokens, ~33 s of prefill on an idle instance of the default cost model, so a TTFT target
#: of 30 s is one an idle cluster meets for all but the very longest prompts; 0.1 s per token
#: is the usual interactive TBT target.
DEFAULT_SLO = SLOClass("interactive", ttft_s=30.0, tbt_s=0.1)
