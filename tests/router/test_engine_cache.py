"""vLLM's own KV events: the batch format (bytes produced by vLLM 0.32's msgspec encoder, and
the same structure built here), each engine's prefix-cache view, gaps, and the choice of the
engine whose own cache holds the prompt."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import msgpack
import numpy as np
import pytest
import xxhash

from kvstore.errors import InvalidRequestError
from kvstore.router.config import CPU_PRIOR, RouterConfig
from kvstore.router.engine_cache import (
    EngineCacheEvent,
    EngineEvents,
    LocalCache,
    chain_keys,
    parse_batch,
)
from kvstore.router.metrics import RouterMetrics
from kvstore.router.state import RouterState
from kvstore.routing.policy import EngineView, RequestShape, choose, estimate_ttft
from kvstore.routing.slo import SLOClass

# ``msgspec.msgpack.Encoder().encode(KVEventBatch(ts=1.5, events=[...], data_parallel_rank=0))``
# under vLLM 0.32 with: BlockStored(hashes [01*32, 02*32], parent None, tokens 0..7, block size
# 4, medium GPU), BlockStored(hash 03*32, parent 02*32, tokens [9]*4, extra_keys [("salt",)]),
# BlockRemoved([03*32], GPU), AllBlocksCleared().
VLLM_BATCH = bytes.fromhex(
    "93cb3ff80000000000009488a474797065ab426c6f636b53746f726564ac626c6f636b5f68617368657392c420"
    "0101010101010101010101010101010101010101010101010101010101010101c420020202020202020202020202"
    "0202020202020202020202020202020202020202b1706172656e745f626c6f636b5f68617368c0a9746f6b656e5f"
    "696473980001020304050607aa626c6f636b5f73697a6504a76c6f72615f6964c0a66d656469756da3475055a96c"
    "6f72615f6e616d65c089a474797065ab426c6f636b53746f726564ac626c6f636b5f68617368657391c420030303"
    "0303030303030303030303030303030303030303030303030303030303b1706172656e745f626c6f636b5f686173"
    "68c4200202020202020202020202020202020202020202020202020202020202020202a9746f6b656e5f69647394"
    "09090909aa626c6f636b5f73697a6504a76c6f72615f6964c0a66d656469756da3475055a96c6f72615f6e616d65"
    "c0aa65787472615f6b6579739191a473616c7483a474797065ac426c6f636b52656d6f766564ac626c6f636b5f68"
    "617368657391c4200303030303030303030303030303030303030303030303030303030303030303a66d65646975"
    "6da347505581a474797065b0416c6c426c6f636b73436c656172656400"
)


def stored(
    hashes: list[Any],
    parent: Any,
    tokens: list[int],
    block_size: int,
    medium: str | None = "GPU",
    extra_keys: list[Any] | None = None,
) -> dict[str, Any]:
    """A ``BlockStored`` as vLLM's encoder writes it (fields in declaration order)."""
    event: dict[str, Any] = {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": parent,
        "token_ids": tokens,
        "block_size": block_size,
        "lora_id": None,
        "medium": medium,
        "lora_name": None,
    }
    if extra_keys is not None:
        event["extra_keys"] = extra_keys
    return event


def removed(hashes: list[Any], medium: str | None = "GPU") -> dict[str, Any]:
    return {"type": "BlockRemoved", "block_hashes": hashes, "medium": medium}


def batch(*events: dict[str, Any], ts: float = 1.5, dp_rank: int | None = 0) -> bytes:
    body: list[Any] = [ts, list(events)]
    if dp_rank is not None:
        body.append(dp_rank)
    return msgpack.packb(body)


H = [bytes([i]) * 32 for i in range(8)]


def test_the_hand_built_structure_is_byte_for_byte_what_vllm_encodes() -> None:
    ours = batch(
        stored([H[1], H[2]], None, list(range(8)), 4),
        stored([H[3]], H[2], [9] * 4, 4, extra_keys=[["salt"]]),
        removed([H[3]]),
        {"type": "AllBlocksCleared"},
    )
    assert ours == VLLM_BATCH
    events = parse_batch(VLLM_BATCH)
    assert [e.kind for e in events] == ["stored", "stored", "removed", "cleared"]
    assert events[0] == EngineCacheEvent(
        "stored", (H[1], H[2]), None, tuple(range(8)), 4, "GPU", False
    )
    assert events[1].parent_hash == H[2] and events[1].has_extra_keys
    assert events[2] == EngineCacheEvent("removed", (H[3],), None, (), 0, "GPU")


@pytest.mark.parametrize(
    "payload",
    [
        b"\xc1",  # not msgpack
        msgpack.packb({"ts": 1}),  # not an array
        msgpack.packb([1.0]),
        batch({"type": "BlockStored", "block_hashes": [H[1]]}),  # fields missing
        batch(stored([H[1]], None, [1, 2, 3], 4)),  # tokens do not fill the blocks
        batch(stored([1.5], None, [1, 2, 3, 4], 4)),  # a float hash
        batch(removed([H[1]], medium=7)),  # type: ignore[arg-type]
    ],
)
def test_malformed_batches_are_refused(payload: bytes) -> None:
    with pytest.raises(ValueError):
        parse_batch(payload)


def test_int_hashes_and_unknown_kinds() -> None:
    events = parse_batch(
        batch(stored([11, 12], None, list(range(8)), 4), {"type": "Future"}, dp_rank=None)
    )
    assert [e.block_hashes for e in events] == [(11, 12)]


def apply(cache: LocalCache, *events: dict[str, Any]) -> None:
    cache.apply(parse_batch(batch(*events)))


def test_the_local_view_chains_token_content_and_follows_removes() -> None:
    prompt = list(range(100, 116))  # four blocks of 4
    cache = LocalCache()
    apply(cache, stored([H[0], H[1]], None, prompt[:8], 4))
    assert cache.count_blocks(prompt, 4) == 2
    apply(cache, stored([H[2]], H[1], prompt[8:12], 4))  # continues the chain
    assert cache.count_blocks(prompt, 4) == 3
    assert cache.count_blocks(prompt[:10], 4) == 2  # only whole blocks
    other = prompt[:4] + [1, 2, 3, 4] + prompt[8:]
    assert cache.count_blocks(other, 4) == 1  # content, not position, decides
    assert cache.count_blocks(prompt, 8) == 0  # another block size: nothing known
    apply(cache, removed([H[1]]))
    assert cache.count_blocks(prompt, 4) == 1 and cache.num_blocks() == 2
    apply(cache, {"type": "AllBlocksCleared"})
    assert cache.count_blocks(prompt, 4) == 0 and cache.num_blocks() == 0


def test_blocks_that_cannot_be_matched_are_not_counted() -> None:
    prompt = list(range(8))
    cache = LocalCache()
    apply(cache, stored([H[0]], H[7], prompt[:4], 4))  # parent never seen
    apply(cache, stored([H[1]], None, prompt[:4], 4, extra_keys=[["tenant-salt"]]))
    apply(cache, stored([H[2]], None, prompt[:4], 4, medium="CPU"))  # an offload tier
    assert cache.count_blocks(prompt, 4) == 0 and cache.num_blocks() == 0
    apply(cache, stored([H[3]], None, prompt[:4], 4, extra_keys=[None]))  # no extra keys
    assert cache.count_blocks(prompt, 4) == 1


def test_a_block_cached_twice_stays_until_both_copies_go() -> None:
    prompt = list(range(4))
    cache = LocalCache()
    apply(cache, stored([H[0]], None, prompt, 4), stored([H[1]], None, prompt, 4))
    apply(cache, removed([H[0]]))
    assert cache.count_blocks(prompt, 4) == 1
    apply(cache, removed([H[1]]), removed([H[5]]))  # an unknown hash: nothing
    assert cache.count_blocks(prompt, 4) == 0


def test_chain_keys_are_the_documented_chain() -> None:
    k0 = xxhash.xxh3_128_digest(bytes(16) + np.arange(4, dtype="<u4").tobytes())
    k1 = xxhash.xxh3_128_digest(k0 + np.arange(4, 8, dtype="<u4").tobytes())
    assert chain_keys(list(range(9)), 4) == [k0, k1]


def frames(seq: int, payload: bytes) -> list[bytes]:
    return [b"", seq.to_bytes(8, "big"), payload]


def test_a_gap_or_a_restarted_engine_clears_the_view() -> None:
    metrics = RouterMetrics.create()
    feed = EngineEvents("http://e1", "tcp://127.0.0.1:1", metrics)
    prompt = list(range(8))
    feed.receive(frames(5, batch(stored([H[0]], None, prompt[:4], 4))))  # first seen: no gap
    feed.receive(frames(6, batch(stored([H[1]], H[0], prompt[4:], 4))))
    assert feed.cache.count_blocks(prompt, 4) == 2
    feed.receive(frames(8, batch()))  # 7 was lost: a remove may be among it
    assert feed.cache.count_blocks(prompt, 4) == 0
    feed.receive(frames(9, batch(stored([H[0]], None, prompt[:4], 4))))
    feed.receive(frames(0, batch()))  # the engine restarted: its cache is empty
    assert feed.cache.count_blocks(prompt, 4) == 0
    feed.receive([b"", b"short", b""])  # malformed: dropped
    feed.receive(frames(1, b"\xc1"))
    sample = metrics.registry.get_sample_value
    assert sample("kvstore_router_engine_event_gaps_total", {"instance": "http://e1"}) == 2
    assert sample("kvstore_router_engine_events_total", {"instance": "http://e1", "kind": "stored"})
    assert (
        sample("kvstore_router_engine_events_total", {"instance": "http://e1", "kind": "malformed"})
        == 2
    )


def view(name: str, local: int = 0, waiting: int = 0) -> EngineView:
    return EngineView(
        name=name,
        healthy=True,
        num_running=0,
        num_waiting=waiting,
        kv_usage=0.0,
        kv_capacity_tokens=0,
        router_inflight=0,
        router_prefill_s=0.0,
        router_reserved_tokens=0,
        above_high=False,
        cost=CPU_PRIOR,
        local_cached_tokens=local,
    )


SLO = SLOClass("standard", 600.0, 60.0)


def test_the_engine_holding_the_prefix_locally_wins_and_the_pool_is_the_second_best() -> None:
    shape = RequestShape(prompt_tokens=1000, cached_tokens=512, max_tokens=16)
    a, b = view("a"), view("b", local=768)
    choice = choose(shape, SLO, [a, b], None)
    assert choice.prefill is not None and choice.prefill.engine == "b"
    assert choice.prefill.local_tokens == 768 and choice.prefill.cached_tokens == 768
    est = estimate_ttft(b, shape, False)
    assert est.transfer_s == 0.0  # its own cache covers more than the pool: nothing to load
    # A smaller local hit than the pool's: the pool's tokens beyond it are loaded.
    part = estimate_ttft(view("c", local=256), shape, False)
    assert part.cached_tokens == 512 and part.local_tokens == 256
    assert part.transfer_s == CPU_PRIOR.transfer_s(256)
    assert part.ttft_s < estimate_ttft(a, shape, False).ttft_s  # same compute, less to load
    # The whole prompt in the local cache: the last token is still computed.
    full = estimate_ttft(view("d", local=5000), shape, False)
    assert full.cached_tokens == full.local_tokens == 999
    # A busy engine loses its local advantage when its queue costs more than the prefill.
    busy = view("b", local=768, waiting=50)
    assert choose(shape, SLO, [a, busy], None).prefill.engine == "a"  # type: ignore[union-attr]


def test_engine_events_must_name_an_engine_and_a_zmq_endpoint() -> None:
    ok = RouterConfig(
        engines=("http://e1", "http://e2"), engine_events=(("http://e1", "tcp://127.0.0.1:5557"),)
    )
    assert ok.engine_events
    for bad in (
        (("http://e3", "tcp://127.0.0.1:5557"),),
        (("http://e1", "http://x"),),
        (("http://e1", "tcp://a:1"), ("http://e1", "tcp://a:2")),
    ):
        with pytest.raises(InvalidRequestError):
            RouterConfig(engines=("http://e1", "http://e2"), engine_events=bad)


def test_a_salted_request_counts_no_local_hit() -> None:
    # vLLM mixes a request's cache_salt into its block hashes: the unsalted blocks the view
    # matches are no hit for a salted request (and the view never matches salted ones).
    everything = SimpleNamespace(block_size=4, count_keys=lambda keys, bs: len(keys))
    state = SimpleNamespace(
        engine_events={"http://e": SimpleNamespace(cache=everything)},
        by_url={"http://e": SimpleNamespace(load=SimpleNamespace(block_size=4))},
    )
    prompt = list(range(10))
    assert RouterState.local_cached_tokens(state, prompt) == {"http://e": 8}  # type: ignore[arg-type]
    assert RouterState.local_cached_tokens(state, prompt, "a") == {"http://e": 0}  # type: ignore[arg-type]
