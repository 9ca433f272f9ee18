"""Client.list_keys: every stored key under a prefix, paged, against a real cluster."""

from __future__ import annotations

import pytest

from kvstore.client import Client
from kvstore.errors import InvalidRequestError


def test_list_keys_pages_through_a_prefix(cluster_factory) -> None:
    cluster = cluster_factory(num_nodes=1)
    with Client.connect(cluster.address) as c:
        keys = [f"lk/{i:03d}" for i in range(25)]
        assert c.batch_put(keys, [b"v"] * 25) == [None] * 25
        c.put("other/1", b"v")
        assert c.list_keys("lk/") == [k.encode() for k in keys]
        assert c.list_keys(b"lk/", page=4) == [k.encode() for k in keys]  # 7 pages
        assert c.list_keys("lk/01") == [f"lk/01{i}".encode() for i in range(10)]
        assert set(c.list_keys()) == {k.encode() for k in keys} | {b"other/1"}
        c.remove("lk/000")
        assert b"lk/000" not in c.list_keys("lk/")
        assert c.list_keys("none/") == []


def test_list_keys_refuses_bad_input(cluster_factory) -> None:
    cluster = cluster_factory(num_nodes=1)
    with Client.connect(cluster.address) as c:
        with pytest.raises(InvalidRequestError):
            c.list_keys(5)  # type: ignore[arg-type]
        with pytest.raises(InvalidRequestError):
            c.list_keys("x" * 600)
        for page in (0, 10_001, True):
            with pytest.raises(InvalidRequestError):
                c.list_keys("", page=page)
