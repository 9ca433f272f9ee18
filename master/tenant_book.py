"""The master's tenants: who they are, their token digests and quotas, and where they are kept.

:class:`TenantBook` is the one place tenants change (the admin REST calls it): create (the
token is made here and returned once; only its digest is kept), show, list, set quotas, delete.
After each change it replaces the :class:`~kvstore.tenants.TenantDirectory` the control server
checks every ``hello`` against, with a higher version, so that the nodes (which get the
directory in their register and heartbeat replies) take the new one.

Where tenants are kept, so that a master that starts again, or a new HA leader, has them:

* with etcd, each under ``<prefix>/tenants/<name>``, each shared namespace under
  ``<prefix>/shared-namespaces/<digest hex>`` and each shared prefix under
  ``<prefix>/shared-prefixes/<name>`` (:class:`EtcdTenantStore`), read by every master when it
  becomes leader;
* without, in memory, and in ``--tenants-file`` when given (:class:`FileTenantStore`, the whole
  book as JSON, written to a temporary file and renamed so that a crash leaves the old or the
  new file, never half of one).

The book also keeps the shared namespaces (:meth:`TenantBook.share`): KV namespaces, by digest,
whose blocks every tenant stores and hits as one (``kvstore.tenants``), and the shared prefixes
(:meth:`TenantBook.share_prefix`): leading token ranges of one namespace's prompts, whose blocks
are stored once and hit by every tenant. Both travel in the same directory, so the nodes let
every tenant's connection use those blocks' grants.

A change is kept first and applied after: when keeping it fails nothing changes here.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import secrets
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from kvstore.errors import InvalidRequestError, KeyNotFoundError, ObjectExistsError
from kvstore.etcd import EtcdStore
from kvstore.tenants import (
    DIGEST_BYTES,
    MAX_SHARED_PREFIX_BLOCKS,
    SharedPrefix,
    TenantDirectory,
    check_name,
    check_namespace_hex,
    token_digest,
)
from kvstore.types import TIER_RANK

log = logging.getLogger(__name__)

#: Bytes of randomness in a tenant token (``secrets.token_urlsafe``).
TOKEN_BYTES = 32
#: Most tenants one master keeps (every hello is checked against all their digests).
MAX_TENANTS = 1024
#: Most shared namespaces (every node gets the whole set with the tenant directory).
MAX_SHARED = 1024
#: Most shared prefixes (their blocks together are bounded too: MAX_SHARED_PREFIX_BLOCKS).
MAX_PREFIXES = 64


def check_quotas(quotas: object, *, allow_null: bool = False) -> dict[str, int | None]:
    """Quota bytes per tier, checked (a tier left out has no quota).

    Args:
        allow_null: a tier may be None (a ``PATCH`` that removes that tier's quota).

    Raises:
        InvalidRequestError: not a map of known tiers to integers >= 0.
    """
    if not isinstance(quotas, Mapping):
        raise InvalidRequestError("quotas must be a map of tier to bytes")
    clean: dict[str, int | None] = {}
    for tier, value in quotas.items():
        if tier not in TIER_RANK:
            raise InvalidRequestError(f"unknown tier {tier!r} in quotas; known: {list(TIER_RANK)}")
        if value is None and allow_null:
            clean[tier] = None
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise InvalidRequestError(f"the {tier} quota must be bytes >= 0, got {value!r}")
        clean[tier] = value
    return clean


@dataclass(frozen=True, slots=True)
class Tenant:
    """One tenant as the master keeps it: never its token, only the token's digest."""

    name: str
    digest: bytes
    quotas: dict[str, int] = field(default_factory=dict)
    created_ms: int = 0

    def to_json(self) -> dict[str, Any]:
        """What the admin API shows of it (no digest: it identifies the token)."""
        return {"name": self.name, "quotas": dict(self.quotas), "created_ms": self.created_ms}

    def to_record(self) -> dict[str, Any]:
        """What is kept of it (etcd, the tenants file)."""
        return {
            "name": self.name,
            "digest": self.digest.hex(),
            "quotas": dict(self.quotas),
            "created_ms": self.created_ms,
        }

    @staticmethod
    def from_record(raw: object) -> Tenant:
        """A kept record, checked.

        Raises:
            InvalidRequestError: malformed.
        """
        if not isinstance(raw, dict):
            raise InvalidRequestError("a tenant record must be a JSON object")
        name = check_name(raw.get("name"))
        try:
            digest = bytes.fromhex(raw.get("digest", ""))
        except (TypeError, ValueError):
            digest = b""
        if len(digest) != DIGEST_BYTES:
            raise InvalidRequestError(f"tenant {name!r}: the digest must be {DIGEST_BYTES} bytes")
        quotas = {t: q for t, q in check_quotas(raw.get("quotas", {})).items() if q is not None}
        created = raw.get("created_ms", 0)
        if not isinstance(created, int) or isinstance(created, bool):
            raise InvalidRequestError(f"tenant {name!r}: created_ms must be an integer")
        return Tenant(name, digest, quotas, created)


class TenantStore(Protocol):
    """Where the book keeps its tenants."""

    async def load(self) -> list[Tenant]:
        """Every kept tenant."""
        ...

    async def write(self, tenants: Mapping[str, Tenant], changed: str) -> None:
        """Keep ``tenants`` after a change to ``changed`` (absent from it: deleted)."""
        ...

    async def load_shared(self) -> set[bytes]:
        """Every kept shared namespace digest."""
        ...

    async def write_shared(self, shared: frozenset[bytes], changed: bytes) -> None:
        """Keep ``shared`` after a change to ``changed`` (absent from it: unshared)."""
        ...

    async def load_prefixes(self) -> list[SharedPrefix]:
        """Every kept shared prefix."""
        ...

    async def write_prefixes(self, prefixes: Mapping[str, SharedPrefix], changed: str) -> None:
        """Keep ``prefixes`` after a change to ``changed`` (absent from it: unshared)."""
        ...


class FileTenantStore:
    """The book as one JSON file (``{"tenants": [...], "shared": [hex, ...], "prefixes":
    [...]}``; a file without ``shared`` or ``prefixes`` has none), replaced atomically on each
    change."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        #: The last tenants and shared set kept or loaded: each write writes the whole file.
        self._tenants: list[Tenant] = []
        self._shared: frozenset[bytes] = frozenset()
        self._prefixes: list[SharedPrefix] = []

    def _read(self) -> dict[str, Any]:
        try:
            text = self.path.read_text()
        except FileNotFoundError:
            return {"tenants": []}
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as err:
            raise InvalidRequestError(f"{self.path}: not JSON ({err})") from None
        if not isinstance(raw, dict) or not isinstance(raw.get("tenants"), list):
            raise InvalidRequestError(f'{self.path}: must be {{"tenants": [...]}}')
        return raw

    async def load(self) -> list[Tenant]:
        self._tenants = [Tenant.from_record(r) for r in self._read()["tenants"]]
        return list(self._tenants)

    async def load_shared(self) -> set[bytes]:
        raw = self._read().get("shared", [])
        if not isinstance(raw, list):
            raise InvalidRequestError(f"{self.path}: shared must be a list of digests")
        try:
            shared = {check_namespace_hex(h) for h in raw}
        except InvalidRequestError as err:
            raise InvalidRequestError(f"{self.path}: {err}") from None
        self._shared = frozenset(shared)
        return shared

    async def load_prefixes(self) -> list[SharedPrefix]:
        raw = self._read().get("prefixes", [])
        if not isinstance(raw, list):
            raise InvalidRequestError(f"{self.path}: prefixes must be a list")
        try:
            self._prefixes = [SharedPrefix.from_record(r) for r in raw]
        except InvalidRequestError as err:
            raise InvalidRequestError(f"{self.path}: {err}") from None
        return list(self._prefixes)

    async def write(self, tenants: Mapping[str, Tenant], changed: str) -> None:
        self._dump(list(tenants.values()), self._shared, self._prefixes)
        self._tenants = list(tenants.values())

    async def write_shared(self, shared: frozenset[bytes], changed: bytes) -> None:
        self._dump(self._tenants, shared, self._prefixes)
        self._shared = shared

    async def write_prefixes(self, prefixes: Mapping[str, SharedPrefix], changed: str) -> None:
        self._dump(self._tenants, self._shared, list(prefixes.values()))
        self._prefixes = list(prefixes.values())

    def _dump(
        self, tenants: list[Tenant], shared: frozenset[bytes], prefixes: list[SharedPrefix]
    ) -> None:
        body = json.dumps(
            {
                "tenants": [t.to_record() for t in tenants],
                "shared": sorted(d.hex() for d in shared),
                "prefixes": [p.to_record() for p in prefixes],
            },
            indent=1,
        )
        tmp = self.path.with_name(self.path.name + ".tmp")
        with open(tmp, "w") as f:
            f.write(body)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o600)  # digests only, but nobody else's business
        os.replace(tmp, self.path)


class EtcdTenantStore:
    """Each tenant under ``<prefix>/tenants/<name>``, so a new leader reads them all."""

    def __init__(self, store: EtcdStore, prefix: str) -> None:
        self.store = store
        self.prefix = f"{prefix}/tenants/".encode()
        #: Each shared namespace under its own key, beside the tenants (not under them: a
        #: tenant's name could be any key there).
        self.shared_prefix = f"{prefix}/shared-namespaces/".encode()
        #: Each shared prefix under its name (its record carries its tokens).
        self.prefixes_prefix = f"{prefix}/shared-prefixes/".encode()

    async def load(self) -> list[Tenant]:
        out = []
        for kv in await self.store.get_prefix(self.prefix):
            try:
                out.append(Tenant.from_record(json.loads(kv.value)))
            except (InvalidRequestError, ValueError) as err:  # someone else's: never trusted
                log.warning("ignoring %s in etcd: %s", kv.key[:200], err)
        return out

    async def close(self) -> None:
        """Close the etcd client it was given (each master gives it one of its own)."""
        await self.store.close()

    async def write(self, tenants: Mapping[str, Tenant], changed: str) -> None:
        key = self.prefix + changed.encode()
        tenant = tenants.get(changed)
        if tenant is None:
            await self.store.delete(key)
        else:
            await self.store.put(key, json.dumps(tenant.to_record()).encode())

    async def load_shared(self) -> set[bytes]:
        out = set()
        for kv in await self.store.get_prefix(self.shared_prefix):
            try:
                out.add(check_namespace_hex(kv.key[len(self.shared_prefix) :].decode()))
            except (InvalidRequestError, UnicodeDecodeError) as err:  # someone else's
                log.warning("ignoring %s in etcd: %s", kv.key[:200], err)
        return out

    async def write_shared(self, shared: frozenset[bytes], changed: bytes) -> None:
        key = self.shared_prefix + changed.hex().encode()
        if changed in shared:
            await self.store.put(key, b"1")
        else:
            await self.store.delete(key)

    async def load_prefixes(self) -> list[SharedPrefix]:
        out = []
        for kv in await self.store.get_prefix(self.prefixes_prefix):
            try:
                out.append(SharedPrefix.from_record(json.loads(kv.value)))
            except (InvalidRequestError, ValueError) as err:  # someone else's: never trusted
                log.warning("ignoring %s in etcd: %s", kv.key[:200], err)
        return out

    async def write_prefixes(self, prefixes: Mapping[str, SharedPrefix], changed: str) -> None:
        key = self.prefixes_prefix + changed.encode()
        prefix = prefixes.get(changed)
        if prefix is None:
            await self.store.delete(key)
        else:
            await self.store.put(key, json.dumps(prefix.to_record()).encode())


class TenantBook:
    """The master's tenants, and the directory of their token digests that serving reads.

    Args:
        has_cluster_token: whether the master has a cluster token. Without one every
            connection is the operator's, so tenants would isolate nothing: refused.
        store: where tenants are kept (None: in memory only).
        clock_ms: wall-clock milliseconds (``created_ms``, and the directory's versions).
        on_change: called with ``(name, quotas or None when deleted)`` after each change (the
            master passes them to the current term's quotas).
    """

    def __init__(
        self,
        *,
        has_cluster_token: bool,
        store: TenantStore | None = None,
        clock_ms: Callable[[], int] = lambda: int(time.time() * 1000),
        on_change: Callable[[str, dict[str, int] | None], None] | None = None,
    ) -> None:
        self.has_cluster_token = has_cluster_token
        self.store = store
        self.clock_ms = clock_ms
        self.on_change = on_change
        self._tenants: dict[str, Tenant] = {}
        #: The shared namespaces' digests (16 bytes each).
        self._shared: frozenset[bytes] = frozenset()
        #: The shared prefixes, by name.
        self._prefixes: dict[str, SharedPrefix] = {}
        #: One change at a time: each is computed from the tenants as they are when it starts
        #: and kept before the next one reads them.
        self._lock = asyncio.Lock()
        #: What serving checks hellos against; the nodes get its wire form.
        self.directory = TenantDirectory()

    # ------------------------------------------------------------------ reading
    def list(self) -> list[Tenant]:
        """Every tenant, by name."""
        return [self._tenants[n] for n in sorted(self._tenants)]

    def show(self, name: str) -> Tenant:
        """One tenant.

        Raises:
            KeyNotFoundError: no such tenant.
        """
        tenant = self._tenants.get(name)
        if tenant is None:
            raise KeyNotFoundError(f"no tenant {str(name)[:64]!r}")
        return tenant

    def shared(self) -> list[bytes]:
        """The shared namespaces' digests, sorted."""
        return sorted(self._shared)

    def prefixes(self) -> list[SharedPrefix]:
        """The shared prefixes, by name."""
        return [self._prefixes[n] for n in sorted(self._prefixes)]

    def __contains__(self, name: object) -> bool:
        return name in self._tenants

    def __len__(self) -> int:
        return len(self._tenants)

    # ------------------------------------------------------------------ changes
    async def create(self, name: object, quotas: object = None) -> tuple[Tenant, str]:
        """A new tenant with a fresh token.

        Returns:
            The tenant and its token: the only time the token exists outside its holder.

        Raises:
            InvalidRequestError: no cluster token, a bad name or bad quotas, too many tenants.
            ObjectExistsError: the tenant exists.
        """
        self._need_cluster_token()
        name = check_name(name)
        clean = check_quotas({} if quotas is None else quotas)
        async with self._lock:
            if name in self._tenants:
                raise ObjectExistsError(f"tenant {name!r} exists")
            if len(self._tenants) >= MAX_TENANTS:
                raise InvalidRequestError(f"at most {MAX_TENANTS} tenants")
            token = secrets.token_urlsafe(TOKEN_BYTES)
            limits = {t: q for t, q in clean.items() if q is not None}
            tenant = Tenant(name, token_digest(token), limits, self.clock_ms())
            await self._apply({**self._tenants, name: tenant}, name)
        return tenant, token

    async def set_quotas(self, name: str, quotas: object) -> Tenant:
        """Change some of a tenant's quotas: a tier given a number gets that quota, a tier
        given None loses its quota, a tier left out keeps what it had.

        Raises:
            InvalidRequestError: bad quotas.
            KeyNotFoundError: no such tenant.
        """
        changes = check_quotas(quotas, allow_null=True)
        async with self._lock:
            old = self.show(name)
            limits = dict(old.quotas)
            for tier, value in changes.items():
                if value is None:
                    limits.pop(tier, None)
                else:
                    limits[tier] = value
            tenant = Tenant(old.name, old.digest, limits, old.created_ms)
            await self._apply({**self._tenants, name: tenant}, name)
        return tenant

    async def delete(self, name: str) -> Tenant:
        """Forget a tenant: its token stops working at once here (and on the nodes when they
        take the new directory). Its objects are the caller's to remove.

        Raises:
            KeyNotFoundError: no such tenant.
        """
        async with self._lock:
            old = self.show(name)
            await self._apply({n: t for n, t in self._tenants.items() if n != name}, name)
        return old

    async def share(self, digest_hex: object) -> bytes:
        """Mark a namespace shared: from now on every tenant's blocks of it are stored once,
        as named, and every tenant's prompts of it match the one tree. Sharing a namespace
        that is shared changes nothing.

        Returns:
            The namespace's 16-byte digest.

        Raises:
            InvalidRequestError: no cluster token (nothing to share between), not 32 hex
                characters, too many shared namespaces.
        """
        self._need_cluster_token()
        digest = check_namespace_hex(digest_hex)
        async with self._lock:
            if digest in self._shared:
                return digest
            if len(self._shared) >= MAX_SHARED:
                raise InvalidRequestError(f"at most {MAX_SHARED} shared namespaces")
            await self._apply_shared(self._shared | {digest}, digest)
        return digest

    async def unshare(self, digest_hex: object) -> bytes:
        """Make a namespace private again: new stores and lookups by a tenant are in its own
        part of the key space (the blocks stored while shared stay, as the operator's).

        Raises:
            InvalidRequestError: not 32 hex characters.
            KeyNotFoundError: the namespace is not shared.
        """
        digest = check_namespace_hex(digest_hex)
        async with self._lock:
            if digest not in self._shared:
                raise KeyNotFoundError(f"namespace {digest.hex()} is not shared")
            await self._apply_shared(self._shared - {digest}, digest)
        return digest

    async def share_prefix(self, name: object, namespace: object, tokens: object) -> SharedPrefix:
        """Share a leading token range of ``namespace``'s prompts under ``name``: from now on
        the blocks of any tenant's prompt that starts with it (its full blocks) are stored once,
        as named, and every tenant's prompt that starts with it hits them; every later block is
        the writing tenant's own. Sharing the same range under the same name again changes
        nothing.

        Raises:
            InvalidRequestError: no cluster token, a bad name, namespace or tokens, too many
                prefixes or blocks.
            ObjectExistsError: another range is shared under ``name``.
        """
        self._need_cluster_token()
        prefix = SharedPrefix.make(name, namespace, tokens, self.clock_ms())
        async with self._lock:
            old = self._prefixes.get(prefix.name)
            if old is not None:
                if old.keys == prefix.keys:
                    return old
                raise ObjectExistsError(f"shared prefix {prefix.name!r} exists")
            if len(self._prefixes) >= MAX_PREFIXES:
                raise InvalidRequestError(f"at most {MAX_PREFIXES} shared prefixes")
            blocks = sum(p.num_blocks for p in self._prefixes.values()) + prefix.num_blocks
            if blocks > MAX_SHARED_PREFIX_BLOCKS:
                raise InvalidRequestError(
                    f"shared prefixes may hold {MAX_SHARED_PREFIX_BLOCKS} blocks in all;"
                    f" this one would make {blocks}"
                )
            await self._apply_prefixes({**self._prefixes, prefix.name: prefix}, prefix.name)
        return prefix

    async def unshare_prefix(self, name: str) -> SharedPrefix:
        """Make a shared prefix's range private again for new stores and lookups (the blocks
        stored while shared stay, as the operator's).

        Raises:
            KeyNotFoundError: no shared prefix of that name.
        """
        async with self._lock:
            old = self._prefixes.get(name)
            if old is None:
                raise KeyNotFoundError(f"no shared prefix {str(name)[:64]!r}")
            rest = {n: p for n, p in self._prefixes.items() if n != name}
            await self._apply_prefixes(rest, name)
        return old

    async def load(self) -> int:
        """Take the tenants kept in the store (a start, or a new HA leader's term). A record
        that is malformed is logged and skipped.

        Returns:
            How many tenants there are now.
        """
        if self.store is None:
            return len(self._tenants)
        async with self._lock:
            loaded = {t.name: t for t in await self.store.load()}
            shared = frozenset(await self.store.load_shared())
            prefixes = {p.name: p for p in await self.store.load_prefixes()}
            gone = set(self._tenants) - set(loaded)
            self._tenants = loaded
            self._shared = shared
            self._prefixes = prefixes
            self._publish()
        if self.on_change is not None:
            for name in gone:
                self.on_change(name, None)
            for t in loaded.values():
                self.on_change(t.name, dict(t.quotas))
        return len(loaded)

    def apply_quotas(self, call: Callable[[str, dict[str, int] | None], None]) -> None:
        """Call ``call(name, quotas)`` for every tenant (a fresh term's quotas)."""
        for t in self._tenants.values():
            call(t.name, dict(t.quotas))

    # ------------------------------------------------------------------ inside
    def _need_cluster_token(self) -> None:
        if not self.has_cluster_token:
            raise InvalidRequestError("tenants need a cluster token (--token-file)")

    async def _apply(self, tenants: dict[str, Tenant], changed: str) -> None:
        """Keep ``tenants`` (first: a failure changes nothing), then serve with them."""
        if self.store is not None:
            await self.store.write(tenants, changed)
        self._tenants = tenants
        self._publish()
        if self.on_change is not None:
            tenant = tenants.get(changed)
            self.on_change(changed, None if tenant is None else dict(tenant.quotas))

    async def _apply_shared(self, shared: frozenset[bytes], changed: bytes) -> None:
        """Keep ``shared`` (first: a failure changes nothing), then serve with it."""
        if self.store is not None:
            await self.store.write_shared(shared, changed)
        self._shared = shared
        self._publish()

    async def _apply_prefixes(self, prefixes: dict[str, SharedPrefix], changed: str) -> None:
        """Keep ``prefixes`` (first: a failure changes nothing), then serve with them."""
        if self.store is not None:
            await self.store.write_prefixes(prefixes, changed)
        self._prefixes = prefixes
        self._publish()

    def _publish(self) -> None:
        """Replace the directory with a higher version. Versions follow the wall clock where
        it is ahead, so a new leader's directory is newer than the last leader's that the
        nodes hold."""
        version = max(self.directory.version + 1, self.clock_ms())
        by_digest = {t.digest: t.name for t in self._tenants.values()}
        self.directory.replace(by_digest, version, self._shared, self._prefixes.values())
