"""The admin API's routes (``master/rest/routes.py``) over real HTTP, on a started master
process with a storage node: readiness, metrics, history, nodes, objects (paging, one, delete),
prefix match and evict; bad input is a typed 4xx that changes nothing."""

from __future__ import annotations

import json
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import xxhash

from kvstore.client import Client
from kvstore.errors import ErrorCode
from tests.support import Cluster, start_master, wait_until

Http = Callable[..., tuple[int, Any]]


def _http(base: str) -> Http:
    def call(method: str, path: str, body: Any = None, *, raw: bytes | None = None) -> Any:
        data = raw if body is None else json.dumps(body).encode()
        headers = {"Content-Type": "application/json"} if data is not None else {}
        req = urllib.request.Request(base + path, data=data, headers=headers, method=method)
        try:
            with urllib.request.urlopen(req, timeout=10) as r:
                status, payload, ctype = r.status, r.read(), r.headers.get("Content-Type", "")
        except urllib.error.HTTPError as exc:
            status, payload, ctype = exc.code, exc.read(), exc.headers.get("Content-Type", "")
        return status, json.loads(payload) if "json" in ctype else payload.decode()

    return call


def _code(reply: tuple[int, Any]) -> tuple[int, int]:
    """(HTTP status, the body's error code) of an error reply."""
    status, body = reply
    assert isinstance(body, dict) and "error" in body, reply
    return status, body["error"]["error_code"]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    c = Cluster(tmp_path_factory.mktemp("routes"), start_master())
    try:
        c.add_node("64MiB")
        yield c
    finally:
        c.stop()


@pytest.fixture(scope="module")
def http(cluster: Cluster) -> Http:
    return _http(cluster.admin)


@pytest.fixture(scope="module")
def client(cluster: Cluster) -> Iterator[Client]:
    with Client.connect(cluster.address) as c:
        yield c


def _num_objects(http: Http) -> int:
    return http("GET", "/api/v1/cluster")[1]["num_objects"]


# ------------------------------------------------------------------ probes, metrics, history
def test_ready_is_503_until_a_node_registers(cluster_factory: Callable[..., Cluster]) -> None:
    c = cluster_factory(num_nodes=0)
    http = _http(c.admin)
    assert _code(http("GET", "/ready")) == (503, ErrorCode.NODE_UNAVAILABLE)
    c.add_node("64MiB")
    wait_until(lambda: http("GET", "/ready")[0] == 200, timeout=30, what="the master ready")
    assert http("GET", "/ready") == (200, {"status": "ready", "num_nodes": 1})


def test_metrics_are_prometheus_text_and_history_is_json(http: Http, client: Client) -> None:
    client.batch_put(["metrics/0"], [b"m"])
    status, text = http("GET", "/metrics")
    assert status == 200 and 'kvstore_requests_total{code="OK",verb="put_start"}' in text
    status, history = http("GET", "/api/v1/history")
    assert status == 200 and isinstance(history, dict)


# ------------------------------------------------------------------ nodes
def test_nodes_list_each_node_as_its_own_route_does(http: Http) -> None:
    status, body = http("GET", "/api/v1/nodes")
    assert status == 200 and len(body["nodes"]) == 1
    listed = body["nodes"][0]
    assert listed["state"] == "active"
    assert listed["capacity_bytes"] == 64 << 20
    assert listed["capacity_bytes"] == sum(s["capacity_bytes"] for s in listed["segments"])
    status, one = http("GET", "/api/v1/nodes/" + urllib.parse.quote(listed["node_id"]))
    assert status == 200
    assert {k: v for k, v in one.items() if k != "last_heartbeat_s_ago"} == {
        k: v for k, v in listed.items() if k != "last_heartbeat_s_ago"
    }
    assert _code(http("GET", "/api/v1/nodes/nope")) == (404, ErrorCode.NODE_NOT_FOUND)


# ------------------------------------------------------------------ objects
def test_objects_page_by_cursor_through_every_key_of_a_prefix(http: Http, client: Client) -> None:
    keys = [f"paged/{i:03d}" for i in range(23)]
    client.batch_put(keys, [b"p" * (i + 1) for i in range(23)])
    client.batch_put(["pagedX"], [b"x"])  # outside the prefix "paged/"
    seen: list[str] = []
    query: dict[str, Any] = {"prefix": "paged/", "limit": 5}
    for _ in range(10):  # bounded: 23 keys are 5 pages
        status, body = http("GET", "/api/v1/objects?" + urllib.parse.urlencode(query))
        assert status == 200 and len(body["objects"]) <= 5
        seen += [o["key"] for o in body["objects"]]
        if body["next_cursor"] is None:
            break
        query["cursor"] = body["next_cursor"]
    assert seen == keys


@pytest.mark.parametrize(
    "query",
    ["limit=0", "limit=1001", "limit=x", "cursor=%21%21", "cursor=", "prefix=" + "p" * 600],
)
def test_bad_listing_queries_are_400(http: Http, query: str) -> None:
    assert _code(http("GET", "/api/v1/objects?" + query)) == (400, ErrorCode.INVALID_REQUEST)


def test_one_object_and_its_delete(http: Http, client: Client) -> None:
    data = b"one object's bytes"
    client.batch_put(["obj/one"], [data])
    status, obj = http("GET", "/api/v1/objects/obj/one")
    assert status == 200
    assert (obj["key"], obj["key_hex"], obj["size"]) == ("obj/one", b"obj/one".hex(), len(data))
    assert obj["checksum"] == f"{xxhash.xxh3_64_intdigest(data):016x}"
    assert [(r["tier"], r["state"]) for r in obj["replicas"]] == [("dram", "complete")]
    assert _code(http("GET", "/api/v1/objects/obj/none")) == (404, ErrorCode.KEY_NOT_FOUND)
    assert http("DELETE", "/api/v1/objects/obj/one") == (200, {"deleted": 1})
    assert client.batch_exists(["obj/one"]) == [False]
    assert _code(http("DELETE", "/api/v1/objects/obj/one")) == (404, ErrorCode.KEY_NOT_FOUND)


# ------------------------------------------------------------------ prefix match, evict
def test_prefix_match_counts_the_leading_stored_keys(http: Http, client: Client) -> None:
    chain = [f"chain/{i}" for i in range(4)]
    client.batch_put(chain[:2], [b"c", b"c"])
    assert http("POST", "/api/v1/prefix/match", {"keys": chain}) == (
        200,
        {"num_matched": 2, "num_queried": 4},
    )
    assert http("POST", "/api/v1/prefix/match", {"keys": ["chain/9", *chain]})[1] == {
        "num_matched": 0,
        "num_queried": 5,
    }
    assert _code(http("POST", "/api/v1/prefix/match", {"keys": ["a"], "tokens": [1]})) == (
        400,
        ErrorCode.INVALID_REQUEST,
    )


def test_evict_by_keys_and_by_prefix_with_a_limit(http: Http, client: Client) -> None:
    keys = [f"evict/{i}" for i in range(5)]
    client.batch_put(keys, [b"e"] * 5)
    assert http("POST", "/api/v1/evict", {"prefix": "evict/", "limit": 2}) == (
        200,
        {"num_evicted": 2, "num_missing": 0},
    )
    assert client.batch_exists(keys) == [False, False, True, True, True]
    assert http("POST", "/api/v1/evict", {"keys": ["evict/4", "evict/none"]}) == (
        200,
        {"num_evicted": 1, "num_missing": 1},
    )
    assert client.batch_exists(keys) == [False, False, True, True, False]


@pytest.mark.parametrize(
    ("body", "raw"),
    [
        ({}, None),
        ({"keys": ["bad/0"], "prefix": "bad/"}, None),
        ({"keys": "bad/0"}, None),
        ({"keys": [1]}, None),
        ({"prefix": ""}, None),
        ({"prefix": 3}, None),
        ({"prefix": "bad/", "limit": 0}, None),
        ({"prefix": "bad/", "limit": True}, None),
        ({"keys": ["bad/0"], "limit": 1}, None),
        ({"keys": ["bad/0"], "what": 1}, None),
        ({"keys": [f"k{i}" for i in range(10_001)]}, None),
        (None, b"not json"),
        (None, b'["bad/0"]'),
    ],
)
def test_bad_evict_bodies_are_400_and_change_nothing(
    http: Http, client: Client, body: Any, raw: bytes | None
) -> None:
    client.batch_put(["bad/0"], [b"b"])
    before = _num_objects(http)
    assert _code(http("POST", "/api/v1/evict", body, raw=raw)) == (400, ErrorCode.INVALID_REQUEST)
    assert _num_objects(http) == before and client.batch_exists(["bad/0"]) == [True]
