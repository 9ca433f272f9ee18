# kvstore: two commands for a fresh machine.
#   make up    create the venv, install, run an embedded master + storage node (Ctrl-C stops it)
#   make test  create the venv, install with test extras, run the whole suite
#   make demo  disaggregated prefill/decode with a small model through an embedded cluster

PYTHON ?= python3
VENV   ?= .venv
PORT   ?= 7700
DRAM   ?= 512MiB
DATA   ?= .kvstore-data
BIN     = $(VENV)/bin

.PHONY: up test lint bench venv clean demo

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

venv: $(BIN)/python
	$(BIN)/pip install -q -e .

up: venv
	$(BIN)/kvstore up --port $(PORT) --dram $(DRAM) --data-dir $(DATA)

test: $(BIN)/python
	$(BIN)/pip install -q -e '.[dev]'
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q -p no:cacheprovider
	$(MAKE) sglang-test

lint: $(BIN)/python
	$(BIN)/ruff check . && $(BIN)/ruff format --check .

demo: $(BIN)/python
	$(BIN)/pip install -q -e '.[dev]'
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/kvstore demo

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
	rm -rf $(VENV) $(DATA) build *.egg-info
