"""Namespaces, chained block keys and the byte layout of one KV block object.

The exact encodings are specified in ``docs/block-keys.md`` (with test vectors in
``tests/data/block_key_vectors.json``) so that another engine or language can reproduce the keys.
Nothing here uses Python's ``hash()``: keys are identical across processes and machines.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NewType

import numpy as np
import xxhash

from kvstore.errors import InvalidRequestError

#: A block key: 16 bytes, the chained hash of a prefix of full token blocks.
BlockKey = NewType("BlockKey", bytes)

BLOCK_KEY_BYTES = 16
#: ``key[-1]``: the parent of the first block of every prompt.
SEED_KEY = BlockKey(bytes(BLOCK_KEY_BYTES))
#: Version of the canonical namespace encoding (byte 4 of the encoding).
NAMESPACE_ENCODING_VERSION = 1
_NS_MAGIC = b"KVNS"

#: Bytes per element of each supported KV dtype.
DTYPE_BYTES: dict[str, int] = {"float16": 2, "bfloat16": 2, "float32": 4, "float8_e4m3": 1}
HASH_ALGORITHMS = ("xxh3_128", "blake2b_128")

_U32_LIMIT = 1 << 32
_MAX_STR_BYTES = 1024


def _xxh3_128(data: bytes) -> bytes:
    return xxhash.xxh3_128_digest(data)  # seed 0, canonical (big-endian) digest


def _blake2b_128(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=16).digest()


# Looked up by name rather than branched on: adding an algorithm is one line here.
_HASHERS: dict[str, Callable[[bytes], bytes]] = {
    "xxh3_128": _xxh3_128,
    "blake2b_128": _blake2b_128,
}


def _check_u32(name: str, value: object, *, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise InvalidRequestError(f"{name} must be an int, got {type(value).__name__}")
    if not minimum <= value < _U32_LIMIT:
        raise InvalidRequestError(f"{name} must be in [{minimum}, 2**32), got {value}")


def _check_str(name: str, value: object) -> bytes:
    if not isinstance(value, str):
        raise InvalidRequestError(f"{name} must be a str, got {type(value).__name__}")
    raw = value.encode("utf-8")
    if not raw:
        raise InvalidRequestError(f"{name} must not be empty")
    if len(raw) > _MAX_STR_BYTES:
        raise InvalidRequestError(f"{name} is {len(raw)} bytes; the limit is {_MAX_STR_BYTES}")
    return raw


def _encode_str(raw: bytes) -> bytes:
    return struct.pack("<H", len(raw)) + raw


@dataclass(frozen=True, slots=True)
class Namespace:
    """What makes two KV caches compatible. Keys of different namespaces never meet.

    Validated on creation; ``digest`` (16 bytes) is computed once and is part of every block key.

    Attributes:
        model: model name or path, e.g. ``"meta-llama/Llama-3.1-8B"`` (1..1024 UTF-8 bytes).
        dtype: KV element type: ``float16``, ``bfloat16``, ``float32`` or ``float8_e4m3``.
        num_layers: transformer layers whose KV the block holds.
        num_kv_heads: KV heads held by this tensor-parallel rank.
        head_dim: elements per head.
        block_size: tokens per block (default 64).
        salt: optional tenant / LoRA isolation string; ``None`` means no salt (empty is refused).
        tp_rank: tensor-parallel rank, ``0 <= tp_rank < tp_size``.
        tp_size: tensor-parallel world size.
        hash_algorithm: ``xxh3_128`` (default) or ``blake2b_128`` for mutually untrusting tenants.
    """

    model: str
    dtype: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int = 64
    salt: str | None = None
    tp_rank: int = 0
    tp_size: int = 1
    hash_algorithm: str = "xxh3_128"
    digest: bytes = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        _check_str("model", self.model)
        if self.dtype not in DTYPE_BYTES:
            raise InvalidRequestError(
                f"dtype must be one of {sorted(DTYPE_BYTES)}, got {self.dtype!r}"
            )
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size", "tp_size"):
            _check_u32(name, getattr(self, name), minimum=1)
        _check_u32("tp_rank", self.tp_rank, minimum=0)
        if self.tp_rank >= self.tp_size:
            raise InvalidRequestError(f"tp_rank {self.tp_rank} must be < tp_size {self.tp_size}")
        if self.salt is not None:
            _check_str("salt", self.salt)
        if self.hash_algorithm not in _HASHERS:
            raise InvalidRequestError(
                f"hash_algorithm must be one of {list(HASH_ALGORITHMS)}, got {self.hash_algorithm!r}"
            )
        object.__setattr__(self, "digest", _blake2b_128(self.canonical_bytes()))

    def canonical_bytes(self) -> bytes:
        """The canonical encoding of this namespace (see ``docs/block-keys.md``).

        Returns:
            ``b"KVNS"``, version byte 1, then model, dtype (u16-length-prefixed UTF-8),
            num_layers, num_kv_heads, head_dim, block_size, tp_rank, tp_size (u32 LE),
            hash_algorithm (u16-length-prefixed), a salt flag byte and, if set, the salt.
        """
        parts = [
            _NS_MAGIC,
            bytes([NAMESPACE_ENCODING_VERSION]),
            _encode_str(self.model.encode("utf-8")),
            _encode_str(self.dtype.encode("utf-8")),
            struct.pack(
                "<6I",
                self.num_layers,
                self.num_kv_heads,
                self.head_dim,
                self.block_size,
                self.tp_rank,
                self.tp_size,
            ),
            _encode_str(self.hash_algorithm.encode("utf-8")),
        ]
        if self.salt is None:
            parts.append(b"\x00")
        else:
            parts.append(b"\x01" + _encode_str(self.salt.encode("utf-8")))
        return b"".join(parts)

    def to_dict(self) -> dict[str, Any]:
        """A plain dict of the fields (for msgpack / JSON); ``Namespace(**d)`` rebuilds it."""
        return {
            "model": self.model,
            "dtype": self.dtype,
            "num_layers": self.num_layers,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "block_size": self.block_size,
            "salt": self.salt,
            "tp_rank": self.tp_rank,
            "tp_size": self.tp_size,
            "hash_algorithm": self.hash_algorithm,
        }

    @staticmethod
    def from_dict(data: Any) -> Namespace:
        """Rebuild a namespace from :meth:`to_dict` output (e.g. taken off the wire).

        Raises:
            InvalidRequestError: not a mapping, unknown or missing fields, or invalid values.
        """
        if not isinstance(data, dict):
            raise InvalidRequestError(f"namespace must be a map, got {type(data).__name__}")
        try:
            return Namespace(**data)
        except TypeError as exc:
            raise InvalidRequestError(f"bad namespace fields: {exc}") from None


def as_token_array(tokens: Any) -> np.ndarray:
    """Validate token ids and return them as a 1-D little-endian ``uint32`` numpy array.

    Accepts a sequence of Python ints, a 1-D numpy integer array or a 1-D torch integer tensor
    (any device; it is copied to the CPU). Checks are vectorised: no per-token Python loop except
    for plain sequences holding ints beyond int64.

    Args:
        tokens: the token ids.

    Returns:
        A contiguous ``<u4`` array (may share memory with ``tokens`` when it already is one).

    Raises:
        InvalidRequestError: not 1-D, not integers (floats, bools, strings), or any id
            negative or ``>= 2**32``.
    """
    if type(tokens).__module__.startswith("torch"):
        if getattr(tokens, "is_floating_point", lambda: True)() or str(tokens.dtype) in (
            "torch.bool",
            "torch.complex64",
            "torch.complex128",
        ):
            raise InvalidRequestError(f"token ids must be integers, got a {tokens.dtype} tensor")
        tokens = tokens.detach().cpu().numpy()
    if isinstance(tokens, np.ndarray):
        arr = tokens
    elif isinstance(tokens, Sequence) and not isinstance(tokens, str | bytes | bytearray):
        if len(tokens) == 0:
            return np.empty(0, dtype="<u4")
        try:
            arr = np.asarray(tokens)
        except (ValueError, TypeError, OverflowError):
            # Ragged or nested sequences ([1, [2]]): numpy cannot make a 1-D array of them.
            raise InvalidRequestError("tokens must be a flat sequence of ints") from None
        if arr.dtype == object:  # ints beyond int64 (or a mix): check one by one, error path only
            for t in tokens:
                if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < _U32_LIMIT:
                    raise InvalidRequestError(
                        f"token ids must be ints in [0, 2**32), got {t!r:.40}"
                    )
            arr = np.asarray(tokens, dtype=np.uint64)
    else:
        raise InvalidRequestError(
            f"tokens must be a sequence, numpy array or torch tensor, got {type(tokens).__name__}"
        )
    if arr.ndim != 1:
        raise InvalidRequestError(f"tokens must be 1-D, got shape {arr.shape}")
    if arr.dtype.kind not in "iu":
        if arr.size == 0 and arr.dtype.kind == "f":
            return np.empty(0, dtype="<u4")
        raise InvalidRequestError(f"token ids must be integers, got dtype {arr.dtype}")
    if arr.size and (arr.dtype.kind == "i" or arr.dtype.itemsize > 4):
        low, high = int(arr.min()), int(arr.max())
        if low < 0 or high >= _U32_LIMIT:
            raise InvalidRequestError(f"token ids must be in [0, 2**32), got min {low} max {high}")
    return np.ascontiguousarray(arr, dtype="<u4")


def _hasher(namespace: Namespace) -> Callable[[bytes], bytes]:
    return _HASHERS[namespace.hash_algorithm]


def block_keys(
    namespace: Namespace, tokens: Any, *, parent: BlockKey | None = None
) -> list[BlockKey]:
    """Chained keys of the full blocks of ``tokens``.

    ``key[i] = H(key[i-1] || namespace.digest || tokens of block i as u32 LE)`` with
    ``key[-1] = parent`` (default :data:`SEED_KEY`, 16 zero bytes). A trailing partial block
    gets no key.

    Args:
        namespace: the namespace (block size, hash algorithm and digest).
        tokens: token ids (see :func:`as_token_array`).
        parent: the key of the block before ``tokens[0]``, to extend a stored prefix.

    Returns:
        ``len(tokens) // namespace.block_size`` keys of 16 bytes.

    Raises:
        InvalidRequestError: bad token ids, or a parent that is not 16 bytes.
    """
    if parent is None:
        parent = SEED_KEY
    elif not isinstance(parent, bytes) or len(parent) != BLOCK_KEY_BYTES:
        raise InvalidRequestError(f"parent must be {BLOCK_KEY_BYTES} bytes")
    arr = as_token_array(tokens)
    step = namespace.block_size * 4
    num_blocks = len(arr) // namespace.block_size
    raw = arr[: num_blocks * namespace.block_size].tobytes()
    h = _hasher(namespace)
    ns_digest = namespace.digest
    keys: list[BlockKey] = []
    prev = bytes(parent)
    for i in range(num_blocks):
        prev = h(prev + ns_digest + raw[i * step : (i + 1) * step])
        keys.append(BlockKey(prev))
    return keys


def block_bytes(namespace: Namespace) -> int:
    """Size in bytes of one block object.

    The object is layer-major: for each layer, K then V, each a C-contiguous
    ``[block_size, num_kv_heads, head_dim]`` array of ``dtype``.

    Args:
        namespace: the namespace.

    Returns:
        ``num_layers * 2 * block_size * num_kv_heads * head_dim * itemsize``.
    """
    return namespace.num_layers * 2 * namespace.block_size * _token_stride(namespace)


def _token_stride(namespace: Namespace) -> int:
    return namespace.num_kv_heads * namespace.head_dim * DTYPE_BYTES[namespace.dtype]


def token_ranges(namespace: Namespace, num_tokens: int) -> list[tuple[int, int]]:
    """Byte ranges of a block object that hold the KV of its first ``num_tokens`` tokens.

    Args:
        namespace: the namespace.
        num_tokens: ``0 <= num_tokens <= block_size``.

    Returns:
        ``(offset, length)`` pairs, one per layer and K/V, in object order
        (layer 0 K, layer 0 V, layer 1 K, ...); empty for ``num_tokens == 0``.

    Raises:
        InvalidRequestError: ``num_tokens`` out of range or not an int.
    """
    if not isinstance(num_tokens, int) or isinstance(num_tokens, bool):
        raise InvalidRequestError(f"num_tokens must be an int, got {type(num_tokens).__name__}")
    if not 0 <= num_tokens <= namespace.block_size:
        raise InvalidRequestError(
            f"num_tokens must be in [0, {namespace.block_size}], got {num_tokens}"
        )
    if num_tokens == 0:
        return []
    stride = _token_stride(namespace)
    plane = namespace.block_size * stride  # one K or V tensor of one layer
    length = num_tokens * stride
    return [(i * plane, length) for i in range(2 * namespace.num_layers)]
