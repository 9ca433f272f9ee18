"""OpenAI request bodies: checked, and tokenized the way the engine will tokenize them.

Completions: a string prompt is tokenized with the tokenizer's special tokens (vLLM's default),
a list of token ids is taken as it is (ids from 0 to :data:`MAX_TOKEN_ID`); batched prompts are
each checked and forwarded, and the first is the one whose prefix is looked up. Chat: the
model's chat template with the generation prompt.

A prompt is tokenized only if its characters could be tokens within the context length
(:func:`check_prompt_length`): a tokenizer's memory grows with its input and stays grown, and
a prompt far beyond the context is refused whatever its tokens.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvstore.client.adapters.vllm_config import engine_namespace, kv_dtype_from
from kvstore.keys import Namespace

#: Tokens reserved for an answer whose request sets no limit (only the KV-room check uses it).
DEFAULT_ANSWER_TOKENS = 256
#: The largest token id: block keys pack ids as uint32 (:func:`kvstore.keys.block_keys`).
MAX_TOKEN_ID = 2**32 - 1
#: Characters a token covers at most, on average over a prompt, for the tokenizers we serve:
#: English averages about four, and only long runs of one character (code's indentation,
#: ruler lines) come near this.
DEFAULT_MAX_CHARS_PER_TOKEN = 16
_ROLES = frozenset({"system", "user", "assistant", "tool", "developer", "function"})


class RequestError(Exception):
    """A request the router refuses: an OpenAI-style error body with an HTTP status.

    Args:
        status: the HTTP status.
        message: what is wrong.
        kind: the error type (``BadRequestError``, ``NotFoundError``, ...).
        param: the offending field, if one.
        headers: extra response headers (``Retry-After``).
    """

    def __init__(
        self,
        status: int,
        message: str,
        kind: str = "BadRequestError",
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.kind = kind
        self.param = param
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        """The OpenAI error body."""
        return {
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": self.status,
            }
        }


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """A served model, from an engine's ``/v1/models`` and its folder's ``config.json``.

    Attributes:
        model_id: the served name.
        root: the model folder (tokenizer and config).
        max_model_len: the context length the engine serves.
        config: the folder's ``config.json``.
    """

    model_id: str
    root: Path
    max_model_len: int
    config: dict[str, Any]

    @staticmethod
    def load(entry: dict[str, Any], model_dir: str | None) -> ModelInfo:
        """Read a ``/v1/models`` entry and the folder it (or ``model_dir``) names.

        Raises:
            OSError: the folder has no readable ``config.json``.
            ValueError: the entry or the config is malformed.
        """
        root = Path(model_dir or entry.get("root") or "")
        config = json.loads((root / "config.json").read_text())
        if not isinstance(config, dict):
            raise ValueError(f"{root}/config.json is not an object")
        max_len = int(entry.get("max_model_len") or config.get("max_position_embeddings") or 0)
        return ModelInfo(str(entry["id"]), root, max_len, config)

    def namespace(
        self,
        block_size: int,
        cache_dtype: str,
        *,
        dtype: str | None,
        salt: str | None,
        tp_size: int = 1,
    ) -> Namespace:
        """The pool namespace the vLLM connector saves this model's KV in (rank 0's: the one
        its scheduler looks up in).

        Args:
            block_size: the engine's block size.
            cache_dtype: the engine's ``--kv-cache-dtype``.
            dtype: the engine's ``--dtype`` (None: the model config's).
            salt: the connector's salt.
            tp_size: the engine's tensor-parallel size.

        Raises:
            InvalidRequestError: a config the namespace cannot describe.
        """
        c = self.config
        model_dtype = dtype or str(c.get("dtype") or c.get("torch_dtype") or "bfloat16")
        heads = int(c["num_attention_heads"])
        head_dim = int(c.get("head_dim") or int(c["hidden_size"]) // heads)
        kv_heads = max(int(c.get("num_key_value_heads") or heads) // tp_size, 1)
        mla = c.get("kv_lora_rank") is not None and c.get("qk_rope_head_dim") is not None
        if mla:
            # vLLM serves a DeepSeek-style config with an MLA backend: one latent of
            # kv_lora_rank + qk_rope_head_dim per token, which the connector stores as two half
            # planes of one head on every rank (CacheGeometry in vllm_layouts).
            kv_heads, head_dim = 1, (int(c["kv_lora_rank"]) + int(c["qk_rope_head_dim"])) // 2
        return engine_namespace(
            served_model=self.model_id,
            revision=None,
            kv_dtype=kv_dtype_from(cache_dtype, model_dtype),
            num_layers=int(c["num_hidden_layers"]),
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            block_size=block_size,
            salt=salt,
            tp_rank=0,
            tp_size=tp_size,
            mla=mla,
        )


def parse_body(raw: bytes) -> dict[str, Any]:
    """The request body as a JSON object.

    Raises:
        RequestError: not JSON, or not an object.
    """
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError):
        raise RequestError(400, "the request body is not JSON") from None
    if not isinstance(body, dict):
        raise RequestError(400, "the request body must be a JSON object")
    return body


def answer_tokens(body: dict[str, Any]) -> int | None:
    """The answer limit a request sets (``max_completion_tokens`` or ``max_tokens``).

    Raises:
        RequestError: a limit that is not a positive integer.
    """
    for name in ("max_completion_tokens", "max_tokens"):
        value = body.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise RequestError(400, f"{name} must be a positive integer", param=name)
        return value
    return None


def truncation(
    body: dict[str, Any], max_model_len: int, tokenizer_side: str | None
) -> slice | None:
    """The slice of the prompt's tokens the engine keeps when the request asks vLLM to truncate
    it (``truncate_prompt_tokens``: that many tokens, ``-1`` the context length less one; from
    the ``truncation_side``, else the tokenizer's: ``left`` keeps the last, ``right`` the
    first), as vLLM's renderer computes it. None: no truncation.

    Args:
        body: the request body.
        max_model_len: the model's context length (0: unknown).
        tokenizer_side: the tokenizer's own ``truncation_side``.

    Raises:
        RequestError: 400, a value vLLM refuses (not an integer >= -1, over the context
            length, zero: no prompt left, an unknown side).
    """
    keep = body.get("truncate_prompt_tokens")
    if keep is None:
        return None
    if isinstance(keep, bool) or not isinstance(keep, int) or keep < -1 or keep == 0:
        raise RequestError(
            400,
            "truncate_prompt_tokens must be a positive integer, or -1 for the context length",
            param="truncate_prompt_tokens",
        )
    if max_model_len and keep > max_model_len:
        raise RequestError(
            400,
            f"truncate_prompt_tokens={keep} cannot be greater than the model's maximum context"
            f" length of {max_model_len} tokens",
            param="truncate_prompt_tokens",
        )
    side = body.get("truncation_side") or tokenizer_side or "right"
    if side not in ("left", "right"):
        raise RequestError(
            400, "truncation_side must be 'left' or 'right'", param="truncation_side"
        )
    if keep == -1:
        if not max_model_len:
            return None
        keep = max_model_len - 1  # (vLLM holds one token of context back for the answer)
    return slice(-keep, None) if side == "left" else slice(0, keep)


def check_messages(messages: Any) -> list[dict[str, Any]]:
    """Check a chat request's ``messages``.

    Raises:
        RequestError: not a non-empty list of ``{role, content}`` objects.
    """
    if not isinstance(messages, list) or not messages:
        raise RequestError(400, "messages must be a non-empty list", param="messages")
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict):
            raise RequestError(400, f"messages[{i}] must be an object", param="messages")
        role = msg.get("role")
        if role not in _ROLES:
            raise RequestError(
                400, f"messages[{i}].role must be one of {sorted(_ROLES)}", param="messages"
            )
        content = msg.get("content")
        if content is None and role == "assistant":
            continue
        if isinstance(content, list):
            if not all(isinstance(p, dict) and p.get("type") == "text" for p in content):
                raise RequestError(
                    400, f"messages[{i}].content: only text parts are supported", param="messages"
                )
            continue
        if not isinstance(content, str):
            raise RequestError(400, f"messages[{i}].content must be a string", param="messages")
    return messages


def _text_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for msg in messages:
        content = msg.get("content")
        if isinstance(content, list):
            content = "".join(p.get("text", "") for p in content)
        out.append({**msg, "content": content or ""})
    return out


def prompt_tokens(kind: str, body: dict[str, Any], tokenizer: Any) -> list[int]:
    """The prompt's token ids as the engine will see them.

    Args:
        kind: ``chat`` or ``completions``.
        body: the request body.
        tokenizer: the model's transformers tokenizer.

    Returns:
        Token ids (for batched completions, the first prompt's).

    Raises:
        RequestError: a missing or malformed prompt, or one the chat template refuses.
    """
    if kind == "chat":
        messages = _text_messages(check_messages(body.get("messages")))
        try:
            encoded = tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=True
            )
        except Exception as err:  # noqa: BLE001 - a template's own refusal: the client's error
            raise RequestError(400, f"the chat template refused the messages: {err}") from None
        ids = encoded["input_ids"] if hasattr(encoded, "keys") else encoded
        return [int(t) for t in ids]
    prompt = completion_prompts(body)[0]  # a batch: its first prompt
    if isinstance(prompt, str):
        return [int(t) for t in tokenizer(prompt)["input_ids"]]
    return prompt


def _is_token_ids(value: Any) -> bool:
    return isinstance(value, list) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in value
    )


def completion_prompts(body: dict[str, Any]) -> list[str | list[int]]:
    """A completions request's prompts, each checked (the engine gets them all).

    Args:
        body: the request body.

    Returns:
        The prompts: one, or a batch's, in order; each a non-empty string or a non-empty list
        of token ids from 0 to :data:`MAX_TOKEN_ID`.

    Raises:
        RequestError: a missing or malformed prompt, in any place of a batch.
    """
    prompt = body.get("prompt")
    if isinstance(prompt, str) or (_is_token_ids(prompt) and prompt):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt:
        prompts = prompt
    else:
        prompts = [None]
    for i, one in enumerate(prompts):
        where = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
        if not one or not (isinstance(one, str) or _is_token_ids(one)):
            raise RequestError(
                400, f"{where} must be a non-empty string or list of token ids", param="prompt"
            )
        if isinstance(one, list) and not all(0 <= t <= MAX_TOKEN_ID for t in one):
            raise RequestError(
                400, f"{where}: token ids must be from 0 to {MAX_TOKEN_ID}", param="prompt"
            )
    return prompts


def _text_chars(kind: str, body: dict[str, Any]) -> int:
    """The characters of the longest text the tokenizer would take: a chat's messages
    together, a completions request's longest string prompt."""
    if kind == "chat":
        messages = _text_messages(check_messages(body.get("messages")))
        return sum(len(m["content"]) for m in messages if isinstance(m["content"], str))
    return max((len(p) for p in completion_prompts(body) if isinstance(p, str)), default=0)


def check_prompt_length(
    kind: str, body: dict[str, Any], max_model_len: int, max_chars_per_token: int
) -> None:
    """Refuse, before tokenizing, a prompt with more characters than ``max_model_len`` tokens
    can cover (each at most ``max_chars_per_token``).

    Args:
        kind: ``chat`` or ``completions``.
        body: the request body.
        max_model_len: the model's context length (0: unknown, nothing is refused).
        max_chars_per_token: the characters a token covers at most.

    Raises:
        RequestError: 400, a prompt too long (the engine's words for a context overflow), or
            a malformed one.
    """
    chars = _text_chars(kind, body)
    limit = max_model_len * max_chars_per_token
    if max_model_len and chars > limit:
        raise RequestError(
            400,
            f"This model's maximum context length is {max_model_len} tokens. However, your "
            f"prompt has {chars} characters, more than {limit} (at most {max_chars_per_token} "
            "a token) could be: it was refused before tokenization.",
            param="messages" if kind == "chat" else "prompt",
        )
