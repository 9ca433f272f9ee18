"""The tenant book's shared namespaces: share, unshare, what is kept (the tenants file, etcd)
and the directory the nodes get; bad digests are refused and change nothing."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from kvstore.errors import InvalidRequestError, KeyNotFoundError
from kvstore.master.tenant_book import FileTenantStore, TenantBook
from kvstore.tenants import TenantDirectory

DIGEST = bytes(range(16))
OTHER = bytes(range(16, 32))


def run(coro):
    return asyncio.run(coro)


def test_share_unshare_and_the_directory() -> None:
    book = TenantBook(has_cluster_token=True)
    run(book.create("acme"))
    version = book.directory.version
    assert run(book.share(DIGEST.hex())) == DIGEST
    assert run(book.share(DIGEST.hex().upper())) == DIGEST  # already shared: no change
    assert book.shared() == [DIGEST] and book.directory.shared == {DIGEST}
    assert book.directory.version > version
    node = TenantDirectory()
    assert node.take_wire(book.directory.wire()) and node.shared == {DIGEST}
    assert len(node) == 1
    run(book.unshare(DIGEST.hex()))
    assert book.shared() == [] and not book.directory.shared
    assert "shared" not in book.directory.wire()
    with pytest.raises(KeyNotFoundError):
        run(book.unshare(DIGEST.hex()))


@pytest.mark.parametrize("bad", ["", "abc", DIGEST.hex()[:-1], DIGEST.hex() + "00", "g" * 32, 7])
def test_bad_digests_change_nothing(bad: object) -> None:
    book = TenantBook(has_cluster_token=True)
    version = book.directory.version
    for change in (book.share, book.unshare):
        with pytest.raises(InvalidRequestError):
            run(change(bad))
    assert book.shared() == [] and book.directory.version == version


def test_no_cluster_token_nothing_to_share() -> None:
    book = TenantBook(has_cluster_token=False)
    with pytest.raises(InvalidRequestError, match="cluster token"):
        run(book.share(DIGEST.hex()))
    assert book.shared() == []


def test_the_tenants_file_keeps_them(tmp_path: Path) -> None:
    path = tmp_path / "tenants.json"
    book = TenantBook(has_cluster_token=True, store=FileTenantStore(path))
    run(book.load())
    run(book.create("acme"))
    run(book.share(DIGEST.hex()))
    run(book.share(OTHER.hex()))
    run(book.unshare(OTHER.hex()))
    run(book.create("bolt"))  # a tenant's change keeps the shared set too
    kept = json.loads(path.read_text())
    assert kept["shared"] == [DIGEST.hex()] and len(kept["tenants"]) == 2
    again = TenantBook(has_cluster_token=True, store=FileTenantStore(path))
    assert run(again.load()) == 2
    assert again.shared() == [DIGEST] and again.directory.shared == {DIGEST}


def test_a_file_from_before_shared_namespaces_has_none(tmp_path: Path) -> None:
    path = tmp_path / "tenants.json"
    path.write_text(json.dumps({"tenants": []}))
    book = TenantBook(has_cluster_token=True, store=FileTenantStore(path))
    assert run(book.load()) == 0 and book.shared() == []
    path.write_text(json.dumps({"tenants": [], "shared": ["nothex"]}))
    with pytest.raises(InvalidRequestError):
        run(TenantBook(has_cluster_token=True, store=FileTenantStore(path)).load())
