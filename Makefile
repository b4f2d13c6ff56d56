# Two commands on a fresh machine: `make demo` and `make test`. Both build .venv when missing.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: venv test lint bench bench-reshard bench-train demo clean

venv: $(STAMP)

# torch first (CPU wheel on local disk; a plain `torch` requirement would fetch a CUDA build), then the project.
$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev]'
	@touch $(STAMP)

test: venv
	$(BIN)/python -m pytest $(PYTEST_ARGS)

lint: venv
	$(BIN)/ruff check elastic operators tests benchmarks

# Every benchmark runs even when one misses its goal (non-zero exit); the target fails at the end.
bench: venv
	@fail=0; for b in benchmarks/*_bench.py; do echo "== $$b"; $(BIN)/python $$b || { echo "!! $$b missed a goal or failed"; fail=1; }; done; exit $$fail

bench-reshard: venv
	$(BIN)/python benchmarks/reshard_bench.py --json

bench-train: venv
	$(BIN)/python benchmarks/train_bench.py

demo: venv
	$(BIN)/elastic demo $(DEMO_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache elastic.db
