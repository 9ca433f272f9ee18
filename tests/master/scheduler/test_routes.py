"""POST /api/v1/schedule on a live master."""

from __future__ import annotations

import json
import urllib.error
import urllib.request


def post(url: str, body: bytes) -> tuple[int, dict]:
    req = urllib.request.Request(
        url, data=body, method="POST", headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, json.load(r)
    except urllib.error.HTTPError as e:
        return e.code, json.load(e)


def test_schedule_route_chooses_instances_and_rejects_bad_bodies(cluster_factory) -> None:
    cluster = cluster_factory(num_nodes=0)
    url = f"{cluster.admin}/api/v1/schedule"
    status, body = post(
        url,
        json.dumps({"block_keys": [1, 2, 3], "input_length": 1500, "output_length": 20}).encode(),
    )
    assert status == 200
    assert body["accepted"] is True
    assert isinstance(body["prefill_instance"], int) and isinstance(body["decode_instance"], int)
    for bad in (
        b"{not json",
        b"[]",
        json.dumps({"block_keys": [1], "input_length": 5000}).encode(),
        json.dumps({"input_length": 10}).encode(),
    ):
        status, body = post(url, bad)
        assert status == 400, body
        assert body["error"]["name"] == "INVALID_REQUEST"
