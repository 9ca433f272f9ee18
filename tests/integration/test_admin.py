"""The admin REST API, node REST and the cluster token against a live cluster (real processes)."""

from __future__ import annotations

import json
import socket
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvstore import protocol
from kvstore.client import Client, KVCache, Namespace
from kvstore.errors import ErrorCode, UnauthenticatedError
from tests.support import Cluster, start_master

SECRET = "admin-test-token-7f3a9c1e5b2d4f60"
WRONG = "wrong-token-00000000000000000000"


class Http:
    """Records every response body, so the test can check that no token leaked into one."""

    def __init__(self, base: str) -> None:
        self.base = base
        self.bodies: list[bytes] = []

    def __call__(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        token: str | None = None,
        raw: bytes | None = None,
    ) -> tuple[int, Any]:
        headers = {}
        data = raw
        if body is not None:
            data = json.dumps(body).encode()
        if data is not None:
            headers["Content-Type"] = "application/json"
        if token is not None:
            headers["Authorization"] = f"Bearer {token}"
        req = urllib.request.Request(self.base + path, data=data, headers=headers, method=method)
        try:
            with urllib.request.urlopen(req, timeout=10) as r:
                status, payload = r.status, r.read()
                ctype = r.headers.get("Content-Type", "")
        except urllib.error.HTTPError as exc:
            status, payload, ctype = exc.code, exc.read(), exc.headers.get("Content-Type", "")
        self.bodies.append(payload)
        if "json" in ctype:
            return status, json.loads(payload)
        return status, payload.decode()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory) -> Iterator[Cluster]:
    tmp = tmp_path_factory.mktemp("admin")
    token_file = tmp / "token"
    token_file.write_text(SECRET + "\n")
    c = Cluster(
        tmp,
        start_master("--token-file", str(token_file)),
        node_args=("--token-file", str(token_file)),
    )
    try:
        c.add_node("64MiB")
        c.add_node("64MiB")
        yield c
    finally:
        c.stop()
        logs = "".join(line for d in [c.master, *c.nodes] for line in d.lines)
        assert SECRET not in logs, "the token leaked into a log"


@pytest.fixture(scope="module")
def http(cluster: Cluster) -> Iterator[Http]:
    h = Http(cluster.admin)
    yield h
    assert not any(SECRET.encode() in b for b in h.bodies), "the token leaked into a body"


@pytest.fixture(scope="module")
def client(cluster: Cluster) -> Iterator[Client]:
    with Client.connect(cluster.address, token=SECRET) as c:
        yield c


def _error_code(payload: Any) -> int:
    assert isinstance(payload, dict) and "error" in payload, payload
    return payload["error"]["error_code"]


def test_probes_and_cluster(http: Http) -> None:
    assert http("GET", "/health") == (200, {"status": "ok"})
    status, body = http("GET", "/ready")
    assert status == 200 and body["num_nodes"] == 2
    status, body = http("GET", "/api/v1/cluster")
    assert status == 200 and body["num_nodes"] == 2
    status, body = http("GET", "/api/v1/openapi.json")
    assert status == 200 and body["openapi"].startswith("3.")


def test_ready_is_503_without_nodes(tmp_path: Path) -> None:
    master = start_master()
    try:
        status, body = Http(master.field("admin"))("GET", "/ready")
        assert status == 503 and _error_code(body) == ErrorCode.NODE_UNAVAILABLE
    finally:
        master.stop()


def test_nodes(http: Http, cluster: Cluster) -> None:
    status, body = http("GET", "/api/v1/nodes")
    assert status == 200
    ids = sorted(n["node_id"] for n in body["nodes"])
    assert len(ids) == 2
    assert all(n["capacity_bytes"] == 64 << 20 for n in body["nodes"])
    status, one = http("GET", f"/api/v1/nodes/{ids[0]}")
    assert status == 200 and one["node_id"] == ids[0]
    status, err = http("GET", "/api/v1/nodes/nope")
    assert status == 404 and _error_code(err) == ErrorCode.NODE_NOT_FOUND


def test_objects_paging_get_delete(http: Http, client: Client) -> None:
    keys = [f"page/{i:03d}" for i in range(7)] + ["other/1"]
    assert client.batch_put(keys, [b"v" * (i + 1) for i in range(len(keys))]) == [None] * 8
    seen: list[str] = []
    cursor = None
    for _ in range(10):  # bounded: 7 keys in pages of 3
        q = {"prefix": "page/", "limit": "3", **({"cursor": cursor} if cursor else {})}
        status, body = http("GET", "/api/v1/objects?" + urllib.parse.urlencode(q))
        assert status == 200
        seen += [o["key"] for o in body["objects"]]
        cursor = body["next_cursor"]
        if cursor is None:
            break
    assert seen == sorted(keys[:7])

    status, obj = http("GET", "/api/v1/objects/page/002")
    assert status == 200 and obj["size"] == 3 and obj["replicas"][0]["tier"] == "dram"
    assert http("GET", "/api/v1/objects/page/nope")[0] == 404

    # Deleting needs the token; without it (or with a wrong one) nothing changes.
    for token in (None, WRONG):
        status, err = http("DELETE", "/api/v1/objects/page/002", token=token)
        assert status == 401 and _error_code(err) == ErrorCode.UNAUTHENTICATED
    assert client.exists("page/002")
    assert http("DELETE", "/api/v1/objects/page/002", token=SECRET) == (200, {"deleted": 1})
    assert not client.exists("page/002")
    assert http("DELETE", "/api/v1/objects/page/002", token=SECRET)[0] == 404


@pytest.mark.parametrize(
    "query",
    [
        "limit=0",
        "limit=1000000",
        "limit=abc",
        "cursor=%%%",
        "cursor=not-a-cursor!",
        "cursor=Q",  # not a whole base64 group
        "cursor=" + "A" * 800,
        "cursor=QQ==",  # padded
        "prefix=" + "x" * 600,
    ],
)
def test_bad_listing_queries(http: Http, query: str) -> None:
    status, body = http("GET", "/api/v1/objects?" + query)
    assert status == 400 and _error_code(body) == ErrorCode.INVALID_REQUEST


@pytest.mark.parametrize(
    ("method", "path", "status"),
    [("GET", "/nope", 404), ("GET", "/api/v2/cluster", 404), ("PUT", "/api/v1/cluster", 405)],
)
def test_unknown_routes(http: Http, method: str, path: str, status: int) -> None:
    got, body = http(method, path, token=SECRET)
    assert got == status and _error_code(body) == ErrorCode.INVALID_REQUEST


@pytest.mark.parametrize(
    ("raw", "body"),
    [
        (b"{not json", None),
        (b"\xff\xfe", None),
        (None, [1, 2]),
        (None, {"keys": "k"}),
        (None, {"keys": [1]}),
        (None, {"keys": [""]}),
        (None, {"keys": ["a"], "prefix": "a"}),
        (None, {"prefix": ""}),
        (None, {"prefix": "a", "limit": 10**9}),
        (None, {"keys": ["k"] * 10001}),
    ],
)
def test_bad_evict_bodies_change_nothing(
    http: Http, client: Client, raw: bytes | None, body: Any
) -> None:
    client.put("keep/1", b"1")
    before = http("GET", "/api/v1/cluster")[1]["num_objects"]
    status, err = http("POST", "/api/v1/evict", body, raw=raw, token=SECRET)
    assert status == 400 and _error_code(err) == ErrorCode.INVALID_REQUEST, err
    assert http("GET", "/api/v1/cluster")[1]["num_objects"] == before
    assert client.exists("keep/1")


DEEP = b"[" * 100_000 + b"]" * 100_000
NS = {"model": "m", "num_layers": 1, "num_kv_heads": 1, "head_dim": 8, "block_size": 4}


@pytest.mark.parametrize(
    ("method", "path", "raw", "status"),
    [
        ("POST", "/api/v1/prefix/match", {"namespace": NS, "tokens": [1, [2]]}, 400),
        ("POST", "/api/v1/prefix/match", {"namespace": NS, "tokens": [[1, 2], [3, 4]]}, 400),
        ("POST", "/api/v1/prefix/match", {"namespace": NS, "tokens": ["x"]}, 400),
        ("POST", "/api/v1/prefix/match", DEEP, 400),
        ("POST", "/api/v1/prefix/match", b'{"tokens": ' + DEEP + b"}", 400),
        ("POST", "/api/v1/evict", DEEP, 400),
        ("GET", "/api/v1/objects?prefix=" + "x" * (65 << 10), None, 400),
        ("GET", "/api/v1/objects?" + "a=b&" * (40 << 10), None, 400),
    ],
    ids=[
        "ragged-tokens",
        "2-d-tokens",
        "str-tokens",
        "deep-array",
        "deep-tokens",
        "deep-evict",
        "query-over-64KiB",
        "many-params-over-64KiB",
    ],
)
def test_malformed_requests_get_typed_json_errors(
    http: Http, method: str, path: str, raw: Any, status: int
) -> None:
    """Never a 500 and never aiohttp's plain text: a 4xx with our JSON error body."""
    body = raw if isinstance(raw, dict) else None
    data = raw if isinstance(raw, bytes) else None
    got, err = http(method, path, body, raw=data, token=SECRET)
    assert got == status and _error_code(err) == ErrorCode.INVALID_REQUEST, (got, err)
    assert http("GET", "/ready")[0] == 200  # and the server keeps serving


def test_huge_body_is_413(http: Http) -> None:
    status, err = http(
        "POST", "/api/v1/evict", raw=b'{"keys": ["' + b"a" * (3 << 20) + b'"]}', token=SECRET
    )
    assert status == 413 and _error_code(err) == ErrorCode.INVALID_REQUEST


def test_evict(http: Http, client: Client) -> None:
    keys = [f"ev/{i}" for i in range(5)]
    client.batch_put(keys, [b"x"] * 5)
    status, err = http("POST", "/api/v1/evict", {"prefix": "ev/"})
    assert status == 401 and _error_code(err) == ErrorCode.UNAUTHENTICATED
    assert all(client.batch_exists(keys))
    assert http("POST", "/api/v1/evict", {"prefix": "ev/", "limit": 2}, token=SECRET) == (
        200,
        {"num_evicted": 2, "num_missing": 0},
    )
    assert client.batch_exists(keys) == [False, False, True, True, True]
    assert http("POST", "/api/v1/evict", {"keys": ["ev/4", "ev/none"]}, token=SECRET) == (
        200,
        {"num_evicted": 1, "num_missing": 1},
    )


NS = {
    "model": "tiny",
    "dtype": "float16",
    "num_layers": 2,
    "num_kv_heads": 1,
    "head_dim": 8,
    "block_size": 16,
}


def test_prefix_match_and_metrics(http: Http, client: Client) -> None:
    chain = [f"blk/{i}" for i in range(4)]
    client.batch_put(chain[:3], [b"k"] * 3)
    assert http("POST", "/api/v1/prefix/match", {"keys": chain}) == (
        200,
        {"num_matched": 3, "num_queried": 4},
    )
    assert http("POST", "/api/v1/prefix/match", {"keys": ["blk/9", *chain]})[1]["num_matched"] == 0

    # The token form asks the master's prefix index (full blocks of 16 tokens are indexed).
    tokens = np.arange(40, dtype=np.uint32)
    kv = [(np.ones((40, 1, 8), np.float16), np.ones((40, 1, 8), np.float16))] * 2
    KVCache(client, Namespace(**NS)).store(tokens, kv)
    status, match = http(
        "POST", "/api/v1/prefix/match", {"namespace": NS, "tokens": list(range(40))}
    )
    assert status == 200, match
    assert match["num_tokens"] == 32 and len(match["blocks"]) == 2
    status, miss = http(
        "POST", "/api/v1/prefix/match", {"namespace": {**NS, "salt": "other"}, "tokens": [1, 2]}
    )
    assert status == 200 and miss["num_tokens"] == 0
    for bad in [
        {"namespace": {**NS, "tp_rank": 3}, "tokens": [1]},
        {"namespace": NS, "tokens": [-1]},
        {"namespace": NS, "tokens": [True]},
        {"namespace": {**NS, "model": "\ud800"}, "tokens": [1]},
        {"namespace": NS},
        {"keys": ["a"], "tokens": [1]},
    ]:
        status, err = http("POST", "/api/v1/prefix/match", bad)
        assert status == 400 and _error_code(err) == ErrorCode.INVALID_REQUEST, (bad, err)

    client.batch_get(["blk/0", "blk/missing"])
    status, text = http("GET", "/metrics")
    assert status == 200
    for needle in [
        'kvstore_requests_total{code="OK",verb="put_start"}',
        'kvstore_request_duration_seconds_bucket{le="+Inf",verb="get_locations"}',
        'kvstore_tier_used_bytes{tier="dram"}',
        'kvstore_tier_capacity_bytes{tier="dram"} 1.34217728e+08',
        'kvstore_tier_lookups_total{result="hit",tier="dram"}',
        'kvstore_tier_lookups_total{result="miss",tier="none"}',
        'kvstore_tier_evictions_total{tier="dram"}',
        "kvstore_nodes_alive 2.0",
        "kvstore_prefix_chain_queried_keys_total 9.0",
        "kvstore_prefix_chain_matched_keys_total 3.0",
        "kvstore_prefix_index_blocks 2.0",
        "kvstore_leases_held",
        "kvstore_pins_held",
        "kvstore_replication_backlog",
    ]:
        assert needle in text, needle
    ratio = next(
        float(line.split()[1])
        for line in text.splitlines()
        if line.startswith("kvstore_prefix_match_hit_ratio ")
    )
    assert 0 < ratio <= 1


def test_node_rest(cluster: Cluster, client: Client) -> None:
    client.put("node-rest/1", b"abc")
    node_http = Http(cluster.nodes[0].field("admin"))
    status, body = node_http("GET", "/health")
    assert status == 200 and body["node_id"].startswith("node-")
    status, text = node_http("GET", "/metrics")
    assert status == 200 and "kvstore_node_writes_total" in text
    assert 'kvstore_node_segment_capacity_bytes{segment="dram",tier="dram"}' in text
    # A node's own process sets the daemons' collector policy (kvstore/gc_policy.py): start-up
    # frozen out of the full collections' way, the collections' pauses recorded.
    frozen = next(
        float(line.split()[1])
        for line in text.splitlines()
        if line.startswith("kvstore_gc_frozen_objects ")
    )
    assert frozen > 1000, "the node's start-up was not frozen"
    assert 'kvstore_gc_collections_total{generation="2"}' in text
    assert node_http("GET", "/nope")[0] == 404
    assert node_http("POST", "/metrics", {})[0] == 405


def _raw_exchange(address: str, frames: list[bytes]) -> tuple[list[int], bool]:
    """Send frames on a fresh connection; the codes of the replies and whether it was closed."""
    host, port = address.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=10)
    fs = protocol.FramedSocket(sock)
    codes = []
    try:
        for frame in frames:
            fs.send_frame(frame)
            codes.append(fs.read_response()[0].code)
        sock.settimeout(5)
        try:
            closed = sock.recv(1) == b""
        except (ConnectionError, TimeoutError):
            closed = isinstance(sock, socket.socket)
        return codes, closed
    finally:
        sock.close()


@pytest.mark.parametrize("plane", ["control", "data"])
def test_connections_without_the_token_are_refused(cluster: Cluster, plane: str) -> None:
    address = cluster.address if plane == "control" else cluster.nodes[0].field("data")
    ping = protocol.encode_request(1, "ping", {})
    codes, closed = _raw_exchange(address, [ping])
    assert codes == [ErrorCode.UNAUTHENTICATED] and closed
    codes, closed = _raw_exchange(address, [protocol.encode_request(1, "hello", {"token": WRONG})])
    assert codes == [ErrorCode.UNAUTHENTICATED] and closed
    hello = protocol.encode_request(1, "hello", {"token": SECRET})
    host, port = address.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=10)
    try:
        fs = protocol.FramedSocket(sock)
        fs.send_frame(hello)
        assert fs.read_response()[0].code == 0
        fs.send_frame(ping)
        assert fs.read_response()[0].code == 0
    finally:
        sock.close()


def test_client_without_token_is_refused(cluster: Cluster, monkeypatch) -> None:
    monkeypatch.delenv("KVSTORE_TOKEN", raising=False)
    monkeypatch.delenv("KVSTORE_TOKEN_FILE", raising=False)
    with pytest.raises(UnauthenticatedError) as exc:
        Client.connect(cluster.address)
    assert SECRET not in str(exc.value)
    with pytest.raises(UnauthenticatedError):
        Client.connect(cluster.address, token=WRONG)
    monkeypatch.setenv("KVSTORE_TOKEN", SECRET)
    with Client.connect(cluster.address) as c:
        assert c.stats()["num_nodes"] == 2


def test_private_reads(tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text(SECRET)
    flags = ("--token-file", str(token_file), "--no-public-reads")
    cluster = Cluster(tmp_path, start_master(*flags), node_args=flags)
    master = cluster.master
    try:
        node = cluster.add_node("16MiB")
        node_http = Http(node.field("admin"))
        assert node_http("GET", "/health")[0] == 200
        status, body = node_http("GET", "/metrics")
        assert status == 401 and _error_code(body) == ErrorCode.UNAUTHENTICATED
        assert node_http("GET", "/metrics", token=SECRET)[0] == 200
        http = Http(master.field("admin"))
        assert http("GET", "/health")[0] == 200
        assert http("GET", "/")[0] == 200  # the page asks for the token itself
        for path in ["/api/v1/cluster", "/metrics", "/api/v1/objects", "/api/v1/nodes"]:
            status, body = http("GET", path)
            assert status == 401 and _error_code(body) == ErrorCode.UNAUTHENTICATED
            assert http("GET", path, token=SECRET)[0] == 200
        assert http("POST", "/api/v1/prefix/match", {"keys": ["a"]})[0] == 401
        assert not any(SECRET.encode() in b for b in http.bodies + node_http.bodies)
    finally:
        cluster.stop()
    assert SECRET not in "".join(master.lines + node.lines)


def test_token_is_not_on_any_command_line(cluster: Cluster) -> None:
    for daemon in [cluster.master, *cluster.nodes]:
        cmdline = Path(f"/proc/{daemon.pid}/cmdline")
        if cmdline.exists():
            assert SECRET.encode() not in cmdline.read_bytes()
