"""The KV-cache API across processes: store in one, load bit-exactly in another."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import pytest

from kvstore.client import Client, KVCache, Namespace
from kvstore.client.puts import PromptCommit
from kvstore.errors import ChecksumMismatchError, InvalidRequestError
from kvstore.keys import block_bytes, block_keys
from kvstore.kvblocks import kv_object_key
from tests.support import flip_arena_byte

L, H, D, BS = 3, 2, 16, 16


def ns(**kw) -> Namespace:
    return Namespace(
        **{
            "model": "tiny",
            "dtype": "float16",
            "num_layers": L,
            "num_kv_heads": H,
            "head_dim": D,
            "block_size": BS,
            **kw,
        }
    )


def make_kv(
    tokens: np.ndarray, seed: int = 0, dtype=np.float16
) -> list[tuple[np.ndarray, np.ndarray]]:
    """Deterministic KV that depends on the whole prefix (like a real model's)."""
    rng = np.random.default_rng(seed)
    base = rng.standard_normal((L, 2, len(tokens), H, D)).astype(dtype)
    return [(base[layer, 0], base[layer, 1]) for layer in range(L)]


def empty_kv(n: int, dtype=np.float16) -> list[tuple[np.ndarray, np.ndarray]]:
    return [
        (np.full((n, H, D), np.nan, dtype), np.full((n, H, D), np.nan, dtype)) for _ in range(L)
    ]


def test_store_lookup_load_token_granular(cluster_factory) -> None:
    cluster = cluster_factory(num_nodes=2, dram="64MiB")
    with Client.connect(cluster.address) as c:
        kv = KVCache(c, ns())
        tokens = np.arange(1000, 1000 + 5 * BS + 7)  # 5 full blocks + 7 tokens
        layers = make_kv(tokens)
        assert kv.lookup(tokens) == 0
        assert kv.store(tokens, layers) == 5 * BS
        assert kv.store(tokens, layers) == 0, "stores only new blocks"
        assert kv.lookup(tokens) == 5 * BS
        assert kv.lookup(tokens[: 3 * BS + 5]) == 3 * BS + 5, "a prompt ending mid-block"
        diverge = tokens.copy()
        diverge[2 * BS + 9] = 7  # shares 2 blocks + 9 tokens of block 2
        assert kv.lookup(diverge) == 2 * BS + 9

        out = empty_kv(len(diverge))
        assert kv.load(diverge, out) == 2 * BS + 9
        for (k, v), (ko, vo) in zip(layers, out, strict=True):
            assert np.array_equal(ko[: 2 * BS + 9], k[: 2 * BS + 9])
            assert np.array_equal(vo[: 2 * BS + 9], v[: 2 * BS + 9])
            assert np.isnan(ko[2 * BS + 9 :].astype(np.float32)).all(), (
                "nothing written past the hit"
            )

        seen = []
        out2 = empty_kv(len(tokens))
        for layer, k, v in kv.load_layers(tokens, out2):
            seen.append(layer)
            assert np.array_equal(k, layers[layer][0][: 5 * BS])
            assert np.array_equal(v, layers[layer][1][: 5 * BS])
        assert seen == list(range(L))
        kv.close()


def test_namespaces_and_salts_are_isolated(cluster_factory) -> None:
    cluster = cluster_factory(num_nodes=1, dram="32MiB")
    with Client.connect(cluster.address) as c:
        tokens = np.arange(4 * BS)
        KVCache(c, ns()).store(tokens, make_kv(tokens))
        assert KVCache(c, ns(salt="tenant-b")).lookup(tokens) == 0
        assert KVCache(c, ns(model="other")).lookup(tokens) == 0
        assert KVCache(c, ns()).lookup(tokens) == 4 * BS


def test_removed_block_cuts_the_match(cluster_factory) -> None:
    cluster = cluster_factory(num_nodes=1, dram="32MiB")
    with Client.connect(cluster.address) as c:
        kv = KVCache(c, ns())
        tokens = np.arange(4 * BS)
        kv.store(tokens, make_kv(tokens))
        _, blocks = kv._match(tokens)
        c.remove(blocks[2].key)
        assert kv.lookup(tokens) == 2 * BS
        out = empty_kv(len(tokens))
        assert kv.load(tokens, out) == 2 * BS


def test_bad_input_stores_nothing(cluster_factory) -> None:
    torch = pytest.importorskip("torch")
    cluster = cluster_factory(num_nodes=1, dram="32MiB")
    with Client.connect(cluster.address) as c:
        kv = KVCache(c, ns())
        tokens = np.arange(2 * BS)
        good = make_kv(tokens)
        bad_cases = [
            (tokens.astype(np.float32), good),
            ([1, -2, 3], good),
            (tokens, good[:-1]),
            (tokens, [(k[:, :1], v) for k, v in good]),
            (tokens, [(k.astype(np.float32), v.astype(np.float32)) for k, v in good]),
            (tokens, [(k[:5], v[:5]) for k, v in good]),
        ]
        for toks, layers in bad_cases:
            with pytest.raises(InvalidRequestError):
                kv.store(toks, layers)
        assert c.stats()["num_objects"] == 0
        kv.store(tokens, good)
        with pytest.raises(InvalidRequestError):
            kv.load(tokens, [(k[:3].copy(), v[:3].copy()) for k, v in good])  # buffers too small
        ro = [(np.frombuffer(k.tobytes(), np.float16).reshape(k.shape), v.copy()) for k, v in good]
        with pytest.raises(InvalidRequestError):
            kv.load(tokens, ro)
        # bfloat16 torch tensors round-trip bit-exactly
        kvb = KVCache(c, ns(dtype="bfloat16"))
        tl = [
            (
                torch.randn(2 * BS, H, D).to(torch.bfloat16),
                torch.randn(2 * BS, H, D).to(torch.bfloat16),
            )
            for _ in range(L)
        ]
        assert kvb.store(tokens, tl) == 2 * BS
        outb = [
            (
                torch.empty(2 * BS, H, D, dtype=torch.bfloat16),
                torch.empty(2 * BS, H, D, dtype=torch.bfloat16),
            )
            for _ in range(L)
        ]
        assert kvb.load(tokens, outb) == 2 * BS
        assert all(
            torch.equal(a, b) and torch.equal(x, y) for (a, x), (b, y) in zip(tl, outb, strict=True)
        )


LOADER = textwrap.dedent(
    """
    import sys, numpy as np
    sys.path.insert(0, sys.argv[2])
    from test_kvcache import ns, make_kv, empty_kv, BS
    from kvstore.client import Client, KVCache
    c = Client.connect(sys.argv[1])
    kv = KVCache(c, ns())
    first = np.arange(10 * BS) + 5
    second = first.copy(); second[7 * BS:] += 100000   # shares 70% of the first prompt
    want = make_kv(first)
    out = empty_kv(len(second))
    n = kv.load(second, out)
    ok = all(np.array_equal(o[0][:n], w[0][:n]) and np.array_equal(o[1][:n], w[1][:n]) for o, w in zip(out, want))
    print(n, ok)
    """
)


def test_cross_process_store_then_load_seventy_percent(cluster_factory, tmp_path) -> None:
    from pathlib import Path

    cluster = cluster_factory(num_nodes=2, dram="32MiB")
    with Client.connect(cluster.address) as c:
        first = np.arange(10 * BS) + 5
        assert KVCache(c, ns()).store(first, make_kv(first)) == 10 * BS
    out = subprocess.run(
        [sys.executable, "-c", LOADER, cluster.address, str(Path(__file__).parent)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.stdout.split() == [str(7 * BS), "True"], out.stderr


def test_kv_blocks_are_immutable_and_not_writable_by_plain_puts(cluster_factory) -> None:
    """A plain put cannot replace a block the prefix index serves (that would be a wrong hit)."""
    from kvstore.errors import ObjectExistsError

    cluster = cluster_factory(num_nodes=1, dram="32MiB")
    with Client.connect(cluster.address) as c:
        kv = KVCache(c, ns())
        tokens = np.arange(2 * BS)
        layers = make_kv(tokens)
        kv.store(tokens, layers)
        _, blocks = kv._match(tokens)
        with pytest.raises(InvalidRequestError):
            c.put(blocks[0].key, b"garbage")
        with pytest.raises(InvalidRequestError):
            c.put(b"kv/new-key", b"garbage")
        # A second writer of the same prompt (a race between two prefill workers) is fine.
        res = c.batch_put(
            [blocks[0].key], [b"x" * 10], prompt=PromptCommit(kv.namespace, np.empty(0, np.uint32))
        )
        assert isinstance(res[0], ObjectExistsError)
        out = empty_kv(len(tokens))
        assert kv.load(tokens, out) == 2 * BS
        assert all(np.array_equal(o[0], w[0]) for o, w in zip(out, layers, strict=True))


def test_block_level_puts_load_back_by_key(cluster_factory) -> None:
    """What a paged engine uses: laid-out block objects in, the same bytes out by key."""
    cluster = cluster_factory(num_nodes=1, dram="64MiB")
    with Client.connect(cluster.address) as c:
        kv = KVCache(c, ns())
        tokens = np.arange(500, 500 + 4 * BS + 3)
        rng = np.random.default_rng(3)
        rows = rng.integers(0, 256, (4, kv.block_nbytes), dtype=np.uint8)
        assert kv.put_blocks(tokens, 0, rows[:2]) == 2
        assert kv.put_blocks(tokens, 2, rows[2:]) == 2, "a later chunk extends the prefix"
        assert kv.lookup(tokens) == 4 * BS
        # The same keys the token-level API uses: load() reads these blocks back.
        out = empty_kv(len(tokens))
        assert kv.load(tokens, out) == 4 * BS
        keys = kv.block_object_keys(tokens)
        assert len(keys) == 4
        # A stored object is the planes, then the block's checksum table.
        objects = np.zeros((4, kv.object_nbytes), dtype=np.uint8)
        assert c.batch_get_into(keys, list(objects)) == [kv.object_nbytes] * 4
        assert np.array_equal(objects[:, : kv.block_nbytes], rows)
        # Whole object rows (what an engine's staging holds) get their table written in place:
        # the same objects as from plane rows.
        staged = np.zeros_like(objects)
        staged[:, : kv.block_nbytes] = rows
        other = np.arange(900, 900 + 4 * BS)
        assert kv.put_blocks(other, 0, staged) == 4
        assert np.array_equal(staged[:, : kv.block_nbytes], rows)
        assert kv.lookup(other) == 4 * BS
        out = empty_kv(len(other))
        assert kv.load(other, out) == 4 * BS
        with pytest.raises(InvalidRequestError):
            kv.put_blocks(tokens, 3, rows[:2])  # block 4 would need more tokens
        with pytest.raises(InvalidRequestError):
            kv.put_blocks(tokens, 0, rows[0, :-1])  # not a whole block


def test_a_flipped_byte_in_a_whole_block_ends_the_load_before_it(cluster_factory) -> None:
    # Whole blocks land straight in the caller's tensors (no staging): a block that fails the
    # object checksum still ends the match before it, and the tokens loaded are exactly those
    # stored; the corrupt replica is reported and dropped.
    cluster = cluster_factory(num_nodes=1, dram="64MiB")
    with Client.connect(cluster.address) as c:
        kv = KVCache(c, ns())
        tokens = np.arange(700, 700 + 3 * BS)
        layers = make_kv(tokens, seed=4)
        assert kv.store(tokens, layers) == 3 * BS
        out = empty_kv(len(tokens))
        assert kv.load(tokens, out) == 3 * BS
        for (k, v), (ko, vo) in zip(layers, out, strict=True):
            assert np.array_equal(ko, k) and np.array_equal(vo, v)

        key = kv_object_key(kv.namespace.digest, block_keys(kv.namespace, tokens)[1])
        loc = c.locate(key).locations[0]
        flip_arena_byte(cluster, loc.node_id, loc.grant.offset + 2 * BS * H * D * 2 + 9)
        out = empty_kv(len(tokens))
        assert kv.load(tokens, out) == BS, "the match ends before the corrupt block"
        for (k, v), (ko, vo) in zip(layers, out, strict=True):
            assert np.array_equal(ko[:BS], k[:BS]) and np.array_equal(vo[:BS], v[:BS])
        assert kv.lookup(tokens) == BS
        assert c.stats()["num_corrupt_replicas"] == 1
        kv.close()


@pytest.mark.parametrize("reader", ["load", "load_layers"])
@pytest.mark.parametrize("where", ["plane", "table"])
def test_a_flipped_byte_in_a_partial_block_is_never_loaded(cluster_factory, where, reader) -> None:
    # Store 32 tokens (2 blocks), load a prompt sharing 24: block 1 is read as a range of its
    # first 8 tokens. A byte flipped inside those 8 tokens (or in the block's checksum table)
    # behind the store's back must end the match before block 1, never hand back wrong bytes.
    cluster = cluster_factory(num_nodes=1, dram="64MiB")
    with Client.connect(cluster.address) as c:
        kv = KVCache(c, ns())
        tokens = np.arange(500, 500 + 2 * BS)
        layers = make_kv(tokens)
        assert kv.store(tokens, layers) == 2 * BS
        prompt = np.concatenate([tokens[: BS + 8], np.arange(9000, 9010)])
        out = empty_kv(len(prompt))
        assert kv.load(prompt, out) == BS + 8
        assert all(
            np.array_equal(o[0][: BS + 8], x[0][: BS + 8]) for o, x in zip(out, layers, strict=True)
        )

        key = kv_object_key(kv.namespace.digest, block_keys(kv.namespace, tokens)[1])
        loc = c.locate(key).locations[0]
        stride = H * D * 2
        if where == "plane":  # layer 1's V, token 3 of the block
            pos = (2 * 1 + 1) * BS * stride + 3 * stride + 5
        else:
            pos = block_bytes(kv.namespace) + 3
        flip_arena_byte(cluster, loc.node_id, loc.grant.offset + pos)

        if reader == "load_layers":
            # The layer holding the flipped byte raises instead of being yielded.
            yielded = []
            with pytest.raises(ChecksumMismatchError):
                for layer, _, _ in kv.load_layers(prompt, empty_kv(len(prompt))):
                    yielded.append(layer)
            assert yielded == ([0] if where == "plane" else [])
        # load: the partial block fails its chunk check (or, once reported, is gone): the match
        # ends before it, with exactly the bytes stored.
        out = empty_kv(len(prompt))
        assert kv.load(prompt, out) == BS, "the match ends before the corrupt block"
        for (k, v), (ko, vo) in zip(layers, out, strict=True):
            assert np.array_equal(ko[:BS], k[:BS]) and np.array_equal(vo[:BS], v[:BS])
            assert np.isnan(ko[BS:].astype(np.float32)).all()
            assert np.isnan(vo[BS:].astype(np.float32)).all()
        # The corrupt block was reported and dropped: lookups stop before it too.
        assert kv.lookup(tokens) == BS
        assert c.stats()["num_corrupt_replicas"] == 1
        kv.close()


@pytest.mark.parametrize(
    "tokens",
    [[1, [2]], [[1], [2, 3]], [[1, 2], [3, 4]], ["a"], [1.5], [None], "abc", {"a": 1}],
    ids=["ragged", "ragged-lists", "2-d", "str-item", "float", "none", "str", "dict"],
)
def test_lookup_of_malformed_tokens_is_a_typed_error(cluster_factory, tokens) -> None:
    cluster = cluster_factory(num_nodes=1, dram="16MiB")
    with Client.connect(cluster.address) as c:
        kv = KVCache(c, ns())
        with pytest.raises(InvalidRequestError):
            kv.lookup(tokens)
        assert kv.lookup(np.arange(BS)) == 0  # the client still works


def test_prompts_over_the_block_limit_are_refused_and_store_nothing(cluster_factory) -> None:
    from kvstore.master.prefix import MAX_PROMPT_BLOCKS

    cluster = cluster_factory(num_nodes=1, dram="64MiB")
    with Client.connect(cluster.address) as c:
        kv = KVCache(c, ns(block_size=1))
        tokens = np.arange(MAX_PROMPT_BLOCKS + 1)
        layers = [(np.zeros((len(tokens), H, D), np.float16),) * 2 for _ in range(L)]
        for call in (kv.lookup, lambda t: kv.store(t, layers), lambda t: kv.load(t, layers)):
            with pytest.raises(InvalidRequestError, match="limit"):
                call(tokens)
        assert c.stats()["num_objects"] == 0


def test_lookups_take_no_read_leases_loads_do(cluster_factory) -> None:
    """A lookup (what an engine's scheduler asks for every request) must not hold blocks from
    eviction; a load leases what it reads."""
    import re
    import urllib.request

    cluster = cluster_factory(num_nodes=1, dram="64MiB")

    def leases() -> float:
        with urllib.request.urlopen(cluster.admin + "/metrics", timeout=10) as r:
            text = r.read().decode()
        m = re.search(r"^kvstore_leases_held (\S+)$", text, re.M)
        assert m, "the master exports kvstore_leases_held"
        return float(m.group(1))

    with Client.connect(cluster.address) as c:
        kv = KVCache(c, ns())
        tokens = np.arange(7000, 7000 + 3 * BS)
        kv.store(tokens, make_kv(tokens))
        base = leases()
        for _ in range(3):
            assert kv.lookup(tokens) == 3 * BS
        assert leases() == base
        assert kv.load(tokens, empty_kv(len(tokens))) == 3 * BS
        assert leases() > base
