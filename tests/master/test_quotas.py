"""Tenant quotas in the master: usage kept exact as replicas come and go, a tenant's put over its
quota freeing its own coldest objects (never another's), refusals that change nothing, and the
order of eviction (tenants over their quota first, within it last). In-process, fake clock, stored
tenant keys named directly (as an operator's client does)."""

from __future__ import annotations

from collections import Counter

import pytest

from kvstore.errors import InvalidRequestError, NoSpaceError
from kvstore.master.metrics import MasterMetrics
from kvstore.master.puts import PendingPut
from kvstore.master.service import MasterConfig, MasterService, ServiceSlot
from kvstore.master.tiering import TierConfig
from kvstore.stored_object import ManifestClaim
from kvstore.tenants import owner_of, tenant_key
from kvstore.types import PutTicket, SegmentSpec
from tests.master.fakes import FakeClock
from tests.master.test_metrics import _samples

KIB = 1024
MIB = 1 << 20
OBJ = 64 * KIB


def make(clock: FakeClock, nodes: int = 1, dram: int = MIB, nvme: int = 4 * MIB) -> MasterService:
    svc = MasterService(
        MasterConfig(put_timeout_s=10, node_ttl_s=3, heartbeat_interval_s=1),
        clock,
        clock.wall_ms,
        tiers=TierConfig(lease_s=2.0, promote_after_hits=2),
    )
    for i in range(nodes):
        segs = [SegmentSpec("dram", "dram", dram)]
        if nvme:
            segs.append(SegmentSpec("nvme", "nvme", nvme))
        svc.register(f"n{i}", "127.0.0.1", 9000 + i, bytes([65 + i]) * 32, segs)
    return svc


def key(tenant: str | None, name: str) -> bytes:
    return tenant_key(tenant, name.encode())


def put_batch(svc: MasterService, keys: list[bytes], size: int = OBJ, replicas: int = 1) -> list:
    """put_start then put_end of ``keys``; returns put_start's answers."""
    out = svc.put_start(keys, [size] * len(keys), replicas=replicas)
    ids = [t.put_id for t in out if isinstance(t, PutTicket)]
    assert svc.put_end(ids, [1] * len(ids)) == [None] * len(ids)
    return out


def put(svc: MasterService, k: bytes, size: int = OBJ) -> None:
    (ticket,) = put_batch(svc, [k], size)
    assert isinstance(ticket, PutTicket), ticket


def run_tasks(svc: MasterService, ok: bool = True) -> int:
    """Every node runs what it was handed and reports it (the heartbeat round trip)."""
    count = 0
    for node_id in list(svc.nodes):
        tasks = svc.take_tasks(node_id)
        svc.tasks_done(node_id, [[t["id"], 0 if ok else 402, None] for t in tasks])
        count += len(tasks)
    return count


def tiers_of(svc: MasterService, k: bytes) -> list[str]:
    return sorted(r.tier for r in svc.objects[k].replicas)


def recount(svc: MasterService) -> dict[str, tuple[dict[str, int], dict[str, int], int]]:
    """Per tenant, from the table and the pending puts: (committed bytes per tier, pending
    bytes per tier, objects): what the quotas must say."""
    used: dict[str, Counter[str]] = {}
    pending: dict[str, Counter[str]] = {}
    objects: Counter[str] = Counter()
    for k in list(svc.objects):
        tenant = owner_of(k)
        if tenant is None:
            continue
        objects[tenant] += 1
        for r in svc.objects.peek(k).replicas:  # type: ignore[union-attr]
            used.setdefault(tenant, Counter())[r.tier] += r.size
    for put_id, rec in svc.pending.items():
        put = PendingPut.of(put_id, rec)
        tenant = owner_of(put.key)
        for r in put.replicas if tenant is not None else ():
            pending.setdefault(tenant, Counter())[r.tier] += r.size
    for task in svc.tasks.by_id.values():
        tenant = owner_of(task.key)
        if tenant is not None:
            pending.setdefault(tenant, Counter())[task.dst.tier] += task.dst.size
    names = set(used) | set(pending) | set(objects)
    return {
        t: (
            {tier: used.get(t, Counter())[tier] for tier in ("hbm", "dram", "nvme")},
            {tier: pending.get(t, Counter())[tier] for tier in ("hbm", "dram", "nvme")},
            objects[t],
        )
        for t in names
    }


def check_exact(svc: MasterService) -> None:
    want = recount(svc)
    for tenant in set(want) | set(svc.quotas.tenants()):
        used, pending, objects = want.get(tenant, ({}, {}, 0))
        fig = svc.quotas.describe(tenant)
        assert {t: v for t, v in fig["used_bytes"].items() if v} == {  # type: ignore[attr-defined]
            t: v for t, v in used.items() if v
        }, tenant
        assert {t: v for t, v in fig["pending_bytes"].items() if v} == {  # type: ignore[attr-defined]
            t: v for t, v in pending.items() if v
        }, tenant
        assert fig["num_objects"] == objects, tenant


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


# ---------------------------------------------------------------- the book of quotas
def test_quotas_are_checked_and_replaced_whole(clock: FakeClock) -> None:
    q = make(clock).quotas
    for bad in ({"tape": 1}, {"dram": -1}, {"dram": 1.5}, {"dram": True}, ["dram"]):
        with pytest.raises(InvalidRequestError):
            q.set_tenant("acme", bad)  # type: ignore[arg-type]
    with pytest.raises(InvalidRequestError):
        q.set_tenant("Not A Name", {"dram": 1})
    q.set_tenant("acme", {"dram": MIB, "nvme": 4 * MIB})
    q.set_tenant("acme", {"dram": 2 * MIB})
    assert q.describe("acme")["quotas"] == {"dram": 2 * MIB}
    assert q.limit("acme", "nvme") is None, "a tier left out is unlimited"
    q.drop_tenant("acme")
    assert q.describe("acme")["quotas"] == {} and not q.limited
    assert q.usage("nobody") == {"hbm": 0, "dram": 0, "nvme": 0, "shared": 0}


# ---------------------------------------------------------------- usage kept exact
def test_usage_follows_puts_overwrites_removes_revokes_and_timeouts(clock: FakeClock) -> None:
    svc = make(clock, nodes=2)
    a = [key("acme", f"k{i}") for i in range(6)]
    put_batch(svc, a[:3])
    put_batch(svc, [a[3]], replicas=2)
    put_batch(svc, [key(None, "plain")])
    check_exact(svc)
    assert svc.quotas.usage("acme")["dram"] == 5 * OBJ
    assert svc.quotas.describe("acme")["num_objects"] == 4
    put_batch(svc, [a[0]], size=OBJ // 2)  # an overwrite: the old version's bytes go
    check_exact(svc)
    assert svc.remove([a[1]]) == [None]
    check_exact(svc)
    pending = svc.put_start([a[4], a[5]], [OBJ, OBJ])
    check_exact(svc)
    assert svc.quotas.charged("acme", "dram") == 3 * OBJ + OBJ // 2 + 2 * OBJ
    svc.put_revoke([pending[0].put_id])  # type: ignore[union-attr]
    check_exact(svc)
    clock.now += 11
    assert svc.reclaim_expired_puts() == 1
    check_exact(svc)
    assert svc.quotas.usage("acme")["dram"] == 3 * OBJ + OBJ // 2
    assert svc.quotas.usage("nobody") == {"hbm": 0, "dram": 0, "nvme": 0, "shared": 0}


def test_usage_follows_demotions_promotions_and_a_node_s_death(clock: FakeClock) -> None:
    svc = make(clock, nodes=2, dram=512 * KIB, nvme=2 * MIB)
    a = [key("acme", f"k{i}") for i in range(18)]
    for k in a:  # past the DRAM watermarks of both nodes: the tick demotes
        clock.now += 1
        put(svc, k)
    check_exact(svc)
    clock.now += 10
    svc.tick()
    assert svc.tasks.by_id, "the watermark demotes"
    check_exact(svc)  # a move in flight counts where it goes, not yet where it is
    assert run_tasks(svc)
    check_exact(svc)
    nvme_only = next(k for k in a if tiers_of(svc, k) == ["nvme"])
    for _ in range(2):
        clock.now += 10
        svc.get_locations([nvme_only])
    assert svc.tasks.by_id, "read twice: promoted"
    check_exact(svc)
    run_tasks(svc, ok=False)  # a failed move changes nothing
    check_exact(svc)
    clock.now += 100
    svc.expire_nodes()  # both nodes silent: declared dead, their replicas gone
    assert not svc.nodes
    check_exact(svc)
    assert svc.quotas.usage("acme") == {"hbm": 0, "dram": 0, "nvme": 0, "shared": 0}


# ---------------------------------------------------------------- a tenant over its quota
def test_a_put_over_the_quota_demotes_the_tenant_s_own_coldest_first(clock: FakeClock) -> None:
    svc = make(clock)
    svc.quotas.set_tenant("acme", {"dram": 4 * OBJ})
    svc.quotas.set_tenant("bee", {"dram": 4 * OBJ})
    b = [key("bee", f"b{i}") for i in range(4)]
    a = [key("acme", f"a{i}") for i in range(4)]
    for k in [*b, *a]:  # bee's are the oldest in DRAM
        clock.now += 1
        put(svc, k)
    clock.now += 10
    svc.get_locations([a[0]])  # acme's a0 is now its most recent
    clock.now += 10
    put(svc, key("acme", "new"))
    assert svc.tasks.by_id, "acme's coldest object is being demoted"
    run_tasks(svc)
    assert tiers_of(svc, a[1]) == ["nvme"], "acme's least recently used object went"
    assert all(tiers_of(svc, k) == ["dram"] for k in [a[0], a[2], a[3], *b])
    assert svc.quotas.usage("acme")["dram"] == 4 * OBJ
    assert svc.quotas.describe("acme")["num_demotions"] == 1
    check_exact(svc)


def test_a_tenant_writing_five_times_its_quota_leaves_another_s_share_alone(
    clock: FakeClock,
) -> None:
    """acme writes 5x its DRAM quota in batches while bee holds a working set within its own:
    bee loses nothing, and acme's DRAM usage never exceeds its quota by more than one batch."""
    svc = make(clock, dram=MIB, nvme=2 * MIB)
    quota, batch = 4 * OBJ, 2
    svc.quotas.set_tenant("acme", {"dram": quota})
    svc.quotas.set_tenant("bee", {"dram": 4 * OBJ})
    working = [key("bee", f"b{i}") for i in range(4)]
    put_batch(svc, working)
    written: list[bytes] = []
    for n in range(5 * quota // OBJ // batch):
        clock.now += 1
        keys = [key("acme", f"a{n}-{i}") for i in range(batch)]
        answers = put_batch(svc, keys)
        assert all(isinstance(t, PutTicket) for t in answers), answers
        written += keys
        assert svc.quotas.usage("acme")["dram"] <= quota + batch * OBJ
        assert svc.quotas.charged("acme", "dram") <= quota
        run_tasks(svc)  # the node reports its moves at its next heartbeat
        svc.tick()
        run_tasks(svc)
        assert svc.quotas.usage("acme")["dram"] <= quota
        clock.now += 1
        svc.get_locations(working)  # bee keeps using its working set
        check_exact(svc)
    assert all(tiers_of(svc, k) == ["dram"] for k in working), "bee lost nothing"
    assert svc.quotas.describe("bee")["num_evictions"] == 0
    assert svc.quotas.describe("bee")["num_demotions"] == 0
    in_dram = {k for k in written if k in svc.objects and tiers_of(svc, k) == ["dram"]}
    assert in_dram == set(written[-len(in_dram) :]), "acme's newest stay in DRAM, oldest went"


def test_a_put_that_cannot_get_under_the_quota_is_refused_and_changes_nothing(
    clock: FakeClock,
) -> None:
    svc = make(clock)
    svc.quotas.set_tenant("acme", {"dram": 2 * OBJ})
    a = [key("acme", "a0"), key("acme", "a1")]
    put_batch(svc, a)
    svc.get_locations(a)  # leased: acme has nothing it may free now
    before = (svc.quotas.describe("acme"), len(svc.pending), dict(svc.tasks.by_id))
    answers = svc.put_start([key("acme", "a2"), key("acme", "a3")], [OBJ, OBJ])
    assert all(isinstance(r, NoSpaceError) for r in answers)
    message = str(answers[0])
    assert "acme" in message and "dram" in message
    after = svc.quotas.describe("acme")
    assert after["num_refused_puts"] == 1, "one refusal per batch and tier"
    assert (after | {"num_refused_puts": 0}, len(svc.pending), dict(svc.tasks.by_id)) == before
    assert all(tiers_of(svc, k) == ["dram"] for k in a)
    # Another tenant and the operator still write.
    put(svc, key("bee", "b0"))
    put(svc, key(None, "plain"))
    clock.now += 10  # the leases end: acme's own object now goes for its next put
    put(svc, key("acme", "a2"))
    run_tasks(svc)
    assert svc.quotas.usage("acme")["dram"] == 2 * OBJ


def test_a_quota_never_takes_another_tenant_s_object_even_with_the_lower_tier_full(
    clock: FakeClock,
) -> None:
    svc = make(clock, dram=512 * KIB, nvme=256 * KIB)
    svc.quotas.set_tenant("acme", {"dram": 2 * OBJ})
    others = [key("bee", f"b{i}") for i in range(4)] + [key(None, f"p{i}") for i in range(4)]
    put_batch(svc, others[:4])  # DRAM: 4 of bee's
    put_batch(svc, others[4:])  # the operator's fill NVMe... and DRAM
    a = [key("acme", "a0"), key("acme", "a1")]
    put_batch(svc, a)
    clock.now += 10
    for i in range(4):
        clock.now += 1
        put(svc, key("acme", f"n{i}"))
        run_tasks(svc)
    assert all(k in svc.objects for k in others), "nobody else's object went for acme's quota"
    assert svc.quotas.usage("acme")["dram"] <= 2 * OBJ
    check_exact(svc)


def test_in_a_full_cluster_a_tenant_at_its_quota_frees_its_own_before_anyone_s(
    clock: FakeClock,
) -> None:
    """The cluster is full, so placement would evict: a tenant at its quota must not have
    another's object evicted for it, neither for a put that then goes in nor for one refused."""
    svc = make(clock, dram=16 * OBJ, nvme=0)
    svc.quotas.set_tenant("acme", {"dram": 2 * OBJ})
    a = [key("acme", "a0"), key("acme", "a1")]
    p = [key(None, f"p{i}") for i in range(14)]
    for k in [*p, *a]:  # the operator's are the least recently used
        clock.now += 1
        put(svc, k)
    svc.get_locations(a)  # leased: acme has nothing it may free
    (refused,) = svc.put_start([key("acme", "a2")], [OBJ])
    assert isinstance(refused, NoSpaceError) and "acme" in str(refused)
    assert all(k in svc.objects for k in [*p, *a]), "nothing went for a refused put"
    assert svc.tiering.num_sync_evictions == 0
    clock.now += 10  # the leases end
    put(svc, key("acme", "a2"))
    assert a[0] not in svc.objects, "acme's own least recent went"
    assert all(k in svc.objects for k in p), "nobody else's"
    put(svc, key("bee", "b0"))  # without a quota: today's order, the operator's oldest
    assert p[0] not in svc.objects and a[1] in svc.objects
    check_exact(svc)


def test_promotion_respects_the_quota_of_the_tier_it_goes_to(clock: FakeClock) -> None:
    svc = make(clock, dram=MIB, nvme=2 * MIB)
    svc.quotas.set_tenant("acme", {"dram": 2 * OBJ})
    a = [key("acme", f"a{i}") for i in range(4)]
    for k in a:
        clock.now += 1
        put(svc, k)
        run_tasks(svc)
    cold = [k for k in a if tiers_of(svc, k) == ["nvme"]]
    assert len(cold) == 2
    for _ in range(3):
        clock.now += 10
        svc.get_locations(cold)
    assert not svc.tasks.by_id, "acme is at its DRAM quota: nothing moves up"
    svc.quotas.set_tenant("acme", {"dram": 4 * OBJ})
    clock.now += 10
    svc.get_locations(cold)
    assert len(svc.tasks.by_id) == 2


def test_a_tenant_at_its_quota_frees_a_margin_so_the_next_puts_rank_nothing(
    clock: FakeClock,
) -> None:
    """Past its quota, a tenant frees down to the tier's low watermark's share of it (the
    tier manager's hysteresis), so a tenant writing steadily ranks its objects once in a while,
    not on every batch."""
    svc = make(clock, dram=4 * MIB, nvme=4 * MIB)
    quota = 20 * OBJ  # its margin (1 - 0.8/0.9 of it) is two objects and a bit
    svc.quotas.set_tenant("acme", {"dram": quota})
    for i in range(20):
        clock.now += 1
        put(svc, key("acme", f"a{i}"))
    clock.now += 10
    put(svc, key("acme", "n0"))
    assert len(svc.tasks.by_id) == 3, "one for the put, two for the margin"
    run_tasks(svc)
    put(svc, key("acme", "n1"))
    put(svc, key("acme", "n2"))
    assert not svc.tasks.by_id, "within the margin: nothing ranked, nothing moved"
    assert svc.quotas.usage("acme")["dram"] == quota
    check_exact(svc)


def test_usage_comes_back_with_a_node_s_manifest(clock: FakeClock) -> None:
    svc = make(clock)
    svc.quotas.set_tenant("acme", {"nvme": MIB})
    fresh = svc.next_term()
    fresh.register("n0", "127.0.0.1", 9000, b"A" * 32, [SegmentSpec("nvme", "nvme", 4 * MIB)])
    claims = [
        ManifestClaim("nvme", 7, key("acme", "a"), 100, 5, 1),
        ManifestClaim("nvme", 8, key(None, "p"), 10, 5, 1),
    ]
    assert fresh.admit_manifest("n0", claims).num_admitted == 2
    assert fresh.quotas.usage("acme")["nvme"] == 100
    assert fresh.quotas.limit("acme", "nvme") == MIB
    check_exact(fresh)


# ---------------------------------------------------------------- the order of eviction
def test_eviction_takes_tenants_over_quota_first_and_within_quota_last(clock: FakeClock) -> None:
    svc = make(clock, dram=16 * OBJ, nvme=0)  # one tier: every eviction deletes
    svc.quotas.set_tenant("bee", {"dram": 4 * OBJ})
    b = [key("bee", f"b{i}") for i in range(4)]
    c = [key("cat", f"c{i}") for i in range(3)]
    p = [key(None, f"p{i}") for i in range(9)]
    for k in [*b, *c, *p]:  # bee's are the oldest
        clock.now += 1
        put(svc, k)
    svc.quotas.set_tenant("cat", {"dram": OBJ})  # cat is now over its quota
    clock.now += 10
    put(svc, key(None, "n0"))
    put(svc, key(None, "n1"))
    assert c[0] not in svc.objects and c[1] not in svc.objects, "over their quota: first"
    assert c[2] in svc.objects, "back within its quota: last"
    assert all(k in svc.objects for k in [*b, *p])
    put(svc, key(None, "n2"))
    assert p[0] not in svc.objects, "then objects of no tenant (least recent first)"
    assert all(k in svc.objects for k in b), "bee, within its quota, keeps its share"
    assert svc.quotas.describe("cat")["num_evictions"] == 2
    check_exact(svc)


@pytest.mark.parametrize("other_quota", [False, True])
def test_a_tenant_without_quota_and_the_operator_evict_as_before(
    clock: FakeClock, other_quota: bool
) -> None:
    """The order test_tiering's sync eviction checks, for a mix of the operator's keys and a
    tenant's without quota, with and without some other tenant's quota set."""
    svc = make(clock, dram=256 * KIB, nvme=512 * KIB)
    if other_quota:
        svc.quotas.set_tenant("acme", {"dram": OBJ})
    keys = [key("free" if i % 2 else None, f"k{i}") for i in range(12)]
    for k in keys:  # 4 in DRAM, 8 in NVMe: both full
        clock.now += 1
        put(svc, k)
    clock.now += 10
    svc.get_locations([keys[4]])
    clock.now += 10
    put(svc, key("free", "new"))
    put(svc, key(None, "new"))
    assert keys[4] in svc.objects
    assert keys[5] not in svc.objects and keys[6] not in svc.objects
    assert svc.tiering.num_sync_evictions == 2
    check_exact(svc)


# ---------------------------------------------------------------- terms, reads, metrics
def test_quotas_and_counters_carry_into_the_next_term(clock: FakeClock) -> None:
    svc = make(clock)
    svc.quotas.set_tenant("acme", {"dram": MIB})
    put(svc, key("acme", "a"))
    svc.get_locations([key("acme", "a"), key("acme", "gone")])
    fresh = svc.next_term()
    assert fresh.quotas.limit("acme", "dram") == MIB
    assert fresh.quotas.describe("acme")["num_hits"] == 1
    assert fresh.quotas.usage("acme")["dram"] == 0, "usage comes back with the manifests"


def test_hits_and_misses_per_tenant(clock: FakeClock) -> None:
    svc = make(clock)
    put_batch(svc, [key("acme", "a"), key("bee", "b"), key(None, "p")])
    svc.get_locations([key("acme", "a"), key("acme", "x"), key("acme", "y")])  # one tenant
    # The operator's mixed batch: counted key by key (it starts or ends with a tenant's key).
    svc.get_locations([key("bee", "b"), key(None, "p"), key("acme", "z"), key(None, "q")])
    svc.get_locations([key(None, "p")])
    acme, bee = svc.quotas.describe("acme"), svc.quotas.describe("bee")
    assert (acme["num_hits"], acme["num_misses"]) == (1, 3)
    assert (bee["num_hits"], bee["num_misses"]) == (1, 0)


def test_metrics_show_each_tenant(clock: FakeClock) -> None:
    svc = make(clock, dram=16 * OBJ, nvme=0)
    svc.quotas.set_tenant("acme", {"dram": 2 * OBJ})
    put_batch(svc, [key("acme", "a0"), key("acme", "a1")])
    put(svc, key("bee", "b"))
    svc.get_locations([key("acme", "a0"), key("acme", "nope")])
    clock.now += 10
    put(svc, key("acme", "a2"))  # over its quota, one tier: its coldest is deleted
    got = _samples(MasterMetrics(ServiceSlot(svc)))
    a, b = (("tenant", "acme"),), (("tenant", "bee"),)
    assert got[("kvstore_tenant_used_bytes", (("tenant", "acme"), ("tier", "dram")))] == 2 * OBJ
    assert got[("kvstore_tenant_used_bytes", (("tenant", "bee"), ("tier", "dram")))] == OBJ
    assert got[("kvstore_tenant_quota_bytes", (("tenant", "acme"), ("tier", "dram")))] == 2 * OBJ
    assert ("kvstore_tenant_quota_bytes", (("tenant", "bee"), ("tier", "dram"))) not in got
    assert got[("kvstore_tenant_objects", a)] == 2 and got[("kvstore_tenant_objects", b)] == 1
    assert got[("kvstore_tenant_evictions_total", a)] == 1
    assert got[("kvstore_tenant_hits_total", a)] == 1
    assert got[("kvstore_tenant_misses_total", a)] == 1
    assert got[("kvstore_tenant_refused_puts_total", b)] == 0
