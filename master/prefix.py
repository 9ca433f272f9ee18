"""The master's prefix index: which leading tokens of a prompt are cached, and where.

Wraps :class:`kvstore.master.radix.RadixIndex` with the rules that keep it honest:

* The master computes block keys from the tokens itself (never trusting a client's keys), so a
  client cannot make another client hit blocks of other tokens.
* A block enters the index only once its object is committed, and only as part of a prefix whose
  every block is committed (the index is prefix-closed).
* A block whose object went away (removed, evicted, its node died) is dropped; ``match`` also
  re-checks every block it returns against the object table and truncates at the first missing
  one, so a stale entry can only ever cost a miss, never a wrong hit.

Bounded work per turn: a prompt at the block limit (16,384 blocks, hashing and one object key
per block) is too much index or match work to hold the master's event loop for
(``.venv/bin/python bench/bench_fairness.py`` times a store and a lookup of one, and the other
clients' latency meanwhile). So :meth:`PrefixIndex.index_steps` and
:meth:`PrefixIndex.match_steps` do it in steps of a given number of blocks, as generators (this
module knows no event loop): the RPC edge runs one step per turn of its loop (:func:`run_steps`
runs them all at once). Other requests may run between
two steps, so the step that changes the tree re-checks what earlier steps found.

Tenants (``kvstore.tenants``): a tenant's blocks are its own objects (their stored keys carry
the tenant) and its prompts live in a tree of their own, keyed by :func:`scoped_digest` of the
tenant and the namespace, so one tenant's prompt never matches another's blocks, and their
events name that scoped digest (the RPC edge shows a tenant its own namespace's digest).

Shared prefixes (``kvstore.tenants.SharedPrefix``): the blocks of a leading token range the
operator shared are stored as named, in no tenant's part of the key space, whoever wrote them.
A tenant's tree holds them as the first blocks of its prompts (under their shared keys); and a
tenant's match also counts the range's blocks the pool holds when its own tree has fewer, so a
tenant hits a shared system prompt another tenant stored, and never that tenant's blocks after it.
"""

from __future__ import annotations

import copy
import hashlib
import itertools
from collections.abc import Callable, Generator, Set
from dataclasses import dataclass
from typing import TypeVar

import numpy as np

from kvstore.errors import InvalidRequestError, KeyNotFoundError
from kvstore.keys import BlockKey, Namespace, block_keys
from kvstore.kvblocks import kv_object_keys, parse_kv_object_key
from kvstore.master.event_ring import EVENT_MOVED, EVENT_REMOVED, EVENT_STORED, EventLog
from kvstore.master.radix import RadixIndex
from kvstore.tenants import TenantDirectory, owner_of, prefix_of, tenant_key, user_key

#: Most full blocks one prompt may have in one call (index or match): the work grows with it
#: (16384 blocks: 256k tokens at block size 16, served in steps).
MAX_PROMPT_BLOCKS = 16384

T = TypeVar("T")
#: Work done in steps: a generator that yields None between two steps and returns its result.
Steps = Generator[None, None, T]


def run_steps(steps: Steps[T]) -> T:
    """Run every step of ``steps`` at once and return its result."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value  # type: ignore[no-any-return]


def check_prompt_size(namespace: Namespace, tokens: np.ndarray) -> None:
    """Refuse a prompt with more full blocks than one call may index or match.

    Raises:
        InvalidRequestError: over :data:`MAX_PROMPT_BLOCKS` full blocks.
    """
    num_blocks = len(tokens) // namespace.block_size
    if num_blocks > MAX_PROMPT_BLOCKS:
        raise InvalidRequestError(
            f"a prompt of {num_blocks} blocks exceeds the limit of {MAX_PROMPT_BLOCKS} per call"
            f" ({MAX_PROMPT_BLOCKS * namespace.block_size} tokens at block size"
            f" {namespace.block_size})"
        )


def scoped_digest(tenant: str, digest: bytes) -> bytes:
    """The digest a tenant's prompts of namespace ``digest`` are indexed under: one per tenant
    and namespace, never a namespace's own."""
    return hashlib.blake2b(
        prefix_of(tenant) + digest, digest_size=16, person=b"kvstore-tscope"
    ).digest()


def _scoped(namespace: Namespace, tenant: str) -> Namespace:
    """``namespace`` with the tenant's :func:`scoped_digest` (for the tree only: block keys are
    still hashed with the namespace's own digest, as the tenant's client hashed them)."""
    scoped = copy.copy(namespace)
    object.__setattr__(scoped, "digest", scoped_digest(tenant, namespace.digest))
    return scoped


@dataclass(frozen=True, slots=True)
class PrefixMatch:
    """Leading tokens cached, and per block (object key, tokens of it that match)."""

    num_tokens: int
    block_size: int
    blocks: list[tuple[bytes, int]]


class PrefixIndex:
    """Prefix index over committed KV block objects, for every namespace.

    Args:
        events: where every change of the index is recorded (see ``events.py``); a private
            log when None.
    """

    def __init__(self, events: EventLog | None = None) -> None:
        self.radix = RadixIndex()
        self.events = events if events is not None else EventLog()
        self.num_queries = 0
        self.num_query_tokens = 0
        self.num_hit_tokens = 0
        #: Scoped digest -> (tenant, the namespace's digest), for every tenant tree made.
        self.scopes: dict[bytes, tuple[str, bytes]] = {}
        #: The tenants' directory (the service's): which blocks are shared prefixes'.
        self.directory = TenantDirectory()

    def _object_keys(
        self, digest: bytes, blocks: list[BlockKey], tenant: str | None
    ) -> list[bytes]:
        """The stored keys of ``blocks``' objects (a tenant's carry the tenant, but for the
        blocks of a shared prefix)."""
        keys = kv_object_keys(digest, blocks)
        if tenant is None:
            return keys
        shared = self.directory.shared_keys
        return [k if k in shared else tenant_key(tenant, k) for k in keys]

    def _parse(self, object_key: bytes) -> tuple[bytes, BlockKey] | None:
        """(tree digest, block key) of a stored block object key, a tenant's too."""
        owner = owner_of(object_key)
        if owner is None:
            return parse_kv_object_key(object_key)
        parsed = parse_kv_object_key(user_key(owner, object_key) or b"")
        if parsed is None:
            return None
        return scoped_digest(owner, parsed[0]), parsed[1]

    def index(
        self,
        namespace: Namespace,
        tokens: np.ndarray,
        is_committed: Callable[[bytes], bool],
        tenant: str | None = None,
    ) -> int:
        """Index the full blocks of ``tokens`` up to the first block whose object is missing.

        Returns:
            The number of blocks newly indexed.

        Raises:
            InvalidRequestError: too many blocks (see :func:`check_prompt_size`).
        """
        steps = self.index_steps(namespace, tokens, is_committed, MAX_PROMPT_BLOCKS, tenant)
        return run_steps(steps)

    def index_steps(
        self,
        namespace: Namespace,
        tokens: np.ndarray,
        is_committed: Callable[[bytes], bool],
        step_blocks: int,
        tenant: str | None = None,
    ) -> Steps[int]:
        """:meth:`index` in steps of ``step_blocks`` blocks (hashing and checking each block),
        then one step that re-checks the committed prefix and changes the tree.

        Raises (at the first step):
            InvalidRequestError: too many blocks (see :func:`check_prompt_size`).
        """
        check_prompt_size(namespace, tokens)
        block_size = namespace.block_size
        digest = namespace.digest
        num_blocks = len(tokens) // block_size
        keys: list[BlockKey] = []
        object_keys: list[bytes] = []
        n = 0  # leading blocks whose object is committed
        for lo in range(0, num_blocks, step_blocks):
            if lo:
                yield
            hi = min(lo + step_blocks, num_blocks)
            parent = keys[-1] if keys else None
            chunk = block_keys(namespace, tokens[lo * block_size : hi * block_size], parent=parent)
            keys += chunk
            object_keys += self._object_keys(digest, chunk, tenant)
            while n < hi and is_committed(object_keys[n]):
                n += 1
            if n < hi:
                break
        if num_blocks > step_blocks:
            # Objects may have gone while other requests ran between two steps: never index a
            # block whose object is not there now (nor a "stored" event after its "removed").
            n = next((i for i in range(n) if not is_committed(object_keys[i])), n)
        if n == 0:
            return 0
        tree = namespace
        if tenant is not None:
            tree = _scoped(namespace, tenant)
            self.scopes[tree.digest] = (tenant, digest)
        added = self.radix.insert(tree, tokens[: n * block_size], keys[:n], [0] * n)
        if added:
            # insert indexes a prompt's blocks after the ones already indexed: the last ``added``.
            self.events.append(EVENT_STORED, tree.digest, keys[n - added : n])
        return added

    def match(
        self,
        namespace: Namespace,
        tokens: np.ndarray,
        is_committed: Callable[[bytes], bool],
        tenant: str | None = None,
    ) -> PrefixMatch:
        """Longest cached prefix of ``tokens`` (token-granular) whose blocks are all committed.

        Raises:
            InvalidRequestError: too many blocks (see :func:`check_prompt_size`).
        """
        steps = self.match_steps(namespace, tokens, is_committed, MAX_PROMPT_BLOCKS, tenant)
        return run_steps(steps)

    def match_steps(
        self,
        namespace: Namespace,
        tokens: np.ndarray,
        is_committed: Callable[[bytes], bool],
        step_blocks: int,
        tenant: str | None = None,
    ) -> Steps[PrefixMatch]:
        """:meth:`match`: the tree's match in one step, then its blocks checked against the
        object table in steps of ``step_blocks``. (A block checked in an earlier step whose
        object goes meanwhile costs its reader a miss, as if it went just after the answer.)

        Raises (at the first step):
            InvalidRequestError: too many blocks (see :func:`check_prompt_size`).
        """
        check_prompt_size(namespace, tokens)
        if tenant is None:
            m = self.radix.match(namespace, tokens)
        else:
            m = self.radix.match(scoped_digest(tenant, namespace.digest), tokens)
        block_size = namespace.block_size
        digest = namespace.digest
        blocks: list[tuple[bytes, int]] = []
        num_blocks = len(m.block_keys)
        for lo in range(0, num_blocks, step_blocks):
            if lo:
                yield
            hi = min(lo + step_blocks, num_blocks)
            stale = None
            chunk = self._object_keys(digest, m.block_keys[lo:hi], tenant)
            for i, obj_key in enumerate(chunk, lo):
                if not is_committed(obj_key):
                    stale = obj_key
                    break
                blocks.append((obj_key, min(block_size, m.num_tokens - i * block_size)))
            if stale is not None:
                self.forget(stale)  # stale: its object went away without telling us
                break
        if tenant is not None:
            blocks = self._longer_shared(namespace, tokens, blocks, is_committed)
        num_tokens = sum(n for _, n in blocks)
        self.num_queries += 1
        self.num_query_tokens += len(tokens)
        self.num_hit_tokens += num_tokens
        return PrefixMatch(num_tokens, block_size, blocks)

    def _longer_shared(
        self,
        namespace: Namespace,
        tokens: np.ndarray,
        blocks: list[tuple[bytes, int]],
        is_committed: Callable[[bytes], bool],
    ) -> list[tuple[bytes, int]]:
        """``blocks`` (a tenant's match), or the committed leading blocks of a shared prefix
        ``tokens`` starts with where those are more (another tenant may have stored them)."""
        best = blocks
        bs = namespace.block_size
        for shared in self.directory.prefixes_of(namespace.digest):
            n = shared.leading_blocks(tokens)
            if n * bs <= sum(k for _, k in best):
                continue
            run = [(key, bs) for key in itertools.takewhile(is_committed, shared.keys[:n])]
            if len(run) * bs > sum(k for _, k in best):
                best = run
        return best

    def forget(self, object_key: bytes, kind: str = EVENT_REMOVED) -> int:
        """Drop a block (and the blocks after it, now unreachable) when its object goes away.

        Args:
            object_key: the object that went away.
            kind: the event to record (``removed``, or ``evicted`` for the tier manager).

        Returns:
            The number of blocks dropped (0 for keys that are not KV blocks).
        """
        parsed = self._parse(object_key)
        if parsed is None:
            return 0
        digest, block = parsed
        trees = [digest]
        if object_key in self.directory.shared_keys:  # in every tenant's tree that holds it
            trees += [s for s, (_, d) in self.scopes.items() if d == digest]
        dropped = 0
        for tree in trees:
            try:
                removed = self.radix.remove(tree, BlockKey(block))
            except KeyNotFoundError:
                continue
            self.events.append(kind, tree, [k for k, _ in removed])
            dropped += len(removed)
        return dropped

    def moved(self, object_key: bytes, src_tier: str, dst_tier: str) -> None:
        """Record that an indexed block's replica moved between tiers (nothing for others)."""
        if src_tier == dst_tier:
            return
        parsed = self._parse(object_key)
        if parsed is None:
            return
        digest, block = parsed
        if self.radix.contains(digest, block):
            self.events.append(EVENT_MOVED, digest, (block,), src_tier, dst_tier)

    def snapshot(self) -> tuple[int, int, dict[bytes, bytes]]:
        """Every indexed block, per namespace, and the event position it reflects.

        Returns:
            (epoch, last seq, namespace digest -> the block keys, 16 bytes each, concatenated).
            Following the events after that seq from this snapshot reproduces the index.
        """
        keys = {digest: self.radix.stored_keys(digest) for digest in self.radix.namespaces()}
        return self.events.epoch, self.events.last_seq, keys

    def tenant_snapshot(
        self, tenant: str, shared: Set[bytes] = frozenset()
    ) -> tuple[int, int, dict[bytes, bytes]]:
        """:meth:`snapshot` of ``tenant``'s trees only, each under its namespace's own digest
        (as the tenant knows it), and of the ``shared`` namespaces' trees (every tenant's, in
        place of any tree the tenant kept from before the namespace was shared)."""
        live = set(self.radix.namespaces())
        keys = {
            digest: self.radix.stored_keys(scoped)
            for scoped, (owner, digest) in self.scopes.items()
            if owner == tenant and scoped in live and digest not in shared
        }
        for digest in shared:
            if digest in live:
                keys[digest] = self.radix.stored_keys(digest)
        return self.events.epoch, self.events.last_seq, keys

    def stats(self) -> dict[str, float | int]:
        return {
            "num_blocks": self.radix.num_blocks(),
            "num_queries": self.num_queries,
            "num_query_tokens": self.num_query_tokens,
            "num_hit_tokens": self.num_hit_tokens,
            "hit_ratio": self.num_hit_tokens / self.num_query_tokens
            if self.num_query_tokens
            else 0.0,
        }
