"""``kvstore tenant share-prefix|unshare-prefix|shared-prefixes`` as an operator types them,
against a real master: a prefix given as files (a namespace and token ids), or as a model folder
and a text (the namespace the vLLM connector saves in, the text tokenized by the folder's
tokenizer), is shared, listed and unshared; a command missing its tokens changes nothing."""

from __future__ import annotations

import json
from pathlib import Path

from kvstore.client.adapters.vllm_config import engine_namespace
from kvstore.keys import Namespace
from tests.cli.test_tenants import kvstore, master  # noqa: F401 (master: a fixture)
from tests.support import Daemon

NS = Namespace(
    model="tiny", dtype="float16", num_layers=2, num_kv_heads=2, head_dim=8, block_size=4
)
WORDS = ["[UNK]", "you", "are", "a", "helpful", "assistant"]


def model_folder(folder: Path) -> Path:
    """A model folder as the router reads one: ``config.json`` and a word-level tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    folder.mkdir()
    config = {
        "num_attention_heads": 2,
        "hidden_size": 16,
        "num_key_value_heads": 2,
        "num_hidden_layers": 2,
        "torch_dtype": "float16",
    }
    (folder / "config.json").write_text(json.dumps(config))
    vocab = {w: i for i, w in enumerate(WORDS)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "[UNK]"})
    )
    return folder


def test_share_a_prefix_from_files_list_and_unshare(
    master: tuple[Daemon, Path],  # noqa: F811
    tmp_path: Path,
) -> None:
    m, token_file = master
    admin = ["--admin", m.field("admin"), "--token-file", str(token_file)]
    ns_file, tokens_file = tmp_path / "ns.json", tmp_path / "tokens.json"
    ns_file.write_text(json.dumps(NS.to_dict()))
    tokens_file.write_text(json.dumps(list(range(10, 20))))
    share = ("share-prefix", "tools", *admin, "--namespace-file", str(ns_file))
    out = kvstore(*share)  # no tokens: refused before any call
    assert out.returncode == 2 and "--tokens-file" in out.stderr, out
    out = kvstore(*share, "--tokens-file", str(tokens_file))
    assert out.returncode == 0, out.stderr
    assert (
        f"prefix tools (8 tokens, 2 blocks of namespace {NS.digest.hex()}) is shared" in out.stdout
    )
    listed = json.loads(kvstore("shared-prefixes", "--json", *admin).stdout)
    assert [(p["name"], p["num_tokens"], p["model"]) for p in listed] == [("tools", 8, "tiny")]
    out = kvstore("unshare-prefix", "tools", *admin)
    assert out.returncode == 0 and "each tenant's own again" in out.stdout, out.stderr
    assert json.loads(kvstore("shared-prefixes", "--json", *admin).stdout) == []
    out = kvstore("unshare-prefix", "tools", *admin)
    assert out.returncode == 2 and "no shared prefix" in out.stderr, out


def test_share_a_system_prompt_from_a_model_folder_and_its_text(
    master: tuple[Daemon, Path],  # noqa: F811
    tmp_path: Path,
) -> None:
    m, token_file = master
    admin = ["--admin", m.field("admin"), "--token-file", str(token_file)]
    folder = model_folder(tmp_path / "tiny-model")
    text = tmp_path / "system.txt"
    text.write_text("you are a helpful assistant you are a helpful")
    out = kvstore(
        "share-prefix", "system", *admin, "--json", "--model-dir", str(folder),
        "--block-size", "4", "--text-file", str(text),
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    reply = json.loads(out.stdout)
    want = engine_namespace(
        served_model="tiny-model", revision=None, kv_dtype="float16", num_layers=2,
        num_kv_heads=2, head_dim=8, block_size=4, salt=None,
    )  # fmt: skip
    assert reply["namespace"] == want.digest.hex() and reply["model"] == "tiny-model"
    assert (reply["num_tokens"], reply["num_blocks"]) == (8, 2)  # 9 words: two full blocks
