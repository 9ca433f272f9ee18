"""Master metrics: recorded at the RPC edge, read from the service at scrape time, one registry
per master (several in one process)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from kvstore import protocol
from kvstore.errors import InvalidRequestError
from kvstore.master.metrics import MasterMetrics
from kvstore.master.rest.history import History
from kvstore.master.rest.routes import decode_cursor, encode_cursor
from kvstore.master.server import dispatch
from kvstore.master.service import MasterService, ServiceSlot
from kvstore.types import SegmentSpec


def _service() -> MasterService:
    svc = MasterService()
    svc.register("n1", "127.0.0.1", 9001, b"a" * 32, [SegmentSpec("dram", "dram", 1 << 20)])
    return svc


def _samples(metrics: MasterMetrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = metrics.exposition().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def _call(svc: MasterService, metrics: MasterMetrics, verb: str, **args: object) -> object:
    frame = dispatch(svc, protocol.Request(1, verb, dict(args)), metrics)
    return protocol.decode_response(frame[protocol.HEADER_SIZE :])


def test_edge_records_verbs_codes_latency_and_lookups() -> None:
    svc = _service()
    metrics = MasterMetrics(ServiceSlot(svc))
    ticket = _call(svc, metrics, "put_start", keys=[b"a"], sizes=[100]).result[0][1]
    _call(svc, metrics, "put_end", put_ids=[ticket[0]], checksums=[7])
    _call(svc, metrics, "get_locations", keys=[b"a", b"b", b"c"])
    _call(svc, metrics, "no_such_verb")
    _call(svc, metrics, "put_start", keys="not a list", sizes=[])
    got = _samples(metrics)
    assert got[("kvstore_requests_total", (("code", "OK"), ("verb", "put_start")))] == 1
    assert got[("kvstore_requests_total", (("code", "UNKNOWN_VERB"), ("verb", "unknown")))] == 1
    assert (
        got[("kvstore_requests_total", (("code", "INVALID_REQUEST"), ("verb", "put_start")))] == 1
    )
    assert got[("kvstore_request_duration_seconds_count", (("verb", "get_locations"),))] == 1
    assert got[("kvstore_tier_lookups_total", (("result", "hit"), ("tier", "dram")))] == 1
    assert got[("kvstore_tier_lookups_total", (("result", "miss"), ("tier", "none")))] == 2
    assert got[("kvstore_tier_objects", (("tier", "dram"),))] == 1
    assert got[("kvstore_tier_capacity_bytes", (("tier", "dram"),))] == 1 << 20
    assert got[("kvstore_tier_used_bytes", (("tier", "dram"),))] >= 100
    assert got[("kvstore_nodes_alive", ())] == 1
    assert got[("kvstore_objects", ())] == 1
    assert (metrics.num_hits, metrics.num_misses) == (1, 2)


def test_registries_are_per_master() -> None:
    a, b = MasterMetrics(ServiceSlot(_service())), MasterMetrics(ServiceSlot(_service()))
    a.record_prefix_match(3, 4)
    assert _samples(a)[("kvstore_prefix_chain_matched_keys_total", ())] == 3
    assert _samples(b)[("kvstore_prefix_chain_matched_keys_total", ())] == 0


def test_prefix_hit_ratio_comes_from_the_index() -> None:
    svc = _service()
    svc.prefix.num_query_tokens, svc.prefix.num_hit_tokens = 10, 4
    assert _samples(MasterMetrics(ServiceSlot(svc)))[("kvstore_prefix_match_hit_ratio", ())] == 0.4


def test_optional_figures_come_from_stats() -> None:
    svc = _service()
    stats = svc.stats

    def more() -> dict[str, object]:
        return {
            **stats(),
            "num_pinned": 5,
            "tiers": {"dram": {"num_evictions": 9, "num_replicas": 7}},
            "eviction": {"num_demotions": 3, "num_evictions": 4, "policy": "lru"},
            "replication": {"num_under_replicated": 2, "num_copies_in_flight": 1},
        }

    svc.stats = more  # type: ignore[method-assign]
    got = _samples(MasterMetrics(ServiceSlot(svc)))
    assert got[("kvstore_pins_held", ())] == 5
    assert got[("kvstore_tier_objects", (("tier", "dram"),))] == 7
    assert got[("kvstore_leases_held", ())] == 0
    assert got[("kvstore_tier_evictions_total", (("tier", "dram"),))] == 9
    assert got[("kvstore_tier_demotions_total", (("tier", "dram"),))] == 0
    assert got[("kvstore_demotions_total", ())] == 3
    assert got[("kvstore_evictions_total", ())] == 4
    assert got[("kvstore_promotions_total", ())] == 0
    assert got[("kvstore_replication_backlog", ())] == 2
    assert got[("kvstore_replication_copies_in_flight", ())] == 1


def test_history_keeps_a_window() -> None:
    n = iter(range(100))
    h = History(lambda: {"x": next(n)}, interval_s=2, window_s=10, wall=lambda: 5.0)
    for _ in range(12):
        h.take()
    assert [s["x"] for s in h.to_json()["samples"]] == list(range(7, 12))


@given(st.binary(min_size=1, max_size=511))
def test_cursors_round_trip(key: bytes) -> None:
    assert decode_cursor(encode_cursor(key)) == key


@pytest.mark.parametrize("bad", ["", "Q", "QQ==", "a+b/", "A" * 700, "é"])
def test_bad_cursors(bad: str) -> None:
    with pytest.raises(InvalidRequestError):
        decode_cursor(bad)


def test_lookup_counters_carry_on_across_a_new_term() -> None:
    """An HA master that leads again starts a fresh service (counts from zero): the counters go on,
    and the request that follows is still answered (a failing counter once broke the edge)."""
    slot = ServiceSlot(_service())
    svc = slot.service
    metrics = MasterMetrics(slot)
    ticket = _call(svc, metrics, "put_start", keys=[b"a"], sizes=[100]).result[0][1]
    _call(svc, metrics, "put_end", put_ids=[ticket[0]], checksums=[7])
    _call(svc, metrics, "get_locations", keys=[b"a", b"a", b"b"])
    svc = slot.next_term()
    svc.register("n1", "127.0.0.1", 9001, b"a" * 32, [SegmentSpec("dram", "dram", 1 << 20)])
    ticket = _call(svc, metrics, "put_start", keys=[b"c"], sizes=[100]).result[0][1]
    _call(svc, metrics, "put_end", put_ids=[ticket[0]], checksums=[7])
    reply = _call(svc, metrics, "get_locations", keys=[b"c", b"d"])
    assert reply.code == 0 and len(reply.result) == 2
    got = _samples(metrics)
    assert got[("kvstore_tier_lookups_total", (("result", "hit"), ("tier", "dram")))] == 3
    assert got[("kvstore_tier_lookups_total", (("result", "miss"), ("tier", "none")))] == 2
    assert (metrics.num_hits, metrics.num_misses) == (3, 2)
