"""Tenant quotas: bytes per tenant per tier, and each tenant's usage kept exact as replicas come
and go.

A tenant's objects are the stored keys in its part of the key space (``kvstore.tenants``:
:func:`~kvstore.tenants.owner_of`); keys of no tenant (the operator's) are never counted here,
and cost the owners that call in one comparison each (:data:`TENANT_END`).

**Moves.** A move of a tenant's replica *into* a tier counts against its quota there as a put's
bytes do (pending while the copy is in flight, :meth:`TenantQuotas.move_started`, committed once
it lands) and asks that quota first (:meth:`TenantQuotas.has_room`):

- a **promotion** goes up only where the quota takes it (else it does not happen: the object
  stays where it is);
- a watermark's **demotion** goes to the next lower tier whose quota takes it, skipping full
  quotas downwards; a **re-replication** (after a node loss) and a **drain** copy into the best
  tier whose quota takes it, on any node (a drain's copy into its source's tier takes nothing
  more there: its source leaves as a demotion's does);
- where no tier's quota takes it, a demotion, a re-replication or a drain **still happens**, into
  the tier it would have taken without quotas, and is counted there: the rule is that nothing
  acknowledged is lost, so no copy is ever dropped (and no last copy left unrepaired) for a
  quota. The tenant is then over its quota there: first in line for eviction in that tier, and
  its next put there frees its own objects first.

Why the figures are kept as replicas change, not counted when asked: a put of a tenant over its
quota must know its usage at once, and a scan of the table per put is what the master cannot
afford. So the owners report every change where it happens:

- **committed** bytes per tenant and tier: ``Space.attach`` (a commit, a finished move or copy,
  an admitted manifest) adds a replica, ``Space.release`` (any way a committed replica goes)
  takes it away (``Space.forget_node`` takes a dropped node's replicas away at once);
- **pending** bytes: ``Puts`` adds what a put allocates and takes it away when the put commits,
  is revoked or times out (a tenant's puts in flight count against its quota, so concurrent
  batches cannot each pass the same check);
- **leaving** bytes: demotions in flight (``TierManager``): the bytes leave their tier once the
  node reports the move, and counting them as gone meanwhile keeps a second put from demoting
  them again (the tier manager's watermarks do the same); a move's new bytes count as pending
  in the tier it goes to until then.

A quota only limits a tenant's puts and orders eviction; this module decides nothing: the tier
manager frees a tenant's own coldest objects when a put would take it over a quota, and ranks
eviction victims by :meth:`TenantQuotas.standing` (tenants over a quota first, tenants within one
last). A tier a tenant has no quota for is unlimited for it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from kvstore.errors import InvalidRequestError
from kvstore.master.tasks import PURPOSE_DEMOTE, PURPOSE_DRAIN
from kvstore.tenants import MARK, check_name, owner_of, prefix_of
from kvstore.types import TIER_RANK

__all__ = ["NEUTRAL", "OVER", "TENANT_END", "WITHIN", "TenantQuotas"]

#: Every stored key of a tenant sorts below this (it starts with ``MARK``, a NUL byte), and so
#: does only the empty key besides: ``key < TENANT_END`` is the one check the owners make per
#: key before asking :func:`~kvstore.tenants.owner_of` (a comparison, cheaper than a slice).
TENANT_END = b"\x01"
assert MARK < TENANT_END and len(MARK) == 1

#: Eviction classes of a tenant in a tier (:meth:`TenantQuotas.standing`): victims are taken
#: from the lowest class first.
OVER, NEUTRAL, WITHIN = 0, 1, 2


def check_limits(limits: object) -> dict[str, int]:
    """Quota bytes per tier, checked.

    Raises:
        InvalidRequestError: not a map of known tiers to non-negative integers.
    """
    if not isinstance(limits, Mapping):
        raise InvalidRequestError("quotas must be a map of tier to bytes")
    clean: dict[str, int] = {}
    for tier, value in limits.items():
        if tier not in TIER_RANK:
            raise InvalidRequestError(f"unknown tier {tier!r} in quotas; known: {list(TIER_RANK)}")
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise InvalidRequestError(f"the {tier} quota must be bytes >= 0, got {value!r}")
        clean[tier] = value
    return clean


class _Tenant:
    """One tenant's figures (made on its first byte or its first quota)."""

    __slots__ = (
        "limits",
        "used",
        "pending",
        "leaving",
        "keys",
        "num_objects",
        "num_evictions",
        "num_demotions",
        "num_hits",
        "num_misses",
        "num_refused",
        "num_prompt_tokens",
        "num_served_tokens",
    )

    def __init__(self) -> None:
        self.limits: dict[str, int] = {}
        self.used: dict[str, int] = dict.fromkeys(TIER_RANK, 0)
        self.pending: dict[str, int] = dict.fromkeys(TIER_RANK, 0)
        self.leaving: dict[str, int] = dict.fromkeys(TIER_RANK, 0)
        # Per tier, key -> replicas of it there: where the tenant's own victims are looked for
        # (only its objects in that tier, never a walk over the tier's segments).
        self.keys: dict[str, dict[bytes, int]] = {t: {} for t in TIER_RANK}
        self.num_objects = 0
        self.num_evictions = 0
        self.num_demotions = 0
        self.num_hits = 0
        self.num_misses = 0
        self.num_refused = 0
        #: Tokens of the prompts the tenant located for loading, and those found in the pool.
        self.num_prompt_tokens = 0
        self.num_served_tokens = 0

    def idle(self) -> bool:
        """Nothing to remember: no quota, no bytes, no counts (a dropped tenant's figures go)."""
        return not (
            self.limits
            or self.num_objects
            or any(self.pending.values())
            or any(self.leaving.values())
            or self.num_evictions
            or self.num_demotions
            or self.num_hits
            or self.num_misses
            or self.num_refused
            or self.num_prompt_tokens
        )


class TenantQuotas:
    """Quotas and usage per tenant per tier, for one master term.

    Single-threaded, as the service that owns it.
    """

    def __init__(self) -> None:
        self._tenants: dict[str, _Tenant] = {}
        #: Tenants with at least one quota: while empty, eviction ranks as it did before tenants.
        self.limited: dict[str, dict[str, int]] = {}

    def _of(self, tenant: str) -> _Tenant:
        t = self._tenants.get(tenant)
        if t is None:
            t = self._tenants[tenant] = _Tenant()
        return t

    # ================================================================ quotas
    def set_tenant(self, name: str, limits: Mapping[str, int]) -> None:
        """Set ``name``'s quotas (bytes per tier), replacing all earlier ones; a tier left out
        is unlimited. A quota below the usage takes effect at the tenant's next put and in the
        order of eviction; nothing is freed at once.

        Raises:
            InvalidRequestError: a bad name, an unknown tier or a negative quota.
        """
        check_name(name)
        clean = check_limits(limits)
        self._of(name).limits = clean
        if clean:
            self.limited[name] = clean
        else:
            self.limited.pop(name, None)

    def drop_tenant(self, name: str) -> None:
        """Forget ``name``'s quotas; its objects, while any are left, still count as its usage."""
        t = self._tenants.get(name)
        self.limited.pop(name, None)
        if t is None:
            return
        t.limits = {}
        if t.idle():
            del self._tenants[name]

    def carry_over(self, earlier: TenantQuotas) -> None:
        """Take ``earlier``'s quotas and counters (a new master term; usage is rebuilt as the
        nodes' manifests are admitted)."""
        for name, t in earlier._tenants.items():
            mine = self._of(name)
            mine.limits = dict(t.limits)
            mine.num_evictions, mine.num_demotions = t.num_evictions, t.num_demotions
            mine.num_hits, mine.num_misses = t.num_hits, t.num_misses
            mine.num_refused = t.num_refused
            mine.num_prompt_tokens, mine.num_served_tokens = (
                t.num_prompt_tokens,
                t.num_served_tokens,
            )
        self.limited = {n: dict(lim) for n, lim in earlier.limited.items()}

    def limit(self, tenant: str, tier: str) -> int | None:
        """``tenant``'s quota in ``tier`` (None: unlimited)."""
        limits = self.limited.get(tenant)
        return None if limits is None else limits.get(tier)

    # ================================================================ figures
    def usage(self, name: str) -> dict[str, int]:
        """Committed bytes of ``name`` per tier (every replica counts)."""
        t = self._tenants.get(name)
        return dict.fromkeys(TIER_RANK, 0) if t is None else dict(t.used)

    def charged(self, tenant: str, tier: str) -> int:
        """What a put of ``tenant`` is checked against in ``tier``: committed bytes, plus puts
        in flight, less demotions in flight."""
        t = self._tenants.get(tenant)
        if t is None:
            return 0
        return t.used[tier] + t.pending[tier] - t.leaving[tier]

    def describe(self, name: str) -> dict[str, object]:
        """Quotas, usage and counts of ``name``, for the admin API."""
        t = self._tenants.get(name) or _Tenant()
        return {
            "tenant": name,
            "quotas": dict(t.limits),
            "used_bytes": dict(t.used),
            "pending_bytes": dict(t.pending),
            "leaving_bytes": dict(t.leaving),
            "num_objects": t.num_objects,
            "num_evictions": t.num_evictions,
            "num_demotions": t.num_demotions,
            "num_hits": t.num_hits,
            "num_misses": t.num_misses,
            "num_refused_puts": t.num_refused,
            "num_prompt_tokens": t.num_prompt_tokens,
            "num_served_tokens": t.num_served_tokens,
        }

    def has_usage(self) -> bool:
        """Whether any tenant has figures (without tenants, a dropped node is not walked)."""
        return bool(self._tenants)

    def tenants(self) -> list[str]:
        """Every tenant with a quota or figures, sorted."""
        return sorted(self._tenants)

    def standing(self, tier: str) -> dict[str, int]:
        """Per tenant with a quota in ``tier``, its eviction class there: :data:`OVER` its
        quota or :data:`WITHIN` it (a tenant left out is :data:`NEUTRAL`)."""
        out: dict[str, int] = {}
        for name, limits in self.limited.items():
            quota = limits.get(tier)
            if quota is not None:
                out[name] = OVER if self.charged(name, tier) > quota else WITHIN
        return out

    def has_room(self, tenant: str, tier: str, size: int) -> bool:
        """Whether ``tenant``'s quota in ``tier`` takes ``size`` more bytes (no quota: yes)."""
        quota = self.limit(tenant, tier)
        return quota is None or self.charged(tenant, tier) + size <= quota

    def keys_in(self, tenant: str, tier: str) -> list[bytes]:
        """``tenant``'s keys with a replica in ``tier`` (a copy: the caller may free them)."""
        t = self._tenants.get(tenant)
        return [] if t is None else list(t.keys[tier])

    # ================================================================ changes (the owners call)
    def attached(self, key: bytes, tier: str, size: int) -> None:
        """A committed replica of ``key`` (a tenant's: its first byte is ``MARK``) is held."""
        tenant = owner_of(key)
        if tenant is None:
            return
        t = self._of(tenant)
        t.used[tier] += size
        keys = t.keys[tier]
        n = keys.get(key, 0)
        if not n and not any(key in k for k in t.keys.values()):
            t.num_objects += 1
        keys[key] = n + 1

    def detached(self, key: bytes, tier: str, size: int) -> None:
        """A committed replica of ``key`` (a tenant's) is no longer held."""
        tenant = owner_of(key)
        t = self._tenants.get(tenant) if tenant is not None else None
        if t is None:
            return
        t.used[tier] -= size
        keys = t.keys[tier]
        n = keys.get(key, 0)
        if n > 1:
            keys[key] = n - 1
        elif n:
            del keys[key]
            if not any(key in k for k in t.keys.values()):
                t.num_objects -= 1

    def pend(self, tenant: str, tiers: Iterable[str], size: int) -> None:
        """A put of ``tenant`` allocated ``size`` bytes in each of ``tiers``."""
        t = self._of(tenant)
        for tier in tiers:
            t.pending[tier] += size

    def unpend(self, key: bytes, tiers: Iterable[str], size: int) -> None:
        """A put of ``key`` (a tenant's) ended: committed, revoked or timed out."""
        tenant = owner_of(key)
        t = self._tenants.get(tenant) if tenant is not None else None
        if t is None:
            return
        for tier in tiers:
            t.pending[tier] -= size

    def move_started(self, key: bytes, src: str, dst: str, size: int, purpose: str) -> None:
        """A move or copy of a replica of ``key`` (a tenant's) from tier ``src`` to ``dst`` was
        handed out: its new bytes count as being written in ``dst``, and a demotion's or a
        drain's (the source replica goes once it lands) as leaving ``src``."""
        tenant = owner_of(key)
        if tenant is None:
            return
        t = self._of(tenant)
        t.pending[dst] += size
        if purpose in (PURPOSE_DEMOTE, PURPOSE_DRAIN):
            t.leaving[src] += size

    def move_ended(
        self, key: bytes, src: str, dst: str, size: int, purpose: str, moved: bool
    ) -> None:
        """That move settled (``moved``: the replica now lives in ``dst``)."""
        tenant = owner_of(key)
        t = self._tenants.get(tenant) if tenant is not None else None
        if t is None:
            return
        t.pending[dst] -= size
        if purpose in (PURPOSE_DEMOTE, PURPOSE_DRAIN):
            t.leaving[src] -= size
        if moved and purpose == PURPOSE_DEMOTE:
            t.num_demotions += 1

    def evicted(self, key: bytes) -> None:
        """A replica of ``key`` was deleted by eviction (counted for its tenant)."""
        tenant = owner_of(key)
        if tenant is not None:
            self._of(tenant).num_evictions += 1

    def refused(self, tenant: str) -> None:
        """A put of ``tenant`` was refused for its quota."""
        self._of(tenant).num_refused += 1

    def count_prompt(self, tenant: str, num_tokens: int, num_served: int) -> None:
        """A prompt of ``tenant`` located for loading: ``num_served`` of its ``num_tokens``
        tokens were found in the pool."""
        t = self._of(tenant)
        t.num_prompt_tokens += num_tokens
        t.num_served_tokens += num_served

    def count_reads(self, keys: Sequence[bytes], found: list[object]) -> None:
        """Hits and misses of a read batch with tenant keys: a batch of one tenant's keys (a
        tenant's connection sends only those) is counted once; a mixed one (the operator's)
        key by key."""
        first, last = keys[0], keys[-1]
        tenant = owner_of(first)
        if tenant is not None and last.startswith(prefix_of(tenant)):
            t = self._of(tenant)
            misses = found.count(None)
            t.num_misses += misses
            t.num_hits += len(keys) - misses
            return
        for key, obj in zip(keys, found, strict=True):
            if key[:1] == MARK and (owner := owner_of(key)) is not None:
                t = self._of(owner)
                if obj is None:
                    t.num_misses += 1
                else:
                    t.num_hits += 1
