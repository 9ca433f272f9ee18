"""Regenerate ``block_key_vectors.json`` (only when the spec version changes).

Run: ``.venv/bin/python tests/data/gen_block_key_vectors.py``
"""

from __future__ import annotations

import json
from pathlib import Path

from kvstore.keys import Namespace, block_keys

TINY = {
    "model": "test/tiny",
    "dtype": "float16",
    "num_layers": 2,
    "num_kv_heads": 2,
    "head_dim": 4,
}
LLAMA = {
    "model": "meta-llama/Llama-3.1-8B",
    "dtype": "bfloat16",
    "num_layers": 32,
    "num_kv_heads": 8,
    "head_dim": 128,
}
CASES = [
    ("tiny, xxh3, ends mid-block", {**TINY, "block_size": 4}, list(range(10))),
    (
        "tiny, blake2b, ends mid-block",
        {**TINY, "block_size": 4, "hash_algorithm": "blake2b_128"},
        list(range(10)),
    ),
    ("tiny, salted", {**TINY, "block_size": 4, "salt": "tenant-a"}, list(range(10))),
    ("tiny, other salt", {**TINY, "block_size": 4, "salt": "tenant-b"}, list(range(10))),
    (
        "tiny, blake2b, salted",
        {**TINY, "block_size": 4, "salt": "tenant-a", "hash_algorithm": "blake2b_128"},
        list(range(10)),
    ),
    ("tiny, shorter than a block", {**TINY, "block_size": 4}, [7, 7, 7]),
    ("tiny, empty", {**TINY, "block_size": 4}, []),
    (
        "llama, block 64, large ids, ends mid-block",
        LLAMA,
        [(i * 7919) % 128256 for i in range(190)] + [4294967295, 65536],
    ),
    (
        "llama, blake2b",
        {**LLAMA, "hash_algorithm": "blake2b_128"},
        [(i * 7919) % 128256 for i in range(128)],
    ),
    (
        "fp8, tp rank 1 of 2, unicode model id",
        {
            **TINY,
            "model": "modèle/ü",
            "dtype": "float8_e4m3",
            "block_size": 2,
            "tp_rank": 1,
            "tp_size": 2,
        },
        [1, 2, 3, 4, 5],
    ),
]


def main() -> None:
    cases = []
    for name, fields, tokens in CASES:
        ns = Namespace(**fields)
        cases.append(
            {
                "name": name,
                "namespace": ns.to_dict(),
                "canonical_hex": ns.canonical_bytes().hex(),
                "digest_hex": ns.digest.hex(),
                "tokens": tokens,
                "keys_hex": [k.hex() for k in block_keys(ns, tokens)],
            }
        )
    doc = {"spec": "docs/block-keys.md", "encoding_version": 1, "cases": cases}
    out = Path(__file__).with_name("block_key_vectors.json")
    out.write_text(json.dumps(doc, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
