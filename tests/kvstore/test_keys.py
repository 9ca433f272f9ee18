"""Block keys: spec vectors, cross-process stability, isolation, layout and input checks."""

from __future__ import annotations

import hashlib
import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import xxhash

from kvstore.errors import InvalidRequestError
from kvstore.keys import (
    SEED_KEY,
    Namespace,
    as_token_array,
    block_bytes,
    block_keys,
    token_ranges,
)

VECTORS = json.loads(
    (Path(__file__).parents[1] / "data" / "block_key_vectors.json").read_text(encoding="utf-8")
)
CASES = VECTORS["cases"]
NS = Namespace("m", "float16", 2, 2, 4, block_size=4)
TOKENS = list(range(100, 117))  # 4 full blocks and one token more


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_vectors(case) -> None:
    ns = Namespace.from_dict(case["namespace"])
    assert ns.canonical_bytes().hex() == case["canonical_hex"]
    assert ns.digest.hex() == case["digest_hex"]
    assert [k.hex() for k in block_keys(ns, case["tokens"])] == case["keys_hex"]


def _spec_keys(fields: dict, tokens: list[int]) -> tuple[bytes, list[bytes]]:
    """An independent implementation written from docs/block-keys.md alone."""

    def s(text: str) -> bytes:
        raw = text.encode("utf-8")
        return struct.pack("<H", len(raw)) + raw

    canonical = b"KVNS" + bytes([1]) + s(fields["model"]) + s(fields["dtype"])
    canonical += struct.pack(
        "<6I",
        *(
            fields[f]
            for f in ("num_layers", "num_kv_heads", "head_dim", "block_size", "tp_rank", "tp_size")
        ),
    )
    canonical += s(fields["hash_algorithm"])
    canonical += b"\x00" if fields["salt"] is None else b"\x01" + s(fields["salt"])
    digest = hashlib.blake2b(canonical, digest_size=16).digest()
    if fields["hash_algorithm"] == "xxh3_128":

        def h(x: bytes) -> bytes:
            return xxhash.xxh3_128_intdigest(x).to_bytes(16, "big")
    else:

        def h(x: bytes) -> bytes:
            return hashlib.blake2b(x, digest_size=16).digest()

    bs = fields["block_size"]
    keys, prev = [], bytes(16)
    for i in range(len(tokens) // bs):
        prev = h(prev + digest + struct.pack(f"<{bs}I", *tokens[i * bs : (i + 1) * bs]))
        keys.append(prev)
    return canonical, keys


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_vectors_match_the_written_spec(case) -> None:
    canonical, keys = _spec_keys(case["namespace"], case["tokens"])
    assert canonical.hex() == case["canonical_hex"]
    assert [k.hex() for k in keys] == case["keys_hex"]


_CHILD = """
import json, sys
from kvstore.keys import Namespace, block_keys
ns = Namespace.from_dict(json.loads(sys.argv[1]))
print(json.dumps([k.hex() for k in block_keys(ns, json.loads(sys.argv[2]))]))
"""


@pytest.mark.parametrize("hash_seed", ["0", "12345"])
def test_separate_processes_compute_identical_keys(hash_seed) -> None:
    ns = Namespace("m", "bfloat16", 4, 2, 8, block_size=4, salt="tenant-x")
    env = {**os.environ, "PYTHONHASHSEED": hash_seed}
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, json.dumps(ns.to_dict()), json.dumps(TOKENS)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert json.loads(out.stdout) == [k.hex() for k in block_keys(ns, TOKENS)]


@pytest.mark.parametrize(
    "change",
    [
        {"salt": "tenant-a"},
        {"model": "m2"},
        {"dtype": "bfloat16"},
        {"num_layers": 3},
        {"num_kv_heads": 1},
        {"head_dim": 8},
        {"tp_rank": 1, "tp_size": 2},
        {"tp_size": 2},
        {"hash_algorithm": "blake2b_128"},
    ],
)
def test_namespaces_isolate_keys(change) -> None:
    other = Namespace(**{**NS.to_dict(), **change})
    assert other.digest != NS.digest
    assert set(block_keys(other, TOKENS)).isdisjoint(block_keys(NS, TOKENS))


def test_salts_isolate_keys() -> None:
    a, b = (Namespace(**{**NS.to_dict(), "salt": s}) for s in ("a", "b"))
    assert set(block_keys(a, TOKENS)).isdisjoint(block_keys(b, TOKENS))


def test_keys_are_chained_and_extendable() -> None:
    keys = block_keys(NS, TOKENS)
    assert len(keys) == 4 and all(len(k) == 16 for k in keys)
    # The same block after a different prefix gets a different key.
    assert block_keys(NS, [0, 0, 0, 0] + TOKENS[4:8])[1] != keys[1]
    assert block_keys(NS, TOKENS[8:], parent=keys[1]) == keys[2:]
    assert block_keys(NS, TOKENS[:4], parent=SEED_KEY) == keys[:1]
    assert block_keys(NS, TOKENS[:3]) == []


def test_token_containers_agree() -> None:
    torch = pytest.importorskip("torch")
    expected = block_keys(NS, TOKENS)
    arr = np.array(TOKENS)
    for tokens in (
        tuple(TOKENS),
        arr.astype(np.int32),
        arr.astype(np.uint32),
        arr.astype(">u4"),
        arr.astype(np.uint16),
        torch.tensor(TOKENS),
        torch.tensor(TOKENS, dtype=torch.int32),
    ):
        assert block_keys(NS, tokens) == expected, type(tokens)
    assert block_keys(NS, [2**32 - 1] * 4) == block_keys(NS, np.full(4, 2**32 - 1, np.uint64))


@pytest.mark.parametrize(
    "tokens",
    [
        [1, -1, 2, 3],
        [1, 2**32, 2, 3],
        [1, 2**70, 2, 3],
        [1.0, 2.0, 3.0, 4.0],
        [1, 2.5, 3, 4],
        ["a", "b", "c", "d"],
        [True, False, True, False],
        "abcd",
        b"abcd",
        42,
        None,
        np.array([[1, 2], [3, 4]]),
        np.array([1.0, 2.0, 3.0, 4.0]),
        np.array([-5, 1, 2, 3], dtype=np.int8),
        np.array([True] * 4),
    ],
)
def test_bad_tokens_raise(tokens) -> None:
    with pytest.raises(InvalidRequestError):
        block_keys(NS, tokens)


def test_bad_torch_tokens_raise() -> None:
    torch = pytest.importorskip("torch")
    for tokens in (torch.ones(8), torch.tensor([1, -1, 2, 3]), torch.ones(8, dtype=torch.bool)):
        with pytest.raises(InvalidRequestError):
            block_keys(NS, tokens)


def test_empty_tokens() -> None:
    assert as_token_array([]).dtype == np.dtype("<u4")
    assert block_keys(NS, np.array([], dtype=np.float64)) == []


def test_bad_parent_raises() -> None:
    with pytest.raises(InvalidRequestError):
        block_keys(NS, TOKENS, parent=b"short")


@pytest.mark.parametrize(
    "fields",
    [
        {"model": ""},
        {"model": 7},
        {"model": "x" * 2000},
        {"dtype": "int8"},
        {"num_layers": 0},
        {"num_kv_heads": -1},
        {"head_dim": 2.0},
        {"head_dim": True},
        {"block_size": 2**32},
        {"tp_rank": 2, "tp_size": 2},
        {"tp_size": 0},
        {"salt": ""},
        {"salt": 5},
        {"hash_algorithm": "md5"},
    ],
)
def test_bad_namespace_raises(fields) -> None:
    with pytest.raises(InvalidRequestError):
        Namespace(**{**NS.to_dict(), **fields})


def test_namespace_round_trip_and_bad_dict() -> None:
    assert Namespace.from_dict(NS.to_dict()) == NS
    assert Namespace.from_dict(NS.to_dict()).digest == NS.digest
    for bad in (None, [], {"model": "m"}, {**NS.to_dict(), "extra": 1}):
        with pytest.raises(InvalidRequestError):
            Namespace.from_dict(bad)


@pytest.mark.parametrize(
    ("dtype", "np_dtype"),
    [
        ("float16", np.float16),
        ("float32", np.float32),
        ("bfloat16", np.uint16),
        ("float8_e4m3", np.uint8),
    ],
)
def test_block_layout_and_token_ranges(dtype, np_dtype) -> None:
    ns = Namespace("m", dtype, num_layers=3, num_kv_heads=2, head_dim=5, block_size=4)
    # layer-major: [layer, K/V, token, head, dim]
    block = np.arange(3 * 2 * 4 * 2 * 5).astype(np_dtype).reshape(3, 2, 4, 2, 5)
    raw = block.tobytes()
    assert block_bytes(ns) == len(raw)
    for k in range(5):
        ranges = token_ranges(ns, k)
        assert len(ranges) == (6 if k else 0)
        got = b"".join(raw[off : off + n] for off, n in ranges)
        assert got == block[:, :, :k].tobytes()


@pytest.mark.parametrize("k", [-1, 5, 2.0, True])
def test_token_ranges_bad_k(k) -> None:
    ns = Namespace("m", "float16", 1, 1, 1, block_size=4)
    with pytest.raises(InvalidRequestError):
        token_ranges(ns, k)
