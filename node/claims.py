"""Write claims: which allocation each granted range of a node's segments belongs to now.

A write grant's expiry is its claim stamp (``expires = put_start time + put timeout``), so of two
grants for overlapping bytes the one that expires later belongs to the newer allocation; the node
refuses a write that an older grant would land on a newer allocation's bytes (see
:class:`WriteClaims`). Only the storage node keeps claims; grants themselves are in
:mod:`kvstore.grants`.
"""

from __future__ import annotations

import bisect
import contextlib
import socket
import threading
from collections.abc import Callable
from typing import Any

from kvstore.errors import GrantInvalidError, KVStoreError, KVTimeoutError
from kvstore.grants import Grant

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


#: A write's hold on ``[start, end)`` of ``segment``: ``(segment, start, end, stamp,
#: signature)``, what :meth:`WriteClaims.begin` returns and :meth:`WriteClaims.end` takes back
#: (``stamp`` and ``signature`` name its grant). A plain tuple: a node makes one per key written
#: (a dataclass's __init__ costs more a key: the node's CPU a key is in ``.venv/bin/python
#: bench/bench_small.py``).
Claim = tuple[str, int, int, int, bytes]


#: A claim as :class:`WriteClaims` keeps it, by its start: ``(end, stamp, signature, done,
#: writing)``: ``done`` once a write with this grant completed (the grant is used up),
#: ``writing`` the write streaming in now (None once it is over; a claim has at most one: a
#: second write with its grant is refused). A plain tuple, which the garbage collector stops
#: tracking at its first pass once nothing streams in: a node keeps a claim per write until its
#: grant expires (a put timeout, 30 s, of writes), and claim objects were most of what its full
#: collections walked under a steady write load.
_Record = tuple[int, int, bytes, bool, WriteStream | None]


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
        # segment -> sorted starts of non-overlapping claims, and start -> its record
        self._starts: dict[str, list[int]] = {}
        self._claims: dict[str, dict[int, _Record]] = {}
        self._num = 0
        self._prune_at = 1 << 14

    def begin(self, grant: Grant, stream: WriteStream | None, by_id: bool = False) -> Claim:
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
    ) -> Claim:
        """Claim ``[start, end)`` of ``segment`` for a writer whose allocation is ordered by
        ``stamp`` (a grant's expiry) and named by ``signature`` with the range (the members of
        a batch grant share its signature); see :meth:`begin`.

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
    ) -> list[Claim | KVStoreError]:
        """:meth:`begin` for the ``(grant, by_id, stream)`` items of one write request: one lock
        for all, then every fenced older write is stopped.

        Returns:
            Per item, its claim or the error :meth:`begin` would raise (GrantInvalidError,
            KVTimeoutError).
        """
        now = self.clock_ms()
        out: list[Claim | KVStoreError] = []
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
                    assert isinstance(claim, tuple), "only a claim fences"
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
    ) -> tuple[Claim, list[WriteStream]]:
        """The claim of :meth:`claim`, and the streams it fences (to stop after the lock).

        NOTE: called holding ``self._lock``.

        Raises:
            GrantInvalidError: as :meth:`begin`.
        """
        starts = self._starts.get(segment)
        if starts is None:
            starts = self._starts[segment] = []
            self._claims[segment] = {}
        claims = self._claims[segment]
        mine = (segment, start, end, stamp, signature)
        if not starts or (starts[-1] < start and claims[starts[-1]][0] <= start):
            # Past every claim (a fresh allocation above the last claimed byte): nothing to
            # check or fence, and the claim goes last.
            starts.append(start)
            claims[start] = (end, stamp, signature, False, stream)
            self._num += 1
            return mine, []
        i = bisect.bisect_left(starts, start)
        if i and claims[starts[i - 1]][0] > start:
            i -= 1
        overlapping = []
        while i < len(starts) and starts[i] < end:
            overlapping.append(starts[i])
            i += 1
        fenced: list[WriteStream] = []
        same: int | None = None  # the start of this very grant's claim, if it has one
        for at in overlapping:
            c_end, c_stamp, c_sig, c_done, c_writing = claims[at]
            if c_stamp < now and c_sig != signature:
                continue  # expired: every grant it could fence has expired too
            if c_sig == signature and (at, c_end) == (start, end):
                if c_done or c_writing is not None:
                    raise GrantInvalidError("this write grant was already used (or is in use)")
                same = at
            elif c_stamp >= stamp:
                raise GrantInvalidError(
                    "these bytes now belong to a newer allocation: the grant is stale"
                )
        for at in overlapping:
            if at != same:
                writing = claims[at][4]
                if writing is not None:
                    fenced.append(writing)
                self._remove(segment, at)
        if same is None:
            bisect.insort(starts, start)
            self._num += 1
        claims[start] = (end, stamp, signature, False, stream)
        return mine, fenced

    def writing(self, claim: Claim) -> WriteStream | None:
        """The write streaming into ``claim`` now (None once it is over, or fenced)."""
        with self._lock:
            rec = self._claims.get(claim[0], {}).get(claim[1])
            return rec[4] if rec is not None and rec[:3] == claim[2:] else None

    def end(self, claim: Claim, stream: WriteStream | None, complete: bool) -> None:
        """The write of ``claim`` is over (``complete``: all its bytes arrived and hold)."""
        self.end_many([(claim, complete)], stream)

    def end_many(self, ends: list[tuple[Claim, bool]], stream: WriteStream | None) -> None:
        """:meth:`end` for many ``(claim, complete)`` of one write request (one lock). A
        claim fenced meanwhile (a newer allocation's claim took its range) is left alone."""
        # NOTE: the fields compared one by one, with no helper or slice per claim: this runs
        # for every key written to the node, and a helper or slices per claim add to the node's
        # CPU a key (``.venv/bin/python bench/bench_small.py``).
        claims_of = self._claims
        with self._lock:
            for (segment, start, end, stamp, signature), complete in ends:
                claims = claims_of.get(segment)
                rec = claims.get(start) if claims is not None else None
                if rec is None or rec[0] != end or rec[1] != stamp or rec[2] != signature:
                    continue  # fenced: no longer the claim of its range
                writing = None if stream is not None and rec[4] is stream else rec[4]
                if writing is not rec[4] or (complete and not rec[3]):
                    claims[start] = (end, stamp, signature, rec[3] or complete, writing)

    def reset(self) -> None:
        """Forget every claim and stop every write in progress (a new grant secret: no grant
        verified under the old one may write another byte)."""
        with self._lock:
            streams = [
                rec[4]
                for claims in self._claims.values()
                for rec in claims.values()
                if rec[4] is not None
            ]
            self._starts.clear()
            self._claims.clear()
            self._num = 0
        for s in streams:
            s.abort()

    def _remove(self, segment: str, start: int) -> None:
        starts = self._starts[segment]
        j = bisect.bisect_left(starts, start)
        if j < len(starts) and starts[j] == start:
            del starts[j]
            del self._claims[segment][start]
            self._num -= 1

    def _prune(self, now_ms: int) -> None:
        """Drop expired claims (no grant they could fence is valid any more)."""
        for segment, claims in self._claims.items():
            live = {s: c for s, c in claims.items() if c[1] >= now_ms or c[4] is not None}
            self._claims[segment] = live
            self._starts[segment] = sorted(live)
        self._num = sum(len(c) for c in self._claims.values())
        self._prune_at = max(1 << 14, 2 * self._num)

    def __len__(self) -> int:
        return self._num
