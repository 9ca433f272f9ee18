"""The data server's own verbs: ``write``, ``read``, ``ping``, ``manifest`` and ``stats``.

``write``  ``{"items": [[grant, start, length, checksum], ...]}`` + payload (the items' bytes,
           concatenated) → per item ``[code, None | message]``; a grant as in ``read``
``read``   ``{"items": [[grant, ranges | None], ...]}`` → per item ``[code, length | message]``
           + payload (the valid items' ranges, concatenated); a grant is one-key or a
           reference to a batch grant given earlier in the items (``kvstore.grants``)

Both take ``"short": true`` too: then a success is answered by its value alone (``None`` for
a write, the length for a read), not ``[0, value]``; an error as always. (A client asks for
it; a node that predates it ignores the flag and answers in full, which the client also reads.)
``ping``, ``manifest``, ``stats``: no arguments, no payload.

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
from functools import partial
from typing import TYPE_CHECKING, Any

from kvstore import grants, protocol
from kvstore.errors import GrantInvalidError, InvalidRequestError, KVStoreError, ProtocolError
from kvstore.manifest import StoredObject
from kvstore.node import claims
from kvstore.node.tiers import TIER_NVME
from kvstore.types import result_to_wire

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
    server.register_verb("ping", simple(lambda args: {"role": "node"}))
    server.register_verb("manifest", simple(lambda args: server.manifest.snapshot()))
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


def write(
    server: DataServer,
    fs: protocol.FramedSocket,
    req: protocol.Request,
    payload_len: int,
    scratch: memoryview,
) -> None:
    """``write``: stream each item's bytes into its granted range (see the module docstring)."""
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
    # Check every item before touching the payload, then stream each into place.
    # NOTE: one WriteStream for the whole request: its items share one socket, and fencing
    # any of them shuts that socket down, so they stop together anyway. It is stopped (and
    # its claims released) when the request is over.
    ok: Any = None if req.args.get("short") is True else [0, None]  # a success's answer
    stream = claims.WriteStream(fs.sock)
    now = server.clock_ms()
    reader = server.grant_reader(grants.OP_WRITE)
    plan: list[tuple[KVStoreError | None, grants.Grant | None, memoryview | None]] = []
    wanted: list[tuple[grants.Grant, bool, claims.WriteStream | None]] = []
    for grant_wire, start, length, checksum in items:
        try:
            grant = reader.resolve(grant_wire)
            if grant is None:
                # One-key write grants are used once: not worth a place in the memo of
                # verified grants.
                grant = server.verified.check(grant_wire, grants.OP_WRITE, now, remember=False)
            view = server.granted_bytes(grant)
            if view is None:  # a tier without memory to write into: whole objects only
                if start != 0 or length != grant.size:
                    raise InvalidRequestError(
                        f"writes to segment {grant.segment!r} carry whole objects"
                    )
                if type(checksum) is not int:
                    raise InvalidRequestError("checksum must be an integer")
                # (bytes buffered, stored after the payload: no stream to fence)
                by_id = server.tiers[grant.segment].tier == TIER_NVME  # (NVMe: ids)
                wanted.append((grant, by_id, None))
                plan.append((None, grant, None))
                continue
            grants.check_range(grant, start, length)
            if type(checksum) is not int:
                raise InvalidRequestError("checksum must be an integer")
            wanted.append((grant, False, stream))
            plan.append((None, grant, view[start : start + length]))
        except KVStoreError as err:
            plan.append((err, None, None))
    # Claim every checked item's range at once (see kvstore.node.claims).
    got = iter(server.claims.begin_many(wanted))
    claimed: list[Any] = []  # per planned item, its claim or None
    for k, (err, _, _) in enumerate(plan):
        if err is not None:
            claimed.append(None)
            continue
        c = next(got)
        if isinstance(c, KVStoreError):
            claimed.append(None)
            plan[k] = (c, None, None)
        else:
            claimed.append(c)
    results: list[Any] = []
    # Whole objects for tiers without in-place memory, stored in one batch per tier after the payload.
    tier_items: dict[str, list[tuple[int, StoredObject, memoryview]]] = {}
    done: set[int] = set()  # planned items whose bytes all arrived
    stored: list[StoredObject] = []
    aborted = stream.is_aborted
    try:
        for i, ((err, grant, dest), (_, start, length, checksum)) in enumerate(
            zip(plan, items, strict=True)
        ):
            if grant is not None and dest is None and err is None:
                buf = memoryview(bytearray(length))
                fs.recv_into(buf)
                obj = StoredObject.written(grant, checksum)
                tier_items.setdefault(grant.segment, []).append((len(results), obj, buf))
                results.append(ok)
                continue
            if grant is None or dest is None:
                fs.discard(length, scratch)
                results.append(result_to_wire(err))
                continue
            # No socket read starts once the grant has expired (or a newer write of these
            # bytes fenced this one): no byte of it lands on another allocation's bytes.
            left_s = (grant.expires_ms - server.clock_ms()) / 1000
            fs.recv_into_before(dest, time.monotonic() + left_s, aborted)
            done.add(i)
            if start == 0 and length == grant.size:
                stored.append(StoredObject.written(grant, checksum))
            results.append(ok)
        for segment, batch in tier_items.items():
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
                    done.add(i)
    finally:
        if stored:
            server.manifest.record_many(stored)
        server.claims.end_many(
            [(c, i in done) for i, c in enumerate(claimed) if c is not None], stream
        )
        stream.stopped.set()
    server.num_writes += len(items)
    fs.send_frame(protocol.encode_response(req.req_id, results))


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
    for grant_wire, ranges in items:
        try:
            grant, view = server.granted_view(grant_wire, grants.OP_READ, reader=reader)
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
