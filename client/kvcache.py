"""The KV-cache API: look up, store and load a prompt's KV cache, token-granular.

A block object holds ``block_size`` tokens of every layer, layer-major: for each layer K then V,
each ``[block_size, num_kv_heads, head_dim]`` (see docs/block-keys.md). Callers hand us per-layer
``(K, V)`` arrays or tensors shaped ``[tokens, num_kv_heads, head_dim]``.

Calls per prompt: ``lookup`` makes one master call (``kv_match`` without locations: it takes no
read leases); ``load`` makes one (``kv_match``: the cached prefix and every block's replicas) and
one data call per node, through the client's read pipeline (:mod:`kvstore.client.reads`).
``store`` makes a lookup, an allocation and a commit that also indexes the prompt. This module
uses only the public methods of :class:`~kvstore.client.client.Client`.

Every byte handed to an engine is verified. A block object ends with a checksum table (see
:func:`kvstore.kvblocks.checksum_table`): an xxh3_64 per token chunk of each (layer, K/V) plane,
sealed with the object key. A full block read whole is verified against the object checksum (one
hash of the whole object, no per-chunk work); the last, partial block of a match is a range read
of its first k tokens rounded up to whole chunks (one range per layer and K/V) plus the table,
verified chunk by chunk; a layer-wise load verifies each layer's chunks before it yields that
layer. A block that fails its check ends the match there (``load``) or raises (``load_layers``):
never wrong bytes.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Hashable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvstore.client.buffers import Segments, as_bytes_view
from kvstore.client.client import Client, PromptCommit
from kvstore.client.reads import LocatedRead
from kvstore.client.transport import ReadItem
from kvstore.errors import (
    ChecksumMismatchError,
    InvalidRequestError,
    KVStoreError,
    ObjectBusyError,
    ObjectExistsError,
)
from kvstore.keys import DTYPE_BYTES, Namespace, as_token_array, block_bytes, block_keys
from kvstore.kvblocks import (
    checksum_table_bytes,
    chunks_per_plane,
    encode_prompt_meta,
    kv_meta_key,
    kv_object_key,
    seal_block,
    verify_chunks,
)
from kvstore.types import ObjectInfo

_TORCH_DTYPES = {
    "torch.float16": "float16",
    "torch.bfloat16": "bfloat16",
    "torch.float32": "float32",
    "torch.float8_e4m3fn": "float8_e4m3",
}


_DTYPE_NAMES: dict[Any, str] = {}  # dtype object -> its namespace name (asking numpy is slow)


def _dtype_name(x: Any) -> str:
    dtype = getattr(x, "dtype", None)
    try:
        return _DTYPE_NAMES[dtype]
    except (KeyError, TypeError):  # (TypeError: an unhashable dtype, never kept)
        pass
    if type(x).__module__.startswith("torch"):
        name = _TORCH_DTYPES.get(str(dtype), str(dtype))
    else:
        name = str(getattr(dtype, "name", dtype))
    if dtype is not None and isinstance(dtype, Hashable):
        _DTYPE_NAMES[dtype] = name
    return name


def _byte_rows(x: Any, rows: int, stride: int, writable: bool) -> np.ndarray:
    """``x``'s bytes as ``[rows, stride]`` uint8 (no copy): a contiguous numpy array by its own
    view (a few attribute reads: this runs for every K and V of every store and load), anything
    else through :func:`as_bytes_view` (which names what is wrong)."""
    if type(x) is np.ndarray and x.flags.c_contiguous and (x.flags.writeable or not writable):
        return x.view(np.uint8).reshape(rows, stride)
    return np.frombuffer(as_bytes_view(x, writable=writable), dtype=np.uint8).reshape(rows, stride)


@dataclass(frozen=True, slots=True)
class _Block:
    key: bytes
    num_tokens: int
    info: ObjectInfo


@dataclass(slots=True)
class _BlockRead:
    """What one read of one block brought: the bytes, as planes and checksum table."""

    planes: np.ndarray | None  # [layers read, 2, tokens read, stride]; None: read in place
    table: np.ndarray  # the block's checksum table
    error: KVStoreError | None = None


class KVCache:
    """A prompt-level view of the pool for one :class:`Namespace`. Thread-safe.

    Args:
        client: a connected :class:`Client`.
        namespace: the model/layout the KV belongs to.
    """

    def __init__(self, client: Client, namespace: Namespace) -> None:
        if not isinstance(namespace, Namespace):
            raise InvalidRequestError("namespace must be a kvstore Namespace")
        self.client = client
        self.namespace = namespace
        self._ns_wire = namespace.to_dict()
        self._stride = namespace.num_kv_heads * namespace.head_dim * DTYPE_BYTES[namespace.dtype]
        self._plane = namespace.block_size * self._stride  # one layer's K (or V) in one block
        self._block_bytes = block_bytes(namespace)  # the planes; the checksum table follows
        self._num_planes = 2 * namespace.num_layers
        self._chunk_tokens = namespace.block_size // chunks_per_plane(namespace.block_size)
        self._chunk_bytes = self._chunk_tokens * self._stride
        self._table_bytes = checksum_table_bytes(self._num_planes, namespace.block_size)
        self._object_bytes = self._block_bytes + self._table_bytes
        self._prefetch = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-prefetch")

    # ------------------------------------------------------------------ checks
    def _layer_views(
        self, layers: Sequence[Any], num_tokens: int, *, writable: bool
    ) -> list[tuple[np.ndarray, np.ndarray]]:
        """Byte views ``[tokens, stride]`` of every layer's K and V, checked against the namespace."""
        ns = self.namespace
        if not isinstance(layers, Sequence) or len(layers) != ns.num_layers:
            raise InvalidRequestError(
                f"expected {ns.num_layers} layers of (K, V), got {len(layers) if isinstance(layers, Sequence) else type(layers).__name__}"
            )
        out = []
        for i, pair in enumerate(layers):
            if not isinstance(pair, Sequence) or len(pair) != 2:
                raise InvalidRequestError(f"layer {i} must be a (K, V) pair")
            views = []
            for name, x in zip("KV", pair, strict=True):
                shape = tuple(getattr(x, "shape", ()))
                if len(shape) != 3 or tuple(shape[1:]) != (ns.num_kv_heads, ns.head_dim):
                    raise InvalidRequestError(
                        f"layer {i} {name} has shape {shape}; expected [tokens, {ns.num_kv_heads}, {ns.head_dim}]"
                    )
                if shape[0] < num_tokens:
                    raise InvalidRequestError(
                        f"layer {i} {name} holds {shape[0]} tokens; {num_tokens} needed"
                    )
                if _dtype_name(x) != ns.dtype:
                    raise InvalidRequestError(
                        f"layer {i} {name} is {_dtype_name(x)}; the namespace says {ns.dtype}"
                    )
                views.append(_byte_rows(x, shape[0], self._stride, writable))
            out.append((views[0], views[1]))
        return out

    def _block_planes(
        self, views: list[tuple[np.ndarray, np.ndarray]]
    ) -> Callable[[int], tuple[memoryview, ...]]:
        """``planes(i)``: block ``i``'s planes in the caller's tensors (the block's rows of each
        layer's K, then V), as flat byte views."""
        flat = [memoryview(x.reshape(-1)) for pair in views for x in pair]
        span = self.namespace.block_size * self._stride

        def planes(i: int) -> tuple[memoryview, ...]:
            lo = i * span
            return tuple([mv[lo : lo + span] for mv in flat])

        return planes

    def _object(
        self,
        planes: tuple[memoryview, ...],
        table: np.ndarray,
        seal: Callable[[], int] | None = None,
    ) -> Segments:
        """A block object as pieces: its planes where they lie, then its checksum table
        (uint8; for a store, filled by ``seal``)."""
        return Segments((*planes, memoryview(table)), self._block_bytes + table.nbytes, seal)

    # ------------------------------------------------------------------ lookup
    def _match(self, tokens: np.ndarray) -> tuple[int, list[_Block]]:
        """The cached prefix of ``tokens`` and where its blocks live, each with a read lease
        (given back by :meth:`_give_back` once read). The prefix ends at the first block that
        vanished between the index and the object table: a shorter hit is still correct."""
        blocks: list[_Block] = []
        unused: list[ObjectInfo] = []  # leases of blocks past a gap: not read, given back at once
        num_tokens = 0
        cut = False
        for b in self.client.locate_prefix(self.namespace, tokens):
            info = b.info
            if isinstance(info, KVStoreError):
                cut = True  # vanished between index and table
            elif cut:
                unused.append(info)
            else:
                blocks.append(_Block(b.key, b.num_tokens, info))
                num_tokens += b.num_tokens
        self.client.release_leases(unused)
        return num_tokens, blocks

    def _give_back(self, blocks: list[_Block]) -> None:
        """The reads of ``blocks`` are done: their read leases go back to the master."""
        self.client.release_leases(b.info for b in blocks)

    def lookup(self, tokens: Any) -> int:
        """Leading tokens of ``tokens`` whose KV is cached (token-granular).

        One master call, and it takes no read leases (a lookup does not hold blocks from
        eviction): a block may still go before a later load, which then loads less.
        """
        return self.client.lookup_prefix(self.namespace, as_token_array(tokens))

    # ------------------------------------------------------------------ whole blocks
    @property
    def block_nbytes(self) -> int:
        """Bytes of one block's KV planes, what an engine lays out (see
        :func:`kvstore.keys.block_bytes`)."""
        return self._block_bytes

    @property
    def object_nbytes(self) -> int:
        """Bytes of one stored block object: its planes, then its checksum table
        (:func:`kvstore.kvblocks.checksum_table`). A whole-object read needs this much room."""
        return self._object_bytes

    def block_object_keys(self, tokens: Any) -> list[bytes]:
        """The pool keys of the block objects of the full blocks of ``tokens``, in order.

        Raises:
            InvalidRequestError: bad token ids.
        """
        keys = block_keys(self.namespace, as_token_array(tokens))
        return [kv_object_key(self.namespace.digest, key) for key in keys]

    def put_blocks(self, tokens: Any, first_block: int, blocks: Any) -> int:
        """Store already laid-out blocks and index the prompt, for engines that keep their KV in
        fixed-size pages (a paged cache block is one object, no repacking here).

        Each row is either a block's planes (``block_nbytes``: copied into a new object row
        with its checksum table) or a whole object row (``object_nbytes``: the planes, then room
        for the table, which is written in place: no copy; the rows must be writable).

        Args:
            tokens: the prompt's token ids; only its full blocks count.
            first_block: index of the block ``blocks[0]`` holds.
            blocks: ``[n, block_nbytes]`` or ``[n, object_nbytes]`` uint8 (numpy array or CPU
                tensor), each row one block in the layout of :func:`kvstore.keys.block_bytes`.

        Returns:
            Blocks stored now (an existing equal block counts: same key, same KV).

        Raises:
            InvalidRequestError: rows of the wrong size, or more blocks than ``tokens`` fill.
            KVStoreError: a block could not be stored; blocks before it stay cached.
        """
        tok = as_token_array(tokens)
        n = len(blocks)
        raw = as_bytes_view(blocks)
        row_bytes = raw.nbytes // n if n else self._object_bytes
        if row_bytes * n != raw.nbytes or row_bytes not in (self._block_bytes, self._object_bytes):
            raise InvalidRequestError(
                f"{n} blocks of {raw.nbytes} bytes: each row must hold {self._block_bytes} bytes "
                f"(planes) or {self._object_bytes} (planes and checksum table)"
            )
        bs = self.namespace.block_size
        end = first_block + n
        if first_block < 0 or end * bs > len(tok):
            raise InvalidRequestError(
                f"blocks {first_block}..{end} need {end * bs} tokens; the prompt has {len(tok)}"
            )
        if n == 0:
            return 0
        if row_bytes == self._object_bytes:
            rows = np.frombuffer(as_bytes_view(blocks, writable=True), dtype=np.uint8)
            rows = rows.reshape(n, self._object_bytes)
        else:
            rows = np.empty((n, self._object_bytes), dtype=np.uint8)
            rows[:, : self._block_bytes] = np.frombuffer(raw, dtype=np.uint8).reshape(n, -1)
        prefix = tok[: end * bs]
        obj_keys, meta_key = self._object_keys(prefix, first_block)
        # Each row's checksum table is filled in place, and the row hashed, by its seal (one
        # pass over the bytes), while the master answers put_start, as in :meth:`store`.
        p = self._plane
        objects: list[np.ndarray | Segments] = []
        for row, obj_key in zip(rows, obj_keys, strict=True):
            whole = memoryview(row)
            planes = tuple(whole[i * p : (i + 1) * p] for i in range(self._num_planes))
            table = row[self._block_bytes :].view("<u8")
            seal = functools.partial(seal_block, obj_key, planes, bs, table)
            objects.append(Segments((whole,), self._object_bytes, seal))
        self._put_objects(prefix, [*obj_keys, meta_key], objects)
        return n

    def _object_keys(self, prefix: np.ndarray, first_block: int) -> tuple[list[bytes], bytes]:
        """The object keys of blocks ``first_block..`` of ``prefix`` (whole blocks), and the
        key of the prompt's meta object."""
        keys = block_keys(self.namespace, prefix)
        digest = self.namespace.digest
        return [kv_object_key(digest, k) for k in keys[first_block:]], kv_meta_key(digest, keys[-1])

    def _put_objects(
        self, prefix: np.ndarray, keys: list[bytes], objects: list[np.ndarray | Segments]
    ) -> None:
        """Store sealed block objects (each its planes, then its checksum table) and the
        prompt's meta object (the last of ``keys``), and commit the prompt to the prefix index,
        in one batched put.

        Raises:
            KVStoreError: a block could not be stored (another writer's equal block is no error:
                equal keys, equal KV); blocks before it stay cached.
        """
        meta = encode_prompt_meta(self._ns_wire, prefix)
        results = self.client.batch_put(
            keys, [*objects, meta], prompt=PromptCommit(self.namespace, prefix)
        )
        for r in results:
            if isinstance(r, KVStoreError) and not isinstance(
                r, ObjectExistsError | ObjectBusyError
            ):
                raise r

    # ------------------------------------------------------------------ store
    def store(self, tokens: Any, layers: Sequence[Any]) -> int:
        """Store the KV of the full blocks of ``tokens`` that are not cached yet.

        Args:
            tokens: the prompt's token ids.
            layers: per layer ``(K, V)``, each ``[>= len(full blocks), kv_heads, head_dim]``.

        Returns:
            Tokens newly stored (a multiple of ``block_size``).

        Raises:
            InvalidRequestError: bad tokens, shapes or dtypes (nothing stored).
            KVStoreError: a block could not be stored; blocks before it stay cached and indexed.
        """
        tok = as_token_array(tokens)
        bs = self.namespace.block_size
        num_full = len(tok) // bs
        if num_full == 0:
            self._layer_views(layers, 0, writable=False)  # (bad layers are refused all the same)
            return 0
        prefix = tok[: num_full * bs]
        # No repacking: a block's object is its planes, each the block's tokens in one layer's
        # K or V (contiguous rows of the caller's tensor), then its checksum table; the client
        # sends the pieces as they lie (one sendmsg; in shared memory, one copy each).
        found: list[tuple[Callable[[int], tuple[memoryview, ...]], list[bytes], bytes]] = []

        def prepare() -> None:  # (the layers checked, the keys and planes found meanwhile)
            views = self._layer_views(layers, num_full * bs, writable=False)
            found.append((self._block_planes(views), *self._object_keys(prefix, 0)))

        # Only the cached length is wanted: a lookup, which takes no read lease.
        cached = self.client.lookup_prefix(self.namespace, prefix, work=prepare)
        first_new = cached // bs
        if first_new == num_full:
            return 0
        block_planes, all_keys, meta_key = found[0]
        # Each block's checksum table is filled, and the block hashed, by its seal: the client
        # runs the seals while the master answers put_start (see Segments.seal).
        objects: list[np.ndarray | Segments] = []
        obj_keys = all_keys[first_new:]
        num_new = len(obj_keys)
        for i, obj_key in enumerate(obj_keys, first_new):
            planes = block_planes(i)
            table = np.empty(self._table_bytes // 8, dtype="<u8")
            seal = functools.partial(seal_block, obj_key, planes, bs, table)
            objects.append(self._object(planes, table.view(np.uint8), seal))
        self._put_objects(prefix, [*obj_keys, meta_key], objects)
        return num_new * bs

    # ------------------------------------------------------------------ load
    def _tokens_read(self, num_tokens: int) -> int:
        """Tokens read of a block whose first ``num_tokens`` are wanted: whole chunks."""
        c = self._chunk_tokens
        return min(self.namespace.block_size, -(-num_tokens // c) * c)

    def _read_blocks(
        self,
        blocks: list[_Block],
        layers: range,
        into: list[tuple[np.ndarray, np.ndarray]] | None = None,
    ) -> list[_BlockRead]:
        """Read the given layers of each block, with its checksum table (or the whole object),
        through the client's read pipeline (replica fallback, corrupt replicas reported: the
        master drops them, so a corrupt last replica makes the block a miss).

        With ``into`` (the caller's per-layer K/V byte views, block ``i`` at rows ``i *
        block_size``), a whole block lands in place: its planes straight into those rows, its
        table into a small buffer (no staging copy; a block that fails its check leaves its
        rows written)."""
        bs = self.namespace.block_size
        reads: list[_BlockRead] = []
        located: list[tuple[_BlockRead, LocatedRead]] = []
        block_planes = self._block_planes(into) if into is not None else None
        for i, b in enumerate(blocks):
            n_read = self._tokens_read(b.num_tokens)
            whole = b.num_tokens == bs and len(layers) == self.namespace.num_layers
            if whole and block_planes is not None:
                table = np.empty(self._table_bytes, dtype=np.uint8)
                read = _BlockRead(None, table)
                dest: memoryview | Segments = self._object(block_planes(i), table)
            else:
                planes_len = len(layers) * 2 * n_read * self._stride
                flat = np.empty(planes_len + self._table_bytes, dtype=np.uint8)
                read = _BlockRead(
                    flat[:planes_len].reshape(len(layers), 2, n_read, self._stride),
                    flat[planes_len:],
                )
                dest = memoryview(flat)
            reads.append(read)
            if b.info.size != self._object_bytes:  # not a block of this layout: a miss
                read.error = ChecksumMismatchError("block object has an unexpected size")
                continue
            if whole:  # verified against the object checksum (one hash), by the pipeline
                located.append((read, LocatedRead(b.info, dest)))
                continue
            ranges = [
                [(2 * layer + which) * self._plane, n_read * self._stride]
                for layer in layers
                for which in (0, 1)
            ]
            ranges.append([self._block_bytes, self._table_bytes])
            verify = self._chunk_check(b, read, layers)
            located.append((read, LocatedRead(b.info, dest, ranges, verify)))
        self.client.batch_read_located([rd for _, rd in located])
        for read, rd in located:
            if isinstance(rd.result, KVStoreError):
                read.error = rd.result
        return reads

    def _chunk_check(
        self, b: _Block, read: _BlockRead, layers: range
    ) -> Callable[[ReadItem], bool]:
        """The check of a range read of ``b``: what was read of each plane, chunk by chunk,
        against the block's checksum table."""

        def verify(_item: ReadItem) -> bool:
            assert read.planes is not None  # a range read is staged
            planes = {
                2 * layer + which: read.planes[i, which]
                for i, layer in enumerate(layers)
                for which in (0, 1)
            }
            return verify_chunks(
                b.key, read.table, planes, self.namespace.block_size, self._chunk_bytes
            )

        return verify

    def load(self, tokens: Any, layers_out: Sequence[Any]) -> int:
        """Fill the cached prefix of ``tokens`` into caller buffers.

        Args:
            tokens: the prompt's token ids.
            layers_out: per layer writable ``(K, V)``, each ``[>= len(tokens), kv_heads, head_dim]``.

        Returns:
            Tokens loaded: the longest prefix read back intact and verified (a lost or corrupt
            block ends it early; a miss is always a correct answer). Whole blocks are read
            straight into the buffers, so rows past the loaded prefix, up to the cached
            prefix, may have been written too: only the first ``loaded`` tokens hold KV.

        Raises:
            InvalidRequestError: bad tokens, shapes, dtypes or read-only buffers.
        """
        tok = as_token_array(tokens)
        views = self._layer_views(layers_out, len(tok), writable=True)
        num_tokens, blocks = self._match(tok)
        if not blocks:
            return 0
        try:
            reads = self._read_blocks(blocks, range(self.namespace.num_layers), into=views)
        finally:
            self._give_back(blocks)
        bs = self.namespace.block_size
        loaded = 0
        for i, (b, read) in enumerate(zip(blocks, reads, strict=True)):
            if read.error is not None:
                break  # lost, corrupt or overwritten: stop here, the prefix before it is good
            n = b.num_tokens
            loaded += n
            if read.planes is None:
                continue  # read in place
            for layer, (k, v) in enumerate(views):
                k[i * bs : i * bs + n] = read.planes[layer, 0, :n]
                v[i * bs : i * bs + n] = read.planes[layer, 1, :n]
        return loaded

    def load_layers(self, tokens: Any, layers_out: Sequence[Any]) -> Iterator[tuple[int, Any, Any]]:
        """Load the cached prefix layer by layer, reading layer ``i + 1`` while ``i`` is used.

        Yields ``(layer, K, V)`` where K and V are the filled slices ``[:num_tokens]`` of the
        caller's buffers for that layer. Each layer's bytes are verified (chunk by chunk,
        against each block's checksum table) before it is yielded; a lost or corrupt block
        raises instead of yielding its layer, so the caller must treat the load as failed.

        Raises:
            InvalidRequestError: bad input. ChecksumMismatchError / NodeUnavailableError: see above.
        """
        tok = as_token_array(tokens)
        views = self._layer_views(layers_out, len(tok), writable=True)
        num_tokens, blocks = self._match(tok)
        bs = self.namespace.block_size
        pending = self._prefetch.submit(self._read_blocks, blocks, range(0, 1)) if blocks else None
        try:
            for layer in range(self.namespace.num_layers):
                if pending is None:
                    break
                reads = pending.result()
                pending = None
                failure = next((r.error for r in reads if r.error is not None), None)
                if failure is not None:
                    raise failure
                nxt = layer + 1
                pending = (
                    self._prefetch.submit(self._read_blocks, blocks, range(nxt, nxt + 1))
                    if nxt < self.namespace.num_layers
                    else None
                )
                k, v = views[layer]
                for i, (b, read) in enumerate(zip(blocks, reads, strict=True)):
                    assert read.planes is not None  # one layer: a staged range read
                    k[i * bs : i * bs + b.num_tokens] = read.planes[0, 0, : b.num_tokens]
                    v[i * bs : i * bs + b.num_tokens] = read.planes[0, 1, : b.num_tokens]
                kx, vx = layers_out[layer]
                yield layer, kx[:num_tokens], vx[:num_tokens]
        finally:
            # The reads are done (or abandoned: a read still in flight ends within the client's
            # timeout; giving its leases back early only risks a checksum failure there).
            if pending is not None:
                pending.cancel()
            self._give_back(blocks)

    def close(self) -> None:
        self._prefetch.shutdown(wait=True)
