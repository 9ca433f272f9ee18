"""The master's RPC verbs: one handler per verb, ``(service, args) -> answer``, in :data:`HANDLERS`.

Each handler checks its arguments (``rpc_args``), calls the service and returns the answer's
wire form; a ``KVStoreError`` it raises is the caller's error frame. No sockets, no frames: the
frame loop and the mapping of errors are ``server.py``; batches served in chunks are
``rpc_chunks.py``; the KV event verbs are ``rpc_events.py``.
"""

from __future__ import annotations

import heapq
import logging
from collections.abc import Callable
from typing import Any

from kvstore import protocol
from kvstore.errors import InvalidRequestError, KVStoreError
from kvstore.keys import Namespace
from kvstore.kvblocks import tokens_from_wire
from kvstore.limits import check_wire_key
from kvstore.master.leases import check_lease_tokens
from kvstore.master.rpc_args import (
    arg,
    list_arg,
    list_keys_args,
    optional_arg,
    per_key,
    site_arg,
)
from kvstore.master.rpc_events import events, events_snapshot
from kvstore.master.service import MasterService
from kvstore.stored_object import ManifestClaim, claims_from_wire
from kvstore.transports import check_transports
from kvstore.types import SegmentSpec, result_to_wire

log = logging.getLogger(__name__)

#: Most keys one ``list_keys`` answer carries (the client asks for the next page after it).
LIST_KEYS_MAX = 10_000

#: The most puts one ``put_end`` commits when it names blanks' keys or asks for blanks.
MAX_NAMED_PUTS = 1024

#: A handler's signature: the service of the current term and the request's arguments.
Handler = Callable[[MasterService, dict[str, Any]], Any]


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
    segments = [SegmentSpec.from_wire(s) for s in list_arg(args, "segments")]
    node_id = arg(args, "node_id", str)
    claims = claims_from_wire(args["manifest"]) if "manifest" in args else None
    svc.register(
        node_id,
        arg(args, "host", str),
        arg(args, "port", int),
        arg(args, "secret", bytes),
        segments,
        check_transports(args.get("transports", {})),
        identity=optional_arg(args, "identity", bytes, None),
        site=site_arg(args, "site"),
    )
    reply: dict[str, Any] = {
        "heartbeat_interval_s": svc.config.heartbeat_interval_s,
        "node_ttl_s": svc.config.node_ttl_s,
        "now_ms": svc.wall_ms(),  # the clock the node checks grants on (kvstore.clocks)
        # The tenants' token digests: the node binds each data connection's hello to its tenant.
        "tenants": svc.tenants.wire(),
    }
    svc.node_tenant_versions[node_id] = svc.tenants.version  # it takes them with this reply
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
    node_id = arg(args, "node_id", str)
    svc.check_node_identity(node_id, optional_arg(args, "identity", bytes, None))
    if "done" in args:
        svc.tasks_done(node_id, list_arg(args, "done", list))
    forget = svc.heartbeat(node_id)
    reply = {
        "forget": [list(p) for p in forget],
        "tasks": svc.take_tasks(node_id),
        "retire": svc.take_retirement(node_id),
        "now_ms": svc.wall_ms(),
    }
    # The tenant directory only when the node's (``tenants_version``) is older than ours.
    seen = optional_arg(args, "tenants_version", int, 0)
    svc.node_tenant_versions[node_id] = seen
    if svc.tenants.version > seen:
        reply["tenants"] = svc.tenants.wire()
    return reply


def _put_start(svc: MasterService, args: dict[str, Any]) -> Any:
    keys = list_arg(args, "keys")
    sizes = list_arg(args, "sizes", int)
    exclude = list_arg(args, "exclude", str) if "exclude" in args else []
    replicas = optional_arg(args, "replicas", int, 1)
    if len(sizes) != len(keys):
        raise InvalidRequestError("keys and sizes differ in length")
    kv_blocks = args.get("kv") is True
    # ``batch_grants``: one write grant per node (and claim stamp), each replica's a reference.
    batch = optional_arg(args, "batch_grants", bool, False)
    at = site_arg(args, "at")  # the writer's site (kvstore.topology): placed near it
    results = per_key(
        keys,
        lambda valid, idx: svc.put_start(
            valid, [sizes[i] for i in idx], exclude, replicas, kv_blocks, batch, at
        ),
    )
    return [result_to_wire(r) for r in results]


def put_end(svc: MasterService, args: dict[str, Any]) -> Any:
    put_ids = list_arg(args, "put_ids", int)
    keys = None
    if "keys" in args or "blanks" in args:
        # Served in one go (rpc_chunks), so it is short: a client names a few blanks at once.
        if len(put_ids) > MAX_NAMED_PUTS:
            raise InvalidRequestError(
                f"a put_end that names keys or asks for blanks commits {MAX_NAMED_PUTS} at most"
            )
        keys = _blank_keys(args) if "keys" in args else None
    results = svc.put_end(put_ids, list_arg(args, "checksums", int), keys)
    answer = [result_to_wire(r) for r in results]
    if "blanks" not in args:
        return answer
    # Blanks asked for with the commit (the client's next puts: kvstore.client.puts), started
    # after it, so a commit never waits for them and a bad ask refuses only itself.
    try:
        blanks = _put_blanks(svc, args["blanks"])
    except KVStoreError as err:
        blanks = result_to_wire(err)
    return {"results": answer, "blanks": blanks}


def _blank_keys(args: dict[str, Any]) -> list[bytes | KVStoreError | None]:
    """``put_end``'s ``keys``: per put, None or the key its blank is committed under (a
    malformed key becomes its error, answered for that put alone)."""
    out: list[bytes | KVStoreError | None] = []
    for k in list_arg(args, "keys"):
        try:
            out.append(None if k is None else check_wire_key(k))
        except KVStoreError as err:
            out.append(err)
    return out


def _put_blanks(svc: MasterService, args: Any) -> Any:
    """``put_blanks`` ``{"size": n, "count": c}`` (c on each node that takes new data) or
    ``{"size": n, "nodes": [[node_id, c], ...]}`` → ``[[put_id, location], ...]``."""
    if isinstance(args, KVStoreError):  # (the tenant edge refused them: rpc_tenants)
        raise args
    if not isinstance(args, dict):
        raise InvalidRequestError("blanks are asked for as {size, count | nodes}")
    size = arg(args, "size", int)
    if "nodes" in args:
        nodes = list_arg(args, "nodes", list)
        if not all(len(n) == 2 and type(n[0]) is str for n in nodes):
            raise InvalidRequestError("blanks' nodes are [[node_id, count], ...]")
        return svc.put_blanks(size, [(n[0], n[1]) for n in nodes], site_arg(args, "at"))
    return svc.put_blanks(size, arg(args, "count", int), site_arg(args, "at"))


def _put_revoke(svc: MasterService, args: dict[str, Any]) -> Any:
    return [result_to_wire(r) for r in svc.put_revoke(list_arg(args, "put_ids", int))]


def _get_locations(svc: MasterService, args: dict[str, Any]) -> Any:
    # Answers come in their wire form; only a malformed key's error is still a record here.
    # ``batch_grants``: one read grant per node, each replica's a reference (kvstore.grants).
    batch = optional_arg(args, "batch_grants", bool, False)
    at = site_arg(args, "at")  # the reader's site (kvstore.topology): replicas nearest first
    answers = per_key(list_arg(args, "keys"), lambda k, _: svc.get_locations_wire(k, batch, at))
    return [r.to_wire() if isinstance(r, KVStoreError) else r for r in answers]


def _release_leases(svc: MasterService, args: dict[str, Any]) -> Any:
    return svc.release_leases(list_arg(args, "tokens", int))


def pop_releases(svc: MasterService, args: dict[str, Any]) -> list[Any]:
    """The read leases piggybacked on a request (``release``: tokens of leases the caller is
    done with), taken out of its arguments. A malformed list refuses the whole request (raised
    before anything is released)."""
    if "release" not in args:
        return []
    tokens = check_lease_tokens(args["release"], svc.config.max_batch)
    del args["release"]
    return tokens


def take_releases(svc: MasterService, args: dict[str, Any]) -> None:
    """Give back the piggybacked read leases (:func:`pop_releases`) before the verb runs."""
    tokens = pop_releases(svc, args)
    if tokens:
        svc.release_leases(tokens)


def _exists(svc: MasterService, args: dict[str, Any]) -> Any:
    return [r is True for r in per_key(list_arg(args, "keys"), lambda k, _: svc.exists(k))]


def _remove(svc: MasterService, args: dict[str, Any]) -> Any:
    return [result_to_wire(r) for r in per_key(list_arg(args, "keys"), lambda k, _: svc.remove(k))]


def _report_corrupt(svc: MasterService, args: dict[str, Any]) -> Any:
    return {"dropped": svc.report_corrupt(list_arg(args, "items", list))}


def _list_keys(svc: MasterService, args: dict[str, Any]) -> Any:
    """Stored keys starting with ``prefix``, sorted, strictly after ``after``; at most ``limit``.

    A page at a time, so that no answer grows with the cluster (the client pages on)."""
    prefix, after, limit = list_keys_args(args, LIST_KEYS_MAX)
    chosen = [k for k in svc.objects if k.startswith(prefix) and (after is None or k > after)]
    return heapq.nsmallest(limit, chosen)


def _node_transports(svc: MasterService, args: dict[str, Any]) -> Any:
    return svc.node_transports()


def _live_nodes(svc: MasterService, args: dict[str, Any]) -> Any:
    """The nodes that take new data, ``[node_id, host, port]`` each: what a client computes
    keys' home nodes over for one-hop reads (:mod:`kvstore.placement`)."""
    return {
        "nodes": [
            [n.node_id, n.host, n.port]
            for n in svc.membership.nodes.values()
            if not n.draining and not n.retired
        ]
    }


def _pin(svc: MasterService, args: dict[str, Any]) -> Any:
    ttl = arg(args, "ttl_s", (int, float))
    hard = optional_arg(args, "hard", bool, False)
    return [
        result_to_wire(r)
        for r in per_key(list_arg(args, "keys"), lambda k, _: svc.pin(k, ttl, hard))
    ]


def _unpin(svc: MasterService, args: dict[str, Any]) -> Any:
    return [result_to_wire(r) for r in per_key(list_arg(args, "keys"), lambda k, _: svc.unpin(k))]


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
    namespace = Namespace.from_dict(arg(args, "namespace", dict))
    tokens = tokens_from_wire(args.get("tokens"))
    put_ids, checksums = list_arg(args, "put_ids", int), list_arg(args, "checksums", int)
    if after is None:
        results, _ = svc.kv_commit(put_ids, checksums, namespace, tokens)
    else:
        results = svc.kv_commit_puts(put_ids, checksums, namespace, tokens)
        after.append(lambda: svc.kv_index(namespace, tokens))
    return {"results": [result_to_wire(r) for r in results]}


def _kv_match(svc: MasterService, args: dict[str, Any]) -> Any:
    namespace = Namespace.from_dict(arg(args, "namespace", dict))
    # ``locate: false``: only the cached prefix, no replicas and so no read leases (a lookup).
    locate = optional_arg(args, "locate", bool, True)
    at = site_arg(args, "at")  # the reader's site: each block's replicas nearest first
    match, infos = svc.kv_match(
        namespace, tokens_from_wire(args.get("tokens")), locate=locate, at=at
    )
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


HANDLERS: dict[str, Handler] = {
    "ping": _ping,
    "register": _register,
    "heartbeat": _heartbeat,
    "put_start": _put_start,
    "put_end": put_end,
    "put_blanks": _put_blanks,
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
    "live_nodes": _live_nodes,
    "report_corrupt": _report_corrupt,
    "kv_commit": _kv_commit,
    "kv_match": _kv_match,
    "events": events,
    "events_snapshot": events_snapshot,
}


#: Verbs whose handler can leave work until its answer is written: ``kv_commit`` answers once its
#: puts are committed and indexes the prompt after, because the radix insert is most of what a
#: small one costs the master and its writer needs none of it (``KVCache.store`` waits for that
#: answer: ``.venv/bin/python bench/profile_kvcache.py --model smollm2`` times it). The loop is
#: single-threaded and the server runs that work before its next turn, so every request sent
#: after the answer arrived, on any connection, finds the prompt indexed.
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
