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

# Tests that start Ray inside the pytest process run in a second pytest process: Ray leaves
# threads behind after ray.shutdown(), and a later test must not share a process with them.
# Both runs always happen; the target fails if either failed (exit 5 only if neither found tests).
# A pytest process that crashes (exit >= 128) has its fault dump printed again at the end.
test: venv
	@ELASTIC_FAULT_LOG=$(CURDIR)/.pytest-fault-1.log $(BIN)/python -m pytest -m "not ray" $(PYTEST_ARGS); a=$$?; \
	ELASTIC_FAULT_LOG=$(CURDIR)/.pytest-fault-2.log $(BIN)/python -m pytest -m ray $(PYTEST_ARGS); b=$$?; \
	for r in "1 $$a" "2 $$b"; do set -- $$r; if [ $$2 -ge 128 ]; then \
	  echo "== pytest run $$1 crashed (exit $$2): the test and the top of every thread's stack"; \
	  awk '/^(running|Fatal|Current thread|Thread |Extension)/{n=8} n-->0' .pytest-fault-$$1.log; fi; done; \
	if [ $$a -ne 0 ] && [ $$a -ne 5 ]; then exit $$a; fi; \
	if [ $$b -ne 0 ] && [ $$b -ne 5 ]; then exit $$b; fi; \
	if [ $$a -eq 5 ] && [ $$b -eq 5 ]; then exit 5; fi

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
