"""The tenant book's shared prefixes: share (its full blocks), the same again, unshare, the
limits, what is kept in the tenants file, and the directory a node gets (the blocks' keys, and a
malformed one refused whole); plus the prefix index's rule: a tenant's match counts a shared
range another tenant stored, and never that tenant's blocks after it."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest

from kvstore.errors import InvalidRequestError, KeyNotFoundError, ObjectExistsError
from kvstore.keys import Namespace, block_keys
from kvstore.kvblocks import kv_object_key, kv_object_keys
from kvstore.master import tenant_book
from kvstore.master.prefix import PrefixIndex
from kvstore.master.tenant_book import FileTenantStore, TenantBook
from kvstore.tenants import SharedPrefix, TenantDirectory, tenant_key

NS = Namespace(model="m", dtype="float16", num_layers=1, num_kv_heads=1, head_dim=4, block_size=4)
SYSTEM = np.arange(100, 111)  # two full blocks and three tokens


def run(coro):
    return asyncio.run(coro)


def test_share_the_same_again_unshare_and_the_directory() -> None:
    book = TenantBook(has_cluster_token=True)
    prefix = run(book.share_prefix("system", NS.to_dict(), SYSTEM.tolist()))
    assert prefix.num_blocks == 2 and prefix.tokens.tolist() == SYSTEM[:8].tolist()
    assert prefix.keys[0].startswith(b"kv/" + NS.digest.hex().encode() + b"/")
    version = book.directory.version
    assert run(book.share_prefix("system", NS, SYSTEM[:9])) is prefix  # same blocks: no change
    assert book.directory.version == version
    with pytest.raises(ObjectExistsError):
        run(book.share_prefix("system", NS, SYSTEM + 1))
    assert book.directory.shared_keys == set(prefix.keys)
    assert book.directory.prefixes_of(NS.digest) == (prefix,)
    node = TenantDirectory()
    assert node.take_wire(book.directory.wire())
    assert node.shared_keys == set(prefix.keys) and node.is_shared_key(prefix.keys[1])
    assert not node.is_shared_key(prefix.keys[1][:-1] + b"0")
    assert node.prefixes_of(NS.digest) == ()  # a node holds the keys only
    assert run(book.unshare_prefix("system")) is prefix
    assert book.prefixes() == [] and "shared_keys" not in book.directory.wire()
    with pytest.raises(KeyNotFoundError):
        run(book.unshare_prefix("system"))


@pytest.mark.parametrize(
    "name, namespace, tokens",
    [
        ("Bad Name", NS.to_dict(), SYSTEM.tolist()),
        ("ok", {"model": "m"}, SYSTEM.tolist()),
        ("ok", NS.to_dict(), [1, 2, 3]),  # no full block
        ("ok", NS.to_dict(), [1, 2, 3, -4]),
        ("ok", NS.to_dict(), "1 2 3 4"),
        ("ok", NS.to_dict(), None),
    ],
)
def test_bad_prefixes_change_nothing(name: str, namespace: object, tokens: object) -> None:
    book = TenantBook(has_cluster_token=True)
    version = book.directory.version
    with pytest.raises(InvalidRequestError):
        run(book.share_prefix(name, namespace, tokens))
    assert book.prefixes() == [] and book.directory.version == version


def test_the_limits(monkeypatch) -> None:
    book = TenantBook(has_cluster_token=True)
    monkeypatch.setattr(tenant_book, "MAX_PREFIXES", 2)
    monkeypatch.setattr(tenant_book, "MAX_SHARED_PREFIX_BLOCKS", 5)
    run(book.share_prefix("one", NS, np.arange(8)))
    with pytest.raises(InvalidRequestError, match="5 blocks in all"):
        run(book.share_prefix("two", NS, np.arange(50, 66)))
    run(book.share_prefix("two", NS, np.arange(50, 62)))
    with pytest.raises(InvalidRequestError, match="at most 2"):
        run(book.share_prefix("three", NS, np.arange(90, 94)))
    assert [p.name for p in book.prefixes()] == ["one", "two"]
    with pytest.raises(InvalidRequestError, match="cluster token"):
        run(TenantBook(has_cluster_token=False).share_prefix("one", NS, np.arange(8)))


def test_the_tenants_file_keeps_them(tmp_path: Path) -> None:
    path = tmp_path / "tenants.json"
    book = TenantBook(has_cluster_token=True, store=FileTenantStore(path))
    run(book.create("acme"))
    run(book.share_prefix("system", NS, SYSTEM))
    run(book.share(bytes(16).hex()))
    again = TenantBook(has_cluster_token=True, store=FileTenantStore(path))
    assert run(again.load()) == 1
    [kept] = again.prefixes()
    assert kept.keys == book.prefixes()[0].keys and kept.namespace == NS
    assert again.directory.shared_keys == set(kept.keys) and again.shared() == [bytes(16)]


def test_a_malformed_wire_changes_nothing() -> None:
    node = TenantDirectory()
    good = TenantDirectory(version=5, prefixes=[SharedPrefix.make("s", NS, SYSTEM)]).wire()
    for bad in ([b"not-a-kv-key"], "x", [kv_object_key(NS.digest, bytes(16))[:-1]]):
        with pytest.raises(InvalidRequestError):
            node.take_wire({**good, "shared_keys": bad})
        assert node.version == 0 and not node.shared_keys


def _committed(keys: set[bytes]):
    return keys.__contains__


def test_a_tenants_match_counts_a_shared_range_another_stored() -> None:
    index = PrefixIndex()
    prefix = SharedPrefix.make("system", NS, SYSTEM)
    index.directory = TenantDirectory(version=1, prefixes=[prefix])
    prompt_a = np.concatenate([SYSTEM[:8], np.arange(500, 508)])
    # What A stored: the shared blocks as named, its own two after them under its tenant.
    stored = set(prefix.keys)
    own = kv_object_keys(NS.digest, block_keys(NS, prompt_a))[2:]
    stored |= {tenant_key("acme", k) for k in own}
    assert index.index(NS, prompt_a, _committed(stored), "acme") == 4
    # B's tree holds nothing, yet B hits the two shared blocks; never A's two after them.
    hit_b = index.match(NS, prompt_a, _committed(stored), "bolt")
    assert hit_b.num_tokens == 8 and [k for k, _ in hit_b.blocks] == list(prefix.keys)
    assert index.match(NS, prompt_a, _committed(stored), "acme").num_tokens == 16
    # A shared block gone: B misses from it on; A's tree forgets it (and what follows).
    stored.discard(prefix.keys[1])
    assert index.match(NS, prompt_a, _committed(stored), "bolt").num_tokens == 4
    assert index.forget(prefix.keys[1]) == 3  # A's tree: the block and A's two after it
    assert index.match(NS, prompt_a, _committed(stored), "acme").num_tokens == 4
