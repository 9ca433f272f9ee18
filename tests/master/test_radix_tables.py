"""The radix index's open-addressing tables (kvstore.master.radix_tables), checked against a
dict: every key or child added is found, every one discarded is gone, through collisions,
backward-shift deletions, growth and shrinking."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.master.radix_tables import ChildTable, KeyTable

MAX_SLOTS = 4096


def key_of(bucket: int, tail: int) -> bytes:
    """A 16-byte key whose first 8 bytes (the bucket hash) are ``bucket``."""
    return bucket.to_bytes(8, "little") + tail.to_bytes(8, "little")


class Keys:
    """The tree's side of a KeyTable: each slot's key in a ``[n, 16]`` uint8 array."""

    def __init__(self) -> None:
        self.array = np.zeros((MAX_SLOTS, 16), dtype=np.uint8)
        self.free = list(range(MAX_SLOTS - 1, -1, -1))

    def place(self, keys: list[bytes]) -> tuple[np.ndarray, np.ndarray]:
        slots = np.array([self.free.pop() for _ in keys], dtype=np.int32)
        rows = np.frombuffer(b"".join(keys), dtype=np.uint8).reshape(-1, 16).copy()
        self.array[slots] = rows
        return rows, slots


# Few buckets, so keys collide (same first 8 bytes) and cluster (neighbouring buckets).
KEYS = st.builds(key_of, st.integers(0, 5), st.integers(0, 1 << 20)) | st.builds(
    key_of, st.integers(0, (1 << 64) - 1), st.integers(0, (1 << 64) - 1)
)
KEY_OPS = st.lists(
    st.one_of(
        # Up to SMALL_BATCH keys are placed one by one, more all at once: both.
        st.tuples(st.just("add"), st.lists(KEYS, min_size=1, max_size=40, unique=True)),
        st.tuples(st.just("discard"), st.lists(KEYS, max_size=4)),
        st.tuples(st.just("discard_known"), st.integers(0, 1000)),
    ),
    max_size=40,
)


@settings(max_examples=200, deadline=None)
@given(KEY_OPS)
def test_key_table_agrees_with_a_dict(ops: list[tuple[str, object]]) -> None:
    table, keys, model = KeyTable(size=16), Keys(), {}
    for op, arg in ops:
        if op == "add":
            new = [k for k in arg if k not in model]  # type: ignore[union-attr]
            if not new:
                continue
            rows, slots = keys.place(new)
            table.add_many(rows, slots, keys.array)
            model.update(zip(new, slots.tolist(), strict=True))
        else:
            if op == "discard_known":
                if not model:
                    continue
                gone = [sorted(model)[arg % len(model)]]  # type: ignore[operator]
            else:
                gone = arg  # type: ignore[assignment]
            for k in gone:
                table.discard(k, keys.array)
                slot = model.pop(k, None)
                if slot is not None:
                    keys.free.append(slot)
        assert table.count == len(model)
        for k, slot in model.items():
            assert table.find(k, keys.array) == slot
        assert table.find(key_of(7, 7), keys.array) == -1
        if model:
            probe = [*model, key_of(7, 7)]
            rows = np.frombuffer(b"".join(probe), dtype=np.uint8).reshape(-1, 16)
            assert table.find_many(rows, keys.array).tolist() == [*model.values(), -1]


def test_key_table_grows_and_shrinks_with_its_keys() -> None:
    table, keys = KeyTable(), Keys()
    start = table.nbytes()
    added = [key_of(i * 0x9E3779B97F4A7C15 % (1 << 64), i) for i in range(3000)]
    rows, slots = keys.place(added)
    table.add_many(rows, slots, keys.array)
    assert table.nbytes() > start
    assert table.count * 5 <= len(table.table) * 3, "load factor kept at most 0.6"
    assert table.find_many(rows, keys.array).tolist() == slots.tolist()
    for k in added[:2900]:
        table.discard(k, keys.array)
    assert table.nbytes() < len(added) * 4, "it shrank back"
    assert [table.find(k, keys.array) for k in added[2900:]] == slots[2900:].tolist()
    assert all(table.find(k, keys.array) == -1 for k in added[:50])


class Children:
    """The tree's side of a ChildTable: each node's parent and first token."""

    def __init__(self) -> None:
        self.parent = np.full(MAX_SLOTS, -1, dtype=np.int64)
        self.first = np.full(MAX_SLOTS, -1, dtype=np.int64)


CHILD_OPS = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.tuples(st.integers(0, 3), st.integers(0, 3))),
        st.tuples(st.just("discard"), st.integers(0, 1000)),
    ),
    max_size=80,
)


@settings(max_examples=200, deadline=None)
@given(CHILD_OPS)
def test_child_table_agrees_with_a_dict(ops: list[tuple[str, object]]) -> None:
    table, tree = ChildTable(size=8), Children()
    model: dict[tuple[int, int], set[int]] = {}
    live: list[int] = []
    next_id = 0
    for op, arg in ops:
        if op == "add":
            parent, token = arg  # type: ignore[misc]
            child, next_id = next_id, next_id + 1
            tree.parent[child], tree.first[child] = parent, token
            table.add(child, tree.parent, tree.first)
            model.setdefault((parent, token), set()).add(child)
            live.append(child)
        elif live:
            child = live.pop(arg % len(live))  # type: ignore[operator]
            table.discard(child, tree.parent, tree.first)
            model[(int(tree.parent[child]), int(tree.first[child]))].discard(child)
        assert table.count == len(live)
        for parent in range(4):
            for token in range(4):
                found = table.find(parent, token, tree.parent, tree.first)
                assert sorted(found) == sorted(model.get((parent, token), ()))


def test_child_table_keeps_siblings_that_share_a_first_token() -> None:
    table, tree = ChildTable(), Children()
    for child in range(3000):
        tree.parent[child], tree.first[child] = child % 7, 42 if child % 2 else child
        table.add(child, tree.parent, tree.first)
    assert sorted(table.find(3, 42, tree.parent, tree.first)) == [
        c for c in range(3000) if c % 7 == 3 and c % 2
    ]
    for child in range(0, 3000, 2):
        table.discard(child, tree.parent, tree.first)
    assert table.find(0, 0, tree.parent, tree.first) == []
    assert len(table.find(3, 42, tree.parent, tree.first)) == len(
        [c for c in range(3000) if c % 7 == 3 and c % 2]
    )
