"""The tenant side of the master's RPC edge: a tenant's requests, in its part of the key space.

A connection whose ``hello`` proved a tenant's token (``kvstore.tenants``) is served here before
the usual dispatch: every key it names becomes its stored key (:func:`~kvstore.tenants.tenant_key`)
before the service sees it, and every key an answer names goes back to the key the tenant knows
(:func:`~kvstore.tenants.user_key`), so no verb reaches or shows another tenant's object. The
operator's connection never comes here (the frame loop tests ``session.tenant is None`` once
per request).

* Keys in arguments (``put_start``, ``get_locations``, ``exists``, ``remove``, ``pin``, ``unpin``,
  ``report_corrupt``) are mapped in place and served by the usual handlers (chunks included).
  The grants they answer with name the stored key: a node checks it is the connection's.
* Put ids (``put_end``, ``put_revoke``, ``kv_commit``) of another tenant's puts are answered as
  unknown ids; so are blanks (``put_blanks``, the operator's alone: a tenant's puts are placed
  against its quotas), and a ``put_end`` that asks for blanks is answered ``FORBIDDEN``
  in their place.
* Answers that name keys or namespaces (``list_keys``, ``kv_match``, ``kv_commit``, ``events``,
  ``events_snapshot``, ``stats``) are built here: a tenant's prompts live in trees of their own
  (``prefix.py``), and its events and snapshot show only those, under its namespaces' digests.
* Shared namespaces (``TenantBook.share``): a block object or prompt meta key of a namespace
  the operator shared is stored as named (every tenant's and the operator's), and ``kv_commit``,
  ``kv_match`` and ``events`` of a shared namespace use its own tree, not the tenant's. The check
  is a prefix and a set lookup per key (``TenantDirectory.is_shared_key``).
* Shared prefixes (``TenantBook.share_prefix``): the blocks of a shared leading token range are
  stored as named too (the same check), while the prompt stays in the tenant's own tree
  (``prefix.py``: a tenant's match counts the range's blocks another tenant stored).
* Lease tokens (``release_leases``, and ``release`` piggybacked on any verb) end only leases the
  tenant's own reads took; another's tokens are answered as unknown ones.
* ``node_transports`` answers without shm or RDMA: both open a node's whole arena, so a tenant
  reads and writes over TCP, where the node checks every grant.
* Node verbs and any verb not named here are refused ``FORBIDDEN``: a verb added later is a
  tenant's only once it is mapped.

NOTE: a tenant's long ``kv_match`` and ``kv_commit`` are served in one go, not in steps.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from typing import Any

from kvstore import protocol
from kvstore.errors import ForbiddenError, KVStoreError
from kvstore.keys import Namespace
from kvstore.kvblocks import tokens_from_wire
from kvstore.limits import check_wire_key
from kvstore.master.prefix import scoped_digest
from kvstore.master.rpc_args import arg, list_arg, list_keys_args, optional_arg, site_arg
from kvstore.master.rpc_events import events, snapshot_answer
from kvstore.master.rpc_verbs import LIST_KEYS_MAX, pop_releases
from kvstore.master.service import MasterService
from kvstore.tenants import TenantDirectory, prefix_of, tenant_key, user_key
from kvstore.types import result_to_wire

#: Verbs whose ``keys`` argument is mapped and then served as usual.
KEY_VERBS = frozenset({"put_start", "get_locations", "exists", "remove", "pin", "unpin"})
#: Verbs a tenant may send as they are (nothing in them names a key).
PLAIN_VERBS = frozenset({"ping"})
#: Transports a tenant is not told about: a process that maps a node's shared-memory arena can
#: read and write every object in it (the grant cannot be checked there), and an RDMA queue pair
#: opens the arena to one-sided reads and writes the node never sees; a tenant reads over TCP.
WHOLE_ARENA_TRANSPORTS = ("shm", "rdma")
#: A put id no put has: what another tenant's put id becomes.
NO_PUT = -1

#: A tenant's own answer: ``(service, args, tenant) -> answer``.
Answer = Callable[[MasterService, dict[str, Any], str], Any]


def scope_request(svc: MasterService, request: protocol.Request, tenant: str) -> Answer | None:
    """Take ``request`` into ``tenant``'s part of the key space (its arguments, in place).

    Returns:
        The handler that answers it here (its answer names keys), or None when the usual
        dispatch serves the mapped request.

    Raises:
        ForbiddenError: a verb a tenant may not send (node verbs, verbs not mapped here).
    """
    verb, args = request.verb, request.args
    if "release" in args:  # piggybacked lease tokens: only the tenant's own end (leases.py)
        svc.release_leases(pop_releases(svc, args), tenant)
    if verb in KEY_VERBS:
        if isinstance(args.get("keys"), list):
            shared = svc.tenants
            args["keys"] = [_stored(tenant, k, shared) for k in args["keys"]]
        return None
    if verb in PLAIN_VERBS:
        return None
    if verb == "release_leases":
        return _release_leases
    if verb == "node_transports":
        return _node_transports
    if verb in ("put_end", "put_revoke", "kv_commit"):
        if "blanks" in args:  # (a tenant's puts are placed against its quotas: no blanks)
            # Answered in the blanks' place; the commit itself is served.
            args["blanks"] = ForbiddenError("blanks are for the operator's connections only")
        _own_puts(svc, args, tenant)
        return _kv_commit if verb == "kv_commit" else None
    if verb == "report_corrupt":
        if isinstance(args.get("items"), list):
            args["items"] = [_corrupt_report(tenant, r, svc.tenants) for r in args["items"]]
        return None
    if verb == "events":
        _scope_namespaces(svc, args, tenant)
        return _events
    own = ANSWERS.get(verb)
    if own is None:
        raise ForbiddenError(f"a tenant's connection may not send {verb[:64]!r}")
    return own


def _release_leases(svc: MasterService, args: dict[str, Any], tenant: str) -> Any:
    """Give back the tenant's own read leases; another's tokens change nothing (tokens run in
    sequence, so they are guessable: ``leases.py`` keeps each batch's tenant)."""
    return svc.release_leases(list_arg(args, "tokens", int), tenant)


def _stored(tenant: str, key: object, shared: TenantDirectory) -> Any:
    """A key's stored form (a shared namespace's block as named); a bad key its error
    (``per_key`` answers it in place)."""
    try:
        checked = check_wire_key(key)
        return checked if shared.is_shared_key(checked) else tenant_key(tenant, checked)
    except KVStoreError as err:
        return err


def _corrupt_report(tenant: str, report: object, shared: TenantDirectory) -> object:
    """A corruption report about the tenant's stored key (malformed ones as they are)."""
    if isinstance(report, list) and report and isinstance(report[0], bytes):
        stored = _stored(tenant, report[0], shared)
        return [stored if isinstance(stored, bytes) else None, *report[1:]]
    return report


def _node_transports(svc: MasterService, args: dict[str, Any], tenant: str) -> Any:
    return {
        node_id: {k: v for k, v in offered.items() if k not in WHOLE_ARENA_TRANSPORTS}
        for node_id, offered in svc.node_transports().items()
    }


def _own_puts(svc: MasterService, args: dict[str, Any], tenant: str) -> None:
    """Another tenant's put ids become :data:`NO_PUT` (answered as unknown ids); a put of a
    shared namespace's block is every tenant's."""
    ids = args.get("put_ids")
    if not isinstance(ids, list):
        return
    prefix, pending, shared = prefix_of(tenant), svc.pending, svc.tenants
    out = []
    for put_id in ids:
        record = pending.get(put_id) if type(put_id) is int else None
        if (
            record is not None
            and not record[0].startswith(prefix)
            and not shared.is_shared_key(record[0])
        ):
            put_id = NO_PUT
        out.append(put_id)
    args["put_ids"] = out


def _scope_namespaces(svc: MasterService, args: dict[str, Any], tenant: str) -> None:
    """An ``events`` call's namespaces become the tenant's trees (all of them when it names
    none), before the long poll waits on them. Malformed ones are left for the handler."""
    args.pop("_asked", None)  # ours alone: a client's own is dropped
    raw, shared = args.get("namespaces"), svc.tenants
    if raw is None:
        args["namespaces"] = _all_trees(svc, tenant)
    elif isinstance(raw, list) and all(isinstance(d, bytes) and len(d) == 16 for d in raw):
        args["namespaces"] = [d if shared.is_shared(d) else scoped_digest(tenant, d) for d in raw]
        args["_asked"] = raw


def _all_trees(svc: MasterService, tenant: str) -> list[bytes]:
    """Every tree of ``tenant``'s events: its own (but for namespaces shared since), and the
    shared namespaces'."""
    shared = svc.tenants
    return [
        s
        for s, (owner, d) in svc.prefix.scopes.items()
        if owner == tenant and not shared.is_shared(d)
    ] + sorted(shared.shared)


def _events(svc: MasterService, args: dict[str, Any], tenant: str) -> Any:
    asked = args.pop("_asked", None)
    if asked is not None:
        back = {scoped_digest(tenant, d): d for d in asked}
    else:
        # Its trees again, now: one it made while the call waited has events in this answer
        # (the wait's own set predates it; the answer's last_seq must not pass them unread).
        args["namespaces"] = _all_trees(svc, tenant)
        back = {s: d for s, (owner, d) in svc.prefix.scopes.items() if owner == tenant}
    # (a shared namespace's events name its own digest, which ``get`` leaves as it is)
    answer = events(svc, args)
    for ev in answer["events"]:
        ev["namespace"] = back.get(ev["namespace"], ev["namespace"])
    return answer


def _events_snapshot(svc: MasterService, args: dict[str, Any], tenant: str) -> Any:
    return snapshot_answer(args, *svc.prefix.tenant_snapshot(tenant, svc.tenants.shared))


def _list_keys(svc: MasterService, args: dict[str, Any], tenant: str) -> Any:
    """The tenant's keys starting with ``prefix``, after ``after``, at most ``limit``."""
    prefix, after, limit = list_keys_args(args, LIST_KEYS_MAX)
    own = prefix_of(tenant)
    start, past = own + prefix, None if after is None else own + after
    chosen = [k for k in svc.objects if k.startswith(start) and (past is None or k > past)]
    cut = len(own)
    return [k[cut:] for k in heapq.nsmallest(limit, chosen)]


def _kv_commit(svc: MasterService, args: dict[str, Any], tenant: str) -> Any:
    namespace = Namespace.from_dict(arg(args, "namespace", dict))
    tokens = tokens_from_wire(args.get("tokens"))
    put_ids, checksums = list_arg(args, "put_ids", int), list_arg(args, "checksums", int)
    scope = None if svc.tenants.is_shared(namespace.digest) else tenant  # shared: its own tree
    results, _ = svc.kv_commit(put_ids, checksums, namespace, tokens, scope)
    return {"results": [result_to_wire(r) for r in results]}


def _kv_match(svc: MasterService, args: dict[str, Any], tenant: str) -> Any:
    namespace = Namespace.from_dict(arg(args, "namespace", dict))
    locate = optional_arg(args, "locate", bool, True)
    tokens = tokens_from_wire(args.get("tokens"))
    scope = None if svc.tenants.is_shared(namespace.digest) else tenant  # shared: its own tree
    at = site_arg(args, "at")
    match, infos = svc.kv_match(namespace, tokens, locate=locate, tenant=scope, at=at)
    if locate:  # a load (a lookup without locations is no serving: it would count twice)
        svc.quotas.count_prompt(tenant, len(tokens), match.num_tokens)
    shared = svc.tenants.shared_keys  # a shared prefix's blocks are named as stored
    return {
        "num_tokens": match.num_tokens,
        "block_size": match.block_size,
        "blocks": [
            [
                key if key in shared else user_key(scope, key),
                n,
                result_to_wire(info) if locate else None,
            ]
            for (key, n), info in zip(
                match.blocks, infos or [None] * len(match.blocks), strict=True
            )
        ],
    }


def _stats(svc: MasterService, args: dict[str, Any], tenant: str) -> Any:
    """What a tenant may see of the cluster: its own objects, and how many nodes serve."""
    own = prefix_of(tenant)
    keys = [k for k in svc.objects if k.startswith(own)]
    sizes = (svc.objects.get(k) for k in keys)
    return {
        "tenant": tenant,
        "num_objects": len(keys),
        "object_bytes": sum(o.size for o in sizes if o is not None),
        "num_nodes": len(svc.nodes),
    }


#: The verbs answered here as a whole.
ANSWERS: dict[str, Answer] = {
    "list_keys": _list_keys,
    "kv_match": _kv_match,
    "events_snapshot": _events_snapshot,
    "stats": _stats,
}
