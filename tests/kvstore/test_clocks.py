"""The master's clock as a node or client keeps it (kvstore.clocks), on injected clocks."""

from __future__ import annotations

from kvstore.clocks import MasterClock


class Clocks:
    def __init__(self) -> None:
        self.wall = 5_000_000  # this host's wall clock, ms: an hour and more off the master's
        self.mono = 100.0

    def wall_ms(self) -> int:
        return self.wall

    def monotonic(self) -> float:
        return self.mono


def test_the_local_wall_clock_stands_in_until_the_master_answers() -> None:
    t = Clocks()
    clock = MasterClock(t.wall_ms, t.monotonic)
    assert clock() == 5_000_000 and clock.age_s() == float("inf")
    clock.observe(None, clock.sent())  # an older master sends no clock: nothing changes
    clock.observe(True, clock.sent())
    assert clock() == 5_000_000


def test_the_masters_clock_is_carried_on_the_monotonic_clock_never_behind() -> None:
    t = Clocks()
    clock = MasterClock(t.wall_ms, t.monotonic)
    sent = clock.sent()
    t.mono += 0.2  # the round trip: the master read its clock somewhere inside it
    clock.observe(9_000_000, sent)
    assert clock() == 9_000_200  # counted from the send: at or past the master's clock
    t.mono += 10.0
    t.wall -= 3_600_000  # someone sets this host's wall clock back an hour: no matter
    assert clock() == 9_010_200 and abs(clock.age_s() - 10.2) < 1e-9
    sent = clock.sent()
    clock.observe(9_010_150, sent)  # a later answer replaces the sample
    assert clock() == 9_010_150
