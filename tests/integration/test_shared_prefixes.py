"""Shared prefixes on a real cluster (two nodes, two tenants and the operator): a system prompt
the operator shares is stored once and hit by every tenant, while every block after it stays the
writing tenant's own; a prompt that leaves the range mid-way hits only the blocks before; only
the operator may share, and bad input changes nothing."""

from __future__ import annotations

import numpy as np
import pytest

from kvstore.client import Client, KVCache
from kvstore.tenants import prefix_of
from tests.integration.test_shared_namespaces import empty_kv, pool, status_of  # noqa: F401
from tests.integration.test_tenants import BS, SECRET, admin, make_kv, ns
from tests.support import Cluster, admin_text

PREFIXES = "/api/v1/shared-prefixes"
#: The system prompt: three full blocks and five tokens (the partial block is not shared).
SYSTEM = np.arange(1000, 1000 + 3 * BS + 5)


def share(cluster: Cluster, name: str = "system", tokens: np.ndarray = SYSTEM) -> dict:
    body = {"namespace": ns().to_dict(), "tokens": tokens.tolist()}
    return admin(cluster, "PUT", f"{PREFIXES}/{name}", body)


def tenant_counter(cluster: Cluster, family: str, tenant: str) -> int:
    """A per-tenant counter of the master's ``/metrics`` (0 before its first count)."""
    text = admin_text(cluster.admin + "/metrics", SECRET)
    want = f'{family}_total{{tenant="{tenant}"}}'
    return next((int(float(ln.split()[-1])) for ln in text.splitlines() if ln.startswith(want)), 0)


def continuation(start: int, blocks: int) -> np.ndarray:
    return np.concatenate([SYSTEM[: 3 * BS], np.arange(start, start + blocks * BS)])


def test_a_shared_system_prompt_is_hit_by_every_tenant_and_nothing_after_it(pool) -> None:  # noqa: F811
    cluster, token_a, token_b = pool
    reply = share(cluster)
    assert reply["num_tokens"] == 3 * BS and reply["num_blocks"] == 3
    assert reply["namespace"] == ns().digest.hex() and reply["nodes_pending"] == []
    listed = admin(cluster, "GET", PREFIXES)["prefixes"]
    assert [(p["name"], p["num_blocks"]) for p in listed] == [("system", 3)]
    prompt_a, prompt_b = continuation(5000, 2), continuation(9000, 1)
    with (
        Client.connect(cluster.address, token=token_a) as a,
        Client.connect(cluster.address, token=token_b) as b,
        Client.connect(cluster.address, token=SECRET) as op,
    ):
        kv_a, kv_b = KVCache(a, ns()), KVCache(b, ns())
        kv = make_kv(len(prompt_a), 1)
        assert kv_a.store(prompt_a, kv) == 5 * BS
        # B hits the system prompt A stored, and loads A's bytes of it, bit for bit ...
        assert kv_b.lookup(prompt_a) == 3 * BS
        out = empty_kv(3 * BS)
        assert kv_b.load(prompt_a[: 3 * BS], out) == 3 * BS
        for (k, v), (k_out, v_out) in zip(kv, out, strict=True):
            assert k[: 3 * BS].tobytes() == k_out.tobytes()
            assert v[: 3 * BS].tobytes() == v_out.tobytes()
        # The pool served B those prompt tokens (a lookup is no serving: only the load counts).
        assert tenant_counter(cluster, "kvstore_tenant_prompt_tokens_served", "bolt") == 3 * BS
        assert tenant_counter(cluster, "kvstore_tenant_prompt_tokens", "bolt") == 3 * BS
        # ... but never A's continuation of it: B stores its own after the shared blocks.
        assert kv_b.store(prompt_a, make_kv(len(prompt_a), 2)) == 2 * BS
        assert kv_b.store(prompt_b, make_kv(len(prompt_b), 3)) == BS
        assert kv_b.lookup(prompt_b) == 4 * BS
        assert kv_a.lookup(prompt_b) == 3 * BS
        assert kv_a.lookup(prompt_a) == 5 * BS
        # A prompt that leaves the range in its second block hits up to where it leaves
        # (token-granular, from B's own tree), and A, whose tree never held it, the first block.
        detour = SYSTEM[: 3 * BS].copy()
        detour[BS + 3] += 1
        assert kv_b.lookup(detour) == BS + 3
        assert kv_a.lookup(detour) == BS + 3
        # The system prompt's blocks are stored once, as named; each continuation is its writer's.
        plain = op.list_keys(prefix=b"kv/" + ns().digest.hex().encode() + b"/")
        assert len(plain) == 3
        assert len(op.list_keys(prefix=prefix_of("acme") + b"kv/")) == 2
        assert len(op.list_keys(prefix=prefix_of("bolt") + b"kv/")) == 3  # A's prompt, and B's
        # Unsharing: the blocks stay, but new lookups are each tenant's own again.
        done = admin(cluster, "DELETE", f"{PREFIXES}/system")
        assert done["shared"] is False and done["name"] == "system"
        assert admin(cluster, "GET", PREFIXES) == {"prefixes": []}
        assert kv_b.lookup(prompt_b) == 0
        assert kv_a.lookup(prompt_a) == 0
        for cache in (kv_a, kv_b):
            cache.close()


def test_bad_prefixes_change_nothing_and_only_the_operator_shares(pool) -> None:  # noqa: F811
    cluster, token_a, _ = pool
    good = {"namespace": ns().to_dict(), "tokens": SYSTEM.tolist()}
    for bad in (
        {"namespace": ns().to_dict(), "tokens": list(range(BS - 1))},  # no full block
        {"namespace": ns().to_dict(), "tokens": ["a"] * BS},
        {"namespace": ns().to_dict(), "tokens": [-1] * BS},
        {"namespace": {"model": "x"}, "tokens": SYSTEM.tolist()},
        {"namespace": ns().to_dict()},
        {**good, "extra": 1},
    ):
        with pytest.raises(Exception) as err:
            admin(cluster, "PUT", f"{PREFIXES}/system", bad)
        assert "400" in str(err.value), bad
    with pytest.raises(Exception) as err:
        admin(cluster, "PUT", f"{PREFIXES}/Not-A-Name", good)
    assert "400" in str(err.value)
    assert admin(cluster, "GET", PREFIXES) == {"prefixes": []}
    share(cluster)
    assert share(cluster)["num_blocks"] == 3  # the same range again changes nothing
    with pytest.raises(Exception) as err:  # another range under the name
        share(cluster, tokens=SYSTEM + 1)
    assert "409" in str(err.value)
    for token in (token_a, None):  # a tenant's token, or none, opens nothing here
        assert status_of(cluster, "DELETE", f"{PREFIXES}/system", token) in (401, 403)
        assert status_of(cluster, "GET", PREFIXES, token) in (401, 403)
    assert status_of(cluster, "DELETE", f"{PREFIXES}/unknown") == 404
    assert [p["name"] for p in admin(cluster, "GET", PREFIXES)["prefixes"]] == ["system"]
