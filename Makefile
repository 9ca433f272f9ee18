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

lint: $(BIN)/python
	$(BIN)/ruff check . && $(BIN)/ruff format --check .

demo: $(BIN)/python
	$(BIN)/pip install -q -e '.[dev]'
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/kvstore demo

bench: venv
	$(BIN)/python bench/bench_store.py

clean:
	rm -rf $(VENV) $(DATA) build *.egg-info
