"""Grants: the master's signed permission to read or write one object's bytes on one node.

The master never moves KV bytes, but it decides which bytes a client may touch. Each node gives
the master a random secret when it registers; the master signs every location it hands out with
that secret (keyed BLAKE2b-128 over the operation, key, segment, offset, size and expiry). The
node recomputes the signature before it touches its arena, and checks every requested range
against the granted ``[offset, offset + size)``. So no request can read or write bytes the master
did not grant, and the node needs no round trip to the master to know it.
"""

from __future__ import annotations

import bisect
import contextlib
import functools
import hashlib
import hmac
import os
import socket
import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvstore.errors import GrantInvalidError, KVStoreError, KVTimeoutError, OutOfRangeError

OP_READ = "r"
OP_WRITE = "w"
SECRET_BYTES = 32
_FIXED = struct.Struct("!1sQQQH")  # op, offset, size, expiry, then the key's length


def new_secret() -> bytes:
    return os.urandom(SECRET_BYTES)


@dataclass(slots=True, unsafe_hash=True)  # not frozen: see the NOTE in kvstore.types
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
    # One update of the concatenation: the same digest as updates of each part, in one call.
    h.update(_FIXED.pack(op.encode(), offset, size, expires_ms, len(key)) + key + segment.encode())
    return h.digest()


def sign(
    secret: bytes, op: str, key: bytes, segment: str, offset: int, size: int, expires_ms: int
) -> Grant:
    return Grant(*sign_wire(secret, op, key, segment, offset, size, expires_ms))  # type: ignore[arg-type]


def sign_wire(
    secret: bytes, op: str, key: bytes, segment: str, offset: int, size: int, expires_ms: int
) -> list[object]:
    """:func:`sign`'s grant in its wire form (``Grant.to_wire``), without the record: what a
    master answering a batch sends per key."""
    return [
        op,
        key,
        segment,
        offset,
        size,
        expires_ms,
        _digest(secret, op, key, segment, offset, size, expires_ms),
    ]


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

    def check(self, grant_wire: Any, op: str, now_ms: int, remember: bool = True) -> Grant:
        """The verified grant of ``grant_wire``.

        Args:
            remember: keep it in the memo (False for grants used once: writes).

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
        if not remember:
            return grant
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


# --------------------------------------------------------------------------- write claims
#: How long a new write waits for an older, fenced write on the same bytes to stop.
FENCE_WAIT_S = 2.0


class WriteStream:
    """One write streaming into node memory, which a newer write of the same bytes can stop.

    The receiving thread checks :attr:`aborted` before every socket read; :meth:`abort` also
    shuts the connection down, so a read blocked on a stalled writer returns at once.
    """

    def __init__(self, sock: Any = None) -> None:
        self.sock = sock
        self.aborted = False
        self.stopped = threading.Event()

    def is_aborted(self) -> bool:
        return self.aborted

    def abort(self) -> None:
        self.aborted = True
        if self.sock is not None:
            with contextlib.suppress(OSError):
                self.sock.shutdown(socket.SHUT_RDWR)


@dataclass(slots=True)
class _Claim:
    start: int
    end: int
    stamp: int  # the grant's expiry (ms): grants for the same bytes are ordered by it
    signature: bytes
    done: bool = False  # a write with this grant completed: the grant is used up
    streams: list[WriteStream] = field(default_factory=list)


class WriteClaims:
    """Which allocation each granted range of a node's segments currently belongs to.

    Why: the master frees an extent (put timeout, revoke, remove, overwrite, eviction,
    demotion) and may hand it to the next object at once, while a write grant for the old
    allocation is still valid (a stalled writer, a late retry, a replay). Grants alone would let
    such a write land on the next tenant's bytes. A grant's expiry is its allocation's place in
    time (``expires = put_start time + put timeout``), so of two grants for overlapping bytes
    the one that expires later belongs to the newer allocation. The node remembers, per
    segment, the newest grant that wrote each range (until that grant expires: every older
    grant has expired by then), and:

    - refuses a write whose range overlaps a newer grant's claim (or an equal expiry of
      another grant: the order is unknown, so the later comer fails cleanly);
    - refuses a second write with a grant that already completed one (used up) or is writing;
    - stops an older write still streaming into the range (shuts its connection down and
      waits for its receive loop to leave) before the newer one touches a byte.

    Together with receives that start no socket read after the grant's expiry (see
    ``DataServer``), no write of an allocation that is no longer current changes a byte of
    another object on this node's TCP path. Bytes a same-host client copies in place (shm,
    RDMA) are checked at ``shm_commit``/``rdma_commit`` the same way; the copy itself is made
    only while the grant is valid with a margin to spare (``kvstore.client.shm``).

    Thread-safe. NOTE: the lock guards the claim maps only; fenced writes are stopped and
    waited for after it is released.
    """

    def __init__(self, clock_ms: Callable[[], int]) -> None:
        self.clock_ms = clock_ms
        self._lock = threading.Lock()
        # segment -> sorted starts of non-overlapping claims, and start -> claim
        self._starts: dict[str, list[int]] = {}
        self._claims: dict[str, dict[int, _Claim]] = {}
        self._num = 0
        self._prune_at = 1 << 14

    def begin(self, grant: Grant, stream: WriteStream | None, by_id: bool = False) -> _Claim:
        """Claim ``grant``'s range for a write (``stream``: bytes that will stream in).

        ``by_id``: the segment addresses objects by id, not by byte (NVMe): the claim is the id.

        Raises:
            GrantInvalidError: a newer allocation owns part of the range, or the grant is used
                up or in use; KVTimeoutError: an older write on the range did not stop in time.
        """
        end = grant.offset + (1 if by_id else max(1, grant.size))
        return self.claim(
            grant.segment, grant.offset, end, grant.expires_ms, grant.signature, stream
        )

    def claim(
        self,
        segment: str,
        start: int,
        end: int,
        stamp: int,
        signature: bytes,
        stream: WriteStream | None = None,
    ) -> _Claim:
        """Claim ``[start, end)`` of ``segment`` for a writer whose allocation is ordered by
        ``stamp`` (a grant's expiry) and named by ``signature``; see :meth:`begin`.

        Raises:
            GrantInvalidError, KVTimeoutError: as :meth:`begin`.
        """
        now = self.clock_ms()
        with self._lock:
            mine, fenced = self._claim_locked(segment, start, end, stamp, signature, stream, now)
            if self._num > self._prune_at:
                self._prune(now)
        for s in fenced:
            s.abort()
        for s in fenced:
            if not s.stopped.wait(FENCE_WAIT_S):
                self.end(mine, stream, complete=False)
                raise KVTimeoutError("an older write on these bytes did not stop in time")
        return mine

    def begin_many(
        self, items: list[tuple[Grant, bool, WriteStream | None]]
    ) -> list[_Claim | KVStoreError]:
        """:meth:`begin` for the ``(grant, by_id, stream)`` items of one write request: one lock
        for all, then every fenced older write is stopped.

        Returns:
            Per item, its claim or the error :meth:`begin` would raise (GrantInvalidError,
            KVTimeoutError).
        """
        now = self.clock_ms()
        out: list[_Claim | KVStoreError] = []
        fenced_by: list[list[WriteStream]] = []
        own = {id(stream) for _, _, stream in items if stream is not None}
        with self._lock:
            for grant, by_id, stream in items:
                end = grant.offset + (1 if by_id else max(1, grant.size))
                try:
                    mine, fenced = self._claim_locked(
                        grant.segment,
                        grant.offset,
                        end,
                        grant.expires_ms,
                        grant.signature,
                        stream,
                        now,
                    )
                except GrantInvalidError as err:
                    out.append(err)
                    fenced_by.append([])
                    continue
                out.append(mine)
                fenced_by.append(fenced)
            if self._num > self._prune_at:
                self._prune(now)
        for fenced in fenced_by:
            for s in fenced:
                s.abort()
        for k, fenced in enumerate(fenced_by):
            for s in fenced:
                # NOTE: a request that fences itself (two live grants of overlapping bytes) has
                # aborted its own stream: no byte of it lands, and waiting for it would deadlock.
                if id(s) not in own and not s.stopped.wait(FENCE_WAIT_S):
                    claim = out[k]
                    assert isinstance(claim, _Claim), "only a claim fences"
                    self.end(claim, items[k][2], complete=False)
                    out[k] = KVTimeoutError("an older write on these bytes did not stop in time")
                    break
        return out

    def _claim_locked(
        self,
        segment: str,
        start: int,
        end: int,
        stamp: int,
        signature: bytes,
        stream: WriteStream | None,
        now: int,
    ) -> tuple[_Claim, list[WriteStream]]:
        """The claim of :meth:`claim`, and the streams it fences (to stop after the lock).

        NOTE: called holding ``self._lock``.

        Raises:
            GrantInvalidError: as :meth:`begin`.
        """
        starts = self._starts.setdefault(segment, [])
        claims = self._claims.setdefault(segment, {})
        i = bisect.bisect_left(starts, start)
        if i and claims[starts[i - 1]].end > start:
            i -= 1
        overlapping = []
        while i < len(starts) and starts[i] < end:
            overlapping.append(claims[starts[i]])
            i += 1
        fenced: list[WriteStream] = []
        mine: _Claim | None = None
        for c in overlapping:
            if c.stamp < now and c.signature != signature:
                continue  # expired: every grant it could fence has expired too
            if c.signature == signature and (c.start, c.end) == (start, end):
                if c.done or c.streams:
                    raise GrantInvalidError("this write grant was already used (or is in use)")
                mine = c
            elif c.stamp >= stamp:
                raise GrantInvalidError(
                    "these bytes now belong to a newer allocation: the grant is stale"
                )
        for c in overlapping:
            if c is not mine:
                fenced.extend(c.streams)
                self._remove(segment, c)
        if mine is None:
            mine = _Claim(start, end, stamp, signature)
            bisect.insort(starts, start)
            claims[start] = mine
            self._num += 1
        if stream is not None:
            mine.streams.append(stream)
        return mine, fenced

    def end(self, claim: _Claim, stream: WriteStream | None, complete: bool) -> None:
        """The write of ``claim`` is over (``complete``: all its bytes arrived and hold)."""
        with self._lock:
            if stream is not None and stream in claim.streams:
                claim.streams.remove(stream)
            if complete:
                claim.done = True

    def end_many(self, ends: list[tuple[_Claim, bool]], stream: WriteStream | None) -> None:
        """:meth:`end` for many ``(claim, complete)`` of one write request (one lock)."""
        with self._lock:
            for claim, complete in ends:
                if stream is not None and stream in claim.streams:
                    claim.streams.remove(stream)
                if complete:
                    claim.done = True

    def reset(self) -> None:
        """Forget every claim and stop every write in progress (a new grant secret: no grant
        verified under the old one may write another byte)."""
        with self._lock:
            streams = [
                s for claims in self._claims.values() for c in claims.values() for s in c.streams
            ]
            self._starts.clear()
            self._claims.clear()
            self._num = 0
        for s in streams:
            s.abort()

    def _remove(self, segment: str, c: _Claim) -> None:
        starts = self._starts[segment]
        j = bisect.bisect_left(starts, c.start)
        if j < len(starts) and starts[j] == c.start and self._claims[segment].get(c.start) is c:
            del starts[j]
            del self._claims[segment][c.start]
            self._num -= 1

    def _prune(self, now_ms: int) -> None:
        """Drop expired claims (no grant they could fence is valid any more)."""
        for segment, claims in self._claims.items():
            live = {s: c for s, c in claims.items() if c.stamp >= now_ms or c.streams}
            self._claims[segment] = live
            self._starts[segment] = sorted(live)
        self._num = sum(len(c) for c in self._claims.values())
        self._prune_at = max(1 << 14, 2 * self._num)

    def __len__(self) -> int:
        return self._num
