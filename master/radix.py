"""Radix-tree prefix index over token ids: which leading tokens of a prompt are cached, and where.

One tree per namespace (keyed by :attr:`Namespace.digest`). Edges are compressed: a node holds a
run of whole blocks, and a node exists only where stored prompts branch (or where the root
starts). Each stored block carries its 16-byte block key and a small integer value (the master's
object handle, used to find replicas).

Matching is token-granular: the tokens of a prompt are compared with the stored tokens, so a
prompt that ends mid-block, or shares only part of a block with a stored prompt, counts exactly
the tokens it shares; the last matched block may be partial.

Invariants (asserted in tests, kept by every mutation):

* prefix-closed: every stored block's parent block is stored, so no cached block is unreachable;
* a non-root node has at least one block; a non-root node never has exactly one child
  (compressed edges: such a node is merged with its child);
* block keys are unique within a namespace.

Removal policy: removing a block that has cached descendants removes the descendants too
(``cascade=True``, the default: they would be unreachable) or, with ``cascade=False``, is refused
with :class:`InvalidRequestError` and changes nothing. :meth:`RadixIndex.evictable` yields only
leaf blocks (leaf-first eviction), so evicting what it yields never cascades.

Memory layout (why no Python object per block or per node): with 1M blocks a Python object, a
dict entry and a bytes key per block would cost ~300 B before storing a single token. Instead
each tree keeps per-block *slots* in parallel numpy arrays (tokens, key, value, owning node) and
per-node records in parallel numpy arrays too (parent, the node's run of slot numbers in one
int32 slot arena, first token, child count, XOR of child ids). The key -> slot map and the
(parent, first token) -> child map are open-addressing tables of int32 ids
(:mod:`kvstore.master.radix_tables`). Tokens are stored as a uint16 low half plus one packed
bit-plane per extra high bit actually used (17 bits for a 128K vocabulary: 2.125 B per token
instead of 4); values are int32 until one needs int64.

So the index stays within its per-block memory target even when almost every prompt makes a
tree node of its own: ``.venv/bin/python bench/bench_radix.py`` prints the bytes per block, and
``--suffix-blocks 2`` (a tree node per 2 blocks) the node-heavy case.

This module is pure: no I/O, no clocks, no locks (the master serialises calls).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvstore.errors import InvalidRequestError, KeyNotFoundError
from kvstore.keys import BLOCK_KEY_BYTES, BlockKey, Namespace, as_token_array
from kvstore.master.radix_tables import ChildTable, KeyTable

_MIN_CAPACITY = 1024
_GROWTH = 1.0625  # modest growth: capacity slack is index memory too (copies stay amortised O(1))
_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1
_INT32_MIN, _INT32_MAX = -(1 << 31), (1 << 31) - 1
_FREE = -2  # n_parent of a node id that is not in use (the root's parent is -1)
_ROOT = 0


@dataclass(slots=True)
class Match:
    """Result of :meth:`RadixIndex.match`.

    Attributes:
        num_tokens: leading tokens of the prompt whose KV is cached.
        block_keys: keys of the blocks covering those tokens, in prompt order.
        values: the value stored with each of those blocks.
        block_size: tokens per block in this namespace (0 when the namespace is unknown).
    """

    num_tokens: int
    block_keys: list[BlockKey]
    values: list[int]
    block_size: int

    @property
    def num_blocks(self) -> int:
        return len(self.block_keys)

    def tokens_in_block(self, i: int) -> int:
        """Matched tokens of block ``i``: ``block_size`` except possibly for the last block."""
        if not 0 <= i < len(self.block_keys):
            raise IndexError(i)
        return min(self.block_size, self.num_tokens - i * self.block_size)

    def blocks(self) -> list[tuple[BlockKey, int, int]]:
        """``(block_key, value, num_tokens_in_block)`` per matched block; only the last may be partial."""
        return [
            (k, v, self.tokens_in_block(i))
            for i, (k, v) in enumerate(zip(self.block_keys, self.values, strict=True))
        ]


class _TokenStore:
    """Tokens of every slot: a uint16 low half plus packed bit-planes for bits 16 and up.

    Why planes: real vocabularies need 15-18 bits per token. uint32 would cost 256 B per
    64-token block, over the whole per-block budget; a plane costs block_size / 8 bytes and is
    only added once a stored token needs that bit.
    """

    __slots__ = ("block_size", "lo", "planes", "_plane_bytes")

    def __init__(self, block_size: int, capacity: int) -> None:
        self.block_size = block_size
        self._plane_bytes = (block_size + 7) // 8
        self.lo = np.zeros((capacity, block_size), dtype=np.uint16)
        self.planes: list[np.ndarray] = []

    def grow(self, capacity: int) -> None:
        self.lo = _resized(self.lo, capacity)
        self.planes = [_resized(p, capacity) for p in self.planes]

    def ensure_bits(self, max_token: int) -> None:
        needed = max(0, int(max_token).bit_length() - 16)
        while len(self.planes) < needed:
            self.planes.append(np.zeros((len(self.lo), self._plane_bytes), dtype=np.uint8))

    def put(self, slots: np.ndarray, tokens: np.ndarray) -> None:
        """Store ``tokens`` (shape ``[len(slots), block_size]``, uint32) at ``slots``."""
        self.lo[slots] = tokens.astype(np.uint16)  # keeps the low 16 bits
        for p, plane in enumerate(self.planes):
            bits = ((tokens >> np.uint32(16 + p)) & np.uint32(1)).astype(np.uint8)
            plane[slots] = np.packbits(bits, axis=1)

    def get(self, slots: np.ndarray) -> np.ndarray:
        """Tokens at ``slots`` as a flat uint32 array (``len(slots) * block_size`` tokens)."""
        out = self.lo[slots].astype(np.uint32)
        for p, plane in enumerate(self.planes):
            bits = np.unpackbits(plane[slots], axis=1, count=self.block_size)
            out |= bits.astype(np.uint32) << np.uint32(16 + p)
        return out.reshape(-1)

    def nbytes(self) -> int:
        return self.lo.nbytes + sum(p.nbytes for p in self.planes)


def _resized(arr: np.ndarray, capacity: int) -> np.ndarray:
    out = np.zeros((capacity, *arr.shape[1:]), dtype=arr.dtype)
    n = min(len(arr), capacity)
    out[:n] = arr[:n]
    return out


class _Tree:
    """The index of one namespace.

    Slots are block records in parallel arrays. Nodes are records in parallel arrays too (no
    Python object per node): parent, where the node's slot run lies in the slot arena (start,
    length), the first token of its first block, its number of children and the XOR of its
    children's ids (which names the only child when there is one, for merging). Children are
    found through :class:`ChildTable`. The arena holds each node's slots as one contiguous
    run of int32; splitting a node only splits its run, extending or merging a run that cannot
    grow in place moves it to the arena's end, and the arena is compacted when moved-away runs
    (garbage) pass a quarter of the live slots.
    """

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        cap = _MIN_CAPACITY
        self.tokens = _TokenStore(block_size, cap)
        self.keys = np.zeros((cap, BLOCK_KEY_BYTES), dtype=np.uint8)
        # int32 until a value needs more (then int64 for good): most values are small handles.
        self.values = np.zeros(cap, dtype=np.int32)
        self.owner = np.full(cap, -1, dtype=np.int32)  # node id per slot, -1 when free
        self.top = 0  # slots [0, top) have been handed out at least once
        # Why an int32 array as a stack (with its own count): a list of freed slot ints would
        # cost ~36 B per slot, and concatenating on every free would be O(free) per eviction.
        self.free_slots = np.empty(_MIN_CAPACITY, dtype=np.int32)
        self.num_free = 0
        self.num_blocks = 0
        self.table = KeyTable()
        # Nodes. Id 0 is the root (no parent, no slots).
        ncap = _MIN_CAPACITY
        self.n_parent = np.full(ncap, _FREE, dtype=np.int32)
        self.n_start = np.zeros(ncap, dtype=np.int32)
        self.n_len = np.zeros(ncap, dtype=np.int32)
        self.n_first = np.zeros(ncap, dtype=np.uint32)
        self.n_nchild = np.zeros(ncap, dtype=np.int32)
        self.n_xor = np.zeros(ncap, dtype=np.int32)
        self.n_parent[_ROOT] = -1
        self.n_top = 1  # node ids [0, n_top) have been handed out at least once
        self.free_nodes = np.empty(_MIN_CAPACITY, dtype=np.int32)
        self.num_free_nodes = 0
        self.children = ChildTable()
        # The slot arena: node n's slots are arena[n_start[n] : n_start[n] + n_len[n]].
        self.arena = np.zeros(_MIN_CAPACITY, dtype=np.int32)
        self.arena_top = 0
        self.arena_live = 0  # sum of n_len over live nodes; the rest below arena_top is garbage

    # -- slots ---------------------------------------------------------------------------------

    def alloc_slots(self, n: int) -> np.ndarray:
        reuse = min(n, self.num_free)
        self.num_free -= reuse
        taken = self.free_slots[self.num_free : self.num_free + reuse].copy()
        fresh = n - reuse
        if self.top + fresh > len(self.keys):
            cap = max(int(len(self.keys) * _GROWTH), self.top + fresh)
            self.tokens.grow(cap)
            self.keys = _resized(self.keys, cap)
            self.values = _resized(self.values, cap)
            owner = np.full(cap, -1, dtype=np.int32)
            owner[: len(self.owner)] = self.owner
            self.owner = owner
        new = np.arange(self.top, self.top + fresh, dtype=np.int32)
        self.top += fresh
        return np.concatenate([taken, new])

    def free(self, slots: np.ndarray) -> list[tuple[BlockKey, int]]:
        removed: list[tuple[BlockKey, int]] = []
        for s in slots.tolist():
            key = self.keys[s].tobytes()
            self.table.discard(key, self.keys)
            removed.append((BlockKey(key), int(self.values[s])))
        self.owner[slots] = -1
        if self.num_free + len(slots) > len(self.free_slots):
            cap = max(int(len(self.free_slots) * _GROWTH), self.num_free + len(slots))
            self.free_slots = _resized(self.free_slots, cap)
        self.free_slots[self.num_free : self.num_free + len(slots)] = slots
        self.num_free += len(slots)
        self.num_blocks -= len(slots)
        return removed

    def key_at(self, slot: int) -> BlockKey:
        return BlockKey(self.keys[slot].tobytes())

    def token_at(self, slot: int) -> int:
        """First token of the block at ``slot``."""
        return int(self.tokens.get(np.array([slot], dtype=np.int32))[0])

    # -- the slot arena ------------------------------------------------------------------------

    def slots(self, node: int) -> np.ndarray:
        """The node's slots, in edge order (a view: copy it before mutating the tree)."""
        start = int(self.n_start[node])
        return self.arena[start : start + int(self.n_len[node])]

    def _arena_reserve(self, n: int) -> None:
        """Make room for ``n`` more slots at the arena's end (compacting or growing it)."""
        if self.arena_top + n <= len(self.arena):
            return
        if (self.arena_top - self.arena_live) * 4 > self.arena_live:
            self._arena_compact()
        if self.arena_top + n > len(self.arena):
            cap = max(int(len(self.arena) * _GROWTH), self.arena_top + n)
            self.arena = _resized(self.arena, cap)

    def _arena_compact(self) -> None:
        live = np.flatnonzero(self.n_parent[: self.n_top] >= 0)
        live = live[self.n_len[live] > 0]
        live = live[np.argsort(self.n_start[live], kind="stable")]
        lens = self.n_len[live].astype(np.int64)
        new_starts = np.zeros(len(live), dtype=np.int64)
        np.cumsum(lens[:-1], out=new_starts[1:])
        total = int(lens.sum())
        src = np.repeat(self.n_start[live].astype(np.int64) - new_starts, lens)
        src += np.arange(total)
        self.arena[:total] = self.arena[src]  # runs move only down, sorted: gather is safe
        self.n_start[live] = new_starts
        self.arena_top = total

    def _arena_put(self, node: int, slots: np.ndarray) -> None:
        """Give ``node`` (no run yet) a run at the arena's end holding ``slots``."""
        self._arena_reserve(len(slots))
        self.arena[self.arena_top : self.arena_top + len(slots)] = slots
        self.n_start[node] = self.arena_top
        self.n_len[node] = len(slots)
        self.arena_top += len(slots)
        self.arena_live += len(slots)

    def _arena_append(self, node: int, slots: np.ndarray) -> None:
        """Append ``slots`` to ``node``'s run, moving the run to the arena's end if needed."""
        start, length = int(self.n_start[node]), int(self.n_len[node])
        if start + length != self.arena_top:
            run = self.arena[start : start + length].copy()
            self._arena_reserve(length + len(slots))
            start = self.arena_top
            self.arena[start : start + length] = run
            self.arena_top += length
            self.n_start[node] = start
        else:
            self._arena_reserve(len(slots))
            start = int(self.n_start[node])  # compaction may have moved it
        self.arena[start + length : start + length + len(slots)] = slots
        self.n_len[node] = length + len(slots)
        self.arena_top = start + length + len(slots)
        self.arena_live += len(slots)

    def _arena_truncate(self, node: int, length: int) -> None:
        self.arena_live -= int(self.n_len[node]) - length
        self.n_len[node] = length

    # -- nodes ---------------------------------------------------------------------------------

    def is_live(self, node: int) -> bool:
        return 0 <= node < self.n_top and self.n_parent[node] != _FREE

    def new_node(self, parent: int, slots: np.ndarray, first_token: int) -> int:
        """A new child of ``parent`` holding ``slots`` (whose first block starts with ``first_token``)."""
        if self.num_free_nodes:
            self.num_free_nodes -= 1
            node = int(self.free_nodes[self.num_free_nodes])
        else:
            if self.n_top == len(self.n_parent):
                cap = max(int(self.n_top * _GROWTH), self.n_top + 1)
                self.n_parent = _resized(self.n_parent, cap)
                self.n_parent[self.n_top :] = _FREE
                self.n_start = _resized(self.n_start, cap)
                self.n_len = _resized(self.n_len, cap)
                self.n_first = _resized(self.n_first, cap)
                self.n_nchild = _resized(self.n_nchild, cap)
                self.n_xor = _resized(self.n_xor, cap)
            node = self.n_top
            self.n_top += 1
        self.n_parent[node] = parent
        self.n_first[node] = first_token
        self.n_nchild[node] = 0
        self.n_xor[node] = 0
        self._arena_put(node, slots)
        self.owner[slots] = node
        self.children.add(node, self.n_parent, self.n_first)
        self.n_nchild[parent] += 1
        self.n_xor[parent] ^= node
        return node

    def detach(self, node: int) -> None:
        """Unfile ``node`` from its parent (its parent pointer is kept)."""
        parent = int(self.n_parent[node])
        self.children.discard(node, self.n_parent, self.n_first)
        self.n_nchild[parent] -= 1
        self.n_xor[parent] ^= node

    def attach(self, parent: int, node: int) -> None:
        """File ``node`` (already detached, ``n_first`` set) under ``parent``."""
        self.n_parent[node] = parent
        self.children.add(node, self.n_parent, self.n_first)
        self.n_nchild[parent] += 1
        self.n_xor[parent] ^= node

    def drop_node(self, node: int) -> None:
        """Free a detached node's id and its arena run."""
        self.arena_live -= int(self.n_len[node])
        self.n_parent[node] = _FREE
        self.n_len[node] = 0
        self.n_nchild[node] = 0
        self.n_xor[node] = 0
        if self.num_free_nodes == len(self.free_nodes):
            cap = max(int(len(self.free_nodes) * _GROWTH), self.num_free_nodes + 1)
            self.free_nodes = _resized(self.free_nodes, cap)
        self.free_nodes[self.num_free_nodes] = node
        self.num_free_nodes += 1

    def child_list(self, node: int) -> list[int]:
        """Children of ``node`` (O(1) for 0 or 1 child, else a scan of the node arrays)."""
        n = int(self.n_nchild[node])
        if n == 0:
            return []
        if n == 1:
            return [int(self.n_xor[node])]
        return np.flatnonzero(self.n_parent[: self.n_top] == node).tolist()

    def descendants(self, node: int) -> list[int]:
        """Every node below ``node`` (not ``node`` itself)."""
        out: list[int] = []
        frontier = self.child_list(node)
        while frontier:  # bounded by the tree's depth
            out.extend(frontier)
            inner = [c for c in frontier if self.n_nchild[c]]
            if not inner:
                break
            if len(inner) == 1:
                frontier = self.child_list(inner[0])
            else:
                frontier = np.flatnonzero(np.isin(self.n_parent[: self.n_top], inner)).tolist()
        return out

    def split(self, node: int, k: int) -> int:
        """Split ``node`` after its first ``k`` blocks; return the new upper node."""
        length = int(self.n_len[node])
        assert 0 < k < length, "split point inside the edge"
        parent = int(self.n_parent[node])
        assert parent >= 0, "the root is never split"
        start = int(self.n_start[node])
        self.detach(node)
        # The upper node takes the first k slots of the run in place: no copy.
        upper = self.new_node_in_place(parent, start, k, int(self.n_first[node]))
        self.n_start[node] = start + k
        self.n_len[node] = length - k
        self.n_first[node] = self.token_at(int(self.arena[start + k]))
        self.attach(upper, node)
        return upper

    def new_node_in_place(self, parent: int, start: int, length: int, first_token: int) -> int:
        """Like :meth:`new_node` for slots already in the arena at ``[start, start + length)``,
        taken over from a node that gives them up (so the live count does not change)."""
        empty = np.empty(0, dtype=np.int32)
        node = self.new_node(parent, empty, first_token)
        self.n_start[node] = start
        self.n_len[node] = length
        self.owner[self.arena[start : start + length]] = node
        return node

    def maybe_merge(self, node: int) -> None:
        """Merge a non-root node that has exactly one child with that child (compressed edges)."""
        if node == _ROOT or self.n_nchild[node] != 1:
            return
        child = int(self.n_xor[node])
        grandchildren = self.child_list(child)
        child_slots = self.slots(child).copy()
        start, length = int(self.n_start[node]), int(self.n_len[node])
        self.detach(child)
        if start + length == int(self.n_start[child]):
            self.n_len[node] = length + len(child_slots)  # runs adjacent (e.g. after a split)
        else:
            self.arena_live -= len(child_slots)  # _arena_append counts them again
            self._arena_append(node, child_slots)
        self.owner[child_slots] = node
        for g in grandchildren:
            self.children.discard(g, self.n_parent, self.n_first)
            self.n_parent[g] = node
            self.children.add(g, self.n_parent, self.n_first)
        self.n_nchild[node] = self.n_nchild[child]
        self.n_xor[node] = self.n_xor[child]
        self.n_len[child] = 0  # its slots now belong to node
        self.drop_node(child)

    # -- walking -------------------------------------------------------------------------------

    def walk(self, q: np.ndarray) -> tuple[list[tuple[int, int]], tuple[int, int, int] | None]:
        """Follow ``q`` down the tree.

        Returns:
            ``path``: ``(node, k)`` pairs, the first ``k`` blocks of ``node`` fully matched;
            ``partial``: ``(node, i, n)`` when block ``i`` of ``node`` shares its first
            ``0 < n < block_size`` tokens with the rest of ``q``, else ``None``.
        """
        bs = self.block_size
        path: list[tuple[int, int]] = []
        node = _ROOT
        pos = 0
        n_q = len(q)
        arena, n_start, n_len = self.arena, self.n_start, self.n_len
        for _ in range(self.n_top + 1):  # bounded: each step goes one node deeper
            if pos >= n_q or not self.n_nchild[node]:
                return path, None
            group = self.children.find(node, int(q[pos]), self.n_parent, self.n_first)
            if not group:
                return path, None
            # Pick the child sharing the most tokens of its first block (ties: any).
            head = q[pos : pos + bs]
            best, best_n = group[0], -1
            if len(group) == 1 and n_q - pos >= bs:
                # One candidate: compare its first block together with the rest of the edge.
                best_n = bs
            else:
                for child in group:
                    shared = _common_prefix(
                        self.tokens.get(arena[n_start[child] : n_start[child] + 1]), head
                    )
                    if shared > best_n:
                        best, best_n = child, shared
                if best_n < bs:
                    return path, (best, 0, best_n)
            start = int(n_start[best])
            edge_blocks = int(n_len[best])
            need = min(edge_blocks, -(-(n_q - pos) // bs))
            if best_n == bs and len(group) == 1:
                stored = self.tokens.get(arena[start : start + need])
                shared = _common_prefix(stored, q[pos : pos + need * bs])
                if shared < bs:
                    return path, ((best, 0, shared) if shared else None)
            elif need > 1:
                stored = self.tokens.get(arena[start + 1 : start + need])
                shared = bs + _common_prefix(stored, q[pos + bs : pos + need * bs])
            else:
                shared = bs
            full = shared // bs
            if full < edge_blocks:
                path.append((best, full))
                rest = shared - full * bs
                return path, ((best, full, rest) if rest else None)
            path.append((best, edge_blocks))
            node = best
            pos += edge_blocks * bs
        raise AssertionError("walk did not terminate")


def _common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the common prefix of two 1-D arrays."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    neq = a[:n] != b[:n]
    i = int(neq.argmax())
    return i if neq[i] else n


def _check_key(key: Any) -> bytes:
    if not isinstance(key, bytes) or len(key) != BLOCK_KEY_BYTES:
        raise InvalidRequestError(f"a block key must be {BLOCK_KEY_BYTES} bytes")
    return key


class RadixIndex:
    """Prefix index of every namespace the master knows. Not thread-safe: callers serialise.

    NOTE: the index trusts the keys it is given. The caller (``put_end`` in the master) must make
    sure ``block_keys`` are the keys of ``tokens`` (e.g. with :func:`kvstore.keys.block_keys`),
    otherwise a lying client could make other clients hit wrong blocks.
    """

    def __init__(self) -> None:
        self._trees: dict[bytes, _Tree] = {}

    def insert(
        self, namespace: Namespace, tokens: Any, block_keys: list[BlockKey], values: Any
    ) -> int:
        """Index the full blocks of a prompt.

        Blocks already indexed keep their value. All checks happen before any change.

        Args:
            namespace: the namespace of the blocks.
            tokens: exactly ``len(block_keys) * namespace.block_size`` token ids.
            block_keys: the chained key of each block.
            values: one int64 per block (e.g. the master's object handle).

        Returns:
            The number of blocks newly indexed.

        Raises:
            InvalidRequestError: lengths disagree, bad tokens/keys/values, a key given for an
                already indexed block differs from the stored one, or a new key is already
                indexed for other tokens.
        """
        q = as_token_array(tokens)
        bs = namespace.block_size
        n = len(block_keys)
        if len(q) != n * bs:
            raise InvalidRequestError(f"{len(q)} tokens do not make {n} full blocks of {bs} tokens")
        keys = [_check_key(k) for k in block_keys]
        vals = _check_values(values, n)
        if n == 0:
            return 0
        tree = self._trees.get(namespace.digest)
        if tree is None:
            tree = _Tree(bs)  # registered only once every check has passed
        path, _ = tree.walk(q)
        matched = sum(k for _, k in path)
        if matched:
            parts = [tree.slots(node)[:k] for node, k in path]
            stored = tree.keys[np.concatenate(parts)].tobytes()
            if stored != b"".join(keys[:matched]):
                raise InvalidRequestError("a block key differs from the indexed block's key")
        new_keys = keys[matched:]
        if len(set(new_keys)) != len(new_keys):
            raise InvalidRequestError("duplicate block keys in one insert")
        rows = np.frombuffer(b"".join(new_keys), dtype=np.uint8).reshape(-1, BLOCK_KEY_BYTES)
        clash = np.flatnonzero(tree.table.find_many(rows, tree.keys) >= 0)
        if len(clash):
            raise InvalidRequestError(
                f"block {matched + int(clash[0])}: key already indexed elsewhere"
            )
        if not new_keys:
            return 0
        # Mutations start here; nothing below raises on valid state.
        self._trees[namespace.digest] = tree
        tree.tokens.ensure_bits(int(q.max()))
        if path:
            node, k = path[-1]
            if k < tree.n_len[node]:
                node = tree.split(node, k)
        else:
            node = _ROOT
        slots = tree.alloc_slots(len(new_keys))
        tree.tokens.put(slots, q[matched * bs :].reshape(-1, bs))
        tree.keys[slots] = rows
        new_vals = vals[matched:]
        if tree.values.dtype != np.int64 and (
            int(new_vals.min()) < _INT32_MIN or int(new_vals.max()) > _INT32_MAX
        ):
            tree.values = tree.values.astype(np.int64)
        tree.values[slots] = new_vals
        tree.table.add_many(rows, slots, tree.keys)
        tree.num_blocks += len(new_keys)
        if node != _ROOT and not tree.n_nchild[node]:
            tree._arena_append(node, slots)  # extend the leaf edge
            tree.owner[slots] = node
        else:
            tree.new_node(node, slots, int(q[matched * bs]))
        return len(new_keys)

    def match(self, namespace: Namespace | bytes, tokens: Any) -> Match:
        """Longest cached prefix of ``tokens``, token-granular.

        Args:
            namespace: the namespace, or its digest.
            tokens: the prompt's token ids (any length).

        Returns:
            A :class:`Match`; an unknown namespace is a miss (``num_tokens == 0``).

        Raises:
            InvalidRequestError: bad token ids.
        """
        digest = namespace.digest if isinstance(namespace, Namespace) else namespace
        q = as_token_array(tokens)
        tree = self._trees.get(digest)
        if tree is None:
            return Match(0, [], [], 0)
        path, partial = tree.walk(q)
        parts = [tree.slots(node)[:k] for node, k in path]
        num_tokens = sum(len(p) for p in parts) * tree.block_size
        if partial is not None:
            node, i, n = partial
            parts.append(tree.slots(node)[i : i + 1])
            num_tokens += n
        if not parts:
            return Match(0, [], [], tree.block_size)
        slots = np.concatenate(parts)
        raw = tree.keys[slots].tobytes()
        keys = [BlockKey(raw[j : j + 16]) for j in range(0, len(raw), 16)]
        return Match(num_tokens, keys, tree.values[slots].tolist(), tree.block_size)

    def remove(
        self, ns_digest: bytes, block_key: BlockKey, *, cascade: bool = True
    ) -> list[tuple[BlockKey, int]]:
        """Remove a block and, with ``cascade``, every block stored after it.

        Args:
            ns_digest: the namespace digest.
            block_key: the block to remove.
            cascade: when False, refuse to remove a block that has cached descendants.

        Returns:
            ``(block_key, value)`` of every block removed (the block itself included).

        Raises:
            KeyNotFoundError: the block is not indexed.
            InvalidRequestError: ``cascade`` is False and the block has cached descendants.
        """
        key = _check_key(block_key)
        tree = self._trees.get(ns_digest)
        slot = -1 if tree is None else tree.table.find(key, tree.keys)
        if tree is None or slot < 0:
            raise KeyNotFoundError("block key not in the prefix index")
        node = int(tree.owner[slot])
        assert node != _ROOT and tree.is_live(node), "slot owned by a dropped node"
        run = tree.slots(node)
        i = int(np.flatnonzero(run == slot)[0])
        is_leaf = i == len(run) - 1 and not tree.n_nchild[node]
        if not is_leaf and not cascade:
            raise InvalidRequestError("block has cached descendants; remove them first")
        removed: list[tuple[BlockKey, int]] = []
        for sub in tree.descendants(node):
            removed.extend(tree.free(tree.slots(sub).copy()))
            tree.detach(sub)
            tree.drop_node(sub)
        removed.extend(tree.free(tree.slots(node)[i:].copy()))
        if i > 0:
            tree._arena_truncate(node, i)
        else:
            parent = int(tree.n_parent[node])
            tree.detach(node)
            tree.drop_node(node)
            tree.maybe_merge(parent)
        if tree.num_blocks == 0:
            del self._trees[ns_digest]  # an empty namespace costs nothing
        return removed

    def evictable(self, ns_digest: bytes | None = None) -> Iterator[tuple[bytes, BlockKey]]:
        """Leaf blocks, which can be evicted without making any cached block unreachable.

        Yields every current leaf once. When the caller removes a yielded block, the block
        before it becomes a leaf and is yielded later in the same iteration, so removing
        everything yielded empties the namespace. Removing blocks while iterating is safe.

        Args:
            ns_digest: one namespace, or ``None`` for all.

        Yields:
            ``(ns_digest, block_key)`` pairs.
        """
        digests = list(self._trees) if ns_digest is None else [ns_digest]
        for digest in digests:
            tree = self._trees.get(digest)
            if tree is None:
                continue
            removed_any = True
            while removed_any and tree.num_blocks:  # each round either removes or stops
                removed_any = False
                seen: set[int] = set()
                stack = (np.flatnonzero(tree.n_parent[1 : tree.n_top] >= 0) + 1).tolist()
                while stack:
                    node = stack.pop()
                    if not tree.is_live(node) or tree.n_nchild[node] or not tree.n_len[node]:
                        continue
                    slot = int(tree.arena[tree.n_start[node] + tree.n_len[node] - 1])
                    if slot in seen:
                        continue
                    seen.add(slot)
                    key = tree.key_at(slot)
                    yield digest, key
                    if tree.table.find(key, tree.keys) < 0:
                        removed_any = True
                        stack.append(node)
                if self._trees.get(digest) is not tree:
                    break

    def get_value(self, ns_digest: bytes, block_key: BlockKey) -> int:
        """The value stored with a block.

        Raises:
            KeyNotFoundError: the block is not indexed.
        """
        key = _check_key(block_key)
        tree = self._trees.get(ns_digest)
        slot = -1 if tree is None else tree.table.find(key, tree.keys)
        if tree is None or slot < 0:
            raise KeyNotFoundError("block key not in the prefix index")
        return int(tree.values[slot])

    def contains(self, ns_digest: bytes, block_key: bytes) -> bool:
        """Whether a block is indexed (bad keys are simply not)."""
        tree = self._trees.get(ns_digest)
        if tree is None or not isinstance(block_key, bytes) or len(block_key) != BLOCK_KEY_BYTES:
            return False
        return tree.table.find(block_key, tree.keys) >= 0

    def stored_keys(self, ns_digest: bytes) -> bytes:
        """The keys of every block of a namespace, 16 bytes each, concatenated (in no order)."""
        tree = self._trees.get(ns_digest)
        if tree is None:
            return b""
        live = np.flatnonzero(tree.owner[: tree.top] >= 0)
        return tree.keys[live].tobytes()

    def num_blocks(self, ns_digest: bytes | None = None) -> int:
        """Blocks indexed in one namespace, or in all of them."""
        if ns_digest is None:
            return sum(t.num_blocks for t in self._trees.values())
        tree = self._trees.get(ns_digest)
        return 0 if tree is None else tree.num_blocks

    def num_nodes(self, ns_digest: bytes | None = None) -> int:
        """Tree nodes (compressed edges), roots excluded."""
        trees = self._trees.values() if ns_digest is None else [self._trees.get(ns_digest)]
        return sum(t.n_top - t.num_free_nodes - 1 for t in trees if t is not None)

    def namespaces(self) -> list[bytes]:
        """Digests of the namespaces that have a tree."""
        return list(self._trees)

    def memory_bytes(self) -> int:
        """Estimate of the index's memory: the arrays' ``nbytes`` (there is no per-node object)."""
        total = sys.getsizeof(self._trees)
        for tree in self._trees.values():
            total += tree.tokens.nbytes() + tree.keys.nbytes + tree.values.nbytes
            total += tree.owner.nbytes + tree.free_slots.nbytes + tree.table.nbytes()
            total += sum(
                a.nbytes
                for a in (tree.n_parent, tree.n_start, tree.n_len, tree.n_first, tree.n_nchild)
            )
            total += tree.n_xor.nbytes + tree.free_nodes.nbytes + tree.arena.nbytes
            total += tree.children.nbytes()
        return total

    def check_invariants(self) -> None:
        """Assert the structural invariants (for tests; O(blocks))."""
        for tree in self._trees.values():
            assert tree.n_parent[_ROOT] == -1 and tree.n_len[_ROOT] == 0, "root"
            live = np.flatnonzero(tree.n_parent[: tree.n_top] != _FREE)
            counts = np.zeros(tree.n_top, dtype=np.int64)
            xors = np.zeros(tree.n_top, dtype=np.int64)
            seen = 0
            for node in live.tolist():
                start, length = int(tree.n_start[node]), int(tree.n_len[node])
                seen += length
                if node == _ROOT:
                    continue
                assert length > 0, "empty non-root node"
                assert tree.n_nchild[node] != 1, "uncompressed edge"
                parent = int(tree.n_parent[node])
                assert parent >= 0, "orphan node"
                assert tree.is_live(parent), "dead parent"
                assert start >= 0 and start + length <= tree.arena_top, "run outside the arena"
                run = tree.slots(node)
                assert (tree.owner[run] == node).all(), "owner mismatch"
                first = int(tree.n_first[node])
                assert tree.token_at(int(run[0])) == first, "child filed under wrong token"
                found = tree.children.find(parent, first, tree.n_parent, tree.n_first)
                assert found.count(node) == 1, "child not filed under its parent"
                counts[parent] += 1
                xors[parent] ^= node
            assert (counts[live] == tree.n_nchild[live]).all(), "child count mismatch"
            assert (xors[live] == tree.n_xor[live]).all(), "child xor mismatch"
            assert tree.children.count == len(live) - 1, "child table count mismatch"
            assert tree.num_free_nodes == tree.n_top - len(live), "free node count mismatch"
            runs = live[tree.n_len[live] > 0]
            order = np.argsort(tree.n_start[runs], kind="stable")
            starts = tree.n_start[runs][order].astype(np.int64)
            ends = starts + tree.n_len[runs][order]
            assert (ends[:-1] <= starts[1:]).all(), "overlapping arena runs"
            assert tree.arena_live == int(tree.n_len[live].sum()), "arena live count mismatch"
            assert seen == tree.num_blocks == tree.table.count, "block count mismatch"


def _check_values(values: Any, n: int) -> np.ndarray:
    try:
        arr = np.asarray(values)
    except (TypeError, ValueError) as exc:
        raise InvalidRequestError(f"bad values: {exc}") from None
    if arr.shape != (n,):
        raise InvalidRequestError(f"need {n} values, got shape {arr.shape}")
    if n and arr.dtype.kind not in "iu":
        raise InvalidRequestError(f"values must be integers, got dtype {arr.dtype}")
    if n and (int(arr.min()) < _INT64_MIN or int(arr.max()) > _INT64_MAX):
        raise InvalidRequestError("values must fit in int64")
    return arr.astype(np.int64)
