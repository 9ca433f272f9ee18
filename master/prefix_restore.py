"""Rebuild the prefix index after a failover from the prompt-meta objects the nodes kept.

Block objects hold KV bytes only; the tokens a new leader needs to rebuild its radix tree travel
in one small ``kvmeta/...`` object per stored prompt (see :mod:`kvstore.kvblocks`). Those are
ordinary objects: they come back in the nodes' manifests like everything else. Once admitted,
the master reads them from the nodes (with grants it signs itself, off the event loop), checks
their checksums, and indexes each prompt's committed prefix. A prompt whose blocks live on a node
that has not re-registered yet is retried on the next admission. Until then a lookup misses,
which is always a correct answer.

Tenants (``kvstore.tenants``): a tenant's prompt meta is stored in its part of the key space
(``\\0tenant\\0kvmeta/...``) and its prompt goes back into the tenant's own tree (the tenant is
the stored key's owner, :func:`is_prompt_meta`); a shared namespace's metas are stored as
named, so they go back into the namespace's own tree, as the operator's do.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import numpy as np
import xxhash

from kvstore import auth, protocol
from kvstore.errors import KVStoreError
from kvstore.keys import Namespace
from kvstore.kvblocks import KV_META_PREFIX, decode_prompt_meta
from kvstore.master.prefix import PrefixIndex, scoped_digest
from kvstore.tenants import owner_of, user_key
from kvstore.types import ObjectInfo

log = logging.getLogger(__name__)

FETCH_TIMEOUT_S = 10.0


def fetch_objects(
    infos: list[tuple[bytes, ObjectInfo]], token: auth.Token | None
) -> dict[bytes, bytes]:
    """Read whole small objects from their first replica (blocking; run in a thread).

    Returns:
        key -> bytes for every object read intact; failures are logged and left out.
    """
    out: dict[bytes, bytes] = {}
    for key, info in infos:
        loc = info.locations[0]
        try:
            conn = protocol.FramedSocket.connect(loc.host, loc.port, timeout=FETCH_TIMEOUT_S)
        except KVStoreError as err:
            log.warning("prefix restore: %s unreachable: %s", loc.node_id, err.message)
            continue
        try:
            auth.hello(conn, token)
            req_id = conn.send_request("read", {"items": [[loc.grant.to_wire(), None]]})
            response, payload_len = conn.read_response()
            result = response.unwrap()
            if (
                response.req_id != req_id
                or type(result) is not list
                or len(result) != 1
                or type(result[0]) is not list
                or not result[0]
                or result[0][0] != 0
                or payload_len != info.size
            ):
                log.warning("prefix restore: could not read %r", key[:64])
                continue
            raw = conn.recv_exact(payload_len)
            if xxhash.xxh3_64_intdigest(raw) == info.checksum:
                out[key] = raw
        except (KVStoreError, OSError) as exc:
            log.warning("prefix restore: reading %r failed: %s", key[:64], exc)
        finally:
            conn.close()
    return out


def is_prompt_meta(stored: bytes) -> bool:
    """Whether a stored key is a prompt meta: the operator's or a shared namespace's
    (``kvmeta/...``) or a tenant's (``\\0tenant\\0kvmeta/...``; its owner is the tenant whose
    tree the prompt goes back into)."""
    key = user_key(owner_of(stored), stored)
    return key is not None and key.startswith(KV_META_PREFIX)


class PromptMetaBacklog:
    """Prompt metas admitted from manifests and not yet (fully) indexed. Owned by the service."""

    def __init__(self) -> None:
        self.to_fetch: set[bytes] = set()
        self.incomplete: dict[bytes, tuple[Namespace, np.ndarray]] = {}
        self.num_restored = 0

    def __bool__(self) -> bool:
        return bool(self.to_fetch or self.incomplete)

    def add_fetched(self, raw_by_key: dict[bytes, bytes]) -> None:
        for key, raw in raw_by_key.items():
            self.to_fetch.discard(key)
            try:
                ns_dict, tokens = decode_prompt_meta(raw)
                self.incomplete[key] = (Namespace.from_dict(ns_dict), tokens)
            except KVStoreError as err:
                log.warning("prefix restore: bad prompt meta %r: %s", key[:64], err.message)

    def index_ready(self, prefix: PrefixIndex, is_committed: Callable[[bytes], bool]) -> int:
        """Index every fetched prompt whose blocks are all committed by now, each in its
        owner's tree (:func:`is_prompt_meta`); forget the metas whose object went away.

        Returns:
            Prompts fully indexed by this call (the others wait for more nodes to re-register).
        """
        done = 0
        for key, (namespace, tokens) in list(self.incomplete.items()):
            if not is_committed(key):
                del self.incomplete[key]  # the meta itself went away
                continue
            tenant = owner_of(key)
            prefix.index(namespace, tokens, is_committed, tenant)
            tree = namespace if tenant is None else scoped_digest(tenant, namespace.digest)
            full = len(tokens) // namespace.block_size * namespace.block_size
            if prefix.radix.match(tree, tokens).num_tokens >= full:
                del self.incomplete[key]
                done += 1
        self.num_restored += done
        return done
