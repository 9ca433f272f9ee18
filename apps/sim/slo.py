"""Service-level objectives: a class of requests with TTFT and TBT targets."""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvstore.errors import InvalidRequestError


@dataclass(frozen=True, slots=True)
class SLOClass:
    """Targets a request of this class must meet to count towards goodput.

    Attributes:
        name: how requests name the class.
        ttft_s: most time to first token, seconds (> 0).
        tbt_s: most mean time between tokens after the first, seconds (> 0).

    Raises:
        InvalidRequestError: on creation, for an empty name or a target that is not a
            positive finite number.
    """

    name: str
    ttft_s: float
    tbt_s: float

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise InvalidRequestError("SLO class name must be a non-empty string")
        for label, value in (("ttft_s", self.ttft_s), ("tbt_s", self.tbt_s)):
            if (
                isinstance(value, bool)
                or not isinstance(value, int | float)
                or not math.isfinite(value)
                or value <= 0
            ):
                raise InvalidRequestError(
                    f"SLO class {self.name!r}: {label} must be > 0, got {value!r}"
                )

    def is_met(self, ttft_s: float, tbt_s: float) -> bool:
        """Whether a served request with these timings met both targets."""
        return ttft_s <= self.ttft_s and tbt_s <= self.tbt_s


#: The class trace requests get unless told otherwise. Prompts in the conversation trace reach
#: 126k tokens, ~33 s of prefill on an idle instance of the default cost model, so a TTFT target
#: of 30 s is one an idle cluster meets for all but the very longest prompts; 0.1 s per token
#: is the usual interactive TBT target.
DEFAULT_SLO = SLOClass("interactive", ttft_s=30.0, tbt_s=0.1)
