"""Drives the vLLM connector's scheduler side with vLLM's own ``Request`` objects, in the vLLM
virtualenv (``python -m tests.adapters.vllm_salt_driver``); prints one JSON line.

Three requests of one prompt, ``cache_salt`` None / ``"a"`` / ``"b"``, plus a second ``"a"``, go
through the lookup, the allocation and a step's plan, against a pool stand-in that records the
namespace each lookup went to; a request the scheduler never looked up is scheduled too (its
salt is unknown, so it must not be saved).
"""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import numpy as np
from vllm.sampling_params import SamplingParams
from vllm.v1.request import Request

from kvstore.client.adapters.vllm_config import engine_namespace, salted_namespace
from kvstore.client.adapters.vllm_pool import Counters
from kvstore.client.adapters.vllm_scheduler import KVStoreScheduler
from kvstore.keys import Namespace, block_keys

BS = 16
PROMPT = [int(t) for t in np.arange(3 * BS + 5, dtype=np.uint32) * 7 % 1000]


class _KV:
    """A pool view that answers "the first block" in the namespace salted ``"a"``, else none."""

    def __init__(self, ns: Namespace, log: list[dict[str, Any]]) -> None:
        self.namespace, self._log = ns, log

    def lookup(self, tokens: np.ndarray) -> int:
        keys = [k.hex() for k in block_keys(self.namespace, tokens)]
        self._log.append({"salt": self.namespace.salt, "keys": keys})
        return BS if self.namespace.salt == "/a" else 0


class _Pool:
    def __init__(self, ns: Namespace) -> None:
        self.namespace, self.lookups = ns, []  # type: ignore[var-annotated]

    def get(self, cache_salt: str | None = None) -> _KV:
        return _KV(salted_namespace(self.namespace, cache_salt), self.lookups)


def main() -> None:
    ns = engine_namespace(
        served_model="tiny-salt",
        revision=None,
        kv_dtype="bfloat16",
        num_layers=3,
        num_kv_heads=2,
        head_dim=64,
        block_size=BS,
        salt=None,
    )
    pool = _Pool(ns)
    sched = KVStoreScheduler(pool, Counters(), BS, "kv_both", load_async=False)  # type: ignore[arg-type]
    salts = {"none": None, "a": "a", "b": "b", "a2": "a"}
    reqs = {
        rid: Request(rid, list(PROMPT), SamplingParams(max_tokens=1), None, cache_salt=salt)
        for rid, salt in salts.items()
    }
    offered = {rid: sched.get_num_new_matched_tokens(r, 0)[0] for rid, r in reqs.items()}
    blocks = SimpleNamespace(get_block_ids=lambda: ([1, 2, 3, 4],))
    for rid, r in reqs.items():
        sched.update_state_after_alloc(r, blocks, offered[rid] or 0)  # type: ignore[arg-type]
    new = [
        SimpleNamespace(
            req_id=rid,
            prompt_token_ids=list(PROMPT),
            block_ids=([1, 2, 3, 4],),
            num_computed_tokens=0,
        )
        for rid in [*reqs, "unseen"]
    ]
    out = SimpleNamespace(
        scheduled_new_reqs=new,
        num_scheduled_tokens={n.req_id: len(PROMPT) for n in new},
        scheduled_cached_reqs=SimpleNamespace(req_ids=[], new_block_ids=[], num_computed_tokens=[]),
    )
    meta = sched.build_connector_meta(out)  # type: ignore[arg-type]
    print(
        json.dumps(
            {
                "lookups": pool.lookups,
                "offered": offered,
                "loads": {t.req_id: t.cache_salt for t in meta.loads},
                "saves": {t.req_id: [t.cache_salt, t.first] for t in meta.saves},
            }
        )
    )


if __name__ == "__main__":
    main()
