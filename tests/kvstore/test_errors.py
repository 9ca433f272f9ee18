"""The error model: every code has one class on the wire, and every code is raised somewhere."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

from kvstore import errors
from kvstore.errors import ErrorCode, KVStoreError, ProtocolError

ROOT = Path(__file__).resolve().parents[2]
SOURCES = [
    p
    for folder in ("kvstore", "master", "node", "client", "apps", "cuda")
    for p in (ROOT / folder).rglob("*.py")
    if p != ROOT / "kvstore" / "errors.py"
]
ERROR_CLASSES = [
    cls
    for _, cls in inspect.getmembers(errors, inspect.isclass)
    if issubclass(cls, KVStoreError) and cls is not KVStoreError
]


def _source() -> str:
    return "\n".join(p.read_text() for p in SOURCES)


@pytest.mark.parametrize("code", [c for c in ErrorCode if c is not ErrorCode.OK])
def test_every_code_crosses_the_wire_as_its_class(code: ErrorCode) -> None:
    err = KVStoreError.from_wire([int(code), "m"])
    assert err.code is code and err.message == "m"
    assert isinstance(err, errors._BY_CODE.get(code, KVStoreError))


def test_an_unknown_code_is_a_protocol_error() -> None:
    assert isinstance(KVStoreError.from_wire([501, "retired"]), ProtocolError)


@pytest.mark.parametrize("code", [c for c in ErrorCode if c is not ErrorCode.OK])
def test_every_code_is_raised_somewhere(code: ErrorCode) -> None:
    """A code nothing raises is dead: remove it (and retire its number) rather than keep it."""
    source = _source()
    classes = [cls.__name__ for cls in ERROR_CLASSES if cls.code is code]
    constructed = any(re.search(rf"\b{name}\(", source) for name in classes)
    # ``ErrorCode.X`` outside a lookup table (``ErrorCode.X: ...``) names the code it raises.
    named = re.search(rf"ErrorCode\.{code.name}\b(?!\s*:)", source) is not None
    assert constructed or named, f"{code.name} is never raised"
