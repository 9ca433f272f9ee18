"""Request checks and the namespace the router looks up in (no engines)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvstore.client.adapters.vllm_config import engine_namespace, kv_dtype_from
from kvstore.client.adapters.vllm_layouts import CacheGeometry
from kvstore.errors import InvalidRequestError
from kvstore.keys import Namespace
from kvstore.router.requests import (
    MAX_TOKEN_ID,
    ModelInfo,
    RequestError,
    answer_tokens,
    check_messages,
    check_prompt_length,
    completion_prompts,
    parse_body,
    prompt_tokens,
)

SMOLLM_CONFIG = {
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "hidden_size": 576,
    "head_dim": 64,
    "dtype": "bfloat16",
}


class FakeTokenizer:
    def __call__(self, text: str) -> dict[str, list[int]]:
        return {"input_ids": [len(w) for w in text.split()]}

    def apply_chat_template(self, messages: list[dict[str, Any]], **kw: Any) -> dict[str, Any]:
        assert kw == {"add_generation_prompt": True, "tokenize": True}
        return {"input_ids": [len(m["content"]) for m in messages] + [0]}


@pytest.mark.parametrize(
    ("raw", "message"),
    [(b"{nope", "not JSON"), (b"[1, 2]", "JSON object"), (b"\xff", "not JSON")],
)
def test_bodies_that_are_not_objects_are_400(raw: bytes, message: str) -> None:
    with pytest.raises(RequestError, match=message) as err:
        parse_body(raw)
    assert err.value.status == 400
    assert err.value.body()["error"]["type"] == "BadRequestError"


@pytest.mark.parametrize(
    "messages",
    [
        None,
        [],
        ["hi"],
        [{"role": "wizard", "content": "x"}],
        [{"role": "user"}],
        [{"role": "user", "content": 5}],
        [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}],
    ],
)
def test_malformed_messages_are_400(messages: Any) -> None:
    with pytest.raises(RequestError) as err:
        check_messages(messages)
    assert err.value.status == 400 and err.value.param == "messages"


@pytest.mark.parametrize(
    ("body", "want"),
    [
        ({}, None),
        ({"max_tokens": 7}, 7),
        ({"max_completion_tokens": 3, "max_tokens": 7}, 3),
    ],
)
def test_answer_limits(body: dict[str, Any], want: int | None) -> None:
    assert answer_tokens(body) == want


@pytest.mark.parametrize("value", [0, -1, True, 1.5, "9"])
def test_bad_answer_limits_are_400(value: Any) -> None:
    with pytest.raises(RequestError):
        answer_tokens({"max_tokens": value})


@pytest.mark.parametrize(
    ("kind", "body", "want"),
    [
        ("completions", {"prompt": "ab cde"}, [2, 3]),
        ("completions", {"prompt": [5, 6, 7]}, [5, 6, 7]),
        ("completions", {"prompt": ["ab c", "zzz"]}, [2, 1]),  # a batch: the first prompt
        ("chat", {"messages": [{"role": "user", "content": "abc"}]}, [3, 0]),
        (
            "chat",
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "ab"}]}]},
            [2, 0],
        ),
    ],
)
def test_prompts_are_tokenized_like_the_engine(
    kind: str, body: dict[str, Any], want: list[int]
) -> None:
    assert prompt_tokens(kind, body, FakeTokenizer()) == want


@pytest.mark.parametrize(
    "prompt",
    [
        None,
        "",
        [],
        [1, -2],
        [True],
        {"a": 1},
        [2**32],
        [1, 2**64],
        [[1], [2**32]],  # any prompt of a batch, not only the first
        [[1], [-1]],
        [[1], []],
        ["ab", ""],
        ["ab", 5],
        [[1], [True]],
    ],
)
def test_bad_prompts_are_400(prompt: Any) -> None:
    with pytest.raises(RequestError) as err:
        prompt_tokens("completions", {"prompt": prompt}, FakeTokenizer())
    assert err.value.status == 400 and err.value.param == "prompt"


@pytest.mark.parametrize(
    ("prompt", "want"),
    [
        ("ab", ["ab"]),
        ([0, MAX_TOKEN_ID], [[0, MAX_TOKEN_ID]]),
        (["ab", [MAX_TOKEN_ID]], ["ab", [MAX_TOKEN_ID]]),
    ],
)
def test_a_batch_is_every_prompt_checked(prompt: Any, want: list[Any]) -> None:
    assert completion_prompts({"prompt": prompt}) == want


@pytest.mark.parametrize(
    ("kind", "body", "max_model_len", "refused"),
    [
        ("completions", {"prompt": "x" * 160}, 10, False),  # 16 characters a token at most
        ("completions", {"prompt": "x" * 161}, 10, True),
        ("completions", {"prompt": ["x", "x" * 161]}, 10, True),
        ("completions", {"prompt": [1] * 1000}, 10, False),  # ids: their count decides, later
        ("completions", {"prompt": "x" * 10_000}, 0, False),  # no known context: no cap
        ("chat", {"messages": [{"role": "user", "content": "x" * 100}] * 2}, 10, True),
        ("chat", {"messages": [{"role": "assistant"}, {"role": "user", "content": "x"}]}, 1, False),
    ],
)
def test_a_prompt_longer_than_its_context_can_hold_is_refused_untokenized(
    kind: str, body: dict[str, Any], max_model_len: int, refused: bool
) -> None:
    if not refused:
        check_prompt_length(kind, body, max_model_len, 16)
        return
    with pytest.raises(RequestError, match="maximum context length") as err:
        check_prompt_length(kind, body, max_model_len, 16)
    assert err.value.status == 400 and err.value.param == (
        "messages" if kind == "chat" else "prompt"
    )


def test_the_router_looks_up_in_the_connectors_namespace(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(SMOLLM_CONFIG))
    info = ModelInfo.load({"id": "smollm2", "root": str(tmp_path), "max_model_len": 4096}, None)
    assert info.max_model_len == 4096
    got = info.namespace(32, "auto", dtype=None, salt=None)
    # What the connector derives for a vLLM serving this model (served name, bf16, 30 layers,
    # 3 KV heads of 64, block size 32, tp 1): the same function builds both.
    assert got == Namespace("smollm2", "bfloat16", 30, 3, 64, 32)
    assert (
        got.digest
        == engine_namespace(
            served_model="smollm2",
            revision=None,
            kv_dtype="bfloat16",
            num_layers=30,
            num_kv_heads=3,
            head_dim=64,
            block_size=32,
            salt=None,
        ).digest
    )
    assert info.namespace(32, "fp8", dtype=None, salt="t").dtype == "float8_e4m3"


def test_the_router_looks_up_an_mla_model_in_the_connectors_latent_namespace(
    tmp_path: Path,
) -> None:
    """A DeepSeek-style config: vLLM serves it with an MLA backend, whose latent the connector
    saves as two half planes of one head under the MLA mark; the router must ask there, or every
    MLA engine's prefix lookup misses."""
    config = dict(SMOLLM_CONFIG, kv_lora_rank=512, qk_rope_head_dim=64, num_hidden_layers=2)
    (tmp_path / "config.json").write_text(json.dumps(config))
    info = ModelInfo.load({"id": "tiny-mla", "root": str(tmp_path)}, None)
    geometry = CacheGeometry(num_kv_heads=1, block_size=32, head_size=512 + 64, mla=True)
    for tp in (1, 2):
        connector = engine_namespace(
            served_model="tiny-mla",
            revision=None,
            kv_dtype="bfloat16",
            num_layers=2,
            num_kv_heads=geometry.plane_heads,
            head_dim=geometry.plane_dim,
            block_size=32,
            salt=None,
            tp_size=tp,
            mla=True,
        )
        assert info.namespace(32, "auto", dtype=None, salt=None, tp_size=tp) == connector
    assert info.namespace(32, "auto", dtype=None, salt=None).model == "tiny-mla#mla"


@pytest.mark.parametrize(("cache", "model"), [("int4", "bfloat16"), ("auto", "int8")])
def test_kv_dtypes_the_pool_cannot_describe_are_refused(cache: str, model: str) -> None:
    with pytest.raises(InvalidRequestError):
        kv_dtype_from(cache, model)
