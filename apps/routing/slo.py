"""Service-level objectives: a class of requests with TTFT and TBT targets (the router's
classes and the simulator's goodput are both judged by one)."""

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
