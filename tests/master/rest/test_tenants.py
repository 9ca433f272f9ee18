"""The admin REST tenant routes over real HTTP on a started master: shapes, the operator's
token, and the errors (401, 404, 409, 400)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support import Daemon, start_master

SECRET = "operator-secret-for-rest-tests"


@pytest.fixture
def master(tmp_path: Path) -> Iterator[Daemon]:
    token_file = tmp_path / "token"
    token_file.write_text(SECRET + "\n")
    m = start_master("--token-file", str(token_file))
    try:
        yield m
    finally:
        m.stop()


def call(m: Daemon, method: str, path: str, body: object = None, token: str | None = SECRET):
    headers = {"Content-Type": "application/json"}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(m.field("admin") + path, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def test_shapes(master: Daemon) -> None:
    status, made = call(master, "POST", "/api/v1/tenants", {"name": "acme", "quotas": {"dram": 9}})
    assert status == 201 and set(made) == {"name", "quotas", "token", "nodes_pending"}
    assert made["name"] == "acme" and made["quotas"] == {"dram": 9}
    status, listed = call(master, "GET", "/api/v1/tenants")
    assert status == 200 and [t["name"] for t in listed["tenants"]] == ["acme"]
    assert set(listed["tenants"][0]) == {"name", "quotas", "created_ms"}
    assert made["token"] not in json.dumps(listed), "the token is shown only at create"
    status, one = call(master, "GET", "/api/v1/tenants/acme")
    assert status == 200 and one == listed["tenants"][0]
    status, changed = call(
        master, "PATCH", "/api/v1/tenants/acme", {"quotas": {"dram": None, "nvme": 5}}
    )
    assert status == 200 and changed["quotas"] == {"nvme": 5}
    status, gone = call(master, "DELETE", "/api/v1/tenants/acme")
    assert status == 200
    assert gone == {"deleted": "acme", "objects_removed": 0, "nodes_pending": []}
    assert call(master, "GET", "/api/v1/tenants")[1] == {"tenants": []}


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        ("POST", "/api/v1/tenants", {"name": "x"}),
        ("GET", "/api/v1/tenants", None),
        ("GET", "/api/v1/tenants/acme", None),
        ("PATCH", "/api/v1/tenants/acme", {"quotas": {}}),
        ("DELETE", "/api/v1/tenants/acme", None),
    ],
)
def test_operator_token_only(master: Daemon, method: str, path: str, body: object) -> None:
    _, made = call(master, "POST", "/api/v1/tenants", {"name": "acme"})
    assert call(master, method, path, body, token=None)[0] == 401
    assert call(master, method, path, body, token=made["token"])[0] == 403, "not a tenant's"
    assert call(master, "GET", "/api/v1/tenants/acme")[0] == 200, "nothing changed"


def test_errors(master: Daemon) -> None:
    assert call(master, "POST", "/api/v1/tenants", {"name": "acme"})[0] == 201
    assert call(master, "POST", "/api/v1/tenants", {"name": "acme"})[0] == 409
    for bad in (
        {"name": "Bad Name"},
        {"name": "ok", "quotas": {"ssd": 1}},
        {"name": "ok", "quotas": {"dram": -1}},
        {"name": "ok", "extra": 1},
        {},
    ):
        status, body = call(master, "POST", "/api/v1/tenants", bad)
        assert status == 400 and "error" in body, bad
    assert call(master, "PATCH", "/api/v1/tenants/acme", {"quotas": {"dram": "x"}})[0] == 400
    assert call(master, "PATCH", "/api/v1/tenants/acme", {})[0] == 400
    for method in ("GET", "DELETE"):
        assert call(master, method, "/api/v1/tenants/nobody")[0] == 404
    assert call(master, "PATCH", "/api/v1/tenants/nobody", {"quotas": {}})[0] == 404
    listed = call(master, "GET", "/api/v1/tenants")[1]["tenants"]
    assert [t["name"] for t in listed] == ["acme"] and listed[0]["quotas"] == {}


def test_no_cluster_token_no_tenants() -> None:
    m = start_master()
    try:
        status, body = call(m, "POST", "/api/v1/tenants", {"name": "acme"}, token=None)
        assert status == 400 and "cluster token" in body["error"]["message"]
    finally:
        m.stop()


def test_tenants_file_keeps_them_across_a_restart(tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text(SECRET + "\n")
    flags = ("--token-file", str(token_file), "--tenants-file", str(tmp_path / "tenants.json"))
    m = start_master(*flags)
    try:
        token = call(m, "POST", "/api/v1/tenants", {"name": "acme", "quotas": {"dram": 3}})[1]
    finally:
        m.stop()
    assert token["token"] not in (tmp_path / "tenants.json").read_text()
    m = start_master(*flags)
    try:
        assert call(m, "GET", "/api/v1/tenants/acme")[1]["quotas"] == {"dram": 3}
    finally:
        m.stop()
