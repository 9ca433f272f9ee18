"""The master's prefix index rules: keys recomputed from tokens, committed prefixes only,
stale blocks cut, and the restore from prompt metas."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

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


def _drive(steps: Any, counted: list[bytes], between: Callable[[int], None] = lambda i: None):
    """Run ``steps`` one at a time: (blocks looked up per step but the last, in the last, result),
    calling ``between(i)`` after step ``i`` (another request served in between)."""
    per_step: list[int] = []
    while True:
        counted.clear()
        try:
            next(steps)
        except StopIteration as done:
            return per_step, len(counted), done.value
        per_step.append(len(counted))
        between(len(per_step) - 1)


@pytest.mark.parametrize("step", [1, 7, 64, 1000])
def test_index_and_match_look_at_a_bounded_number_of_blocks_per_step(step: int) -> None:
    """The RPC edge runs one step per turn of its loop: no step but the one that changes the
    tree hashes or looks up more than ``step`` blocks, and the steps answer as one call does."""
    tokens = np.arange(4 * 300 + 2, dtype=np.uint32)  # 300 full blocks and a partial one
    keys = keys_of(tokens)
    committed = set(keys[:250])
    counted: list[bytes] = []

    def is_committed(key: bytes) -> bool:
        counted.append(key)
        return key in committed

    idx, whole = PrefixIndex(), PrefixIndex()
    per_step, last, added = _drive(idx.index_steps(NS, tokens, is_committed, step), counted)
    assert added == whole.index(NS, tokens, committed.__contains__) == 250
    assert len(per_step) == 250 // step, "it stops at the step of the first missing block"
    assert all(n <= step for n in per_step), per_step
    # The last step: the rest of its own blocks, then (after several) the prefix re-checked.
    assert last <= step + (250 if per_step else 0)
    per_step, last, match = _drive(idx.match_steps(NS, tokens, is_committed, step), counted)
    assert all(n <= step for n in [*per_step, last]), (per_step, last)
    assert match == whole.match(NS, tokens, committed.__contains__)
    assert match.num_tokens == 1000 and len(match.blocks) == 250


def test_an_object_that_goes_between_two_steps_is_never_indexed_nor_matched() -> None:
    tokens = np.arange(4 * 300, dtype=np.uint32)
    keys = keys_of(tokens)
    committed = set(keys)
    counted: list[bytes] = []

    def is_committed(key: bytes) -> bool:
        counted.append(key)
        return key in committed

    idx = PrefixIndex()
    gone = lambda i: committed.discard(keys[50]) if i == 1 else None  # noqa: E731
    _, _, added = _drive(idx.index_steps(NS, tokens, is_committed, 100), counted, gone)
    assert added == 50, "a block checked in an earlier step whose object went was indexed"
    assert idx.events.last_seq == 1 and idx.radix.num_blocks() == 50
    committed.add(keys[50])
    assert idx.index(NS, tokens, committed.__contains__) == 250
    # Matching: block 150's object goes after the step that checked blocks 100..199 began.
    gone = lambda i: committed.discard(keys[150]) if i == 0 else None  # noqa: E731
    _, _, match = _drive(idx.match_steps(NS, tokens, is_committed, 100), counted, gone)
    assert match.num_tokens == 150 * 4 and idx.radix.num_blocks() == 150, "stale blocks kept"
