from __future__ import annotations

import json

import pytest

from kvstore.errors import ErrorCode, InvalidRequestError
from kvstore.master.scheduler.api import SchedulerState, schedule_request
from kvstore.master.scheduler.cluster import ClusterConfig, ClusterState


def state() -> SchedulerState:
    cluster = ClusterState.build(ClusterConfig(num_prefill=2, num_decode=2))
    cluster.prefill[1].cache.access(("k0", "k1"))
    return SchedulerState(cluster)


def body(**overrides) -> dict:
    base = {"block_keys": ["k0", "k1", "k2"], "input_length": 1200, "output_length": 50}
    base.update(overrides)
    return {k: v for k, v in base.items() if v is not None}


def test_valid_request_returns_the_chosen_instances_as_json() -> None:
    s = state()
    answer = schedule_request(s, body())
    json.dumps(answer)  # JSON-able
    assert answer["accepted"] is True
    assert answer["prefill_instance"] == 1  # holds the first two blocks
    assert answer["local_hit_blocks"] == 2
    assert answer["decode_instance"] in (0, 1)
    assert answer["predicted_ttft_s"] > 0 and answer["predicted_tbt_s"] > 0
    assert answer["reject_reason"] is None
    # nothing was committed: asking again gives the same answer and the caches are unchanged
    assert schedule_request(s, body()) == answer
    assert len(s.cluster.prefill[0].cache) == 0


def test_overload_is_an_answer_not_an_error() -> None:
    s = state()
    for p in s.cluster.prefill:
        p.busy_until_s = 1_000.0
    answer = schedule_request(s, body(now_s=0.0))
    assert answer["accepted"] is False
    assert "TTFT" in answer["reject_reason"]
    assert answer["decode_instance"] is None and answer["prefill_instance"] is None
    assert answer["predicted_ttft_s"] > 30.0


@pytest.mark.parametrize(
    ("request_dict", "fragment"),
    [
        ([1, 2], "must be a JSON object"),
        (body(input_length=None), "missing field 'input_length'"),
        (body(block_keys=None), "missing field 'block_keys'"),
        (body(input_length=-3), "'input_length' must be >= 1"),
        (body(input_length="12"), "'input_length' must be an integer"),
        (body(output_length=0), "'output_length' must be >= 1"),
        (body(output_length=True), "'output_length' must be an integer"),
        (body(block_keys="k0"), "'block_keys' must be a list"),
        (body(block_keys=["k0", None, "k2"]), r"block_keys\[1\] must be an integer or a string"),
        (body(block_keys=["k0", -1, "k2"]), r"block_keys\[1\] must be >= 0"),
        (body(block_keys=["k0", "", "k2"]), r"block_keys\[1\] must have"),
        (body(block_keys=["k0"]), "has 1 keys but input_length 1200 needs 3 blocks"),
        (body(slo_class=7), "'slo_class' must be a string"),
        (body(slo_class="gold"), "unknown SLO class 'gold'"),
        (body(now_s="soon"), "'now_s' must be a finite number"),
        (body(now_s=float("nan")), "'now_s' must be a finite number"),
        ({**body(), "priority": 1}, "unknown field"),
    ],
)
def test_bad_input_is_a_typed_error_naming_the_field(request_dict: object, fragment: str) -> None:
    with pytest.raises(InvalidRequestError, match=fragment) as info:
        schedule_request(state(), request_dict)
    assert info.value.code == ErrorCode.INVALID_REQUEST
