"""Bounded work per turn of the master's event loop: large batches served in chunks.

A batch verb of more than ``chunk_items`` items (:data:`CHUNKED`) is served a chunk at a time,
with the loop free between two chunks, so that one client's 65,536-key batch does not stall the
others; a long prompt's ``kv_match`` and ``kv_commit`` walk the prefix index in steps of as
many blocks. The answer is packed chunk by chunk into the same bytes one go would give.
:func:`kvstore.master.server.dispatch_bounded` decides which requests come here.
"""

from __future__ import annotations

import asyncio
from typing import Any

import msgpack

from kvstore import protocol
from kvstore.env import DEFAULT_CHUNK_ITEMS
from kvstore.keys import Namespace
from kvstore.kvblocks import tokens_from_wire
from kvstore.master.prefix import Steps, check_prompt_size
from kvstore.master.rpc_args import arg, list_arg, optional_arg, site_arg
from kvstore.master.rpc_verbs import HANDLERS, put_end
from kvstore.master.service import MasterService

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


def chunk_count(svc: MasterService, request: protocol.Request, chunk_items: int) -> int:
    """How many items a request has that is worth serving in chunks (0: serve it in one go).

    Every item's type is checked here, before the first chunk changes anything, so that a bad
    item refuses the whole request as it would unchunked.

    Raises:
        InvalidRequestError: an item of the wrong type.
    """
    fields = CHUNKED.get(request.verb)
    if fields is None:
        return 0
    if request.verb in ("put_end", "kv_commit") and (
        "keys" in request.args or "blanks" in request.args
    ):
        return 0  # (a put_end that names blanks or asks for them is short: rpc_verbs.put_end)
    lists = [request.args.get(f) for f in fields]
    if not all(isinstance(v, list) for v in lists):
        return 0  # the handler refuses it, as before
    n = len(lists[0])
    if any(len(v) != n for v in lists) or n > svc.config.max_batch:
        return 0  # likewise
    if n <= chunk_items and (request.verb != "kv_commit" or prompt_fits(request, chunk_items)):
        return 0  # small: one go (a kv_commit's prompt too: it is indexed in one step anyway)
    for name, item in fields.items():
        if item is not None:
            list_arg(request.args, name, item)
    return n


PACK = msgpack.Packer(use_bin_type=True)


def pack_items(items: list[Any]) -> bytes:
    """The msgpack encoding of ``items`` one after another, without an array header: one
    ``pack`` call for the whole chunk instead of one per item."""
    n = len(items)
    return PACK.pack(items)[1 if n < 16 else 3 if n < 1 << 16 else 5 :]


async def serve_chunks(
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
        namespace = Namespace.from_dict(arg(args, "namespace", dict))
        tokens = tokens_from_wire(args.get("tokens"))
        check_prompt_size(namespace, tokens)
        handler = put_end
    parts = [PACK.pack_array_header(n)]
    for lo in range(0, n, chunk_items):
        if lo:
            await asyncio.sleep(0)  # one turn of the loop for everyone else
        sub = dict(args)
        for name in fields:
            sub[name] = args[name][lo : lo + chunk_items]
        parts.append(pack_items(handler(svc, sub)))
    if verb != "kv_commit":
        return b"".join(parts)
    await asyncio.sleep(0)
    # Index the committed prefix, a step of chunk_items blocks a turn, before the answer: a
    # later request must not find it half indexed (the one-go path indexes after the answer).
    await run_steps(svc.kv_index_steps(namespace, tokens, chunk_items))
    return b"".join([PACK.pack_map_header(1), PACK.pack("results"), *parts])


async def run_steps(steps: Steps[Any]) -> Any:
    """Run ``steps`` (``prefix.py``), one step a turn of the loop; return their result."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value
        await asyncio.sleep(0)


async def serve_kv_match(svc: MasterService, request: protocol.Request, chunk_items: int) -> bytes:
    """``kv_match`` of a long prompt: the match in steps of ``chunk_items`` blocks, then (unless
    ``locate`` is false) the replicas of its blocks in chunks."""
    namespace = Namespace.from_dict(arg(request.args, "namespace", dict))
    tokens = tokens_from_wire(request.args.get("tokens"))
    locate = optional_arg(request.args, "locate", bool, True)
    at = site_arg(request.args, "at")
    match = await run_steps(svc.kv_match_steps(namespace, tokens, chunk_items))
    parts = [
        PACK.pack_map_header(3),
        PACK.pack("num_tokens"),
        PACK.pack(match.num_tokens),
        PACK.pack("block_size"),
        PACK.pack(match.block_size),
        PACK.pack("blocks"),
        PACK.pack_array_header(len(match.blocks)),
    ]
    for lo in range(0, len(match.blocks), chunk_items):
        await asyncio.sleep(0)  # after the match's steps, and between two chunks
        chunk = match.blocks[lo : lo + chunk_items]
        if not locate:  # a lookup: no locations, so no read leases
            parts.append(pack_items([[key, k, None] for key, k in chunk]))
            continue
        answers = svc.get_locations_wire([key for key, _ in chunk], at=at)
        parts.append(pack_items([[key, k, a] for (key, k), a in zip(chunk, answers, strict=True)]))
    return b"".join(parts)


async def release_in_chunks(svc: MasterService, tokens: list[Any], chunk_items: int) -> None:
    """Give back ``tokens`` (already checked), ``chunk_items`` a turn of the loop: a client
    piggybacks up to thousands after a big read."""
    for lo in range(0, len(tokens), chunk_items):
        if lo:
            await asyncio.sleep(0)
        svc.release_leases(tokens[lo : lo + chunk_items])


def prompt_fits(request: protocol.Request, chunk_items: int) -> bool:
    """Whether a KV request's prompt, read from its raw arguments, has at most ``chunk_items``
    blocks (one step). Malformed arguments do not fit: served in steps, where the handler
    refuses them as it would in one go."""
    raw, namespace = request.args.get("tokens"), request.args.get("namespace")
    block_size = namespace.get("block_size") if type(namespace) is dict else None
    if type(raw) is not bytes or type(block_size) is not int or block_size < 1:
        return False
    return len(raw) // 4 // block_size <= chunk_items


def is_large_kv_match(request: protocol.Request, chunk_items: int) -> bool:
    """A ``kv_match`` of more blocks than one step takes (or malformed): served in steps."""
    return request.verb == "kv_match" and not prompt_fits(request, chunk_items)
