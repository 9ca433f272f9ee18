"""The protocol's limits and the rules that check values against them: keys, sizes, batches."""

from __future__ import annotations

import re

from kvstore.errors import InvalidRequestError

#: Longest key in bytes (UTF-8). Matches lmdb's key limit so every key can live in any tier.
MAX_KEY_BYTES = 511

#: Largest single object. Bigger values should be split by the caller (KV blocks are far smaller).
MAX_OBJECT_BYTES = 1 << 40

#: Most keys in one control-protocol call; the client splits a longer batch into such calls.
MAX_BATCH_KEYS = 65536

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "kib": 1 << 10,
    "mib": 1 << 20,
    "gib": 1 << 30,
    "tib": 1 << 40,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str | int) -> int:
    """Parse ``512MiB``, ``4GiB``, ``1.5GB``, ``4096`` into bytes.

    Raises:
        InvalidRequestError: for anything that is not a non-negative size with a known unit.
    """
    if isinstance(text, int) and not isinstance(text, bool):
        if text < 0:
            raise InvalidRequestError(f"size must be >= 0, got {text}")
        return text
    if not isinstance(text, str):
        raise InvalidRequestError(f"size must be a string like '512MiB', got {type(text).__name__}")
    m = _SIZE_RE.match(text)
    if not m or m.group(2).lower() not in _UNITS:
        raise InvalidRequestError(f"bad size {text!r}: use a number and a unit like 512MiB or 4GiB")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def format_size(num_bytes: int) -> str:
    value = float(num_bytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def encode_key(key: str | bytes) -> bytes:
    """Validate a user key and return its wire form (UTF-8 bytes).

    Raises:
        InvalidRequestError: empty, too long, or not str/bytes.
    """
    if type(key) is bytes and 0 < len(key) <= MAX_KEY_BYTES:
        return key  # the common case, checked in one step
    if isinstance(key, str):
        raw = key.encode("utf-8", "surrogatepass")
    elif isinstance(key, bytes | bytearray | memoryview):
        raw = bytes(key)
    else:
        raise InvalidRequestError(f"key must be str or bytes, got {type(key).__name__}")
    if not raw:
        raise InvalidRequestError("key must not be empty")
    if len(raw) > MAX_KEY_BYTES:
        raise InvalidRequestError(f"key is {len(raw)} bytes; the limit is {MAX_KEY_BYTES}")
    return raw


def check_wire_key(key: object) -> bytes:
    """Server-side check of a key taken off the wire (msgpack gives bytes or str)."""
    if isinstance(key, bytes | str):
        return encode_key(key)
    raise InvalidRequestError(f"key must be bytes, got {type(key).__name__}")
