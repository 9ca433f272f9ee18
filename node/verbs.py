"""The data server's own verbs: ``write``, ``read``, ``ping``, ``manifest`` and ``stats``.

``write``  ``{"items": [[grant, start, length, checksum], ...]}`` + payload (the items' bytes,
           concatenated) → per item ``[code, None | message]``; a grant as in ``read``
``read``   ``{"items": [[grant, ranges | None], ...]}`` → per item ``[code, length | message]``
           + payload (the valid items' ranges, concatenated); a grant is one-key or a
           reference to a batch grant given earlier in the items (``kvstore.grants``)

Both take ``"short": true`` too: then a success is answered by its value alone (``None`` for
a write, the length for a read), not ``[0, value]``; an error as always. Without the flag
every item is answered in full, and the client reads either form.
``read_keys`` ``{"items": [[key, room], ...]}`` → per item ``[size, checksum]`` or an error
           + payload (the found objects' bytes, concatenated): a one-hop read, by key and
           without a grant, of the objects this node holds whole in memory (DRAM), each at
           most ``room`` bytes; any other is a miss (``KEY_NOT_FOUND``) the client takes to
           the master. With ``"where": true`` (a client that maps this node's arenas, so the
           operator's) a hit is ``[size, checksum, segment, offset]`` and no bytes follow: the
           client copies them itself. A node that may have been fenced answers every item
           ``NODE_UNAVAILABLE`` (the rule is in :mod:`kvstore.placement`).
``ping``, ``manifest``, ``stats``: no arguments, no payload.

A tenant's connection (``kvstore.node.server.DataConnection``) may use only grants for its own
tenant's keys, or for the blocks of a namespace the operator shared (``DataServer.check_owned``):
any other item is answered ``FORBIDDEN`` and touches nothing. It may not ask for the
``manifest`` either (every tenant's keys are in it).

A verb is a handler ``(conn, request, payload_len, scratch)`` registered on the
:class:`~kvstore.node.server.DataServer` through its public ``register_verb``, like the optional
verbs of the shm (``kvstore.node.shm_verbs``) and RDMA transports. They live apart from the
server so that the server is only connections and the framing rules, and a verb reads as one
function: check every item, then move the bytes, then answer per item.

A handler raises a ``KVStoreError`` only before it touches the payload (the server then answers
the refusal and skips the payload); after that, every item's outcome is in the answer.

Writes to a tier with memory in place (DRAM) stream each item straight into the tier
(``recv_into``); writes to the other tiers (NVMe, HBM) carry whole objects, buffered and stored
after the payload in one batch per tier (one lmdb transaction for NVMe).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

from kvstore import grants, protocol
from kvstore.errors import (
    ForbiddenError,
    GrantInvalidError,
    InvalidRequestError,
    KeyNotFoundError,
    KVStoreError,
    NodeUnavailableError,
    ProtocolError,
)
from kvstore.node import claims
from kvstore.stored_object import StoredObject
from kvstore.types import TIERS_BY_ID, result_to_wire

if TYPE_CHECKING:
    from kvstore.node.server import DataServer, VerbHandler

#: Most ranges one ``read`` item may ask for.
MAX_RANGES_PER_ITEM = 4096
#: The most payload bytes of ``write`` (every other verb here takes none).
MAX_WRITE_PAYLOAD = protocol.DEFAULT_MAX_PAYLOAD


def install(server: DataServer) -> None:
    """Register the data server's own verbs on ``server``."""
    server.register_verb("write", partial(write, server), max_payload=MAX_WRITE_PAYLOAD)
    server.register_verb("read", partial(read, server))
    server.register_verb("read_keys", partial(read_keys, server))
    server.register_verb("ping", simple(lambda args: {"role": "node"}))
    server.register_verb("manifest", partial(manifest, server))
    server.register_verb("stats", simple(lambda args: server.stats()))


def simple(fn: Callable[[dict[str, Any]], Any]) -> VerbHandler:
    """A verb without payload whose answer is ``fn(args)``."""

    def handler(
        fs: protocol.FramedSocket, req: protocol.Request, payload_len: int, scratch: memoryview
    ) -> None:
        if payload_len:
            raise ProtocolError(f"{req.verb} takes no payload")
        fs.send_frame(protocol.encode_response(req.req_id, fn(req.args)))

    return handler


def manifest(
    server: DataServer,
    fs: protocol.FramedSocket,
    req: protocol.Request,
    payload_len: int,
    scratch: memoryview,
) -> None:
    """``manifest``: what the node holds, for the operator only (it names every tenant's keys)."""
    if payload_len:
        raise ProtocolError("manifest takes no payload")
    if server.owned_by(fs) is not None:
        raise ForbiddenError("the manifest is the operator's: it names every tenant's keys")
    fs.send_frame(protocol.encode_response(req.req_id, server.manifest.snapshot()))


def write(
    server: DataServer,
    fs: protocol.FramedSocket,
    req: protocol.Request,
    payload_len: int,
    scratch: memoryview,
) -> None:
    """``write``: stream each item's bytes into its granted range (see the module docstring).

    Five steps: check the request (:func:`check_write_items`, the only refusal of the whole
    request), plan each item (:func:`plan_write_item`), claim the planned ranges
    (:func:`claim_write_items`), receive the payload (:func:`receive_write_items`), store the
    buffered whole objects (:func:`store_buffered_objects`); then answer per item.
    """
    raw_items = check_write_items(req, payload_len)
    ok: Any = None if req.args.get("short") is True else [0, None]  # a success's answer
    # NOTE: one WriteStream for the whole request: its items share one socket, and fencing
    # any of them shuts that socket down, so they stop together anyway. It is stopped (and
    # its claims released) when the request is over.
    stream = claims.WriteStream(fs.sock)
    now = server.clock_ms()
    reader = server.grant_reader(grants.OP_WRITE)
    owned = server.owned_by(fs)
    items = [plan_write_item(server, reader, now, owned, *raw) for raw in raw_items]
    claim_write_items(server, items, stream)
    try:
        results, buffered = receive_write_items(server, fs, items, scratch, stream.is_aborted, ok)
        store_buffered_objects(server, items, buffered, results, ok)
    finally:
        _end_write(server, items, stream)
    server.num_writes += len(items)
    fs.send_frame(protocol.encode_response(req.req_id, results))


@dataclass(slots=True)
class WriteItem:
    """One item of a ``write`` request as its steps see it: planned, then claimed, then
    received (and stored)."""

    start: int
    length: int
    checksum: Any
    #: Why the item is refused (its bytes are skipped and it is answered this error), or None.
    error: KVStoreError | None = None
    grant: grants.Grant | None = None
    #: The bytes it streams into (a tier with memory in place), or None: a whole object,
    #: buffered and stored after the payload.
    dest: memoryview | None = None
    #: Its claim is by object id, not by byte range (NVMe).
    by_id: bool = False
    claim: claims.Claim | None = None
    #: All its bytes arrived (and, when buffered, were stored).
    done: bool = False

    def wrote_whole_in_place(self) -> bool:
        """Whether a whole object streamed into a tier with memory in place (the manifest
        records it; a buffered one is recorded by ``DataServer.store_objects``)."""
        grant = self.grant
        whole = grant is not None and self.start == 0 and self.length == grant.size
        return self.done and self.dest is not None and whole


#: Per segment, its buffered whole objects: ``(item index, object, bytes)``.
Buffered = dict[str, list[tuple[int, StoredObject, memoryview]]]


def check_write_items(req: protocol.Request, payload_len: int) -> list[list[Any]]:
    """The items of a ``write`` request, checked as a whole before any payload byte is read.

    Raises:
        InvalidRequestError: items that are not ``[grant, start, length, checksum]`` lists, or
            a length that is not a non-negative int.
        ProtocolError: a payload that is not the items' lengths added up.
    """
    items = req.args.get("items")
    if not isinstance(items, list) or not all(isinstance(i, list) and len(i) == 4 for i in items):
        raise InvalidRequestError("write takes items: [[grant, start, length, checksum], ...]")
    lengths = [i[2] for i in items]
    if not all(type(n) is int and n >= 0 for n in lengths):
        raise InvalidRequestError("item lengths must be non-negative integers")
    if sum(lengths) != payload_len:
        raise ProtocolError(
            f"payload of {payload_len} bytes does not match the items' {sum(lengths)}"
        )
    return items


def plan_write_item(
    server: DataServer,
    reader: grants.GrantReader,
    now: int,
    owned: bytes | None,
    grant_wire: Any,
    start: Any,
    length: int,
    checksum: Any,
) -> WriteItem:
    """Check one item's grant (``owned``: what its key must start with, None: any key),
    range and checksum, and say where its bytes go; a refusal is kept on the item (nothing is
    touched yet)."""
    item = WriteItem(start, length, checksum)
    try:
        grant = reader.resolve(grant_wire)
        if grant is None:
            # One-key write grants are used once: not worth a place in the memo of verified
            # grants.
            grant = server.verified.check(grant_wire, grants.OP_WRITE, now, remember=False)
        if owned is not None:
            server.check_owned(grant, owned)
        view = server.granted_bytes(grant)
        if view is None:  # a tier without memory to write into: whole objects only
            if start != 0 or length != grant.size:
                raise InvalidRequestError(
                    f"writes to segment {grant.segment!r} carry whole objects"
                )
        else:
            grants.check_range(grant, start, length)
        if type(checksum) is not int:
            raise InvalidRequestError("checksum must be an integer")
        if view is None:  # (bytes buffered, stored after the payload: no stream to fence)
            item.by_id = server.tiers[grant.segment].tier in TIERS_BY_ID  # (NVMe, shared: ids)
        else:
            item.dest = view[start : start + length]
        item.grant = grant
    except KVStoreError as err:
        item.error = err
    return item


def claim_write_items(
    server: DataServer, items: list[WriteItem], stream: claims.WriteStream
) -> None:
    """Claim every planned item's range at once (see :mod:`kvstore.node.claims`): a write
    refused there (a stale grant, a newer write of the same bytes) keeps the refusal."""
    planned = [i for i in items if i.error is None]
    wanted = [(i.grant, i.by_id, None if i.dest is None else stream) for i in planned]
    for item, got in zip(planned, server.claims.begin_many(wanted), strict=True):
        if isinstance(got, KVStoreError):
            item.error, item.grant, item.dest = got, None, None
        else:
            item.claim = got


def receive_write_items(
    server: DataServer,
    fs: protocol.FramedSocket,
    items: list[WriteItem],
    scratch: memoryview,
    aborted: Callable[[], bool],
    ok: Any,
) -> tuple[list[Any], Buffered]:
    """Read the payload, item by item: a refused item's bytes are skipped, an in-place item's
    streamed into its tier, a whole object's buffered for :func:`store_buffered_objects`.

    Returns:
        The answer per item so far, and the buffered objects by segment.
    """
    results: list[Any] = []
    buffered: Buffered = {}
    for i, item in enumerate(items):
        if item.error is not None or item.grant is None:
            fs.discard(item.length, scratch)
            results.append(result_to_wire(item.error))
        elif item.dest is None:
            buf = memoryview(bytearray(item.length))
            fs.recv_into(buf)
            obj = StoredObject.written(item.grant, item.checksum)
            buffered.setdefault(item.grant.segment, []).append((i, obj, buf))
            results.append(ok)
        else:
            # No socket read starts once the grant has expired (or a newer write of these
            # bytes fenced this one): no byte of it lands on another allocation's bytes.
            left_s = (item.grant.expires_ms - server.clock_ms()) / 1000
            fs.recv_into_before(item.dest, time.monotonic() + left_s, aborted)
            item.done = True
            results.append(ok)
    return results, buffered


def store_buffered_objects(
    server: DataServer, items: list[WriteItem], buffered: Buffered, results: list[Any], ok: Any
) -> None:
    """Store the buffered whole objects, one batch per tier (one lmdb transaction for NVMe),
    each answer in ``results``: a grant that expired while its bytes arrived stores nothing."""
    for segment, batch in buffered.items():
        now = server.clock_ms()
        live = []
        for i, obj, buf in batch:
            if now > obj.stamp:  # (the stamp is the write grant's expiry)
                results[i] = result_to_wire(
                    GrantInvalidError("write grant expired before its bytes arrived")
                )
            else:
                live.append((i, obj, buf))
        errs = server.store_objects(segment, [(obj, buf) for _, obj, buf in live])
        for (i, _, _), e in zip(live, errs, strict=True):
            results[i] = ok if e is None else result_to_wire(e)
            if e is None:
                items[i].done = True


def _end_write(server: DataServer, items: list[WriteItem], stream: claims.WriteStream) -> None:
    """Whatever happened: record the whole objects written in place in the manifest, release
    every claim (a completed one as done), and mark the request's stream stopped."""
    stored = [StoredObject.written(i.grant, i.checksum) for i in items if i.wrote_whole_in_place()]
    if stored:
        server.manifest.record_many(stored)
    server.claims.end_many([(i.claim, i.done) for i in items if i.claim is not None], stream)
    stream.stopped.set()


def read(
    server: DataServer,
    fs: protocol.FramedSocket,
    req: protocol.Request,
    payload_len: int,
    scratch: memoryview,
) -> None:
    """``read``: send the granted bytes (or ranges of them) after the answer."""
    if payload_len:
        raise ProtocolError("read takes no payload")
    items = req.args.get("items")
    if not isinstance(items, list) or not all(isinstance(i, list) and len(i) == 2 for i in items):
        raise InvalidRequestError("read takes items: [[grant, ranges | None], ...]")
    short = req.args.get("short") is True  # a success answered by its length alone
    results: list[Any] = []
    views: list[memoryview] = []
    reader = server.grant_reader(grants.OP_READ)
    owned = server.owned_by(fs)
    for grant_wire, ranges in items:
        try:
            grant, view = server.granted_view(
                grant_wire, grants.OP_READ, reader=reader, owned=owned
            )
            if ranges is None:
                views.append(view)
                results.append(len(view) if short else [0, len(view)])
                continue
            if not isinstance(ranges, list) or len(ranges) > MAX_RANGES_PER_ITEM:
                raise InvalidRequestError(
                    f"ranges must be a list of at most {MAX_RANGES_PER_ITEM} pairs"
                )
            item_views = []
            for r in ranges:
                if not isinstance(r, list) or len(r) != 2:
                    raise InvalidRequestError("each range must be [start, length]")
                grants.check_range(grant, r[0], r[1])
                item_views.append(view[r[0] : r[0] + r[1]])
            views.extend(item_views)
            length = sum(len(v) for v in item_views)
            results.append(length if short else [0, length])
        except KVStoreError as err:
            results.append(err.to_wire())
    total = sum(map(len, views))
    server.num_reads += len(items)
    fs.send_frame(protocol.encode_response(req.req_id, results, total), views)


def read_keys(
    server: DataServer,
    fs: protocol.FramedSocket,
    req: protocol.Request,
    payload_len: int,
    scratch: memoryview,
) -> None:
    """``read_keys``: send the whole objects found by key (see the module docstring)."""
    if payload_len:
        raise ProtocolError("read_keys takes no payload")
    items = req.args.get("items")
    if not isinstance(items, list) or not all(
        isinstance(i, list) and len(i) == 2 and type(i[0]) is bytes and type(i[1]) is int
        for i in items
    ):
        raise InvalidRequestError("read_keys takes items: [[key, room], ...]")
    results: list[Any] = []
    views: list[memoryview] = []
    if not server.serves_one_hop():
        refused = NodeUnavailableError("this node is not sure it is still a member").to_wire()
        fs.send_frame(protocol.encode_response(req.req_id, [refused] * len(items)))
        return
    owned = server.owned_by(fs)
    where = req.args.get("where") is True
    if where and owned is not None:
        raise ForbiddenError("a tenant's connection reads bytes, not places in the arena")
    find, tiers = server.manifest.find, server.tiers
    for key, room in items:
        obj = find(key)
        if obj is None or obj.size > room:
            results.append(_MISS)
            continue
        if (
            owned is not None
            and not key.startswith(owned)
            and not server.tenants.is_shared_key(key)
        ):
            results.append(_MISS)  # (a guess at another tenant's key learns nothing)
            continue
        tier = tiers.get(obj.segment)
        view = tier.in_place(obj.offset, obj.size) if tier is not None else None
        if view is None:
            results.append(_MISS)  # not in memory here (NVMe, HBM): the master's way
            continue
        if where:
            results.append([obj.size, obj.checksum, obj.segment, obj.offset])
            server.num_reads += 1
            continue
        views.append(view)
        results.append([obj.size, obj.checksum])
    server.num_reads += len(views)
    fs.send_frame(protocol.encode_response(req.req_id, results, sum(map(len, views))), views)


_MISS = KeyNotFoundError("not held here in memory").to_wire()
