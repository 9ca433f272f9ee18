"""The argument checks of the master's RPC verbs (``master/rpc_args.py``): a wrong type is an
``InvalidRequestError``, a bool is never an int, and a bad key fails alone in its place."""

from __future__ import annotations

from typing import Any

import pytest

from kvstore.errors import InvalidRequestError, KVStoreError
from kvstore.limits import MAX_KEY_BYTES
from kvstore.master.rpc_args import arg, list_arg, optional_arg, per_key


@pytest.mark.parametrize(
    ("value", "kind", "ok"),
    [
        (3, int, True),
        (True, int, False),
        (True, bool, True),
        (1, bool, False),
        (1.5, (int, float), True),
        (False, (int, float), False),
        (b"x", bytes, True),
        ("x", bytes, False),
        (None, int, False),
    ],
)
def test_arg_takes_only_its_type(value: Any, kind: type, ok: bool) -> None:
    if ok:
        assert arg({"a": value}, "a", kind) == value
    else:
        with pytest.raises(InvalidRequestError, match="'a'"):
            arg({"a": value}, "a", kind)


def test_an_absent_argument_is_refused_unless_optional() -> None:
    with pytest.raises(InvalidRequestError):
        arg({}, "a", int)
    assert optional_arg({}, "a", int, 7) == 7
    assert optional_arg({"a": 2}, "a", int, 7) == 2
    with pytest.raises(InvalidRequestError):
        optional_arg({"a": None}, "a", int, 7)  # present but not an int


@pytest.mark.parametrize(
    ("value", "item", "ok"),
    [
        ([1, 2], int, True),
        ([1, True], int, False),
        ([1, "2"], int, False),
        (["x", 2], None, True),
        ((1, 2), int, False),
        ([], bytes, True),
    ],
)
def test_list_arg_checks_every_item(value: Any, item: type | None, ok: bool) -> None:
    if ok:
        assert list_arg({"l": value}, "l", item) == value
    else:
        with pytest.raises(InvalidRequestError, match="'l'"):
            list_arg({"l": value}, "l", item)


def test_per_key_runs_the_valid_keys_and_leaves_each_bad_one_its_error() -> None:
    calls: list[tuple[list[bytes], list[int]]] = []

    def call(keys: list[bytes], idx: list[int]) -> list[Any]:
        calls.append((keys, idx))
        return [k.upper() for k in keys]

    out = per_key([b"a", 7, b"x" * (MAX_KEY_BYTES + 1), b"c"], call)
    assert calls == [([b"a", b"c"], [0, 3])]
    assert out[0] == b"A" and out[3] == b"C"
    assert all(isinstance(e, KVStoreError) for e in out[1:3])
