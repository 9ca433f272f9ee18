"""The routing choice on fake engine loads (no engines, no clock)."""

from __future__ import annotations

import dataclasses

import pytest

from kvstore.routing.cost import CostModel
from kvstore.routing.policy import (
    DEFAULT_POLICY,
    POLICIES,
    EngineView,
    RequestShape,
    choose,
    estimate_ttft,
    handoff_penalty_s,
    kv_room,
    predicted_tbt,
    watermark_state,
)
from kvstore.routing.slo import SLOClass
from kvstore.topology import Site

COST = CostModel(
    block_size_tokens=32,
    prefill_base_s=0.05,
    prefill_s_per_token=1e-3,
    prefill_s_per_token_pair=0.0,
    decode_base_s=0.04,
    decode_s_per_seq=0.01,
    decode_s_per_kv_token=0.0,
    kv_bytes_per_token=1000,
    transfer_bytes_per_s=1e6,  # 1 ms per token: transfers are visible
    transfer_latency_s=0.0,
)
LOOSE = SLOClass("loose", ttft_s=100.0, tbt_s=10.0)


def view(name: str, **kw: object) -> EngineView:
    base = dict(
        name=name,
        healthy=True,
        num_running=0,
        num_waiting=0,
        kv_usage=0.0,
        kv_capacity_tokens=10_000,
        router_inflight=0,
        router_prefill_s=0.0,
        router_reserved_tokens=0,
        above_high=False,
        cost=COST,
    )
    base.update(kw)
    return EngineView(**base)  # type: ignore[arg-type]


def shape(prompt: int = 1000, cached: int = 0, out: int = 100) -> RequestShape:
    return RequestShape(prompt, cached, out)


def test_ttft_is_queue_or_transfer_then_prefill_of_the_uncached_tokens() -> None:
    e = estimate_ttft(view("a", router_prefill_s=2.0), shape(1000, 640), handoff=False)
    assert e.prefill_s == pytest.approx(0.05 + 360e-3)
    assert e.transfer_s == pytest.approx(0.640)
    assert e.queue_s == 2.0
    assert e.ttft_s == pytest.approx(2.0 + 0.41)  # the transfer overlaps the wait
    idle = estimate_ttft(view("a"), shape(1000, 640), handoff=True)
    assert idle.ttft_s == pytest.approx(0.640 + 0.41 + 1.0)  # + the decode engine's load


def test_a_kv_both_engine_whose_slots_are_taken_costs_the_wait_for_one() -> None:
    # 4 slots, all held and one more request queued: two answers of 100 tokens must finish
    # first, a quarter of a full batch's decode (0.04 + 4 x 0.01 a step) each.
    full = view("a", slots=4, router_inflight=4, router_queued=1)
    e = estimate_ttft(full, shape(1000, 0, out=100), handoff=False)
    assert e.queue_s == pytest.approx(2 * 100 * 0.08 / 4)
    free = view("b", slots=4, router_inflight=3)
    assert estimate_ttft(free, shape(1000, 0, out=100), handoff=False).queue_s == 0.0
    choice = choose(shape(1000, 0, out=100), LOOSE, [full, free], None)
    assert choice.prefill is not None and choice.prefill.engine == "b"  # not the first by name
    # P/D: the prefill step holds its slot only for the prefill (already in the queue term).
    assert estimate_ttft(full, shape(1000, 0, out=100), handoff=True).queue_s == 0.0


def test_every_token_cached_still_computes_the_last_one() -> None:
    assert shape(64, 64).uncached_tokens == 1


@pytest.mark.parametrize(
    ("loads", "cached", "want"),
    [
        # Idle engines: the one with less queued work wins.
        ({"a": {"router_prefill_s": 1.0}, "b": {}}, 0, "b"),
        # The engine's own waiting requests count as queued prefills like this one.
        ({"a": {"num_waiting": 3}, "b": {"router_prefill_s": 0.5}}, 0, "b"),
        # An unhealthy engine is never chosen, whatever its load.
        ({"a": {"healthy": False}, "b": {"router_prefill_s": 5.0}}, 0, "b"),
        # Ties go by name (deterministic).
        ({"b": {}, "a": {}}, 0, "a"),
    ],
)
def test_prefill_is_the_smallest_predicted_ttft(
    loads: dict[str, dict[str, object]], cached: int, want: str
) -> None:
    prefill = [view(name, **kw) for name, kw in loads.items()]
    choice = choose(shape(1000, cached), LOOSE, prefill, [view("d")])
    assert choice.accepted and choice.prefill is not None
    assert choice.prefill.engine == want and choice.decode == "d"


def test_cached_tokens_shrink_the_prediction() -> None:
    cold = choose(shape(2000, 0), LOOSE, [view("p")], [view("d")])
    warm = choose(shape(2000, 1984), LOOSE, [view("p")], [view("d")])
    assert cold.prefill is not None and warm.prefill is not None
    assert warm.prefill.prefill_s < cold.prefill.prefill_s / 10


@pytest.mark.parametrize(
    ("above", "usage", "want"),
    [
        (False, 0.95, True),  # crossed high
        (False, 0.8, False),  # between, was fine: stays fine
        (True, 0.8, True),  # between, was full: stays full (hysteresis)
        (True, 0.6, False),  # under low: takes requests again
    ],
)
def test_watermark_hysteresis(above: bool, usage: float, want: bool) -> None:
    assert watermark_state(above, usage, high=0.9, low=0.7) is want


def test_decode_choice_keeps_under_the_high_watermark_then_picks_the_fastest_step() -> None:
    busy = view("busy", num_running=8, kv_usage=0.1)
    full = view("full", kv_usage=0.85)  # 0.85 + 1100/10000 > 0.9
    tripped = view("tripped", kv_usage=0.5, above_high=True)
    idle = view("idle", num_running=1, kv_usage=0.2)
    request = shape(1000, 0, 100)
    assert not kv_room(full, request, 0.9) and not kv_room(tripped, request, 0.9)
    assert kv_room(busy, request, 0.9)
    choice = choose(request, LOOSE, [view("p")], [full, busy, tripped, idle])
    assert choice.decode == "idle"
    assert choice.predicted_tbt_s == pytest.approx(predicted_tbt(idle, request))
    # Reservations the router already made there count against the room.
    crowded = dataclasses.replace(idle, router_reserved_tokens=7000)
    assert choose(request, LOOSE, [view("p")], [crowded, busy]).decode == "busy"


def test_no_decode_room_is_an_early_rejection_unless_disabled() -> None:
    full = [view("d1", kv_usage=0.95), view("d2", above_high=True)]
    choice = choose(shape(), LOOSE, [view("p")], full)
    assert not choice.accepted and "room" in (choice.reason or "")
    assert choose(shape(), LOOSE, [view("p")], full, early_rejection=False).accepted


def test_an_impossible_ttft_is_rejected_with_a_retry_hint() -> None:
    tight = SLOClass("tight", ttft_s=0.3, tbt_s=1.0)
    choice = choose(shape(1000), tight, [view("p", router_prefill_s=4.2)], [view("d")])
    assert not choice.accepted and "TTFT" in (choice.reason or "")
    assert choice.retry_after_s == 5  # the queue ahead drains in ~4.2 s
    assert choose(shape(1000), tight, [view("p")], [view("d")], early_rejection=False).accepted


def test_tbt_rejection_only_on_a_measured_decode_fit() -> None:
    tight = SLOClass("tight", ttft_s=100.0, tbt_s=0.01)
    assert choose(shape(), tight, [view("p")], [view("d")]).accepted  # prior only: admitted
    fitted = choose(shape(), tight, [view("p")], [view("d", decode_fitted=True)])
    assert not fitted.accepted and "TBT" in (fitted.reason or "")


def test_fallbacks_by_choice_when_a_role_has_no_healthy_engine() -> None:
    no_decode = choose(shape(), LOOSE, [view("p")], [view("d", healthy=False)])
    assert no_decode.accepted and no_decode.decode is None  # p does the whole request
    assert no_decode.prefill is not None and no_decode.prefill.handoff_s == 0
    no_prefill = choose(shape(), LOOSE, [view("p", healthy=False)], [view("d")])
    assert no_prefill.accepted and no_prefill.prefill is not None
    assert no_prefill.prefill.engine == "d" and no_prefill.decode is None
    nothing = choose(shape(), LOOSE, [view("p", healthy=False)], [view("d", healthy=False)])
    assert not nothing.accepted and nothing.reason == "no engine is healthy"


def test_kv_both_choice_is_one_engine_by_ttft_with_room() -> None:
    engines = [view("a", kv_usage=0.95), view("b", router_prefill_s=0.5), view("c", num_waiting=9)]
    choice = choose(shape(1000, 960), LOOSE, engines, None)
    assert choice.accepted and choice.prefill is not None
    assert choice.prefill.engine == "b" and choice.decode is None
    assert choice.prefill.transfer_s == pytest.approx(0.96)  # cached tokens come from the pool


# ---------------------------------------------------------------- baselines (--policy)
def test_round_robin_cycles_over_healthy_engines_blind_to_caches_and_load() -> None:
    rr = POLICIES["round-robin"]()
    # b holds the whole prefix in its own cache and a is busy: round robin does not care.
    engines = [view("b", local_cached_tokens=960), view("a", num_waiting=5), view("c")]
    picked = [choose(shape(), LOOSE, engines, None, policy=rr) for _ in range(6)]
    assert [c.prefill.engine for c in picked if c.prefill] == ["a", "b", "c", "a", "b", "c"]
    # An engine going down is skipped; the cycle goes on over the others.
    down = [view("a"), view("b", healthy=False), view("c")]
    names = [choose(shape(), LOOSE, down, None, policy=rr).prefill.engine for _ in range(4)]  # type: ignore[union-attr]
    assert sorted(names) == ["a", "a", "c", "c"]


@pytest.mark.parametrize(
    ("loads", "want"),
    [
        # Running + waiting from the engine's /metrics decides...
        ({"a": {"num_running": 2, "num_waiting": 1}, "b": {"num_running": 2}}, "b"),
        # ...blind to caches: b holds the prefix, a is emptier.
        ({"a": {}, "b": {"num_running": 1, "local_cached_tokens": 960}}, "a"),
        # A tie goes to fewer of the router's own requests in flight there.
        ({"a": {"num_running": 1, "router_inflight": 2}, "b": {"num_waiting": 1}}, "b"),
        # Then by name.
        ({"b": {}, "a": {}}, "a"),
        # An unhealthy engine is never chosen.
        ({"a": {"healthy": False}, "b": {"num_running": 4}}, "b"),
    ],
)
def test_least_loaded_picks_by_live_load(loads: dict[str, dict[str, object]], want: str) -> None:
    engines = [view(name, **kw) for name, kw in loads.items()]
    got = choose(shape(), LOOSE, engines, None, policy=POLICIES["least-loaded"]())
    assert got.accepted and got.prefill is not None and got.prefill.engine == want


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_admission_is_the_same_rule_for_every_policy(name: str) -> None:
    tight = SLOClass("tight", ttft_s=0.5, tbt_s=10.0)
    # Both engines are predicted past the target: every policy rejects, with the same reason.
    busy = [view("a", router_prefill_s=2.0), view("b", router_prefill_s=3.0)]
    got = choose(shape(), tight, busy, None, policy=POLICIES[name]())
    assert not got.accepted and got.reason is not None and got.reason.startswith("predicted TTFT")
    # No room for the KV anywhere: rejected whatever the policy.
    full = [view("a", kv_usage=0.95), view("b", kv_usage=0.95)]
    got = choose(shape(), LOOSE, full, None, policy=POLICIES[name]())
    assert not got.accepted and got.reason == "no engine has room for the KV"
    # Within the target: accepted, and the estimate is the chosen engine's.
    idle = [view("a"), view("b")]
    got = choose(shape(), LOOSE, idle, None, policy=POLICIES[name]())
    assert got.accepted and got.prefill is not None and got.prefill.ttft_s < LOOSE.ttft_s


def test_cache_aware_is_the_default_policy() -> None:
    engines = [view("a", num_waiting=2), view("b", local_cached_tokens=960)]
    default = choose(shape(), LOOSE, engines, None)
    explicit = choose(shape(), LOOSE, engines, None, policy=POLICIES[DEFAULT_POLICY]())
    assert default == explicit and default.prefill is not None and default.prefill.engine == "b"


def test_the_decode_choice_counts_the_handoff_s_distance_from_the_prefill_engine() -> None:
    p = view("p", site=Site("h1", "r1"))
    # d-far is a little less loaded (a smaller TBT) but in another rack; d-near shares the
    # prefill's host. Transfers of 1000 tokens take 1 s here (1 ms a token).
    far = view("d-far", site=Site("h9", "r2"))
    near = view("d-near", site=Site("h1", "r1"), num_running=1)
    assert handoff_penalty_s(p.site, far, shape()) == pytest.approx(1.0)  # one more transfer
    assert handoff_penalty_s(p.site, near, shape()) == pytest.approx(-0.96)
    assert choose(shape(), LOOSE, [p], [far, near]).decode == "d-near"
    # Without sites (or all in one rack) the least loaded decode engine wins as before.
    bare = [dataclasses.replace(v, site=None) for v in (far, near)]
    assert choose(shape(), LOOSE, [p], bare).decode == "d-far"
    one_rack = [
        dataclasses.replace(far, site=Site("h8", "r1")),
        dataclasses.replace(near, site=Site("h7", "r1")),
    ]
    assert choose(shape(), LOOSE, [p], one_rack).decode == "d-far"
