"""The KV-cache API: look up, store and load a prompt's KV cache, token-granular.

A block object holds ``block_size`` tokens of every layer, layer-major: for each layer K then V,
each ``[block_size, num_kv_heads, head_dim]`` (see docs/block-keys.md). Callers hand us per-layer
``(K, V)`` arrays or tensors shaped ``[tokens, num_kv_heads, head_dim]``.

Calls per prompt: ``lookup`` and ``load`` make one master call (``kv_match``: the cached prefix
and every block's replicas) and one data call per node. ``store`` makes a match, an allocation and
a commit that also indexes the prompt. Full blocks are verified against their checksum; the last,
partial block of a match is a range read of just its first k tokens (one range per layer and K/V),
protected by the read grant but not by a checksum (the checksum covers the whole block).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import xxhash

from kvstore.buffers import as_bytes_view
from kvstore.client.client import Client
from kvstore.client.transport import ReadItem
from kvstore.errors import (
    ChecksumMismatchError,
    InvalidRequestError,
    KVStoreError,
    ObjectBusyError,
    ObjectExistsError,
)
from kvstore.keys import DTYPE_BYTES, Namespace, as_token_array, block_bytes, block_keys
from kvstore.kvblocks import encode_prompt_meta, kv_meta_key, kv_object_key, tokens_to_wire
from kvstore.types import ObjectInfo, result_from_wire

_TORCH_DTYPES = {
    "torch.float16": "float16",
    "torch.bfloat16": "bfloat16",
    "torch.float32": "float32",
    "torch.float8_e4m3fn": "float8_e4m3",
}


def _dtype_name(x: Any) -> str:
    if type(x).__module__.startswith("torch"):
        return _TORCH_DTYPES.get(str(x.dtype), str(x.dtype))
    dtype = getattr(x, "dtype", None)
    return str(getattr(dtype, "name", dtype))


@dataclass(frozen=True, slots=True)
class _Block:
    key: bytes
    num_tokens: int
    info: ObjectInfo


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
        self._block_bytes = block_bytes(namespace)
        self._prefetch = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-prefetch")
        self._lock = threading.Lock()

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
                raw = np.frombuffer(as_bytes_view(x, writable=writable), dtype=np.uint8)
                views.append(raw.reshape(shape[0], self._stride))
            out.append((views[0], views[1]))
        return out

    # ------------------------------------------------------------------ lookup
    def _match(self, tokens: np.ndarray, *, locate: bool = True) -> tuple[int, list[_Block]]:
        args: dict[str, Any] = {"namespace": self._ns_wire, "tokens": tokens_to_wire(tokens)}
        if not locate:
            args["locate"] = False
        reply = self.client._control.call("kv_match", args)
        blocks: list[_Block] = []
        num_tokens = 0
        for key, n, r in reply["blocks"]:
            if r is None:  # asked without locations: the index's answer is the answer
                num_tokens += n
                continue
            err, payload = result_from_wire(r)
            if err is not None:
                break  # vanished between index and table: a shorter hit is still correct
            blocks.append(_Block(key, n, ObjectInfo.from_wire(payload)))
            num_tokens += n
        return num_tokens, blocks

    def lookup(self, tokens: Any) -> int:
        """Leading tokens of ``tokens`` whose KV is cached (token-granular).

        One master call, and it takes no read leases (a lookup does not hold blocks from
        eviction): a block may still go before a later load, which then loads less.
        """
        return self._match(as_token_array(tokens), locate=False)[0]

    # ------------------------------------------------------------------ whole blocks
    @property
    def block_nbytes(self) -> int:
        """Bytes of one block object (see :func:`kvstore.keys.block_bytes`)."""
        return self._block_bytes

    def block_object_keys(self, tokens: Any) -> list[bytes]:
        """The pool keys of the block objects of the full blocks of ``tokens``, in order.

        Raises:
            InvalidRequestError: bad token ids.
        """
        keys = block_keys(self.namespace, as_token_array(tokens))
        return [kv_object_key(self.namespace.digest, key) for key in keys]

    def put_blocks(self, tokens: Any, first_block: int, blocks: Any) -> int:
        """Store already laid-out block objects and index the prompt, for engines that keep
        their KV in fixed-size pages (a paged cache block is one object, no repacking here).

        Args:
            tokens: the prompt's token ids; only its full blocks count.
            first_block: index of the block ``blocks[0]`` holds.
            blocks: ``[n, block_nbytes]`` uint8 (numpy array or CPU tensor), each row one
                block object in the layout of :func:`kvstore.keys.block_bytes`.

        Returns:
            Blocks stored now (an existing equal block counts: same key, same KV).

        Raises:
            InvalidRequestError: rows of the wrong size, or more blocks than ``tokens`` fill.
            KVStoreError: a block could not be stored; blocks before it stay cached.
        """
        tok = as_token_array(tokens)
        rows = np.frombuffer(as_bytes_view(blocks), dtype=np.uint8)
        if rows.size % self._block_bytes:
            raise InvalidRequestError(
                f"blocks hold {rows.size} bytes, not a multiple of {self._block_bytes}"
            )
        rows = rows.reshape(-1, self._block_bytes)
        n = len(rows)
        bs = self.namespace.block_size
        end = first_block + n
        if first_block < 0 or end * bs > len(tok):
            raise InvalidRequestError(
                f"blocks {first_block}..{end} need {end * bs} tokens; the prompt has {len(tok)}"
            )
        if n == 0:
            return 0
        keys = block_keys(self.namespace, tok[: end * bs])
        obj_keys = [kv_object_key(self.namespace.digest, key) for key in keys[first_block:]]
        meta = encode_prompt_meta(self._ns_wire, tok[: end * bs])
        results = self.client._batch_put(
            [*obj_keys, kv_meta_key(self.namespace.digest, keys[-1])],
            [*rows, meta],
            commit={"namespace": self._ns_wire, "tokens": tokens_to_wire(tok[: end * bs])},
        )
        for r in results:
            if isinstance(r, KVStoreError) and not isinstance(
                r, ObjectExistsError | ObjectBusyError
            ):
                raise r
        return n

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
        views = self._layer_views(layers, num_full * bs, writable=False)
        if num_full == 0:
            return 0
        cached, _ = self._match(tok[: num_full * bs])
        first_new = cached // bs
        num_new = num_full - first_new
        if num_new == 0:
            return 0
        keys = block_keys(self.namespace, tok[: num_full * bs])
        staging = np.empty((num_new, self._block_bytes), dtype=np.uint8)
        lo, hi = first_new * bs, num_full * bs
        for layer, (k, v) in enumerate(views):
            for which, src in enumerate((k, v)):
                col = (2 * layer + which) * self._plane
                staging[:, col : col + self._plane] = src[lo:hi].reshape(num_new, self._plane)
        obj_keys = [kv_object_key(self.namespace.digest, key) for key in keys[first_new:]]
        meta = encode_prompt_meta(self._ns_wire, tok[: num_full * bs])
        results = self.client._batch_put(
            [*obj_keys, kv_meta_key(self.namespace.digest, keys[-1])],
            [*staging, meta],
            commit={"namespace": self._ns_wire, "tokens": tokens_to_wire(tok[: num_full * bs])},
        )
        for r in results:
            # Another writer stored (or is storing) the same block: equal keys, equal KV.
            if isinstance(r, KVStoreError) and not isinstance(
                r, ObjectExistsError | ObjectBusyError
            ):
                raise r
        return num_new * bs

    # ------------------------------------------------------------------ load
    def _read_blocks(
        self, blocks: list[_Block], layers: range
    ) -> tuple[list[np.ndarray], list[KVStoreError | None]]:
        """Read the given layers of each block: per block a ``[len(layers), 2, n, stride]`` array."""
        bs = self.namespace.block_size
        bufs: list[np.ndarray] = []
        items: list[ReadItem] = []
        for b in blocks:
            n = b.num_tokens
            buf = np.empty((len(layers), 2, n, self._stride), dtype=np.uint8)
            whole = n == bs and len(layers) == self.namespace.num_layers
            ranges = (
                None
                if whole
                else [
                    [(2 * layer + which) * self._plane, n * self._stride]
                    for layer in layers
                    for which in (0, 1)
                ]
            )
            loc = b.info.locations[0]
            items.append(ReadItem(loc, memoryview(buf.reshape(-1)), ranges))
            bufs.append(buf)
        self.client._data.read(items)
        return bufs, [i.result for i in items]

    def load(self, tokens: Any, layers_out: Sequence[Any]) -> int:
        """Fill the cached prefix of ``tokens`` into caller buffers.

        Args:
            tokens: the prompt's token ids.
            layers_out: per layer writable ``(K, V)``, each ``[>= len(tokens), kv_heads, head_dim]``.

        Returns:
            Tokens loaded: the longest prefix read back intact (a lost block ends it early; a
            miss is always a correct answer).

        Raises:
            InvalidRequestError: bad tokens, shapes, dtypes or read-only buffers.
        """
        tok = as_token_array(tokens)
        views = self._layer_views(layers_out, len(tok), writable=True)
        num_tokens, blocks = self._match(tok)
        if not blocks:
            return 0
        bufs, errors = self._read_blocks(blocks, range(self.namespace.num_layers))
        bs = self.namespace.block_size
        loaded = 0
        for i, (b, buf, err) in enumerate(zip(blocks, bufs, errors, strict=True)):
            if err is not None:
                break
            if b.num_tokens == bs and xxhash.xxh3_64_intdigest(buf) != b.info.checksum:
                break  # corrupt or overwritten: stop here, the prefix before it is good
            for layer, (k, v) in enumerate(views):
                k[i * bs : i * bs + b.num_tokens] = buf[layer, 0]
                v[i * bs : i * bs + b.num_tokens] = buf[layer, 1]
            loaded += b.num_tokens
        return loaded

    def load_layers(self, tokens: Any, layers_out: Sequence[Any]) -> Iterator[tuple[int, Any, Any]]:
        """Load the cached prefix layer by layer, reading layer ``i + 1`` while ``i`` is used.

        Yields ``(layer, K, V)`` where K and V are the filled slices ``[:num_tokens]`` of the
        caller's buffers for that layer. Full blocks are checksummed incrementally (the object
        is layer-major, so layers arrive in checksum order); a mismatch or a lost block raises
        after the last layer, so the caller must treat the load as failed.

        Raises:
            InvalidRequestError: bad input. ChecksumMismatchError / NodeUnavailableError: see above.
        """
        tok = as_token_array(tokens)
        views = self._layer_views(layers_out, len(tok), writable=True)
        num_tokens, blocks = self._match(tok)
        bs = self.namespace.block_size
        hashers = [xxhash.xxh3_64() for _ in blocks]
        failure: KVStoreError | None = None
        pending = self._prefetch.submit(self._read_blocks, blocks, range(0, 1)) if blocks else None
        for layer in range(self.namespace.num_layers):
            if pending is None:
                break
            bufs, errors = pending.result()
            nxt = layer + 1
            pending = (
                self._prefetch.submit(self._read_blocks, blocks, range(nxt, nxt + 1))
                if nxt < self.namespace.num_layers
                else None
            )
            k, v = views[layer]
            for i, (b, buf, err) in enumerate(zip(blocks, bufs, errors, strict=True)):
                if err is not None:
                    failure = failure or err
                    continue
                k[i * bs : i * bs + b.num_tokens] = buf[0, 0]
                v[i * bs : i * bs + b.num_tokens] = buf[0, 1]
                if b.num_tokens == bs:
                    hashers[i].update(buf)
            kx, vx = layers_out[layer]
            yield layer, kx[:num_tokens], vx[:num_tokens]
        for b, h in zip(blocks, hashers, strict=True):
            if failure is None and b.num_tokens == bs and h.intdigest() != b.info.checksum:
                failure = ChecksumMismatchError("a block's bytes do not match its checksum")
        if failure is not None:
            raise failure

    def close(self) -> None:
        self._prefetch.shutdown(wait=True)
