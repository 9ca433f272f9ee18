"""The P/D simulator prices the prefill-to-decode handoff by the distance between the two
instances' sites (``ClusterConfig.prefill_sites`` / ``decode_sites``), with the live router's
factors (:data:`kvstore.routing.policy.HANDOFF_SCALE`); without sites it is what it was."""

from __future__ import annotations

import numpy as np
import pytest

from kvstore.errors import InvalidRequestError
from kvstore.routing.cost import CostModel
from kvstore.routing.policy import HANDOFF_SCALE
from kvstore.sim.cluster import ClusterConfig
from kvstore.sim.scheduler import SchedulerConfig
from kvstore.sim.simulator import SimConfig, simulate
from kvstore.sim.trace import parse_trace_lines
from kvstore.topology import FAR, SAME_HOST, SAME_RACK, SAME_ZONE, Site

from .factories import synthetic_trace, trace_line

#: A handoff slower than the prefill it streams behind (1 GB/s: one rack uplink of the test
#: bed), so that its distance shows in the time between tokens.
SLOW_LINK = CostModel(transfer_bytes_per_s=1e9)
PREFILL_SITE = Site("h0", "r0", "z0")
DECODE_AT = {
    "same host": Site("h0", "r0", "z0"),
    "same rack": Site("h1", "r0", "z0"),
    "other rack": Site("h2", "r1", "z0"),
    "other zone": Site("h3", "r2", "z1"),
}


def _pd(decode: Site | None, cost: CostModel = SLOW_LINK) -> ClusterConfig:
    sites = {} if decode is None else {"prefill_sites": (PREFILL_SITE,), "decode_sites": (decode,)}
    return ClusterConfig(num_prefill=1, num_decode=1, cost=cost, **sites)


@pytest.mark.parametrize(
    ("where", "factor"),
    [
        ("same host", HANDOFF_SCALE[SAME_HOST]),
        ("same rack", 1.0),
        ("other rack", HANDOFF_SCALE[SAME_ZONE] / HANDOFF_SCALE[SAME_RACK]),
        ("other zone", HANDOFF_SCALE[FAR] / HANDOFF_SCALE[SAME_RACK]),
    ],
)
def test_the_handoff_scale_is_the_router_s_factor_for_the_distance(where, factor) -> None:
    assert _pd(DECODE_AT[where]).handoff_scale(0, 0) == pytest.approx(factor)


def test_no_sites_no_scale() -> None:
    assert _pd(None).handoff_scale(0, 0) == 1.0
    half = ClusterConfig(num_prefill=1, num_decode=1, prefill_sites=(PREFILL_SITE,))
    assert half.handoff_scale(0, 0) == 1.0


def test_sites_must_number_the_instances() -> None:
    with pytest.raises(InvalidRequestError):
        ClusterConfig(num_prefill=2, num_decode=1, prefill_sites=(PREFILL_SITE,))
    with pytest.raises(InvalidRequestError):
        ClusterConfig(num_prefill=1, num_decode=1, decode_sites=())


def test_decode_in_another_rack_predicts_a_longer_tbt_than_on_the_prefill_s_host() -> None:
    requests = parse_trace_lines([trace_line(0, 3000, list(range(6)), output_length=101)])
    tbt, ttft = {}, {}
    for where, site in DECODE_AT.items():
        result = simulate(requests, SimConfig(cluster=_pd(site), router="round-robin"))
        tbt[where], ttft[where] = float(result.tbt_s[0]), float(result.ttft_s[0])
    assert tbt["same host"] < tbt["same rack"] < tbt["other rack"] < tbt["other zone"], tbt
    # The first token comes out of prefill: the handoff delays the tokens after it only.
    assert len(set(ttft.values())) == 1, ttft
    # by hand: the decode joins when the slower of prefill and the scaled transfer ends
    prefill = SLOW_LINK.prefill_s(3000, 0)
    step = SLOW_LINK.decode_step_s(1, 3000 + 50)
    join = max(prefill, SLOW_LINK.transfer_s(3000) * HANDOFF_SCALE[SAME_ZONE])
    assert tbt["other rack"] == pytest.approx((join - prefill + 100 * step) / 100)


def test_without_sites_or_within_one_rack_the_run_is_unchanged() -> None:
    requests = synthetic_trace(7, 200, block_size=512, gap_ms=20)
    base = ClusterConfig(num_prefill=2, num_decode=2, cost=SLOW_LINK)
    one_rack = ClusterConfig(
        num_prefill=2,
        num_decode=2,
        cost=SLOW_LINK,
        prefill_sites=(Site("p0", "r"), Site("p1", "r")),
        decode_sites=(Site("d0", "r"), Site("d1", "r")),
    )
    runs = [
        simulate(requests, SimConfig(cluster=c, scheduler=SchedulerConfig(early_rejection=False)))
        for c in (base, one_rack)
    ]
    for name in ("ttft_s", "tbt_s", "decode_ids", "prefill_ids"):
        np.testing.assert_array_equal(getattr(runs[0], name), getattr(runs[1], name), name)
