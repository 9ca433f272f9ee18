"""The master's tenant book alone: changes, what it keeps (digests, never tokens), bad input."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from kvstore.errors import InvalidRequestError, KeyNotFoundError, ObjectExistsError
from kvstore.master.tenant_book import FileTenantStore, TenantBook
from kvstore.tenants import token_digest


def run(coro):
    return asyncio.run(coro)


def test_create_list_show_set_delete() -> None:
    changes: list[tuple[str, dict | None]] = []
    book = TenantBook(has_cluster_token=True, on_change=lambda n, q: changes.append((n, q)))
    v0 = book.directory.version
    acme, token = run(book.create("acme", {"dram": 20 << 30, "nvme": 200 << 30}))
    assert acme.quotas == {"dram": 20 << 30, "nvme": 200 << 30}
    assert acme.digest == token_digest(token) and len(token) >= 40
    assert book.directory.resolve(token) == "acme" and book.directory.version > v0
    bolt, token_b = run(book.create("bolt"))
    assert token_b != token and [t.name for t in book.list()] == ["acme", "bolt"]
    v1 = book.directory.version
    changed = run(book.set_quotas("acme", {"dram": 40 << 30, "nvme": None, "hbm": 1}))
    assert changed.quotas == {"dram": 40 << 30, "hbm": 1} == book.show("acme").quotas
    assert book.directory.version > v1
    run(book.delete("acme"))
    assert "acme" not in book and book.directory.resolve(token) is None
    assert book.directory.resolve(token_b) == "bolt"
    assert changes[-1] == ("acme", None) and ("acme", {"dram": 40 << 30, "hbm": 1}) in changes
    assert "token" not in json.dumps(book.show("bolt").to_json())


@pytest.mark.parametrize(
    ("name", "quotas"),
    [
        ("Acme", None),
        ("", None),
        ("a" * 33, None),
        (7, None),
        ("ok", {"ssd": 1}),
        ("ok", {"dram": -1}),
        ("ok", {"dram": True}),
        ("ok", {"dram": None}),
        ("ok", [1]),
    ],
)
def test_bad_input_is_typed_and_changes_nothing(name, quotas) -> None:
    book = TenantBook(has_cluster_token=True)
    run(book.create("acme"))
    version = book.directory.version
    with pytest.raises(InvalidRequestError):
        run(book.create(name, quotas))
    assert [t.name for t in book.list()] == ["acme"] and book.directory.version == version


def test_conflicts_and_unknowns() -> None:
    book = TenantBook(has_cluster_token=True)
    run(book.create("acme"))
    version = book.directory.version
    with pytest.raises(ObjectExistsError):
        run(book.create("acme"))
    with pytest.raises(KeyNotFoundError):
        book.show("nobody")
    with pytest.raises(KeyNotFoundError):
        run(book.set_quotas("nobody", {}))
    with pytest.raises(KeyNotFoundError):
        run(book.delete("nobody"))
    with pytest.raises(InvalidRequestError):
        run(book.set_quotas("acme", {"dram": "lots"}))
    assert book.directory.version == version


def test_no_cluster_token_no_tenants() -> None:
    book = TenantBook(has_cluster_token=False)
    with pytest.raises(InvalidRequestError, match="cluster token"):
        run(book.create("acme"))
    assert len(book) == 0


def test_file_keeps_digests_only_and_a_new_book_loads_them(tmp_path: Path) -> None:
    path = tmp_path / "tenants.json"
    book = TenantBook(has_cluster_token=True, store=FileTenantStore(path))
    _, token = run(book.create("acme", {"dram": 5}))
    run(book.create("bolt"))
    run(book.delete("bolt"))
    text = path.read_text()
    assert token not in text and token_digest(token).hex() in text
    assert not (tmp_path / "tenants.json.tmp").exists()
    again = TenantBook(has_cluster_token=True, store=FileTenantStore(path))
    assert run(again.load()) == 1
    assert again.show("acme").quotas == {"dram": 5}
    assert again.directory.resolve(token) == "acme"


def test_a_failed_write_changes_nothing(tmp_path: Path) -> None:
    book = TenantBook(has_cluster_token=True, store=FileTenantStore(tmp_path / "gone" / "t.json"))
    with pytest.raises(OSError):
        run(book.create("acme"))
    assert len(book) == 0 and book.directory.version == 0
