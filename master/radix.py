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

Memory layout (why not a Python object per block): with 1M blocks a Python object, a dict entry
and a bytes key per block would cost ~300 B before storing a single token. Instead each tree keeps
per-block *slots* in parallel numpy arrays (tokens, key, value, owning node), nodes hold only
their slot numbers (packed int32), and the key -> slot map is an open-addressing table of int32
slot numbers. Tokens are stored as a uint16 low half plus one packed bit-plane per extra high bit
actually used (17 bits for a 128K vocabulary: 2.125 B per token instead of 4).

Measured with ``bench/bench_radix.py`` (1M blocks of 64 tokens): ~180 B per block with a 128K
vocabulary, ~174 B with a 32K one. Each node (one per branch) costs ~190 B more, so a workload of
prompts whose unique suffix is only ~2 blocks (one leaf node per 2 blocks) reaches ~280 B per block.

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

_MIN_CAPACITY = 1024
_GROWTH = 1.125  # modest growth: capacity slack is index memory too (copies stay amortised O(1))
_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1


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


class _Node:
    """A compressed edge: a run of blocks (slots) and the branches after it.

    ``children`` maps the first token of a child's first block to the child starting with it,
    or to a list when siblings share a first token (they differ later in the block); the list
    is rare, so the common case saves its ~64 B.

    The slots are kept as packed int32 ``bytes`` (48 B for a short edge) rather than a numpy
    array (112 B of header): short-suffix prompts make one node per prompt, so per-node bytes
    count. ``slots`` returns a read-only zero-copy numpy view.
    """

    __slots__ = ("node_id", "parent", "_slots", "children")

    def __init__(self, node_id: int, parent: _Node | None, slots: np.ndarray) -> None:
        self.node_id = node_id
        self.parent = parent
        self._slots = slots.astype(np.int32).tobytes()
        self.children: dict[int, _Node | list[_Node]] | None = None

    @property
    def slots(self) -> np.ndarray:
        return np.frombuffer(self._slots, dtype=np.int32)

    @slots.setter
    def slots(self, value: np.ndarray) -> None:
        self._slots = value.astype(np.int32).tobytes()

    @property
    def num_slots(self) -> int:
        return len(self._slots) // 4

    def num_children(self) -> int:
        if not self.children:
            return 0
        return sum(len(g) if isinstance(g, list) else 1 for g in self.children.values())

    def iter_children(self) -> Iterator[_Node]:
        if self.children:
            for group in self.children.values():
                if isinstance(group, list):
                    yield from group
                else:
                    yield group


class _KeyTable:
    """Block key -> slot: open addressing with linear probing over an int32 array.

    Why not a dict: a dict of 16-byte ``bytes`` to ``int`` costs ~150 B per entry; this costs
    ~8-13 B (4 B per entry, load factor kept in (0.3, 0.6]). Keys are uniform hashes, so their
    first 8 bytes are the bucket hash; the full 16 bytes are compared on every probe hit.
    """

    __slots__ = ("table", "mask", "count")

    def __init__(self, size: int = 1 << 11) -> None:
        self.table = np.full(size, -1, dtype=np.int32)
        self.mask = size - 1
        self.count = 0

    @staticmethod
    def _bucket(key: bytes) -> int:
        return int.from_bytes(key[:8], "little")

    def find(self, key: bytes, keys: np.ndarray) -> int:
        table, mask = self.table, self.mask
        i = self._bucket(key) & mask
        for _ in range(len(table)):
            s = int(table[i])
            if s < 0:
                return -1
            if keys[s].tobytes() == key:
                return s
            i = (i + 1) & mask
        return -1

    def find_many(self, rows: np.ndarray, keys: np.ndarray) -> np.ndarray:
        """Slots of ``rows`` (``[n, 16]`` uint8 keys), -1 where absent; probes all rows at once."""
        result = np.full(len(rows), -1, dtype=np.int32)
        pos = (_buckets(rows) & np.uint64(self.mask)).astype(np.int64)
        active = np.arange(len(rows))
        for _ in range(len(self.table)):  # bounded: each round advances every active probe
            if not len(active):
                break
            s = self.table[pos[active]]
            occupied = s >= 0
            hit = np.zeros(len(active), dtype=bool)
            hit[occupied] = (keys[s[occupied]] == rows[active[occupied]]).all(axis=1)
            result[active[hit]] = s[hit]
            active = active[occupied & ~hit]
            pos[active] = (pos[active] + 1) & self.mask
        return result

    def add_many(self, rows: np.ndarray, slots: np.ndarray, keys: np.ndarray) -> None:
        """Add absent, distinct keys ``rows`` mapping to ``slots``, all at once.

        Each key still lands on the first free bucket of its probe sequence (ties within the
        batch go to the first claimant, the others probe on), so lookups stay correct.
        """
        if (self.count + len(rows)) * 5 > len(self.table) * 3:
            size = len(self.table)
            while (self.count + len(rows)) * 5 > size * 3:
                size *= 2
            self._rehash(size, keys)
        table = self.table
        pos = (_buckets(rows) & np.uint64(self.mask)).astype(np.int64)
        active = np.arange(len(rows))
        for _ in range(len(table)):  # bounded: every round places or advances each key
            if not len(active):
                break
            p = pos[active]
            free = table[p] < 0
            claim_pos, first = np.unique(p[free], return_index=True)
            winners = active[free][first]
            table[claim_pos] = slots[winners]
            placed = np.zeros(len(rows), dtype=bool)
            placed[winners] = True
            active = active[~placed[active]]
            pos[active] = (pos[active] + 1) & self.mask
        self.count += len(rows)

    def discard(self, key: bytes, keys: np.ndarray) -> None:
        """Remove ``key`` (backward-shift deletion: no tombstones, probes stay short)."""
        table, mask = self.table, self.mask
        i = self._bucket(key) & mask
        for _ in range(len(table)):
            s = int(table[i])
            if s < 0:
                return
            if keys[s].tobytes() == key:
                break
            i = (i + 1) & mask
        else:
            return
        j = i
        for _ in range(len(table)):
            j = (j + 1) & mask
            s = int(table[j])
            if s < 0:
                break
            home = self._bucket(keys[s].tobytes()) & mask
            # Move entry j into the hole at i unless its home lies cyclically in (i, j].
            if (j > i and (home <= i or home > j)) or (j < i and home <= i and home > j):
                table[i] = s
                i = j
        table[i] = -1
        self.count -= 1
        if len(self.table) > (1 << 11) and self.count * 10 < len(self.table) * 3 // 2:
            self._rehash(len(self.table) // 2, keys)

    def _rehash(self, size: int, keys: np.ndarray) -> None:
        live = self.table[self.table >= 0]
        self.table = np.full(size, -1, dtype=np.int32)
        self.mask = size - 1
        self.count = 0
        self.add_many(keys[live], live, keys)

    def nbytes(self) -> int:
        return self.table.nbytes


class _Tree:
    """The index of one namespace. Slots are block records in parallel arrays."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        cap = _MIN_CAPACITY
        self.tokens = _TokenStore(block_size, cap)
        self.keys = np.zeros((cap, BLOCK_KEY_BYTES), dtype=np.uint8)
        self.values = np.zeros(cap, dtype=np.int64)
        self.owner = np.full(cap, -1, dtype=np.int32)  # node id per slot, -1 when free
        self.top = 0  # slots [0, top) have been handed out at least once
        # Why an int32 array as a stack (with its own count): a list of freed slot ints would
        # cost ~36 B per slot, and concatenating on every free would be O(free) per eviction.
        self.free_slots = np.empty(_MIN_CAPACITY, dtype=np.int32)
        self.num_free = 0
        self.num_blocks = 0
        self.table = _KeyTable()
        self.root = _Node(0, None, np.empty(0, dtype=np.int32))
        self.nodes: list[_Node | None] = [self.root]
        self.free_node_ids: list[int] = []

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

    def first_token(self, node: _Node) -> int:
        return int(self.tokens.get(node.slots[:1])[0])

    # -- nodes ---------------------------------------------------------------------------------

    def new_node(self, parent: _Node, slots: np.ndarray) -> _Node:
        if self.free_node_ids:
            node_id = self.free_node_ids.pop()
            node = _Node(node_id, parent, slots)
            self.nodes[node_id] = node
        else:
            node = _Node(len(self.nodes), parent, slots)
            self.nodes.append(node)
        self.owner[slots] = node.node_id
        return node

    def drop_node(self, node: _Node) -> None:
        self.nodes[node.node_id] = None
        self.free_node_ids.append(node.node_id)
        node.parent = None

    def attach(self, parent: _Node, child: _Node, first_token: int) -> None:
        if parent.children is None:
            parent.children = {}
        group = parent.children.get(first_token)
        if group is None:
            parent.children[first_token] = child
        elif isinstance(group, list):
            group.append(child)
        else:
            parent.children[first_token] = [group, child]
        child.parent = parent

    def detach(self, parent: _Node, child: _Node, first_token: int) -> None:
        assert parent.children is not None, "detach from a node without children"
        group = parent.children[first_token]
        if isinstance(group, list):
            group.remove(child)
            if len(group) == 1:
                parent.children[first_token] = group[0]
        else:
            assert group is child, "detaching a node filed elsewhere"
            del parent.children[first_token]
        if not parent.children:
            parent.children = None

    def split(self, node: _Node, k: int) -> _Node:
        """Split ``node`` after its first ``k`` blocks; return the new upper node."""
        assert 0 < k < len(node.slots), "split point inside the edge"
        parent = node.parent
        assert parent is not None, "the root is never split"
        first = self.first_token(node)
        upper = self.new_node(parent, node.slots[:k].copy())
        self.detach(parent, node, first)
        self.attach(parent, upper, first)
        node.slots = node.slots[k:].copy()
        self.attach(upper, node, self.first_token(node))
        return upper

    def maybe_merge(self, node: _Node) -> None:
        """Merge a non-root node that has exactly one child with that child (compressed edges)."""
        if node is self.root or node.num_children() != 1:
            return
        child = next(node.iter_children())
        node.slots = np.concatenate([node.slots, child.slots])
        self.owner[child.slots] = node.node_id
        node.children = child.children
        for grandchild in node.iter_children():
            grandchild.parent = node
        child.children = None
        self.drop_node(child)

    # -- walking -------------------------------------------------------------------------------

    def walk(self, q: np.ndarray) -> tuple[list[tuple[_Node, int]], tuple[_Node, int, int] | None]:
        """Follow ``q`` down the tree.

        Returns:
            ``path``: ``(node, k)`` pairs, the first ``k`` blocks of ``node`` fully matched;
            ``partial``: ``(node, i, n)`` when block ``i`` of ``node`` shares its first
            ``0 < n < block_size`` tokens with the rest of ``q``, else ``None``.
        """
        bs = self.block_size
        path: list[tuple[_Node, int]] = []
        node = self.root
        pos = 0
        n_q = len(q)
        for _ in range(len(self.nodes) + 1):  # bounded: each step goes one node deeper
            if pos >= n_q or not node.children:
                return path, None
            group = node.children.get(int(q[pos]))
            if not group:
                return path, None
            # Pick the child sharing the most tokens of its first block (ties: any).
            head = q[pos : pos + bs]
            if not isinstance(group, list):
                group = [group]
            best, best_n = group[0], -1
            for child in group:
                shared = _common_prefix(self.tokens.get(child.slots[:1]), head)
                if shared > best_n:
                    best, best_n = child, shared
            if best_n < bs:
                return path, (best, 0, best_n)
            # First block matched fully: compare the rest of the edge in one vectorised step.
            edge_blocks = len(best.slots)
            need = min(edge_blocks, -(-(n_q - pos) // bs))
            if need > 1:
                stored = self.tokens.get(best.slots[1:need])
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

    def subtree(self, node: _Node) -> list[_Node]:
        out = [node]
        stack = list(node.iter_children())
        while stack:  # bounded by the number of nodes
            n = stack.pop()
            out.append(n)
            stack.extend(n.iter_children())
        return out


def _buckets(rows: np.ndarray) -> np.ndarray:
    """Bucket hash of ``[n, 16]`` uint8 keys: their first 8 bytes as little-endian uint64."""
    return np.ascontiguousarray(rows[:, :8]).view("<u8").reshape(-1)


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
            stored = tree.keys[np.concatenate([node.slots[:k] for node, k in path])].tobytes()
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
            if k < len(node.slots):
                node = tree.split(node, k)
        else:
            node = tree.root
        slots = tree.alloc_slots(len(new_keys))
        tree.tokens.put(slots, q[matched * bs :].reshape(-1, bs))
        tree.keys[slots] = rows
        tree.values[slots] = vals[matched:]
        tree.table.add_many(rows, slots, tree.keys)
        tree.num_blocks += len(new_keys)
        if node is not tree.root and not node.children:
            node.slots = np.concatenate([node.slots, slots])  # extend the leaf edge in place
            tree.owner[slots] = node.node_id
        else:
            leaf = tree.new_node(node, slots)
            tree.attach(node, leaf, int(q[matched * bs]))
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
        parts = [node.slots[:k] for node, k in path]
        num_tokens = sum(len(p) for p in parts) * tree.block_size
        if partial is not None:
            node, i, n = partial
            parts.append(node.slots[i : i + 1])
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
        node = tree.nodes[int(tree.owner[slot])]
        assert node is not None, "slot owned by a dropped node"
        i = int(np.flatnonzero(node.slots == slot)[0])
        is_leaf = i == len(node.slots) - 1 and not node.children
        if not is_leaf and not cascade:
            raise InvalidRequestError("block has cached descendants; remove them first")
        first = tree.first_token(node)
        removed: list[tuple[BlockKey, int]] = []
        for sub in tree.subtree(node)[1:]:
            removed.extend(tree.free(sub.slots))
            sub.children = None
            tree.drop_node(sub)
        removed.extend(tree.free(node.slots[i:]))
        node.children = None
        if i > 0:
            node.slots = node.slots[:i]
        else:
            parent = node.parent
            assert parent is not None, "the root holds no blocks"
            tree.detach(parent, node, first)
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
                stack = [n for n in tree.nodes if n is not None and n is not tree.root]
                while stack:
                    node = stack.pop()
                    if tree.nodes[node.node_id] is not node or node.children or not len(node.slots):
                        continue
                    slot = int(node.slots[-1])
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

    def num_blocks(self, ns_digest: bytes | None = None) -> int:
        """Blocks indexed in one namespace, or in all of them."""
        if ns_digest is None:
            return sum(t.num_blocks for t in self._trees.values())
        tree = self._trees.get(ns_digest)
        return 0 if tree is None else tree.num_blocks

    def num_nodes(self, ns_digest: bytes | None = None) -> int:
        """Tree nodes (compressed edges), roots excluded."""
        trees = self._trees.values() if ns_digest is None else [self._trees.get(ns_digest)]
        return sum(len(t.nodes) - len(t.free_node_ids) - 1 for t in trees if t is not None)

    def namespaces(self) -> list[bytes]:
        """Digests of the namespaces that have a tree."""
        return list(self._trees)

    def memory_bytes(self) -> int:
        """Estimate of the index's memory: arrays by ``nbytes``, nodes by ``sys.getsizeof``."""
        total = sys.getsizeof(self._trees)
        for tree in self._trees.values():
            total += tree.tokens.nbytes() + tree.keys.nbytes + tree.values.nbytes
            total += tree.owner.nbytes + tree.free_slots.nbytes + tree.table.nbytes()
            total += sys.getsizeof(tree.nodes) + sys.getsizeof(tree.free_node_ids)
            for node in tree.nodes:
                if node is None:
                    continue
                total += sys.getsizeof(node) + sys.getsizeof(node._slots)
                if node.children:
                    total += sys.getsizeof(node.children)
                    total += sum(
                        sys.getsizeof(g) for g in node.children.values() if isinstance(g, list)
                    )
        return total

    def check_invariants(self) -> None:
        """Assert the structural invariants (for tests; O(blocks))."""
        for tree in self._trees.values():
            seen = 0
            for node in tree.nodes:
                if node is None:
                    continue
                if node is not tree.root:
                    assert len(node.slots) > 0, "empty non-root node"
                    assert node.num_children() != 1, "uncompressed edge"
                    assert node.parent is not None, "orphan node"
                    assert tree.nodes[node.parent.node_id] is node.parent, "dead parent"
                    assert (tree.owner[node.slots] == node.node_id).all(), "owner mismatch"
                seen += len(node.slots)
                for first, group in (node.children or {}).items():
                    assert not isinstance(group, list) or len(group) > 1, "list of one child"
                    for child in group if isinstance(group, list) else [group]:
                        assert child.parent is node, "child's parent pointer"
                        assert tree.first_token(child) == first, "child filed under wrong token"
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
