"""The master's prefix index rules: keys recomputed from tokens, committed prefixes only,
stale blocks cut, and the restore from prompt metas."""

from __future__ import annotations

import numpy as np
import pytest

from kvstore.errors import InvalidRequestError
from kvstore.keys import Namespace, block_keys
from kvstore.kvblocks import decode_prompt_meta, encode_prompt_meta, kv_object_key
from kvstore.master.prefix import PrefixIndex
from kvstore.master.prefix_restore import PromptMetaBacklog

NS = Namespace(model="m", dtype="float16", num_layers=1, num_kv_heads=1, head_dim=4, block_size=4)


def keys_of(tokens: np.ndarray) -> list[bytes]:
    return [kv_object_key(NS.digest, k) for k in block_keys(NS, tokens)]


def test_index_stops_at_the_first_uncommitted_block_and_match_cuts_stale_ones() -> None:
    tokens = np.arange(20, dtype=np.uint32)  # 5 blocks
    committed = set(keys_of(tokens))
    committed.discard(keys_of(tokens)[3])
    idx = PrefixIndex()
    assert idx.index(NS, tokens, committed.__contains__) == 3
    assert idx.match(NS, tokens, committed.__contains__).num_tokens == 12
    assert idx.match(NS, tokens[:10], committed.__contains__).num_tokens == 10  # mid-block
    committed.discard(keys_of(tokens)[1])  # its object went away without telling the index
    m = idx.match(NS, tokens, committed.__contains__)
    assert m.num_tokens == 4 and len(m.blocks) == 1
    assert idx.radix.num_blocks() == 1, "the stale block and what hangs off it are dropped"
    assert idx.stats()["num_queries"] == 3


def test_forget_ignores_other_keys() -> None:
    idx = PrefixIndex()
    assert idx.forget(b"plain/key") == 0
    assert idx.forget(kv_object_key(NS.digest, b"\x00" * 16)) == 0


def test_prompt_meta_round_trip_and_bad_input() -> None:
    tokens = np.arange(8, dtype=np.uint32)
    ns_dict, back = decode_prompt_meta(encode_prompt_meta(NS.to_dict(), tokens))
    assert Namespace.from_dict(ns_dict) == NS and np.array_equal(back, tokens)
    for bad in (b"\xc1", b"\x90", encode_prompt_meta(NS.to_dict(), tokens)[:-1]):
        with pytest.raises(InvalidRequestError):
            decode_prompt_meta(bad)
    backlog = PromptMetaBacklog()
    backlog.to_fetch.update({b"a", b"b"})
    backlog.add_fetched({b"a": encode_prompt_meta(NS.to_dict(), tokens), b"b": b"junk"})
    assert list(backlog.incomplete) == [b"a"] and not backlog.to_fetch
