"""Fakes of our own making for the master's tests."""

from __future__ import annotations


class FakeClock:
    """The service's clock: monotonic seconds when called, wall milliseconds from the same
    ``now``; tests move ``now`` by hand instead of sleeping."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def wall_ms(self) -> int:
        return int(self.now * 1000)
