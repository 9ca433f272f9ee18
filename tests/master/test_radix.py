"""The radix prefix index against a naive reference, plus table-driven edge cases."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvstore.errors import InvalidRequestError, KeyNotFoundError
from kvstore.keys import Namespace, block_keys
from kvstore.master.radix import Match, RadixIndex

BS = 3
NS_A = Namespace("model", "float16", 2, 2, 4, block_size=BS)
NS_B = Namespace("model", "float16", 2, 2, 4, block_size=BS, salt="tenant-b")  # same but salt
NS_C = Namespace("model", "float16", 2, 2, 4, block_size=2, hash_algorithm="blake2b_128")
NAMESPACES = [NS_A, NS_B, NS_C]
# A tiny alphabet makes prompts share prefixes and partial blocks; the large ids exercise the
# packed high bit-planes (17 and 18 bits).
TOKEN = st.sampled_from([0, 1, 2, 70_000, 131_073])


def _lcp(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


class Reference:
    """The naive model: every stored block is a prefix (list of tokens) with its key and value.

    The stored set is prefix-closed; match is the longest common token prefix with any stored
    prefix.
    """

    def __init__(self) -> None:
        self.blocks: dict[bytes, dict[bytes, tuple[list[int], int]]] = {}

    def of(self, ns: Namespace) -> dict[bytes, tuple[list[int], int]]:
        return self.blocks.setdefault(ns.digest, {})

    def insert(self, ns: Namespace, tokens: list[int], values: list[int]) -> int:
        store = self.of(ns)
        new = 0
        for i, key in enumerate(block_keys(ns, tokens)):
            if key not in store:
                store[key] = (tokens[: (i + 1) * ns.block_size], values[i])
                new += 1
        return new

    def match_len(self, ns: Namespace, query: list[int]) -> int:
        return max((_lcp(p, query) for p, _ in self.of(ns).values()), default=0)

    def descendants(self, ns: Namespace, key: bytes) -> set[bytes]:
        prefix = self.of(ns)[key][0]
        return {k for k, (p, _) in self.of(ns).items() if p[: len(prefix)] == prefix}


def check_match(ref: Reference, ns: Namespace, query: list[int], m: Match) -> None:
    bs = ns.block_size
    assert m.num_tokens == ref.match_len(ns, query)
    assert m.num_blocks == -(-m.num_tokens // bs)
    full = block_keys(ns, query[: (m.num_tokens // bs) * bs])
    store = ref.of(ns)
    for i, (key, value, n) in enumerate(m.blocks()):
        assert n == min(bs, m.num_tokens - i * bs) and n > 0
        prefix, ref_value = store[key]
        assert value == ref_value
        assert len(prefix) == (i + 1) * bs
        # The block's stored tokens agree with the query on every token it is credited for.
        assert prefix[: i * bs + n] == query[: i * bs + n]
        if n == bs:
            assert key == full[i]


class RadixMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.index = RadixIndex()
        self.ref = Reference()
        self.prompts: list[tuple[Namespace, list[int]]] = []
        self.next_value = 0

    def _query(self, data: st.DataObject) -> tuple[Namespace, list[int]]:
        """A query: random, or a stored prompt's prefix, possibly changed and extended."""
        ns = data.draw(st.sampled_from(NAMESPACES))
        if self.prompts and data.draw(st.booleans()):
            base_ns, base = data.draw(st.sampled_from(self.prompts))
            cut = data.draw(st.integers(0, len(base)))
            query = list(base[:cut])
            ns = base_ns if data.draw(st.integers(0, 4)) else ns
        else:
            query = []
        query += data.draw(st.lists(TOKEN, max_size=8))
        return ns, query

    @rule(data=st.data())
    def insert(self, data: st.DataObject) -> None:
        ns, tokens = self._query(data)
        tokens = tokens[: len(tokens) - len(tokens) % ns.block_size]
        n = len(tokens) // ns.block_size
        values = list(range(self.next_value, self.next_value + n))
        self.next_value += n
        keys = block_keys(ns, tokens)
        expected = self.ref.insert(ns, tokens, values)
        assert self.index.insert(ns, tokens, keys, values) == expected
        self.prompts.append((ns, tokens))

    @rule(data=st.data())
    def match(self, data: st.DataObject) -> None:
        ns, query = self._query(data)
        check_match(self.ref, ns, query, self.index.match(ns, query))

    @rule(data=st.data(), limit=st.integers(1, 6), per_ns=st.booleans())
    def evict(self, data: st.DataObject, limit: int, per_ns: bool) -> None:
        ns = data.draw(st.sampled_from(NAMESPACES))
        candidates = self.index.evictable(ns.digest if per_ns else None)
        for removed, (digest, key) in enumerate(candidates, start=1):
            store = self.ref.blocks[digest]
            prefix = store[key][0]
            # Leaf-first: nothing stored extends this block.
            assert all(
                len(p) <= len(prefix) or p[: len(prefix)] != prefix for p, _ in store.values()
            )
            out = self.index.remove(digest, key, cascade=False)
            assert out == [(key, store[key][1])]
            del store[key]
            if removed >= limit:
                break

    @precondition(lambda self: any(self.ref.blocks.values()))
    @rule(data=st.data(), cascade=st.booleans())
    def remove(self, data: st.DataObject, cascade: bool) -> None:
        ns = data.draw(st.sampled_from([n for n in NAMESPACES if self.ref.of(n)]))
        key = data.draw(st.sampled_from(sorted(self.ref.of(ns))))
        victims = self.ref.descendants(ns, key)
        if not cascade and len(victims) > 1:
            with pytest.raises(InvalidRequestError):
                self.index.remove(ns.digest, key, cascade=False)
            return
        out = self.index.remove(ns.digest, key, cascade=cascade)
        assert {k for k, _ in out} == victims
        for k, v in out:
            assert self.ref.of(ns).pop(k)[1] == v

    @invariant()
    def consistent(self) -> None:
        self.index.check_invariants()
        for ns in NAMESPACES:
            assert self.index.num_blocks(ns.digest) == len(self.ref.of(ns))


RadixMachine.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestRadixAgainstReference = RadixMachine.TestCase


# -- table-driven cases ----------------------------------------------------------------------

NS4 = Namespace("m", "bfloat16", 1, 1, 8, block_size=4)
A = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]


@pytest.fixture
def index() -> RadixIndex:
    idx = RadixIndex()
    idx.insert(NS4, A, block_keys(NS4, A), [100, 101, 102])
    return idx


@pytest.mark.parametrize(
    ("query", "num_tokens", "values", "last_block_tokens"),
    [
        ([], 0, [], None),
        ([9], 0, [], None),
        ([1, 2], 2, [100], 2),  # prompt ends mid-block
        ([1, 2, 3, 4, 5, 6, 0, 8], 6, [100, 101], 2),  # shares part of the second block
        (A[:8], 8, [100, 101], 4),
        (A + [13, 14], 12, [100, 101, 102], 4),
        (A[:11], 11, [100, 101, 102], 3),
        (np.array(A[:9], dtype=np.int64), 9, [100, 101, 102], 1),
    ],
)
def test_match_partial_blocks(index, query, num_tokens, values, last_block_tokens) -> None:
    m = index.match(NS4, query)
    assert m.num_tokens == num_tokens
    assert m.values == values
    if last_block_tokens is not None:
        assert m.blocks()[-1][2] == last_block_tokens
        assert m.block_keys == block_keys(NS4, A)[: len(values)]


def test_sibling_with_same_first_token_picks_longest_share(index) -> None:
    b = [1, 2, 3, 4, 5, 6, 7, 99]
    index.insert(NS4, b, block_keys(NS4, b), [200, 201])
    index.check_invariants()
    assert index.match(NS4, [1, 2, 3, 4, 5, 6, 7, 99, 0]).values == [100, 201]
    assert index.match(NS4, [1, 2, 3, 4, 5, 6, 7, 8, 0]).values == [100, 101]
    m = index.match(NS4, [1, 2, 3, 4, 5, 6, 7])
    assert m.num_tokens == 7 and m.values[0] == 100 and m.values[1] in (101, 201)


def test_salted_namespace_is_isolated(index) -> None:
    salted = Namespace("m", "bfloat16", 1, 1, 8, block_size=4, salt="lora-7")
    assert index.match(salted, A).num_tokens == 0
    assert index.match(salted.digest, A).num_tokens == 0
    assert index.match(NS4.digest, A).num_tokens == 12


def test_insert_existing_blocks_keeps_values(index) -> None:
    assert index.insert(NS4, A[:8], block_keys(NS4, A[:8]), [7, 7]) == 0
    assert index.match(NS4, A).values == [100, 101, 102]


def test_insert_extends_leaf_edge_without_new_node(index) -> None:
    longer = A + [13, 14, 15, 16]
    assert index.insert(NS4, longer, block_keys(NS4, longer), [1, 2, 3, 4]) == 1
    assert index.num_nodes() == 1
    index.check_invariants()


@pytest.mark.parametrize(
    ("tokens", "keys", "values"),
    [
        (A[:7], block_keys(NS4, A[:4]), [1]),  # not whole blocks
        (A[:8], block_keys(NS4, A[:4]), [1]),  # fewer keys than blocks
        (A[:4], block_keys(NS4, A[:4]), [1, 2]),  # values length
        (A[:4], block_keys(NS4, A[:4]), [1.5]),  # non-integer value
        (A[:4], [b"short"], [1]),  # key size
        ([-1, 2, 3, 4], block_keys(NS4, A[:4]), [1]),  # bad token
        (A[:4], block_keys(NS4, [9, 9, 9, 9]), [1]),  # key differs from the stored block's
        ([9, 9, 9, 9], block_keys(NS4, A[:4]), [1]),  # key already indexed for other tokens
        ([9] * 8, block_keys(NS4, [9] * 4) * 2, [1, 2]),  # duplicate keys
    ],
)
def test_bad_insert_raises_and_changes_nothing(index, tokens, keys, values) -> None:
    with pytest.raises(InvalidRequestError):
        index.insert(NS4, tokens, keys, values)
    assert index.num_blocks() == 3
    assert index.match(NS4, A).values == [100, 101, 102]
    index.check_invariants()


def test_remove_interior_refused_or_cascades(index) -> None:
    keys = block_keys(NS4, A)
    with pytest.raises(InvalidRequestError):
        index.remove(NS4.digest, keys[1], cascade=False)
    assert index.num_blocks() == 3
    assert index.remove(NS4.digest, keys[1]) == [(keys[1], 101), (keys[2], 102)]
    assert index.match(NS4, A).num_tokens == 4
    with pytest.raises(KeyNotFoundError):
        index.remove(NS4.digest, keys[2])
    with pytest.raises(KeyNotFoundError):
        index.get_value(b"\x00" * 16, keys[0])


def test_evictable_drains_leaf_first(index) -> None:
    b = [1, 2, 3, 4, 50, 60, 70, 80]
    index.insert(NS4, b, block_keys(NS4, b), [200, 201])
    order = []
    for digest, key in index.evictable():
        order.append(index.get_value(digest, key))
        index.remove(digest, key, cascade=False)
        index.check_invariants()
    assert sorted(order) == [100, 101, 102, 201] and order[-1] == 100
    assert order.index(102) < order.index(101)
    assert index.num_blocks() == 0 and index.namespaces() == []


def test_evictable_without_removal_yields_each_leaf_once(index) -> None:
    b = [1, 2, 3, 4, 50, 60, 70, 80]
    index.insert(NS4, b, block_keys(NS4, b), [200, 201])
    leaves = [index.get_value(d, k) for d, k in index.evictable(NS4.digest)]
    assert sorted(leaves) == [102, 201]


def test_memory_bytes_is_positive_and_grows(index) -> None:
    before = index.memory_bytes()
    rng = np.random.default_rng(0)
    t = rng.integers(0, 1 << 17, 4 * 5000)
    index.insert(NS4, t, block_keys(NS4, t), np.arange(5000))
    assert index.memory_bytes() > before > 0
    assert index.match(NS4, t).num_tokens == len(t)


def test_failed_insert_into_new_namespace_leaves_nothing() -> None:
    idx = RadixIndex()
    with pytest.raises(InvalidRequestError):
        idx.insert(NS4, A[:8], block_keys(NS4, A[:4]) * 2, [1, 2])
    assert idx.namespaces() == [] and idx.num_blocks() == 0


def test_unknown_namespace_is_a_miss_and_empty_insert_is_noop() -> None:
    idx = RadixIndex()
    assert idx.match(NS4, A).num_tokens == 0
    assert idx.insert(NS4, [], [], []) == 0
    assert list(idx.evictable()) == [] and idx.namespaces() == []


@pytest.mark.parametrize("seed", range(3))
def test_larger_random_workload_against_reference(seed) -> None:
    """Long multi-block edges, splits and merges at a scale hypothesis does not reach."""
    rng = np.random.default_rng(seed)
    ns = Namespace("m", "float16", 1, 1, 8, block_size=4)
    idx, ref = RadixIndex(), Reference()
    prompts: list[list[int]] = []
    for step in range(300):
        if prompts and rng.random() < 0.7:
            base = prompts[int(rng.integers(len(prompts)))]
            prompt = base[: int(rng.integers(0, len(base) + 1))]
        else:
            prompt = []
        prompt += rng.integers(0, 3, int(rng.integers(0, 40))).tolist()
        prompt = prompt[: len(prompt) - len(prompt) % 4]
        values = list(range(step * 100, step * 100 + len(prompt) // 4))
        assert idx.insert(ns, prompt, block_keys(ns, prompt), values) == ref.insert(
            ns, prompt, values
        )
        prompts.append(prompt)
        if rng.random() < 0.2 and ref.of(ns):
            keys = sorted(ref.of(ns))
            key = keys[int(rng.integers(len(keys)))]
            victims = ref.descendants(ns, key)
            assert {k for k, _ in idx.remove(ns.digest, key)} == victims
            for k in victims:
                del ref.of(ns)[k]
        query = prompts[int(rng.integers(len(prompts)))][:]
        query += rng.integers(0, 3, int(rng.integers(0, 6))).tolist()
        check_match(ref, ns, query, idx.match(ns, query))
    idx.check_invariants()
    assert idx.num_blocks() == len(ref.of(ns))


def test_values_widen_to_int64_when_needed(index) -> None:
    """Values start as int32 and widen, keeping every stored value exact."""
    b = [1, 2, 3, 4, 50, 60, 70, 80, 90, 91, 92, 93]
    index.insert(NS4, b, block_keys(NS4, b), [0, (1 << 40) + 5, -(1 << 62)])
    assert index.match(NS4, b).values == [100, (1 << 40) + 5, -(1 << 62)]
    assert index.match(NS4, A).values == [100, 101, 102]
    index.check_invariants()


def test_node_churn_keeps_arena_and_child_table_consistent() -> None:
    """Many short branches added and evicted: node ids, arena runs and child entries are reused."""
    idx = RadixIndex()
    rng = np.random.default_rng(7)
    base = rng.integers(0, 1 << 17, 4 * 8).tolist()
    for rnd in range(4):
        prompts = [
            base[: 4 * int(rng.integers(1, 9))] + rng.integers(0, 5, 8).tolist() for _ in range(300)
        ]
        for i, p in enumerate(prompts):
            idx.insert(NS4, p, block_keys(NS4, p), list(range(i * 10, i * 10 + len(p) // 4)))
        idx.check_invariants()
        for p in prompts[::3]:
            assert idx.match(NS4, p).num_tokens == len(p)
        for evicted, (digest, key) in enumerate(idx.evictable(NS4.digest), start=1):
            idx.remove(digest, key, cascade=False)
            if evicted == 200 * (rnd + 1):
                break
        idx.check_invariants()
    for digest, key in list(idx.evictable()):
        idx.remove(digest, key)
    idx.check_invariants()
