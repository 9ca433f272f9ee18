"""Tenants: who a connection is, and the part of the key space that is theirs.

A pool serves many tenants (models, teams, customers). The store, not the client, keeps them
apart: each tenant has its own token, a connection proves one token at ``hello`` and is bound to
that tenant for its life, and every key it names is taken into the tenant's part of the key
space on the server (:func:`tenant_key`). Two tenants' keys never collide and no key a tenant can
name reaches another tenant's objects, whatever it guesses or replays.

* The **operator** holds the cluster token (``--token-file``): its connections are bound to no
  tenant (``None``) and see every object, each tenant's under its stored key.
* A **tenant** holds a token the master made for it (``kvstore tenant create``): its connections
  see only keys in its part of the key space (and namespaces marked shared).
* Without tenants the pool behaves as before: the cluster token (or none) is the operator's.

A token is kept only as its digest (:func:`token_digest`); a server holds a
:class:`TenantDirectory` (digest -> tenant), replaced whole when tenants change.

**Shared namespaces.** The operator may mark a KV namespace shared (by its 16-byte digest): its
block objects and prompt metas (``kv/<digest hex>/...``, ``kvmeta/<digest hex>/...``) are then
stored as named, in no tenant's part of the key space, so every tenant reads and writes the same
blocks (:func:`shared_namespace_hex`, :meth:`TenantDirectory.is_shared_key`). The directory
carries the shared set, so the nodes learn it with the tenants.

**Shared prefixes.** The operator may also share a leading token range of one namespace's
prompts (a system prompt, tool definitions: :class:`SharedPrefix`). Block keys chain, so a
block's key names every token before it: the blocks of that range have the same keys in every
tenant's prompt that starts with it, and those keys (exactly those, listed) are stored as named
and hit by every tenant. Every later block's key is stored in its writer's part of the key space,
so the tenant is carried from the first private block on, and a prompt that differs from the
range anywhere in a block has that block's key, and every later one, private.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvstore.errors import InvalidRequestError
from kvstore.keys import Namespace, as_token_array, block_keys
from kvstore.kvblocks import KV_META_PREFIX, KV_PREFIX, kv_object_keys, parse_kv_object_key
from kvstore.limits import MAX_KEY_BYTES

#: A tenant's name: lower-case letters, digits, ``-`` and ``_``, starting with a letter.
NAME_RE = re.compile(r"^[a-z][a-z0-9_-]{0,31}$")
#: The first byte of a stored key in a tenant's part of the key space. A tenant's own keys may
#: not start with it, so no key a tenant names can be taken for another tenant's.
MARK = b"\x00"
#: Bytes of a token digest.
DIGEST_BYTES = 16


#: Most full blocks one shared prefix may have (every node holds the keys of all of them).
MAX_PREFIX_BLOCKS = 4096
#: Most blocks of all shared prefixes together (the directory a node gets carries each key).
MAX_SHARED_PREFIX_BLOCKS = 16384

#: Hex characters of a namespace digest in a KV object's key.
_HEX = 2 * DIGEST_BYTES
_HEX_CHARS = frozenset(b"0123456789abcdef")


def check_name(name: object) -> str:
    """A tenant name, checked.

    Raises:
        InvalidRequestError: not a string of 1..32 lower-case letters, digits, ``-`` or ``_``
            starting with a letter.
    """
    if not isinstance(name, str) or not NAME_RE.match(name):
        raise InvalidRequestError(
            f"tenant name must be 1-32 of a-z, 0-9, '-', '_' starting with a letter, got {name!r}"
        )
    return name


def token_digest(secret: bytes | str) -> bytes:
    """What a server keeps of a tenant token (never the token itself)."""
    raw = secret.encode() if isinstance(secret, str) else bytes(secret)
    return hashlib.blake2b(raw, digest_size=DIGEST_BYTES, person=b"kvstore-tenant").digest()


def prefix_of(tenant: str) -> bytes:
    """The bytes every stored key of ``tenant`` starts with."""
    return MARK + tenant.encode() + MARK


def tenant_key(tenant: str | None, key: bytes) -> bytes:
    """The stored key for ``key`` named by a connection of ``tenant`` (None: the operator's
    connection, whose keys are stored as named).

    Raises:
        InvalidRequestError: a tenant's key starting with :data:`MARK`, or one too long once in
            the tenant's part of the key space.
    """
    if tenant is None:
        return key
    if key[:1] == MARK:
        raise InvalidRequestError("a key may not start with a NUL byte")
    stored = prefix_of(tenant) + key
    if len(stored) > MAX_KEY_BYTES:
        raise InvalidRequestError(
            f"key is {len(key)} bytes; tenant {tenant!r}'s keys may have at most "
            f"{MAX_KEY_BYTES - len(stored) + len(key)}"
        )
    return stored


def check_namespace_hex(digest_hex: object) -> bytes:
    """A namespace digest given as hex (the admin API's and the CLI's form), checked.

    Returns:
        The 16-byte digest.

    Raises:
        InvalidRequestError: not 32 hex characters.
    """
    if (
        not isinstance(digest_hex, str)
        or len(digest_hex) != _HEX
        or not _HEX_CHARS.issuperset(digest_hex.lower().encode())
    ):
        raise InvalidRequestError(
            f"a namespace digest must be {_HEX} hex characters, got {str(digest_hex)[:80]!r}"
        )
    return bytes.fromhex(digest_hex)


def shared_namespace_hex(key: bytes) -> bytes | None:
    """The namespace digest (as the key's hex bytes) of a KV block or prompt-meta key, or None
    for any other key: a slice, no parsing, so that a set of hex digests answers whether the
    key's namespace is shared."""
    if key.startswith(KV_PREFIX):
        start = len(KV_PREFIX)
    elif key.startswith(KV_META_PREFIX):
        start = len(KV_META_PREFIX)
    else:
        return None
    end = start + _HEX
    return key[start:end] if key[end : end + 1] == b"/" else None


def owner_of(stored: bytes) -> str | None:
    """The tenant a stored key belongs to (None: the operator's key space, no tenant)."""
    if stored[:1] != MARK:
        return None
    end = stored.find(MARK, 1)
    return stored[1:end].decode() if end > 1 else None


def user_key(tenant: str | None, stored: bytes) -> bytes | None:
    """The key a connection of ``tenant`` knows a stored key by, or None when that stored key
    is not the tenant's (the operator knows every key by its stored form)."""
    if tenant is None:
        return stored
    prefix = prefix_of(tenant)
    return stored[len(prefix) :] if stored.startswith(prefix) else None


@dataclass(frozen=True, slots=True)
class SharedPrefix:
    """A leading token range of one namespace's prompts that every tenant shares.

    Only its full blocks count (a block's key chains every token before it, so a partial block
    would be the first private one). Make one with :meth:`make`.
    """

    name: str
    namespace: Namespace
    #: The range's tokens, full blocks only (``<u4``).
    tokens: np.ndarray
    #: The block objects' keys (``kv/<namespace>/<block>``), in order.
    keys: tuple[bytes, ...]
    created_ms: int = 0

    @staticmethod
    def make(name: object, namespace: object, tokens: object, created_ms: int = 0) -> SharedPrefix:
        """A shared prefix of ``tokens`` in ``namespace`` (a :class:`Namespace` or its
        ``to_dict`` form), cut to its full blocks.

        Raises:
            InvalidRequestError: a bad name or namespace, tokens that are not ids, no full
                block, more than :data:`MAX_PREFIX_BLOCKS` blocks.
        """
        name = check_name(name)
        ns = namespace if isinstance(namespace, Namespace) else Namespace.from_dict(namespace)
        tok = as_token_array(tokens)
        num_blocks = len(tok) // ns.block_size
        if num_blocks == 0:
            raise InvalidRequestError(
                f"a shared prefix needs one full block at least ({ns.block_size} tokens);"
                f" got {len(tok)}"
            )
        if num_blocks > MAX_PREFIX_BLOCKS:
            raise InvalidRequestError(
                f"a shared prefix of {num_blocks} blocks exceeds the limit of"
                f" {MAX_PREFIX_BLOCKS} ({MAX_PREFIX_BLOCKS * ns.block_size} tokens)"
            )
        full = tok[: num_blocks * ns.block_size].copy()
        keys = tuple(kv_object_keys(ns.digest, block_keys(ns, full)))
        return SharedPrefix(name, ns, full, keys, created_ms)

    @property
    def num_blocks(self) -> int:
        return len(self.keys)

    def leading_blocks(self, tokens: np.ndarray) -> int:
        """How many of the range's blocks lead ``tokens`` (its full blocks, token by token)."""
        bs = self.namespace.block_size
        n = min(len(self.tokens), len(tokens) // bs * bs)
        differ = np.flatnonzero(self.tokens[:n] != tokens[:n])
        return (int(differ[0]) if len(differ) else n) // bs

    def to_json(self) -> dict[str, Any]:
        """What the admin API shows of it."""
        return {
            "name": self.name,
            "namespace": self.namespace.digest.hex(),
            "model": self.namespace.model,
            "block_size": self.namespace.block_size,
            "num_tokens": len(self.tokens),
            "num_blocks": self.num_blocks,
            "created_ms": self.created_ms,
        }

    def to_record(self) -> dict[str, Any]:
        """What is kept of it (etcd, the tenants file): enough to make it again."""
        return {
            "name": self.name,
            "namespace": self.namespace.to_dict(),
            "tokens": self.tokens.tolist(),
            "created_ms": self.created_ms,
        }

    @staticmethod
    def from_record(raw: object) -> SharedPrefix:
        """A kept record, checked.

        Raises:
            InvalidRequestError: malformed.
        """
        if not isinstance(raw, dict):
            raise InvalidRequestError("a shared prefix record must be a JSON object")
        created = raw.get("created_ms", 0)
        if not isinstance(created, int) or isinstance(created, bool):
            raise InvalidRequestError("a shared prefix's created_ms must be an integer")
        return SharedPrefix.make(raw.get("name"), raw.get("namespace"), raw.get("tokens"), created)


class TenantDirectory:
    """Token digests -> tenant names, the shared namespaces and the shared prefixes' block
    keys, as one server knows them. Thread-safe: :meth:`replace` swaps the whole of it (the
    master after a change; a node from the master's answer).

    The master's also holds the shared prefixes themselves (:meth:`prefixes_of`: their tokens,
    to match prompts against); a node's holds their keys only."""

    __slots__ = ("_by_digest", "_lock", "_prefixes", "_shared_hex", "_shared_keys", "version")

    def __init__(
        self,
        by_digest: Mapping[bytes, str] | None = None,
        version: int = 0,
        shared: Iterable[bytes] = (),
        prefixes: Iterable[SharedPrefix] = (),
    ) -> None:
        self._lock = threading.Lock()
        self._by_digest: dict[bytes, str] = dict(by_digest or {})
        #: The shared namespaces' digests as lower-case hex bytes, the form KV keys carry them
        #: in, so a key's check is a slice and a set lookup.
        self._shared_hex: frozenset[bytes] = frozenset(d.hex().encode() for d in shared)
        self._prefixes, self._shared_keys = _by_namespace(prefixes)
        #: Increases with every change the master makes; a node keeps the newest it saw.
        self.version = version

    def replace(
        self,
        by_digest: Mapping[bytes, str],
        version: int,
        shared: Iterable[bytes] = (),
        prefixes: Iterable[SharedPrefix] = (),
    ) -> bool:
        """Take a newer mapping, shared set and shared prefixes; an older or equal version
        changes nothing. Returns whether it was taken."""
        shared_hex = frozenset(d.hex().encode() for d in shared)
        by_namespace, keys = _by_namespace(prefixes)
        with self._lock:
            if version <= self.version:
                return False
            self._by_digest = dict(by_digest)
            self._shared_hex = shared_hex
            self._prefixes, self._shared_keys = by_namespace, keys
            self.version = version
            return True

    @property
    def shared(self) -> frozenset[bytes]:
        """The shared namespaces' 16-byte digests."""
        return frozenset(bytes.fromhex(h.decode()) for h in self._shared_hex)

    def is_shared(self, digest: bytes) -> bool:
        """Whether the namespace with this 16-byte digest is shared."""
        return bool(self._shared_hex) and digest.hex().encode() in self._shared_hex

    @property
    def shared_keys(self) -> frozenset[bytes]:
        """The block object keys of every shared prefix."""
        return self._shared_keys

    def prefixes_of(self, digest: bytes) -> tuple[SharedPrefix, ...]:
        """The shared prefixes of the namespace with this digest (the master's directory)."""
        return self._prefixes.get(digest, ())

    def is_shared_key(self, key: bytes) -> bool:
        """Whether ``key`` is a block object or prompt meta of a shared namespace, or a block
        of a shared prefix (stored as named and open to every tenant)."""
        if key in self._shared_keys:
            return True
        shared = self._shared_hex
        if not shared:
            return False
        digest_hex = shared_namespace_hex(key)
        return digest_hex is not None and digest_hex in shared

    def resolve(self, offered: object) -> str | None:
        """The tenant whose token ``offered`` is, or None when it is no tenant's."""
        if not isinstance(offered, bytes | str) or not self._by_digest:
            return None
        digest = token_digest(offered)
        by_digest = self._by_digest
        for known, name in by_digest.items():  # compare_digest: no timing hint of near misses
            if hmac.compare_digest(known, digest):
                return name
        return None

    def has(self, tenant: str) -> bool:
        """Whether ``tenant`` still exists here (a deleted tenant's connections are refused)."""
        return tenant in self._by_digest.values()

    def __len__(self) -> int:
        return len(self._by_digest)

    def wire(self) -> dict[str, object]:
        """The form the master hands its nodes: ``{"version": v, "digests": {digest: name},
        "shared": [namespace digest, ...], "shared_keys": [block object key, ...]}`` (each list
        only when not empty, so a node that predates it reads the form as before)."""
        out: dict[str, object] = {"version": self.version, "digests": dict(self._by_digest)}
        if self._shared_hex:
            out["shared"] = sorted(bytes.fromhex(h.decode()) for h in self._shared_hex)
        if self._shared_keys:
            out["shared_keys"] = sorted(self._shared_keys)
        return out

    def take_wire(self, wire: object) -> bool:
        """Take the master's :meth:`wire` form; a malformed one changes nothing.

        Raises:
            InvalidRequestError: ``wire`` is not that form.
        """
        if not isinstance(wire, dict):
            raise InvalidRequestError("tenants must be a map")
        version, digests = wire.get("version"), wire.get("digests")
        if type(version) is not int or not isinstance(digests, dict):
            raise InvalidRequestError("tenants must carry an int version and a digests map")
        clean: dict[bytes, str] = {}
        for digest, name in digests.items():
            if not isinstance(digest, bytes) or len(digest) != DIGEST_BYTES:
                raise InvalidRequestError("a tenant digest must be 16 bytes")
            clean[digest] = check_name(name)
        shared = wire.get("shared", [])  # absent: a master without shared namespaces
        if not isinstance(shared, list) or not all(
            isinstance(d, bytes) and len(d) == DIGEST_BYTES for d in shared
        ):
            raise InvalidRequestError("shared must be a list of 16-byte namespace digests")
        shared_hex = frozenset(d.hex().encode() for d in shared)
        keys = wire.get("shared_keys", [])  # absent: no shared prefix
        if (
            not isinstance(keys, list)
            or len(keys) > MAX_SHARED_PREFIX_BLOCKS
            or not all(isinstance(k, bytes) and parse_kv_object_key(k) is not None for k in keys)
        ):
            raise InvalidRequestError(
                f"shared_keys must be a list of at most {MAX_SHARED_PREFIX_BLOCKS} block keys"
            )
        with self._lock:
            if version <= self.version:
                return False
            self._by_digest = clean
            self._shared_hex = shared_hex
            self._prefixes, self._shared_keys = {}, frozenset(keys)
            self.version = version
            return True


def _by_namespace(
    prefixes: Iterable[SharedPrefix],
) -> tuple[dict[bytes, tuple[SharedPrefix, ...]], frozenset[bytes]]:
    """Shared prefixes per namespace digest, and every block key of them."""
    by_namespace: dict[bytes, tuple[SharedPrefix, ...]] = {}
    keys: set[bytes] = set()
    for p in prefixes:
        by_namespace[p.namespace.digest] = (*by_namespace.get(p.namespace.digest, ()), p)
        keys.update(p.keys)
    return by_namespace, frozenset(keys)
