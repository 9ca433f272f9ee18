"""A client's blanks on their own (``kvstore.client.blanks``): what a put takes, what a commit
asks for, and what is given back; over a master's answers of the test's making."""

from __future__ import annotations

from kvstore import grants
from kvstore.client.blanks import DEPTH, MAX_SIZES, Blanks
from kvstore.errors import ForbiddenError, NoSpaceError
from kvstore.placement import Homes
from kvstore.types import result_to_wire


class Clock:
    def __init__(self) -> None:
        self.ms = 1_000_000

    def __call__(self) -> int:
        return self.ms


def _answer(node_ids: list[str], size: int, expires_ms: int, first_id: int = 1) -> list[object]:
    """A master's ``blanks`` answer: one blank of ``size`` on each of ``node_ids``."""
    return [
        [
            first_id + i,
            [
                n,
                "127.0.0.1",
                9000,
                grants.sign_wire(
                    b"s" * 32, grants.OP_WRITE, grants.BLANK_KEY, "dram", i * size, size, expires_ms
                ),
            ],
        ]
        for i, n in enumerate(node_ids)
    ]


def test_a_put_takes_a_blank_of_its_size_on_its_home_and_none_past_half_its_life() -> None:
    clock = Clock()
    blanks = Blanks(clock)
    assert blanks.wanted(4096) is None, "a size put once: none yet"
    assert blanks.wanted(4096) == {"size": 4096, "count": DEPTH}, "put again: on every node"
    assert blanks.take(4096, b"k", None) is None
    expires = clock.ms + 30_000
    blanks.add(4096, {"size": 4096, "count": DEPTH}, _answer(["a", "b", "a"], 4096, expires), 3)
    home = Homes(["a", "b"]).home(b"k")
    blank = blanks.take(4096, b"k", None)
    assert blank is not None and blank.location.node_id == home and blank.epoch == 3
    assert blanks.take(1000, b"k", None) is None, "another size has none"
    assert blanks.take(4096, b"k", "c") is None, "none on the home one-hop reads name"
    # Past half its life: not written into (the master takes it back at its expiry).
    clock.ms += 15_000
    assert blanks.take(4096, b"k", "a") is None and blanks.take(4096, b"k", "b") is None


def test_commits_ask_for_the_nodes_that_run_low_and_all_nodes_now_and_then() -> None:
    clock = Clock()
    blanks = Blanks(clock)
    blanks.add(100, {"size": 100, "count": 2}, _answer(["a", "a", "b"], 100, clock.ms + 30_000), 1)
    assert blanks.wanted(100) == {"size": 100, "nodes": [["b", DEPTH - 1]]}
    assert blanks.wanted(1 << 20) is None, "large objects are put the usual way"
    clock.ms += 10_000
    assert blanks.wanted(100) == {"size": 100, "count": DEPTH}


def test_sizes_held_are_bounded_and_another_term_drops_every_blank() -> None:
    clock = Clock()
    blanks = Blanks(clock)
    for size in range(1, MAX_SIZES + 2):
        blanks.add(size, {"size": size, "count": 1}, _answer(["a"], size, clock.ms + 30_000), 1)
    assert blanks.take(1, b"k", "a") is None, "the oldest size went"
    assert [b.put_id for b in blanks.take_dropped()] == [1], "to be given back"
    assert blanks.take_dropped() == []
    assert len(blanks.take_all()) == MAX_SIZES and blanks.take_all() == []
    blanks.add(7, {"size": 7, "count": 1}, _answer(["a"], 7, clock.ms + 30_000), 1)
    blanks.add(8, {"size": 8, "count": 1}, _answer(["a"], 8, clock.ms + 30_000, 9), 2)
    assert [b.put_id for b in blanks.take_all()] == [9], "the first term's blank is gone"


def test_a_node_that_failed_a_write_and_a_refusal_are_remembered() -> None:
    clock = Clock()
    blanks = Blanks(clock)
    blanks.add(5, {"size": 5, "count": 1}, _answer(["a", "b"], 5, clock.ms + 30_000), 1)
    blanks.forget_node("a")
    assert blanks.take(5, b"k", "a") is None and blanks.take(5, b"k", "b") is not None
    blanks.add(5, {"size": 5, "count": 1}, result_to_wire(NoSpaceError("full")), 1)
    assert blanks.enabled, "no room now is no refusal"
    blanks.add(5, {"size": 5, "count": 1}, result_to_wire(ForbiddenError("a tenant")), 1)
    assert not blanks.enabled and blanks.wanted(5) is None


def test_a_workload_of_ever_new_sizes_asks_for_no_blanks() -> None:
    blanks = Blanks(Clock())
    assert all(blanks.wanted(size) is None for size in range(1, 1000))
    assert blanks.wanted(999) is not None, "a size put again while remembered"
    assert blanks.wanted(1) is None, "long forgotten"
