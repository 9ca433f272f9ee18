"""How KV-cache blocks map onto stored objects (shared by the client and the master).

A block object is stored under ``kv/<namespace digest hex>/<block key hex>``: the block key
already identifies the whole prefix (chained hash), and carrying the namespace digest lets the
master drop a block from the right prefix tree when its object goes away.
"""

from __future__ import annotations

import msgpack
import numpy as np

from kvstore.errors import InvalidRequestError
from kvstore.keys import BLOCK_KEY_BYTES, BlockKey

KV_PREFIX = b"kv/"
#: One small object per stored prompt: the namespace and the tokens of its full blocks. It lives
#: in the pool like any object, so it survives a master failover in the nodes' manifests, and a
#: new leader rebuilds the prefix index from it (block objects hold KV bytes only, no tokens).
KV_META_PREFIX = b"kvmeta/"
_KEY_LEN = len(KV_PREFIX) + 32 + 1 + 2 * BLOCK_KEY_BYTES


def kv_object_key(ns_digest: bytes, block_key: BlockKey) -> bytes:
    return KV_PREFIX + ns_digest.hex().encode() + b"/" + block_key.hex().encode()


def parse_kv_object_key(key: bytes) -> tuple[bytes, BlockKey] | None:
    """(namespace digest, block key) of a block object's key, or None for any other key."""
    if len(key) != _KEY_LEN or not key.startswith(KV_PREFIX):
        return None
    try:
        digest = bytes.fromhex(key[3:35].decode())
        block = bytes.fromhex(key[36:].decode())
    except ValueError:
        return None
    return digest, BlockKey(block)


def kv_meta_key(ns_digest: bytes, last_block_key: BlockKey) -> bytes:
    return KV_META_PREFIX + ns_digest.hex().encode() + b"/" + last_block_key.hex().encode()


def encode_prompt_meta(namespace_dict: dict[str, object], tokens: np.ndarray) -> bytes:
    return msgpack.packb(
        {"namespace": namespace_dict, "tokens": tokens_to_wire(tokens)}, use_bin_type=True
    )


def decode_prompt_meta(raw: bytes) -> tuple[dict[str, object], np.ndarray]:
    """Raises InvalidRequestError for anything that is not a prompt meta object."""
    try:
        obj = msgpack.unpackb(raw, raw=False)
    except Exception:  # noqa: BLE001 - msgpack raises many types for bad input
        raise InvalidRequestError("prompt meta is not msgpack") from None
    if not isinstance(obj, dict) or not isinstance(obj.get("namespace"), dict):
        raise InvalidRequestError("prompt meta must be a map with a namespace")
    return obj["namespace"], tokens_from_wire(obj.get("tokens"))


def tokens_to_wire(tokens: np.ndarray) -> bytes:
    """Token ids on the wire: little-endian uint32, packed."""
    return np.ascontiguousarray(tokens, dtype="<u4").tobytes()


def tokens_from_wire(raw: object) -> np.ndarray:
    if not isinstance(raw, bytes) or len(raw) % 4:
        raise InvalidRequestError("tokens must be packed little-endian uint32 bytes")
    return np.frombuffer(raw, dtype="<u4")
