"""``SimShape`` carries the engines' sites to the P/D simulator (``prefill_sites`` /
``decode_sites``): a decode engine in another rack predicts a longer run than one on the
prefill engine's host."""

from __future__ import annotations

import pytest

from kvstore.errors import InvalidRequestError
from kvstore.replay.fit import SimShape, simulate_requests
from kvstore.routing.cost import CostModel
from kvstore.sim.default_slo import SLOClass
from kvstore.sim.trace import parse_trace_lines
from kvstore.topology import Site
from tests.sim.factories import trace_line

SLO = SLOClass("t", ttft_s=10.0, tbt_s=0.1)
SLOW_LINK = CostModel(transfer_bytes_per_s=1e9)


def _shape(decode: Site | None) -> SimShape:
    if decode is None:
        return SimShape(shared_pool=True)
    return SimShape(shared_pool=True, prefill_sites=(Site("h0", "r0"),), decode_sites=(decode,))


def test_a_decode_engine_in_another_rack_predicts_a_longer_run() -> None:
    trace = parse_trace_lines(
        [trace_line(i * 100, 3000, [i * 10 + k for k in range(6)], 21) for i in range(4)]
    )
    runs = {
        name: simulate_requests(trace, SLOW_LINK, _shape(site), SLO)
        for name, site in [
            ("none", None),
            ("same host", Site("h0", "r0")),
            ("same rack", Site("h1", "r0")),
            ("other rack", Site("h2", "r1")),
        ]
    }
    assert runs["none"] == runs["same rack"]
    assert runs["same host"].makespan_s < runs["same rack"].makespan_s
    assert runs["same rack"].makespan_s < runs["other rack"].makespan_s
    assert runs["same host"].mean_ttft_s == runs["other rack"].mean_ttft_s


def test_sites_must_number_the_engines() -> None:
    with pytest.raises(InvalidRequestError):
        SimShape(num_decode=2, decode_sites=(Site("h0"),))
