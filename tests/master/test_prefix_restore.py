"""Rebuilding the prefix index after a failover (kvstore.master.prefix_restore): prompt metas
read from a real data server with grants the master signs, kept only when intact, and the
backlog of metas not yet indexed."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import xxhash

from kvstore import auth, grants, protocol
from kvstore.keys import Namespace, block_keys
from kvstore.kvblocks import encode_prompt_meta, kv_meta_key, kv_object_keys
from kvstore.master.prefix import PrefixIndex
from kvstore.master.prefix_restore import PromptMetaBacklog, fetch_objects, is_prompt_meta
from kvstore.master.service import MasterService
from kvstore.node.arena import ShmArena
from kvstore.node.server import DataServer
from kvstore.stored_object import StoredObject
from kvstore.tenants import tenant_key
from kvstore.types import Location, ObjectInfo, PutTicket
from tests.master.test_tiering import MIB, FakeClock, make

TOKEN = "prefix-restore-test-token-0123"
NS = Namespace(model="m", dtype="float16", num_layers=2, num_kv_heads=2, head_dim=8, block_size=4)


@pytest.fixture(params=[None, TOKEN], ids=["open", "token"])
def token(request: pytest.FixtureRequest) -> auth.Token | None:
    return None if request.param is None else auth.Token(request.param)


@pytest.fixture
def server(tmp_path: Path, token: auth.Token | None) -> Iterator[DataServer]:
    arena = ShmArena(tmp_path / "arena", 1 << 16, prefault=False)
    srv = DataServer({"dram": arena}, grants.new_secret(), token=token)
    srv.start()
    yield srv
    srv.stop()
    arena.close()


def store(server: DataServer, key: bytes, offset: int, data: bytes) -> ObjectInfo:
    """Put ``data`` on the node and return the master's answer for it (with a read grant)."""
    checksum = xxhash.xxh3_64_intdigest(data)
    obj = StoredObject("dram", offset, key, len(data), checksum, 1)
    assert server.store_objects("dram", [(obj, memoryview(data))]) == [None]
    return info_for(server, key, offset, len(data), checksum)


def info_for(
    server: DataServer,
    key: bytes,
    offset: int,
    size: int,
    checksum: int,
    *,
    secret: bytes | None = None,
    expires_ms: int | None = None,
    port: int | None = None,
) -> ObjectInfo:
    expires = expires_ms if expires_ms is not None else int(time.time() * 1000) + 60_000
    grant = grants.sign(secret or server.secret, grants.OP_READ, key, "dram", offset, size, expires)
    loc = Location("n1", server.host, port or server.port, grant)
    return ObjectInfo(size, checksum, [loc])


def meta(tokens: list[int]) -> bytes:
    return encode_prompt_meta(NS.to_dict(), np.array(tokens, dtype=np.uint32))


def test_intact_objects_are_read(server: DataServer, token: auth.Token | None) -> None:
    a, b = meta([1, 2, 3, 4]), meta([9] * 8)
    infos = [(b"kvmeta/a", store(server, b"kvmeta/a", 0, a))]
    infos.append((b"kvmeta/b", store(server, b"kvmeta/b", 4096, b)))
    assert fetch_objects(infos, token) == {b"kvmeta/a": a, b"kvmeta/b": b}


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_what_cannot_be_read_intact_is_left_out(
    server: DataServer, token: auth.Token | None
) -> None:
    good = meta([5, 6, 7, 8])
    good_info = store(server, b"good", 0, good)
    other = store(server, b"other", 4096, b"other bytes")
    ck = other.checksum
    infos = [
        (b"checksum", info_for(server, b"other", 4096, 11, ck ^ 1)),  # bytes do not match
        (b"forged", info_for(server, b"other", 4096, 11, ck, secret=b"f" * 32)),
        (b"expired", info_for(server, b"other", 4096, 11, ck, expires_ms=1)),
        (b"gone", info_for(server, b"other", 4096, 11, ck, port=_closed_port())),
        (b"good", good_info),  # still read after all the failures before it
    ]
    assert fetch_objects(infos, token) == {b"good": good}


def test_a_node_that_wants_a_token_gives_nothing_without_it(tmp_path: Path) -> None:
    arena = ShmArena(tmp_path / "arena", 1 << 16, prefault=False)
    srv = DataServer({"dram": arena}, grants.new_secret(), token=auth.Token(TOKEN))
    srv.start()
    try:
        info = store(srv, b"k", 0, meta([1, 2, 3, 4]))
        assert fetch_objects([(b"k", info)], None) == {}
        assert fetch_objects([(b"k", info)], auth.Token(TOKEN)) != {}
    finally:
        srv.stop()
        arena.close()


@pytest.mark.parametrize("reply", [7, [], [7], [[]], None], ids=repr)
def test_a_node_answering_a_read_out_of_shape_is_left_out_and_the_rest_read(
    server: DataServer, token: auth.Token | None, reply: object, tmp_path: Path
) -> None:
    """A node that answers ``read`` with a result of the wrong shape costs its own object, not
    the batch (the keys of a batch leave the backlog before the fetch, so an escaping error would
    lose every one of them)."""
    good = meta([1, 2, 3, 4])
    good_info = store(server, b"good", 0, good)
    arena = ShmArena(tmp_path / "odd-arena", 1 << 16, prefault=False)
    odd = DataServer({"dram": arena}, grants.new_secret(), token=token)

    def out_of_shape(fs: protocol.FramedSocket, req: protocol.Request, *_: object) -> None:
        fs.send_frame(protocol.encode_response(req.req_id, reply))

    odd.register_verb("read", out_of_shape)
    odd.start()
    try:
        odd_info = info_for(odd, b"odd", 0, 4, 1)
        assert fetch_objects([(b"odd", odd_info), (b"good", good_info)], token) == {b"good": good}
    finally:
        odd.stop()
        arena.close()


# ---------------------------------------------------------------- the backlog
def test_the_backlog_decodes_what_was_fetched() -> None:
    backlog = PromptMetaBacklog()
    assert not backlog
    backlog.to_fetch.update({b"a", b"b", b"c"})
    assert backlog
    backlog.add_fetched({b"a": meta([1, 2, 3, 4, 5]), b"b": b"\xc1 not msgpack"})
    assert backlog.to_fetch == {b"c"}, "fetched, whether good or bad, is not fetched again"
    assert set(backlog.incomplete) == {b"a"}, "a bad meta is dropped"
    namespace, tokens = backlog.incomplete[b"a"]
    assert namespace == NS and tokens.tolist() == [1, 2, 3, 4, 5]


@pytest.mark.parametrize(
    "raw",
    [
        b"",
        encode_prompt_meta({"model": "m"}, np.array([1], dtype=np.uint32)),  # bad namespace
        meta([1])[:-1],  # cut short
    ],
    ids=["empty", "bad-namespace", "truncated"],
)
def test_a_bad_meta_never_reaches_the_index(raw: bytes) -> None:
    backlog = PromptMetaBacklog()
    backlog.to_fetch.add(b"x")
    backlog.add_fetched({b"x": raw})
    assert not backlog and backlog.incomplete == {}


# ---------------------------------------------------------------- tenants' prompts
def _store_prompt(svc: MasterService, tenant: str | None, tokens: list[int]) -> bytes:
    """Commit a prompt's block objects and its meta in ``tenant``'s part of the key space (None:
    the operator's) and index it, as ``kv_commit`` does. Returns the meta's stored key."""
    arr = np.array(tokens, dtype=np.uint32)
    blocks = block_keys(NS, arr)
    meta_key = tenant_key(tenant, kv_meta_key(NS.digest, blocks[-1]))
    keys = [tenant_key(tenant, k) for k in kv_object_keys(NS.digest, blocks)] + [meta_key]
    tickets = svc.put_start(keys, [1024] * len(keys), kv_blocks=True)
    put_ids = [t.put_id for t in tickets if isinstance(t, PutTicket)]
    assert len(put_ids) == len(keys), tickets
    assert svc.put_end(put_ids, [1] * len(keys)) == [None] * len(keys)
    assert svc.kv_index(NS, arr, tenant) == len(blocks)
    return meta_key


@pytest.mark.parametrize(
    ("stored", "is_meta"),
    [
        (b"kvmeta/x", True),
        (b"\x00a\x00kvmeta/x", True),
        (b"\x00a\x00kv/x", False),
        (b"kv/x", False),
        (b"\x00kvmeta/x", False),  # (no tenant's key: not a meta)
    ],
)
def test_a_tenants_prompt_meta_is_one(stored: bytes, is_meta: bool) -> None:
    assert is_prompt_meta(stored) is is_meta


def test_each_tenants_prompts_go_back_into_its_own_tree() -> None:
    """Two tenants' prompts and the operator's, restored on a fresh index (a new leader's):
    tenant A's prompt hits for A, not for B; the operator's in the namespace's own tree."""
    svc = make(FakeClock(), dram=4 * MIB, nvme=0)
    a_tokens, b_tokens, op_tokens = [1] * 8, [2] * 8, [3] * 8
    metas = {
        _store_prompt(svc, "a", a_tokens): a_tokens,
        _store_prompt(svc, "b", b_tokens): b_tokens,
        _store_prompt(svc, None, op_tokens): op_tokens,
    }
    # A new leader: a fresh index, the metas admitted (only prompt metas) and read.
    svc.prefix = PrefixIndex()
    svc.prompt_metas.to_fetch.update(k for k in svc.objects if is_prompt_meta(k))
    assert svc.prompt_metas.to_fetch == set(metas)
    svc.prompt_metas.add_fetched({k: meta(t) for k, t in metas.items()})
    assert svc.restore_prefix_index() == 3 and not svc.prompt_metas

    def hit(tokens: list[int], tenant: str | None) -> int:
        match, _ = svc.kv_match(NS, np.array(tokens, dtype=np.uint32), locate=False, tenant=tenant)
        return match.num_tokens

    assert hit(a_tokens, "a") == 8, "A's prompt is back in A's tree"
    assert hit(b_tokens, "b") == 8
    assert hit(a_tokens, "b") == 0, "B never hits A's prompt"
    assert hit(b_tokens, "a") == 0
    assert hit(a_tokens, None) == 0, "nor does the namespace's own tree hold it"
    assert hit(op_tokens, None) == 8, "the operator's prompt in the namespace's own tree"
    assert hit(op_tokens, "a") == 0
