"""The master's RPC edge: decode a frame, call the service, map the error. Nothing else.

Every handler validates the types of its arguments before the service sees them, so a wrong
type is an ``InvalidRequestError`` for the caller, never an internal error.
"""

from __future__ import annotations

import asyncio
import heapq
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import msgpack

from kvstore import auth, protocol, serving
from kvstore.config import MAX_KEY_BYTES, check_wire_key
from kvstore.env import DEFAULT_CHUNK_ITEMS
from kvstore.errors import (
    InternalError,
    InvalidRequestError,
    KVStoreError,
    OverloadedError,
    UnknownVerbError,
)
from kvstore.keys import Namespace
from kvstore.kvblocks import tokens_from_wire
from kvstore.manifest import ManifestClaim, claims_from_wire
from kvstore.master.events import (
    MAX_EVENTS_PER_CALL,
    EventBatch,
    EventLog,
    Resync,
    event_to_wire,
)
from kvstore.master.leases import check_lease_tokens
from kvstore.master.prefix import Steps, check_prompt_size
from kvstore.master.service import MasterService, ServiceSlot
from kvstore.polling import MASTER_WINDOWS, LoopAwake, poll_window
from kvstore.transports import check_transports
from kvstore.types import SegmentSpec, result_to_wire

log = logging.getLogger(__name__)

#: Most keys one ``list_keys`` answer carries (the client asks for the next page after it).
LIST_KEYS_MAX = 10_000
#: Longest long poll of one ``events`` call (a subscriber's call timeout must exceed it).
EVENTS_MAX_WAIT_S = 30.0
EVENTS_DEFAULT_MAX = 1000
#: Most namespaces one ``events`` or ``events_snapshot`` call may name.
EVENTS_MAX_NAMESPACES = 1024
#: Most block keys one snapshot answer carries (16 bytes each: 24 MiB, under the frame limit).
SNAPSHOT_MAX_BLOCKS = 1_500_000
#: Most ``events_snapshot`` answers built or being written at once: each may hold up to
#: SNAPSHOT_MAX_BLOCKS keys until its reader takes it, so many subscribers asking together must
#: not each hold one (the rest are refused OVERLOADED; the client's event stream retries).
SNAPSHOTS_IN_FLIGHT = 4
#: How long a subscriber may take to read its snapshot before its connection is closed (so a
#: reader that never reads cannot hold a slot).
SNAPSHOT_WRITE_TIMEOUT_S = 30.0


# ---------------------------------------------------------------- argument checks
def _arg(args: dict[str, Any], name: str, kind: type | tuple[type, ...]) -> Any:
    value = args.get(name)
    if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool:
        raise InvalidRequestError(f"argument {name!r} must be {getattr(kind, '__name__', kind)}")
    return value


def _list(
    args: dict[str, Any], name: str, item: type | tuple[type, ...] | None = None
) -> list[Any]:
    value = _arg(args, name, list)
    if item is not None:
        for v in value:
            if not isinstance(v, item) or isinstance(v, bool):
                raise InvalidRequestError(
                    f"every item of {name!r} must be {getattr(item, '__name__', item)}"
                )
    return value


def _per_key(raw_keys: list[Any], call: Callable[[list[bytes], list[int]], list[Any]]) -> list[Any]:
    """Run ``call(valid_keys, their_indices)``; invalid keys get their own error in place."""
    out: list[Any] = [None] * len(raw_keys)
    valid_idx: list[int] = []
    valid: list[bytes] = []
    for i, k in enumerate(raw_keys):
        try:
            valid.append(check_wire_key(k))
            valid_idx.append(i)
        except KVStoreError as err:
            out[i] = err
    for i, r in zip(valid_idx, call(valid, valid_idx), strict=True):
        out[i] = r
    return out


# ---------------------------------------------------------------- handlers
def _ping(svc: MasterService, args: dict[str, Any]) -> Any:
    return {
        "role": "master",
        "protocol": protocol.PROTOCOL_VERSION,
        # How long the read lease of a get_locations answer holds (clients with lease reads
        # reuse an answer for that long, see kvstore.client.locations).
        "lease_s": svc.tiering.config.lease_s,
        # Grants expire by this master's wall clock: clients keep it (kvstore.clocks).
        "now_ms": svc.wall_ms(),
    }


def _register(svc: MasterService, args: dict[str, Any]) -> Any:
    segments = [SegmentSpec.from_wire(s) for s in _list(args, "segments")]
    node_id = _arg(args, "node_id", str)
    claims = claims_from_wire(args["manifest"]) if "manifest" in args else None
    svc.register(
        node_id,
        _arg(args, "host", str),
        _arg(args, "port", int),
        _arg(args, "secret", bytes),
        segments,
        check_transports(args.get("transports", {})),
        identity=_arg(args, "identity", bytes) if "identity" in args else None,
    )
    reply: dict[str, Any] = {
        "heartbeat_interval_s": svc.config.heartbeat_interval_s,
        "node_ttl_s": svc.config.node_ttl_s,
        "now_ms": svc.wall_ms(),  # the clock the node checks grants on (kvstore.clocks)
    }
    if claims is not None:  # a node that kept objects across a master change (HA, etcd)
        report = svc.admit_manifest(node_id, [c for c in claims if isinstance(c, ManifestClaim)])
        for bad in (c for c in claims if not isinstance(c, ManifestClaim)):
            report.num_rejected += 1
            log.warning("manifest claim of %s rejected: %s", node_id, bad.message)
        reply["admission"] = report.to_wire()
    return reply


def _heartbeat(svc: MasterService, args: dict[str, Any]) -> Any:
    # The node reports the tasks it ran; the reply carries what to forget and what to do next
    # (see node/tasks.py), and whether a drained node may stop.
    node_id = _arg(args, "node_id", str)
    svc.check_node_identity(node_id, _arg(args, "identity", bytes) if "identity" in args else None)
    if "done" in args:
        svc.tasks_done(node_id, _list(args, "done", list))
    forget = svc.heartbeat(node_id)
    return {
        "forget": [list(p) for p in forget],
        "tasks": svc.take_tasks(node_id),
        "retire": svc.take_retirement(node_id),
        "now_ms": svc.wall_ms(),
    }


def _put_start(svc: MasterService, args: dict[str, Any]) -> Any:
    keys = _list(args, "keys")
    sizes = _list(args, "sizes", int)
    exclude = _list(args, "exclude", str) if "exclude" in args else []
    replicas = _arg(args, "replicas", int) if "replicas" in args else 1
    if len(sizes) != len(keys):
        raise InvalidRequestError("keys and sizes differ in length")
    kv_blocks = args.get("kv") is True
    # ``batch_grants``: one write grant per node (and claim stamp), each replica's a reference.
    batch = _arg(args, "batch_grants", bool) if "batch_grants" in args else False
    results = _per_key(
        keys,
        lambda valid, idx: svc.put_start(
            valid, [sizes[i] for i in idx], exclude, replicas, kv_blocks, batch
        ),
    )
    return [result_to_wire(r) for r in results]


def _put_end(svc: MasterService, args: dict[str, Any]) -> Any:
    results = svc.put_end(_list(args, "put_ids", int), _list(args, "checksums", int))
    return [result_to_wire(r) for r in results]


def _put_revoke(svc: MasterService, args: dict[str, Any]) -> Any:
    return [result_to_wire(r) for r in svc.put_revoke(_list(args, "put_ids", int))]


def _get_locations(svc: MasterService, args: dict[str, Any]) -> Any:
    # Answers come in their wire form; only a malformed key's error is still a record here.
    # ``batch_grants``: one read grant per node, each replica's a reference (kvstore.grants).
    batch = _arg(args, "batch_grants", bool) if "batch_grants" in args else False
    answers = _per_key(_list(args, "keys"), lambda k, _: svc.get_locations_wire(k, batch))
    return [r.to_wire() if isinstance(r, KVStoreError) else r for r in answers]


def _release_leases(svc: MasterService, args: dict[str, Any]) -> Any:
    return svc.release_leases(_list(args, "tokens", int))


def _pop_releases(svc: MasterService, args: dict[str, Any]) -> list[Any]:
    """The read leases piggybacked on a request (``release``: tokens of leases the caller is
    done with), taken out of its arguments. A malformed list refuses the whole request (raised
    before anything is released)."""
    if "release" not in args:
        return []
    tokens = check_lease_tokens(args["release"], svc.config.max_batch)
    del args["release"]
    return tokens


def _take_releases(svc: MasterService, args: dict[str, Any]) -> None:
    """Give back the piggybacked read leases (:func:`_pop_releases`) before the verb runs."""
    tokens = _pop_releases(svc, args)
    if tokens:
        svc.release_leases(tokens)


def _exists(svc: MasterService, args: dict[str, Any]) -> Any:
    return [r is True for r in _per_key(_list(args, "keys"), lambda k, _: svc.exists(k))]


def _remove(svc: MasterService, args: dict[str, Any]) -> Any:
    return [result_to_wire(r) for r in _per_key(_list(args, "keys"), lambda k, _: svc.remove(k))]


def _report_corrupt(svc: MasterService, args: dict[str, Any]) -> Any:
    return {"dropped": svc.report_corrupt(_list(args, "items", list))}


def _list_keys(svc: MasterService, args: dict[str, Any]) -> Any:
    """Stored keys starting with ``prefix``, sorted, strictly after ``after``; at most ``limit``.

    A page at a time, so that no answer grows with the cluster (the client pages on)."""
    prefix = args.get("prefix", b"")
    after = args.get("after")
    limit = args.get("limit", LIST_KEYS_MAX)
    if not isinstance(prefix, bytes) or len(prefix) > MAX_KEY_BYTES:
        raise InvalidRequestError(f"prefix must be bytes of at most {MAX_KEY_BYTES}")
    if after is not None and not isinstance(after, bytes):
        raise InvalidRequestError("after must be bytes or absent")
    if not isinstance(limit, int) or isinstance(limit, bool) or not 1 <= limit <= LIST_KEYS_MAX:
        raise InvalidRequestError(f"limit must be an int in 1..{LIST_KEYS_MAX}")
    chosen = [k for k in svc.objects if k.startswith(prefix) and (after is None or k > after)]
    return heapq.nsmallest(limit, chosen)


def _node_transports(svc: MasterService, args: dict[str, Any]) -> Any:
    return svc.node_transports()


def _pin(svc: MasterService, args: dict[str, Any]) -> Any:
    ttl = _arg(args, "ttl_s", (int, float))
    hard = _arg(args, "hard", bool) if "hard" in args else False
    return [
        result_to_wire(r) for r in _per_key(_list(args, "keys"), lambda k, _: svc.pin(k, ttl, hard))
    ]


def _unpin(svc: MasterService, args: dict[str, Any]) -> Any:
    return [result_to_wire(r) for r in _per_key(_list(args, "keys"), lambda k, _: svc.unpin(k))]


def _stats(svc: MasterService, args: dict[str, Any]) -> Any:
    return svc.stats()


def _kv_commit(svc: MasterService, args: dict[str, Any]) -> Any:
    return _kv_commit_then_index(svc, args, None)


def _kv_commit_then_index(
    svc: MasterService, args: dict[str, Any], after: list[Callable[[], None]] | None
) -> Any:
    """``kv_commit``: commit the puts, then index the prompt; with ``after``, the indexing is
    appended to it, for the server to run once the answer is written (see
    :data:`AFTER_REPLY`). The answer is the per-put results either way: the blocks the index
    gained are its ``stored`` events."""
    namespace = Namespace.from_dict(_arg(args, "namespace", dict))
    tokens = tokens_from_wire(args.get("tokens"))
    put_ids, checksums = _list(args, "put_ids", int), _list(args, "checksums", int)
    if after is None:
        results, _ = svc.kv_commit(put_ids, checksums, namespace, tokens)
    else:
        results = svc.kv_commit_puts(put_ids, checksums, namespace, tokens)
        after.append(lambda: svc.kv_index(namespace, tokens))
    return {"results": [result_to_wire(r) for r in results]}


def _kv_match(svc: MasterService, args: dict[str, Any]) -> Any:
    namespace = Namespace.from_dict(_arg(args, "namespace", dict))
    # ``locate: false``: only the cached prefix, no replicas and so no read leases (a lookup).
    locate = _arg(args, "locate", bool) if "locate" in args else True
    match, infos = svc.kv_match(namespace, tokens_from_wire(args.get("tokens")), locate=locate)
    return {
        "num_tokens": match.num_tokens,
        "block_size": match.block_size,
        "blocks": [
            [key, n, result_to_wire(info)] if locate else [key, n, None]
            for (key, n), info in zip(
                match.blocks, infos or [None] * len(match.blocks), strict=True
            )
        ],
    }


@dataclass(frozen=True, slots=True)
class EventsQuery:
    """The checked arguments of an ``events`` call."""

    since_seq: int
    since_epoch: int | None
    max_events: int
    wait_s: float
    namespaces: frozenset[bytes] | None


def _namespaces_arg(args: dict[str, Any]) -> frozenset[bytes] | None:
    if "namespaces" not in args or args["namespaces"] is None:
        return None
    digests = _list(args, "namespaces", bytes)
    if len(digests) > EVENTS_MAX_NAMESPACES or any(len(d) != 16 for d in digests):
        raise InvalidRequestError(
            f"namespaces must be at most {EVENTS_MAX_NAMESPACES} digests of 16 bytes"
        )
    return frozenset(digests)


def events_query(args: dict[str, Any]) -> EventsQuery:
    """Check the arguments of ``events``.

    NOTE: the caller's epoch travels as ``since_epoch``, never ``epoch``: ``epoch`` is the HA
    fence's (the leader the caller believes in), and an event epoch there would be refused as
    stale, or even make a leader step down.

    Raises:
        InvalidRequestError: a wrong type or a value out of range.
    """
    since_seq = _arg(args, "since_seq", int) if "since_seq" in args else 0
    if since_seq < 0:
        raise InvalidRequestError("since_seq must be >= 0")
    raw_epoch = args.get("since_epoch")
    since_epoch = None if raw_epoch is None else _arg(args, "since_epoch", int)
    max_events = _arg(args, "max", int) if "max" in args else EVENTS_DEFAULT_MAX
    if not 1 <= max_events <= MAX_EVENTS_PER_CALL:
        raise InvalidRequestError(f"max must be in 1..{MAX_EVENTS_PER_CALL}")
    wait_s = float(_arg(args, "wait_s", (int, float))) if "wait_s" in args else 0.0
    if not 0.0 <= wait_s <= EVENTS_MAX_WAIT_S:  # (NaN fails too)
        raise InvalidRequestError(f"wait_s must be in 0..{EVENTS_MAX_WAIT_S:g}")
    return EventsQuery(since_seq, since_epoch, max_events, wait_s, _namespaces_arg(args))


def _read_events(log_: EventLog, q: EventsQuery) -> EventBatch | Resync:
    return log_.read(q.since_seq, q.since_epoch, q.max_events, q.namespaces)


def _events(svc: MasterService, args: dict[str, Any]) -> Any:
    """The KV events after the caller's position, or a resync (see ``master/events.py``).

    The long poll (``wait_s``) happens in :meth:`ControlServer._await_events`, before this.
    """
    log_ = svc.events
    got = _read_events(log_, events_query(args))
    if isinstance(got, Resync):
        return {
            "epoch": log_.epoch,
            "last_seq": log_.last_seq,
            "events": [],
            "resync": {"reason": got.reason, "message": got.message},
        }
    return {
        "epoch": got.epoch,
        "last_seq": got.last_seq,
        "events": [event_to_wire(ev) for ev in got.events],
        "resync": None,
    }


def _events_snapshot(svc: MasterService, args: dict[str, Any]) -> Any:
    """Every indexed block per namespace, and the ``(epoch, seq)`` to follow events from."""
    wanted = _namespaces_arg(args)
    epoch, seq, keys = svc.prefix.snapshot()
    if wanted is not None:
        keys = {d: k for d, k in keys.items() if d in wanted}
    num_blocks = sum(len(k) for k in keys.values()) // 16
    if num_blocks > SNAPSHOT_MAX_BLOCKS:
        raise InvalidRequestError(
            f"a snapshot of {num_blocks} blocks exceeds {SNAPSHOT_MAX_BLOCKS} per answer: "
            "ask for fewer namespaces at a time"
        )
    return {"epoch": epoch, "seq": seq, "namespaces": keys, "num_blocks": num_blocks}


HANDLERS: dict[str, Callable[[MasterService, dict[str, Any]], Any]] = {
    "ping": _ping,
    "register": _register,
    "heartbeat": _heartbeat,
    "put_start": _put_start,
    "put_end": _put_end,
    "put_revoke": _put_revoke,
    "get_locations": _get_locations,
    "release_leases": _release_leases,
    "exists": _exists,
    "remove": _remove,
    "list_keys": _list_keys,
    "pin": _pin,
    "unpin": _unpin,
    "stats": _stats,
    "node_transports": _node_transports,
    "report_corrupt": _report_corrupt,
    "kv_commit": _kv_commit,
    "kv_match": _kv_match,
    "events": _events,
    "events_snapshot": _events_snapshot,
}


#: Verbs whose handler can leave work until its answer is written: ``kv_commit`` answers once its
#: puts are committed and indexes the prompt after (the radix insert is most of what a small
#: one costs the master, and the writer waits for nothing of it). The loop is single-threaded
#: and the server runs that work before its next turn, so every request sent after the answer
#: arrived, on any connection, finds the prompt indexed.
AFTER_REPLY: dict[
    str, Callable[[MasterService, dict[str, Any], list[Callable[[], None]] | None], Any]
] = {"kv_commit": _kv_commit_then_index}


def run_after_reply(after: list[Callable[[], None]]) -> None:
    """Run (and clear) the work requests left until their answers were written: a failure is
    logged (the answer is gone: its puts are committed whatever the index does)."""
    for work in after:
        try:
            work()
        except Exception:  # noqa: BLE001 - one failure must not stop the connection
            log.exception("work after an answer failed")
    after.clear()


class RpcObserver(Protocol):
    """Records each served request (metrics). ``result`` is the handler's return value or None."""

    def observe(self, request: protocol.Request, code: int, result: Any, seconds: float) -> None:
        """Args: the request, its error code (0 = ok), the handler's result, the time it took."""


def dispatch(
    svc: MasterService,
    request: protocol.Request,
    observer: RpcObserver | None = None,
    after: list[Callable[[], None]] | None = None,
) -> bytes:
    """Run one request and return the encoded response frame.

    Args:
        after: where a verb of :data:`AFTER_REPLY` leaves its remaining work, for the caller
            to run (:func:`run_after_reply`) once the frame is written; None: it is done here.
    """
    handler = HANDLERS.get(request.verb)
    started, code, result = time.perf_counter(), 0, None
    try:
        if handler is None:
            raise UnknownVerbError(f"unknown verb {request.verb[:64]!r}")
        _take_releases(svc, request.args)
        deferring = AFTER_REPLY.get(request.verb) if after is not None else None
        if deferring is not None:
            result = deferring(svc, request.args, after)
        else:
            result = handler(svc, request.args)
        return protocol.encode_response(request.req_id, result)
    except Exception as exc:  # noqa: BLE001 - every failure is an error frame, never a hang-up
        code, frame = _error_frame(request, exc)
        return frame
    finally:
        if observer is not None:
            observer.observe(request, code, result, time.perf_counter() - started)


def _error_frame(request: protocol.Request, exc: Exception) -> tuple[int, bytes]:
    """The error code and response frame for a failed request: a typed error travels as it
    is; anything else is logged and answered as an internal error (its message never leaves)."""
    if isinstance(exc, KVStoreError):
        return int(exc.code), protocol.encode_error(request.req_id, exc)
    log.exception("internal error while serving %r", request.verb[:64])
    return int(InternalError.code), protocol.encode_error(
        request.req_id, InternalError("internal error")
    )


# ---------------------------------------------------------------- bounded work per loop turn
#: Items (keys, put ids) served per turn of the event loop by default: a large batch is served in
#: chunks of this many, and other connections' requests run between two chunks. (A master's
#: ``chunk_items`` option, from ``KVSTORE_CHUNK_ITEMS``, overrides it, for
#: bench/bench_fairness.py to compare against unchunked serving.)
CHUNK_ITEMS = DEFAULT_CHUNK_ITEMS

#: Batch verbs served in chunks: their parallel list arguments and each item's type (None:
#: keys, checked one by one with an error in place).
CHUNKED: dict[str, dict[str, type | None]] = {
    "put_start": {"keys": None, "sizes": int},
    "put_end": {"put_ids": int, "checksums": int},
    "put_revoke": {"put_ids": int},
    "get_locations": {"keys": None},
    "release_leases": {"tokens": int},
    "exists": {"keys": None},
    "remove": {"keys": None},
    "pin": {"keys": None},
    "unpin": {"keys": None},
    "kv_commit": {"put_ids": int, "checksums": int},
}


def _chunk_count(svc: MasterService, request: protocol.Request, chunk_items: int) -> int:
    """How many items a request has that is worth serving in chunks (0: serve it in one go).

    Every item's type is checked here, before the first chunk changes anything, so that a bad
    item refuses the whole request as it would unchunked.

    Raises:
        InvalidRequestError: an item of the wrong type.
    """
    fields = CHUNKED.get(request.verb)
    if fields is None:
        return 0
    lists = [request.args.get(f) for f in fields]
    if not all(isinstance(v, list) for v in lists):
        return 0  # the handler refuses it, as before
    n = len(lists[0])
    if any(len(v) != n for v in lists) or n > svc.config.max_batch:
        return 0  # likewise
    if n <= chunk_items and (request.verb != "kv_commit" or _prompt_fits(request, chunk_items)):
        return 0  # small: one go (a kv_commit's prompt too: it is indexed in one step anyway)
    for name, item in fields.items():
        if item is not None:
            _list(request.args, name, item)
    return n


_PACK = msgpack.Packer(use_bin_type=True)


def _pack_items(items: list[Any]) -> bytes:
    """The msgpack encoding of ``items`` one after another, without an array header: one
    ``pack`` call for the whole chunk instead of one per item."""
    n = len(items)
    return _PACK.pack(items)[1 if n < 16 else 3 if n < 1 << 16 else 5 :]


async def _serve_chunks(
    svc: MasterService, request: protocol.Request, n: int, chunk_items: int
) -> bytes:
    """Serve a batch in chunks of ``chunk_items``, yielding to the loop between two.

    Returns:
        The msgpack encoding of the result, packed chunk by chunk.
    """
    verb, args = request.verb, request.args
    fields = CHUNKED[verb]
    handler = HANDLERS[verb]
    if verb == "kv_commit":  # checked before any put is committed
        namespace = Namespace.from_dict(_arg(args, "namespace", dict))
        tokens = tokens_from_wire(args.get("tokens"))
        check_prompt_size(namespace, tokens)
        handler = _put_end
    parts = [_PACK.pack_array_header(n)]
    for lo in range(0, n, chunk_items):
        if lo:
            await asyncio.sleep(0)  # one turn of the loop for everyone else
        sub = dict(args)
        for name in fields:
            sub[name] = args[name][lo : lo + chunk_items]
        parts.append(_pack_items(handler(svc, sub)))
    if verb != "kv_commit":
        return b"".join(parts)
    await asyncio.sleep(0)
    # Index the committed prefix, a step of chunk_items blocks a turn, before the answer: a
    # later request must not find it half indexed (the one-go path indexes after the answer).
    await _run_steps(svc.kv_index_steps(namespace, tokens, chunk_items))
    return b"".join([_PACK.pack_map_header(1), _PACK.pack("results"), *parts])


async def _run_steps(steps: Steps[Any]) -> Any:
    """Run ``steps`` (``prefix.py``), one step a turn of the loop; return their result."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value
        await asyncio.sleep(0)


async def _serve_kv_match(svc: MasterService, request: protocol.Request, chunk_items: int) -> bytes:
    """``kv_match`` of a long prompt: the match in steps of ``chunk_items`` blocks, then (unless
    ``locate`` is false) the replicas of its blocks in chunks."""
    namespace = Namespace.from_dict(_arg(request.args, "namespace", dict))
    tokens = tokens_from_wire(request.args.get("tokens"))
    locate = _arg(request.args, "locate", bool) if "locate" in request.args else True
    match = await _run_steps(svc.kv_match_steps(namespace, tokens, chunk_items))
    parts = [
        _PACK.pack_map_header(3),
        _PACK.pack("num_tokens"),
        _PACK.pack(match.num_tokens),
        _PACK.pack("block_size"),
        _PACK.pack(match.block_size),
        _PACK.pack("blocks"),
        _PACK.pack_array_header(len(match.blocks)),
    ]
    for lo in range(0, len(match.blocks), chunk_items):
        await asyncio.sleep(0)  # after the match's steps, and between two chunks
        chunk = match.blocks[lo : lo + chunk_items]
        if not locate:  # a lookup: no locations, so no read leases
            parts.append(_pack_items([[key, k, None] for key, k in chunk]))
            continue
        answers = svc.get_locations_wire([key for key, _ in chunk])
        parts.append(_pack_items([[key, k, a] for (key, k), a in zip(chunk, answers, strict=True)]))
    return b"".join(parts)


async def _release_in_chunks(svc: MasterService, tokens: list[Any], chunk_items: int) -> None:
    """Give back ``tokens`` (already checked), ``chunk_items`` a turn of the loop: a client
    piggybacks up to thousands after a big read."""
    for lo in range(0, len(tokens), chunk_items):
        if lo:
            await asyncio.sleep(0)
        svc.release_leases(tokens[lo : lo + chunk_items])


def _prompt_fits(request: protocol.Request, chunk_items: int) -> bool:
    """Whether a KV request's prompt, read from its raw arguments, has at most ``chunk_items``
    blocks (one step). Malformed arguments do not fit: served in steps, where the handler
    refuses them as it would in one go."""
    raw, namespace = request.args.get("tokens"), request.args.get("namespace")
    block_size = namespace.get("block_size") if type(namespace) is dict else None
    if type(raw) is not bytes or type(block_size) is not int or block_size < 1:
        return False
    return len(raw) // 4 // block_size <= chunk_items


def _is_large_kv_match(request: protocol.Request, chunk_items: int) -> bool:
    """A ``kv_match`` of more blocks than one step takes (or malformed): served in steps."""
    return request.verb == "kv_match" and not _prompt_fits(request, chunk_items)


async def dispatch_bounded(
    svc: MasterService,
    request: protocol.Request,
    observer: RpcObserver | None = None,
    chunk_items: int = CHUNK_ITEMS,
    after: list[Callable[[], None]] | None = None,
) -> bytes:
    """:func:`dispatch`, but a large batch is served in chunks of ``chunk_items`` with the loop
    free between two (bounded work per turn: one client's 65,536-key batch does not stall the
    others). ``after``: as :func:`dispatch` (a request served in one go may leave work there)."""
    started, code, delegated = time.perf_counter(), 0, False
    try:
        if request.verb in HANDLERS and "release" in request.args:
            # As _take_releases, bounded: a short list, the usual case, is given back at once,
            # without a coroutine.
            tokens = _pop_releases(svc, request.args)
            if len(tokens) <= chunk_items:
                svc.release_leases(tokens)
            else:
                await _release_in_chunks(svc, tokens, chunk_items)
        if _is_large_kv_match(request, chunk_items):
            packed = await _serve_kv_match(svc, request, chunk_items)
        else:
            n = _chunk_count(svc, request, chunk_items)
            if not n:
                delegated = True  # small: in one go (dispatch observes it)
                return dispatch(svc, request, observer, after)
            packed = await _serve_chunks(svc, request, n, chunk_items)
        body = _PACK.pack_array_header(3) + _PACK.pack(request.req_id) + _PACK.pack(0) + packed
        return protocol.encode_header(protocol.KIND_RESPONSE, len(body)) + body
    except Exception as exc:  # noqa: BLE001 - as in dispatch
        code, frame = _error_frame(request, exc)
        return frame
    finally:
        if observer is not None and not delegated:
            observer.observe(request, code, None, time.perf_counter() - started)


class Fence(Protocol):
    """Decides, before any handler runs, whether this master may serve a request (HA mode)."""

    def check(self, request: protocol.Request) -> KVStoreError | None: ...


#: Bytes a connection's stream reader buffers before it pauses reading the socket (x2).
STREAM_LIMIT = 64 << 10
#: How often the server looks for connections past their frame or hello deadline.
SWEEP_INTERVAL_S = 0.5


class ControlServer:
    """Serves the msgpack control protocol on an asyncio loop, each request by the service of
    the current term (read from ``slot`` per request: an HA term swaps in a fresh one)."""

    def __init__(
        self,
        slot: ServiceSlot,
        host: str,
        port: int,
        *,
        max_body: int = protocol.DEFAULT_MAX_BODY,
        fence: Fence | None = None,
        observer: RpcObserver | None = None,
        token: auth.Token | None = None,
        chunk_items: int = CHUNK_ITEMS,
        deadlines: serving.WireDeadlines = serving.DEFAULT_DEADLINES,
    ) -> None:
        if chunk_items < 1:
            raise InvalidRequestError("chunk_items must be >= 1")
        self.slot = slot
        self.chunk_items = chunk_items
        self.fence = fence
        self.observer = observer
        self.token = token
        #: How long a frame (and, before the token is proved, the hello) may take to arrive.
        self.deadlines = deadlines
        self.host = host
        self.port = port
        self.max_body = max_body
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        #: Connections with a frame (or the hello) on the way -> the loop time it must be in by.
        self._deadlines: dict[asyncio.StreamWriter, float] = {}
        self._sweeper: asyncio.Task[None] | None = None
        # Clients come back after a round trip to a node: see kvstore.polling.MASTER_WINDOWS.
        self._awake = LoopAwake(poll_window() * MASTER_WINDOWS)
        #: Connections that have not sent their hello yet (bounded; see auth.PendingConnections).
        self.pending = auth.PendingConnections()
        self._stopping = False
        #: ``events_snapshot`` answers being built or written now (see SNAPSHOTS_IN_FLIGHT).
        self._snapshots = 0

    async def start(self) -> None:
        # A small stream limit: a connection buffers at most ~2x this before we read it, so a
        # flood of peers that are never authenticated holds little memory (readexactly of a
        # larger body still works: it resumes reading as it goes).
        self._server = await asyncio.start_server(
            self._serve, self.host, self.port, limit=STREAM_LIMIT
        )
        self.port = self._server.sockets[0].getsockname()[1]
        self._sweeper = asyncio.create_task(self._sweep())

    async def stop(self) -> None:
        self._stopping = True
        self.slot.service.events.wake()  # long polls answer now, not at their timeout
        if self._sweeper is not None:
            self._sweeper.cancel()
        if self._server is not None:
            self._server.close()
            for w in list(self._writers):
                w.close()
            await self._server.wait_closed()

    def _take_snapshot_slot(self) -> KVStoreError | None:
        """Count one more snapshot answer in flight, or the refusal when
        :data:`SNAPSHOTS_IN_FLIGHT` are already."""
        if self._snapshots >= SNAPSHOTS_IN_FLIGHT:
            return OverloadedError(
                f"{SNAPSHOTS_IN_FLIGHT} event snapshots are being sent already; try again shortly"
            )
        self._snapshots += 1
        return None

    async def _await_events(self, request: protocol.Request) -> None:
        """The long poll of ``events``: wait until an event the caller wants is recorded, or
        ``wait_s`` passes, or the log is replaced (a new term) or the server stops.

        Holds nothing while it waits (a callback on the log, a future): other connections are
        served meanwhile. Bad arguments return at once; the handler then refuses them.
        """
        try:
            q = events_query(request.args)
        except KVStoreError:
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + q.wait_s
        log_ = self.slot.service.events
        while not self._stopping and self.slot.service.events is log_:
            got = _read_events(log_, q)
            if not isinstance(got, EventBatch) or got.events:
                return
            left = deadline - loop.time()
            if left <= 0:
                return
            q = EventsQuery(got.last_seq, q.since_epoch, q.max_events, 0.0, q.namespaces)
            woken: asyncio.Future[None] = loop.create_future()

            def wake(fut: asyncio.Future[None] = woken) -> None:
                if not fut.done():
                    fut.set_result(None)

            log_.add_waiter(wake)
            try:
                await asyncio.wait({woken}, timeout=left)
            finally:
                log_.remove_waiter(wake)

    async def _sweep(self) -> None:
        """Close every connection whose frame (or hello) is past its deadline.

        One timer for the whole server instead of one per request: a request only records its
        deadline in ``_deadlines`` while its frame is on the way (a dict write, no timer).
        """
        loop = asyncio.get_running_loop()
        last = loop.time()
        while True:
            await asyncio.sleep(SWEEP_INTERVAL_S)
            now = loop.time()
            stalled = now - last - SWEEP_INTERVAL_S
            last = now
            if stalled > SWEEP_INTERVAL_S:
                # This loop did not run (a long batch, a GC pause): the peers' bytes may be
                # waiting unread. Their time did not run out, ours did: push every deadline back.
                for w in self._deadlines:
                    self._deadlines[w] += stalled
                continue
            late = [w for w, by in self._deadlines.items() if by < now]
            for w in late:
                self._deadlines.pop(w, None)
                w.close()  # its reader sees EOF: the serving coroutine returns

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One connection's frame loop (its rules: :class:`kvstore.serving.FrameSession`)."""
        self._writers.add(writer)
        loop = asyncio.get_running_loop()
        session = serving.FrameSession(self.token, loop.time(), deadlines=self.deadlines)
        deadlines = self._deadlines
        after: list[Callable[[], None]] = []  # a request's work left until its answer is out
        if not session.authenticated:  # the whole hello must arrive, small, by this time
            deadlines[writer] = session.hello_by
            self.pending.add(writer, writer.close)
        try:
            while True:
                try:
                    if session.authenticated:
                        # Idle between frames as long as it likes; once a frame starts, it
                        # must arrive whole within its deadline (no half-sent frame holds us).
                        first = await reader.readexactly(1)
                        started = loop.time()
                        deadlines[writer] = session.header_deadline(started)
                        raw = first + await reader.readexactly(protocol.HEADER_SIZE - 1)
                    else:
                        raw = await reader.readexactly(protocol.HEADER_SIZE)
                except (asyncio.IncompleteReadError, ConnectionError):
                    return
                try:
                    header = protocol.decode_header(raw, max_body=self.max_body, max_payload=0)
                    session.check_header(header)
                except KVStoreError as err:
                    # The framing is lost (or the peer is not authenticated): answer once,
                    # then hang up.
                    writer.write(protocol.encode_error(0, err))
                    await writer.drain()
                    return
                if session.authenticated and header.body_len > protocol.READ_AHEAD:
                    deadlines[writer] = session.body_deadline(started, header)
                try:
                    body = await reader.readexactly(header.body_len)
                except (asyncio.IncompleteReadError, ConnectionError):
                    return
                if session.authenticated:
                    deadlines.pop(writer, None)
                holds_snapshot = False  # this request holds one of the snapshot slots
                try:
                    step = session.open_request(header, body)
                    if isinstance(step, serving.Refusal):
                        # (No payload to skip: the header's limit refused every payload.)
                        if session.authenticated:
                            deadlines.pop(writer, None)
                            self.pending.discard(writer)
                        writer.write(step.frame)
                        if step.hang_up:
                            await writer.drain()
                            return
                    else:
                        request = step
                        refusal = self.fence.check(request) if self.fence is not None else None
                        if refusal is None and request.verb == "events_snapshot":
                            refusal = self._take_snapshot_slot()
                            holds_snapshot = refusal is None
                        if refusal is None and request.verb == "events":
                            await self._await_events(request)
                            # It may have lost the lead while it waited: ask the fence again.
                            refusal = self.fence.check(request) if self.fence is not None else None
                        if refusal is not None:
                            writer.write(protocol.encode_error(request.req_id, refusal))
                        else:
                            reply = await dispatch_bounded(
                                self.slot.service, request, self.observer, self.chunk_items, after
                            )
                            writer.write(reply)
                            if after:  # (no await between: see AFTER_REPLY)
                                run_after_reply(after)
                    if not holds_snapshot:
                        await writer.drain()
                    else:
                        try:
                            await asyncio.wait_for(writer.drain(), SNAPSHOT_WRITE_TIMEOUT_S)
                        except TimeoutError:
                            log.warning("a subscriber did not read its event snapshot; closing")
                            writer.transport.abort()  # close() would keep the buffer to send
                            return
                finally:
                    if holds_snapshot:
                        self._snapshots -= 1
                self._awake.served()
        except ConnectionError:
            return
        finally:
            deadlines.pop(writer, None)
            self.pending.discard(writer)
            self._writers.discard(writer)
            writer.close()
