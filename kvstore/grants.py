"""Grants: the master's signed permission to read or write one object's bytes on one node.

The master never moves KV bytes, but it decides which bytes a client may touch. Each node gives
the master a random secret when it registers; the master signs every location it hands out with
that secret (keyed BLAKE2b-128 over the operation, key, segment, offset, size and expiry). The
node recomputes the signature before it touches its arena, and checks every requested range
against the granted ``[offset, offset + size)``. So no request can read or write bytes the master
did not grant, and the node needs no round trip to the master to know it.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import os
import struct
from dataclasses import dataclass
from typing import Any

from kvstore.errors import GrantInvalidError, OutOfRangeError

OP_READ = "r"
OP_WRITE = "w"
SECRET_BYTES = 32
_FIXED = struct.Struct("!1sQQQ")


def new_secret() -> bytes:
    return os.urandom(SECRET_BYTES)


@dataclass(frozen=True, slots=True)
class Grant:
    """Permission for ``op`` on ``[offset, offset + size)`` of ``segment``, holding ``key``.

    ``expires_ms`` is wall-clock milliseconds since the epoch.
    """

    op: str
    key: bytes
    segment: str
    offset: int
    size: int
    expires_ms: int
    signature: bytes

    def to_wire(self) -> list[object]:
        return [
            self.op,
            self.key,
            self.segment,
            self.offset,
            self.size,
            self.expires_ms,
            self.signature,
        ]

    @staticmethod
    def from_wire(obj: object) -> Grant:
        """Raises GrantInvalidError when ``obj`` is not a well-formed grant."""
        if not isinstance(obj, list | tuple) or len(obj) != 7:
            raise GrantInvalidError("grant must be a 7-item list")
        op, key, segment, offset, size, expires_ms, sig = obj
        # NOTE: ``type(x) is int`` (not isinstance) also refuses bools, in one cheap test: this
        # runs once per item of every data-plane request.
        if (
            (op != OP_READ and op != OP_WRITE)
            or type(key) is not bytes
            or type(segment) is not str
            or type(offset) is not int
            or type(size) is not int
            or type(expires_ms) is not int
            or type(sig) is not bytes
            or offset < 0
            or size < 0
        ):
            raise GrantInvalidError("malformed grant")
        return Grant(op, key, segment, offset, size, expires_ms, sig)


@functools.lru_cache(maxsize=64)
def _keyed(secret: bytes) -> Any:
    # A keyed BLAKE2b state per secret, copied per grant: copying is ~3x cheaper than keying.
    return hashlib.blake2b(digest_size=16, key=secret)


def _digest(
    secret: bytes, op: str, key: bytes, segment: str, offset: int, size: int, expires_ms: int
) -> bytes:
    h = _keyed(secret).copy()
    h.update(_FIXED.pack(op.encode(), offset, size, expires_ms))
    h.update(struct.pack("!H", len(key)))
    h.update(key)
    h.update(segment.encode())
    return h.digest()


def sign(
    secret: bytes, op: str, key: bytes, segment: str, offset: int, size: int, expires_ms: int
) -> Grant:
    return Grant(
        op,
        key,
        segment,
        offset,
        size,
        expires_ms,
        _digest(secret, op, key, segment, offset, size, expires_ms),
    )


def verify(secret: bytes, grant: Grant, op: str, now_ms: int) -> None:
    """Check a grant's signature, operation and expiry.

    Raises:
        GrantInvalidError: forged, for another operation, or expired.
    """
    expected = _digest(
        secret, grant.op, grant.key, grant.segment, grant.offset, grant.size, grant.expires_ms
    )
    if not hmac.compare_digest(expected, grant.signature):
        raise GrantInvalidError("grant signature does not verify")
    if grant.op != op:
        raise GrantInvalidError(f"grant is for op {grant.op!r}, not {op!r}")
    if now_ms > grant.expires_ms:
        raise GrantInvalidError("grant expired")


class VerifiedGrants:
    """A node's memo of grants whose signature it has checked, so a grant presented again (a
    client rereading a key under its lease) costs a dict lookup instead of a BLAKE2b.

    An entry is the exact wire form that verified; a grant is taken from the memo only when its
    wire form is equal in every field (the signature covers them all). Operation and expiry are
    still checked on every use. Bounded: past ``max_entries`` expired grants go (all, if few have).

    Not locked: a dict's get and set are atomic under the GIL, and a lost entry only costs a
    recomputation.
    """

    def __init__(self, secret: bytes, max_entries: int = 1 << 14) -> None:
        self.secret = secret
        self.max_entries = max_entries
        self._memo: dict[bytes, tuple[list[Any], Grant]] = {}

    def check(self, grant_wire: Any, op: str, now_ms: int) -> Grant:
        """The verified grant of ``grant_wire``.

        Raises:
            GrantInvalidError: malformed, forged, for another operation, or expired.
        """
        if type(grant_wire) is list and len(grant_wire) == 7:
            sig = grant_wire[6]
            hit = self._memo.get(sig) if type(sig) is bytes else None
            if hit is not None and hit[0] == grant_wire:
                grant = hit[1]
                if grant.op != op:
                    raise GrantInvalidError(f"grant is for op {grant.op!r}, not {op!r}")
                if now_ms > grant.expires_ms:
                    raise GrantInvalidError("grant expired")
                return grant
        grant = Grant.from_wire(grant_wire)
        verify(self.secret, grant, op, now_ms)
        if len(self._memo) >= self.max_entries:
            self._drop_expired(now_ms)
        self._memo[grant.signature] = (list(grant_wire), grant)
        return grant

    def _drop_expired(self, now_ms: int) -> None:
        """Make room: drop expired grants, or everything when too few have expired."""
        entries = list(self._memo.items())  # one C call: other threads may insert meanwhile
        live = {s: e for s, e in entries if e[1].expires_ms >= now_ms}
        self._memo = live if len(live) < self.max_entries // 2 else {}


def check_range(grant: Grant, start: int, length: int) -> None:
    """Raises OutOfRangeError unless ``[start, start + length)`` lies inside the granted object."""
    if (
        not isinstance(start, int)
        or not isinstance(length, int)
        or isinstance(start, bool)
        or isinstance(length, bool)
        or start < 0
        or length < 0
        or start + length > grant.size
    ):
        raise OutOfRangeError(f"range ({start!r}, {length!r}) outside object of {grant.size} bytes")
