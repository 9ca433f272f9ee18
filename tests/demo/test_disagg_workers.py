"""Prefill worker -> pool -> decode worker, each its own process, against colocated ``generate``.

In float32 the greedy tokens of the disaggregated flow equal transformers' own ``generate`` in
one process, for a cold prompt, a prompt sharing a cached prefix, a prefix that ends mid-block and
a prompt entirely cached. Random weights can produce near-ties between the top two logits, where
float rounding (a prompt computed in two chunks instead of one) could flip a greedy choice: the
tiny models use a large weight scale (see kvstore.demo.models) and every comparison
first checks that the colocated run's smallest top-1/top-2 gap is far above float32 rounding.
"""

from __future__ import annotations

import pytest
import torch

from kvstore.demo.models import build_model, greedy_margins
from kvstore.demo.serve import WorkerProcess
from kvstore.demo.workers import colocated_generate
from kvstore.errors import InvalidRequestError

BS = 16
NEW = 8
MIN_MARGIN = 1e-3  # float32 rounding differences between the two paths are ~1e-5 here


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@torch.inference_mode()
def reference(model, prompt: list[int]) -> list[int]:
    want = colocated_generate(model, prompt, NEW)
    ids = torch.tensor([prompt + want[:-1]])
    margins = greedy_margins(model(input_ids=ids).logits[0, len(prompt) - 1 :])
    assert float(margins.min()) > MIN_MARGIN, "near-tie: pick another seed for this prompt"
    return want


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gpt2"])
def test_disaggregated_greedy_tokens_equal_colocated_generate(cluster_factory, name: str) -> None:
    cluster = cluster_factory(num_nodes=1, dram="128MiB")
    opts = ["--model", name, "--block-size", str(BS)]
    system = tokens(5 * BS, seed=10)
    cases = [
        ("cold", system + tokens(21, 11), 0),
        ("shared prefix", system + tokens(30, 12), 5 * BS),
        ("prefix ends mid-block", system[: 3 * BS + 7] + tokens(20, 13), 3 * BS + 7),
        ("entirely cached", system, 5 * BS - 1),  # the last token is always computed
    ]
    with (
        WorkerProcess("prefill", cluster.address, opts, wait=False) as prefill,
        WorkerProcess("decode", cluster.address, opts, wait=False) as decode,
    ):
        model = build_model(name)  # the colocated reference, while the workers start
        prefill.wait_ready()
        decode.wait_ready()
        assert prefill.fields["weights"] == decode.fields["weights"]
        assert prefill.fields["namespace"] == decode.fields["namespace"]
        for label, prompt, cached in cases:
            want = reference(model, prompt)
            p = prefill.call({"tokens": prompt})
            assert p["num_cached"] == cached, label
            assert p["first_token"] == want[0], label
            full = len(prompt) // BS * BS
            for pipelined in (True, False):
                d = decode.call(
                    {
                        "tokens": prompt,
                        "max_new_tokens": NEW,
                        "first_token": p["first_token"],
                        "pipelined": pipelined,
                    }
                )
                assert d["tokens"] == want, (label, pipelined)
                assert d["num_loaded"] == full and not d["fell_back"], label
                assert d["bytes_loaded"] > 0
            # Without the prefill's first token the decode side computes the last token itself.
            d = decode.call({"tokens": prompt, "max_new_tokens": NEW})
            assert d["tokens"] == want, label


def test_fp8_workers_agree_on_scales_and_answer_bad_requests(cluster_factory) -> None:
    """Two processes calibrate the same FP8 scales (same namespace); bad requests get typed
    errors and the worker carries on."""
    cluster = cluster_factory(num_nodes=1, dram="64MiB")
    opts = ["--model", "tiny-gpt2", "--block-size", str(BS), "--max-context", "64", "--fp8"]
    with (
        WorkerProcess("prefill", cluster.address, opts, wait=False) as prefill,
        WorkerProcess("decode", cluster.address, opts, wait=False) as decode,
    ):
        prefill.wait_ready()
        decode.wait_ready()
        assert prefill.fields["namespace"] == decode.fields["namespace"]
        with pytest.raises(InvalidRequestError, match="context"):
            prefill.call({"tokens": tokens(80, 1)})
        with pytest.raises(InvalidRequestError):
            prefill.call({"nothing": 1})
        prompt = tokens(40, 1)
        p = prefill.call({"tokens": prompt})
        assert p["num_stored"] == 2 * BS and p["bytes_stored"] == 2 * BS * 2 * 2 * 64  # 1 B/elem
        d = decode.call({"tokens": prompt, "max_new_tokens": 4, "first_token": p["first_token"]})
        assert d["num_loaded"] == 2 * BS and not d["fell_back"] and len(d["tokens"]) == 4
        with pytest.raises(InvalidRequestError, match="context"):
            decode.call({"tokens": prompt, "max_new_tokens": 30})
