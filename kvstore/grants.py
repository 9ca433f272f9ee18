"""Grants: the master's signed permission to read or write one object's bytes on one node.

The master never moves KV bytes, but it decides which bytes a client may touch. Each node gives
the master a random secret when it registers; the master signs every location it hands out with
that secret (keyed BLAKE2b-128 over the operation, key, segment, offset, size and expiry). The
node recomputes the signature before it touches its arena, and checks every requested range
against the granted ``[offset, offset + size)``. So no request can read or write bytes the master
did not grant, and the node needs no round trip to the master to know it.

A **batch grant** reads or writes many objects of one node under one signature: ``[op,
expires_ms, items, signature]`` where ``items`` is the msgpack encoding of ``[[key, segment,
offset, size], ...]`` and the signature covers a tag, the op, the expiry and those bytes. The
master answers a ``get_locations`` batch with one read grant per node, and a ``put_start`` batch
with one write grant per node and claim stamp (both asked for with ``batch_grants``), so it
signs, the client decodes and the node verifies once per batch instead of once per key: the
per-key grant was the largest per-key cost of a small read in all three processes. In a message
a grant takes one of three wire forms, read in order:

- ``[op, key, segment, offset, size, expires_ms, signature]``: a one-key grant;
- ``[slot, index, batch]``: item ``index`` of ``batch`` (a batch grant's wire form), which is
  slot ``slot`` of this message from here on;
- ``[slot, index]``: item ``index`` of the batch given as slot ``slot`` earlier in the message.

:class:`GrantBatcher` writes the master's, :class:`GrantRefs` a client's request to a node, and
:class:`GrantReader` reads them (the node verifying each batch, memoised like one-key grants).
A write grant's expiry is also its claim stamp (see :class:`kvstore.node.claims.WriteClaims`), so a write batch holds
the items of one node with one stamp; its items share the signature, and a claim is named by the
signature with its range (the master never grants overlapping ranges in one answer).

A **blank grant** is a one-key write grant signed for the empty key (:data:`BLANK_KEY`, which no
object has): the master allocates a put's space before its writer knows the key (``put_blanks``,
:mod:`kvstore.master.puts`), and the writer names the key when it writes. On the wire it is the
one-key form with the writer's key in place of the empty one and ``True`` as an eighth item
(:meth:`Grant.for_key`); the node checks the signature over the empty key and records the
object under the key written. It only ever permits a write of that one range, like any write
grant; which key the bytes hold is the master's to decide when the blank is committed.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import os
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import msgpack

from kvstore.errors import GrantInvalidError, KVStoreError, OutOfRangeError

OP_READ = "r"
OP_WRITE = "w"
SECRET_BYTES = 32
#: The key a blank grant is signed for (see the module docstring): no object has the empty key.
BLANK_KEY = b""
_FIXED = struct.Struct("!1sQQQH")  # op, offset, size, expiry, then the key's length
#: A batch grant's signed bytes start with this tag, never the first byte of a one-key grant's
#: (its op, "r" or "w"): no signature of one kind verifies as the other.
_BATCH_TAG = b"B"
_BATCH_FIXED = struct.Struct("!1s1sQ")  # tag, op, expiry, then the packed items
_PACK_ITEMS = msgpack.Packer(use_bin_type=True).pack


def new_secret() -> bytes:
    return os.urandom(SECRET_BYTES)


@dataclass(slots=True, unsafe_hash=True)  # not frozen: see the NOTE in kvstore.types
class Grant:
    """Permission for ``op`` on ``[offset, offset + size)`` of ``segment``, holding ``key``.

    ``expires_ms`` is wall-clock milliseconds since the epoch, by the master's clock (nodes and
    clients check it on the master's clock as they keep it, :mod:`kvstore.clocks`). A member of a batch grant has
    ``batch`` (the batch's wire form, as a tuple) and its ``index`` there; its ``signature`` is
    the batch's.
    """

    op: str
    key: bytes
    segment: str
    offset: int
    size: int
    expires_ms: int
    signature: bytes
    batch: tuple[Any, ...] | None = None
    index: int = 0
    #: A blank grant used for ``key`` (signed for :data:`BLANK_KEY`; see the module docstring).
    blank: bool = False

    def to_wire(self) -> list[object]:
        """The one-key wire form. A batch member has none of its own: it is sent as a reference
        (:class:`GrantRefs`)."""
        assert self.batch is None, "a batch grant's member is sent through GrantRefs"
        wire: list[object] = [
            self.op,
            self.key,
            self.segment,
            self.offset,
            self.size,
            self.expires_ms,
            self.signature,
        ]
        if self.blank:
            wire.append(True)
        return wire

    def for_key(self, key: bytes) -> Grant:
        """This blank grant (one signed for :data:`BLANK_KEY`) used to write ``key``."""
        assert self.key == BLANK_KEY and self.batch is None and self.op == OP_WRITE, "not blank"
        return Grant(
            self.op,
            key,
            self.segment,
            self.offset,
            self.size,
            self.expires_ms,
            self.signature,
            blank=True,
        )

    @staticmethod
    def from_wire(obj: object) -> Grant:
        """Raises GrantInvalidError when ``obj`` is not a well-formed grant."""
        if not isinstance(obj, list | tuple) or not 7 <= len(obj) <= 8:
            raise GrantInvalidError(
                "grant must be a 7-item list (8 for a blank grant used for a key)"
            )
        blank = len(obj) == 8
        if blank and (obj[7] is not True or obj[0] != OP_WRITE or not obj[1]):
            raise GrantInvalidError("a blank grant is a write grant used for a key")
        op, key, segment, offset, size, expires_ms, sig = obj[:7]
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
        return Grant(op, key, segment, offset, size, expires_ms, sig, blank=blank)


@functools.lru_cache(maxsize=64)
def _keyed(secret: bytes) -> Any:
    # A keyed BLAKE2b state per secret, copied per grant: copying a keyed state is cheaper than
    # keying a new one (the per-grant CPU is in ``.venv/bin/python bench/cpu_per_op.py``).
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
    key = BLANK_KEY if grant.blank else grant.key
    expected = _digest(
        secret, grant.op, key, grant.segment, grant.offset, grant.size, grant.expires_ms
    )
    if not hmac.compare_digest(expected, grant.signature):
        raise GrantInvalidError("grant signature does not verify")
    _check_use(grant, op, now_ms)


def _check_use(granted: Grant | Batch, op: str, now_ms: int) -> None:
    """Raises GrantInvalidError unless ``granted`` (verified) is for ``op`` and unexpired."""
    if granted.op != op:
        raise GrantInvalidError(f"grant is for op {granted.op!r}, not {op!r}")
    if now_ms > granted.expires_ms:
        raise GrantInvalidError("grant expired")


class VerifiedGrants:
    """A node's memo of grants whose signature it has checked, so a grant presented again (a
    client rereading a key under its lease) costs a dict lookup instead of a BLAKE2b.

    An entry is the exact wire form that verified; a grant is taken from the memo only when its
    wire form is equal in every field (the signature covers them all). Operation and expiry are
    still checked on every use. Write grants are used once: they are verified, never kept.

    Bounded by the grants it holds, a batch counting each of its items (a batch holds up to 256
    and its items are most of the memory: bounded by entries, a node's memory grew with every
    put until 16K batches were held; tests/integration/test_churn.py). Past ``max_items``,
    expired grants go (all, if few have).

    Not locked: a dict's get and set are atomic under the GIL, and a lost entry only costs a
    recomputation.
    """

    def __init__(self, secret: bytes, max_items: int = 1 << 15) -> None:
        self.secret = secret
        self.max_items = max_items
        self._memo: dict[bytes, tuple[list[Any], Grant | Batch]] = {}
        self._num_items = 0  # grants in the memo, a batch's items each (racy: a bound, not a count)

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
                _check_use(grant, op, now_ms)
                return grant
        grant = Grant.from_wire(grant_wire)
        if not grant.key:  # (a blank grant as the master hands it out: see Grant.for_key)
            raise GrantInvalidError("a blank grant writes only with the key it is used for")
        verify(self.secret, grant, op, now_ms)
        if not remember:
            return grant
        self._remember(grant.signature, list(grant_wire), grant, 1, now_ms)
        return grant

    def check_batch(self, batch_wire: Any, op: str, now_ms: int) -> Batch:
        """The verified batch grant of ``batch_wire``, memoised when it reads (a client
        rereading under its lease presents it again).

        Raises:
            GrantInvalidError: malformed, forged, for another operation, or expired.
        """
        if type(batch_wire) is not list or len(batch_wire) != 4:
            raise GrantInvalidError("a batch grant must be a 4-item list")
        sig = batch_wire[3]
        hit = self._memo.get(sig) if type(sig) is bytes else None
        if hit is not None and hit[0] == batch_wire:
            batch = hit[1]
        else:
            op_, expires_ms, blob, sig = _batch_fields(batch_wire)
            expected = _batch_digest(self.secret, op_, expires_ms, blob)
            if not hmac.compare_digest(expected, sig):
                raise GrantInvalidError("batch grant signature does not verify")
            # Signed by the master: its items are well formed (see sign_batch). Tuples, not
            # lists: a tuple of a key, a segment and ints leaves the garbage collector's sight
            # at its first pass, and the memo holds up to max_items of them (as lists, they
            # were most of what a node's full collections walked under many tiny writes:
            # ``.venv/bin/python bench/bench_node_gc.py``).
            items = msgpack.unpackb(blob, use_list=False)
            batch = Batch(op_, expires_ms, sig, tuple(batch_wire), items)
            if op_ == OP_READ:
                self._remember(sig, list(batch_wire), batch, len(items), now_ms)
        _check_use(batch, op, now_ms)
        return batch

    def _remember(
        self, sig: bytes, wire: list[Any], granted: Grant | Batch, num_items: int, now_ms: int
    ) -> None:
        if self._num_items + num_items > self.max_items:
            self._drop_expired(now_ms)
        self._memo[sig] = (wire, granted)
        self._num_items += num_items

    def _drop_expired(self, now_ms: int) -> None:
        """Make room: drop expired grants, or everything when too few have expired."""
        entries = list(self._memo.items())  # one C call: other threads may insert meanwhile
        live = {s: e for s, e in entries if e[1].expires_ms >= now_ms}
        num_items = sum(_num_items(e[1]) for e in live.values())
        if num_items < self.max_items // 2:
            self._memo, self._num_items = live, num_items
        else:
            self._memo, self._num_items = {}, 0


def _num_items(granted: Grant | Batch) -> int:
    return len(granted.items) if type(granted) is Batch else 1


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


# --------------------------------------------------------------------------- batch grants
def _batch_digest(secret: bytes, op: str, expires_ms: int, blob: bytes) -> bytes:
    h = _keyed(secret).copy()
    h.update(_BATCH_FIXED.pack(_BATCH_TAG, op.encode(), expires_ms) + blob)
    return h.digest()


def sign_batch(secret: bytes, op: str, expires_ms: int, items: list[list[Any]]) -> list[Any]:
    """A batch grant's wire form: ``op`` on each of ``items`` (``[key, segment, offset, size]``,
    well formed: the node trusts what verifies) until ``expires_ms``."""
    blob = _PACK_ITEMS(items)
    return [op, expires_ms, blob, _batch_digest(secret, op, expires_ms, blob)]


@dataclass(slots=True)
class Batch:
    """A batch grant opened: its op, expiry, signature, wire form and items."""

    op: str
    expires_ms: int
    signature: bytes
    wire: tuple[Any, ...]
    items: Sequence[Any]  # [key, segment, offset, size] each (tuples once verified by a node)

    def grant(self, index: Any, check: bool) -> Grant:
        """The grant of item ``index`` (``check``: its fields are checked, as a client does
        with an answer it has not verified).

        Raises:
            GrantInvalidError: no such item, or (``check``) a malformed one.
        """
        if type(index) is not int or not 0 <= index < len(self.items):
            raise GrantInvalidError("malformed grant: no such item in its batch")
        item = self.items[index]
        if check and not (
            type(item) in (list, tuple)
            and len(item) == 4
            and type(item[0]) is bytes
            and type(item[1]) is str
            and type(item[2]) is int
            and type(item[3]) is int
            and item[2] >= 0
            and item[3] >= 0
        ):
            raise GrantInvalidError("malformed batch grant item")
        key, segment, offset, size = item
        return Grant(
            self.op, key, segment, offset, size, self.expires_ms, self.signature, self.wire, index
        )


def _batch_fields(batch_wire: Any) -> tuple[str, int, bytes, bytes]:
    """A batch grant's op, expiry, packed items and signature.

    Raises:
        GrantInvalidError: malformed.
    """
    if type(batch_wire) is not list or len(batch_wire) != 4:
        raise GrantInvalidError("a batch grant must be a 4-item list")
    op, expires_ms, blob, sig = batch_wire
    if (
        (op != OP_READ and op != OP_WRITE)
        or type(expires_ms) is not int
        or type(blob) is not bytes
        or type(sig) is not bytes
        or not 0 <= expires_ms < 1 << 64
    ):
        raise GrantInvalidError("malformed batch grant")
    return op, expires_ms, blob, sig


def open_batch_unverified(batch_wire: Any) -> Batch:
    """A batch grant as a client reads it (it holds no secret: the node verifies).

    Raises:
        GrantInvalidError: malformed.
    """
    op, expires_ms, blob, sig = _batch_fields(batch_wire)
    try:
        items = msgpack.unpackb(blob)
    except ValueError as exc:  # msgpack's errors derive from it
        raise GrantInvalidError(f"malformed batch grant items: {exc}") from None
    if type(items) is not list:
        raise GrantInvalidError("malformed batch grant items")
    return Batch(op, expires_ms, sig, tuple(batch_wire), items)


class GrantReader:
    """Reads the grants of one message in order (see the module docstring): batch references
    resolved against the batches given earlier in it.

    ``open_batch(batch_wire)`` opens a batch: :func:`open_batch_unverified` on a client, the
    node's :meth:`VerifiedGrants.check_batch` on a node (``check=False`` then: verified items
    are the master's own). A batch that fails to open fails every reference to its slot.
    """

    __slots__ = ("_open", "_check", "_slots")

    def __init__(self, open_batch: Callable[[Any], Batch], check: bool) -> None:
        self._open = open_batch
        self._check = check
        self._slots: dict[Any, Batch | KVStoreError] = {}

    def resolve(self, wire: Any) -> Grant | None:
        """The grant a reference names, or None when ``wire`` is not a reference (a one-key
        grant, for the caller to read).

        Raises:
            GrantInvalidError: a malformed reference or batch, or an unknown slot; any error of
                ``open_batch`` for its batch.
        """
        if type(wire) is not list:
            return None
        n = len(wire)
        if n == 2:  # the common case first: a later member of a batch opened already
            batch = self._slots.get(wire[0]) if type(wire[0]) is int else None
            if type(batch) is Batch:
                return batch.grant(wire[1], self._check)
        elif n != 3:
            return None
        if type(wire[0]) is not int:
            raise GrantInvalidError("malformed grant: a batch slot must be an integer")
        if n == 2:
            batch = self._slots.get(wire[0])
            if batch is None:
                raise GrantInvalidError("malformed grant: its batch slot was not given before")
        else:
            try:
                batch = self._open(wire[2])
            except KVStoreError as err:
                batch = err
            self._slots[wire[0]] = batch
        if isinstance(batch, KVStoreError):
            raise batch
        return batch.grant(wire[1], self._check)


class GrantRefs:
    """Writes the grants of one request to a node: a one-key grant whole, a member of a batch as
    a reference, its batch given whole with the first."""

    __slots__ = ("_slots",)

    def __init__(self) -> None:
        self._slots: dict[int, int] = {}  # id of a batch's wire form -> its slot

    def wire(self, grant: Grant) -> list[Any]:
        batch = grant.batch
        if batch is None:
            return grant.to_wire()
        slot = self._slots.get(id(batch))
        if slot is None:
            slot = self._slots[id(batch)] = len(self._slots)
            return [slot, grant.index, list(batch)]
        return [slot, grant.index]


class GrantBatcher:
    """Builds the master's answer's batch grants for ``op``: one per node and expiry.

    :meth:`ref` gives an extent's reference as it goes; :meth:`sign` then signs each batch into
    the reference that comes first in the answer, which opens its slot for a reader (see
    :class:`GrantReader`). The answer's order need not be the order of the :meth:`ref` calls:
    a put places its keys size by size, so a key early in the answer may be placed after a
    later one of another size on the same node. The caller sets :attr:`position` (the place in
    the answer of the references made next) where the two orders differ.
    """

    __slots__ = ("op", "position", "_batches")

    def __init__(self, op: str) -> None:
        self.op = op
        #: The position in the answer of the references :meth:`ref` makes next (left at 0, the
        #: call order is the answer's order).
        self.position = 0
        # (node id, expiry) -> [its secret, its items, the reference that carries it (the first
        # in the answer), that reference's position]
        self._batches: dict[tuple[str, int], list[Any]] = {}

    def ref(
        self,
        node_id: str,
        secret: bytes,
        key: bytes,
        segment: str,
        offset: int,
        size: int,
        expires_ms: int,
    ) -> list[Any]:
        """The reference of ``op`` on ``[offset, offset + size)`` of ``segment`` on ``node_id``
        until ``expires_ms``, an item of the batch of that node and expiry."""
        batch = self._batches.get((node_id, expires_ms))
        if batch is None:
            ref = [len(self._batches), 0]
            item = [key, segment, offset, size]
            self._batches[node_id, expires_ms] = [secret, [item], ref, self.position]
            return ref
        items = batch[1]
        items.append([key, segment, offset, size])
        ref = [batch[2][0], len(items) - 1]
        if self.position < batch[3]:  # earlier in the answer: this one carries the batch
            batch[2], batch[3] = ref, self.position
        return ref

    def sign(self) -> None:
        """Sign every batch into the first of its references in the answer (call once, after
        the last :meth:`ref`)."""
        for (_, expires_ms), (secret, items, carrier, _) in self._batches.items():
            carrier.append(sign_batch(secret, self.op, expires_ms, items))
