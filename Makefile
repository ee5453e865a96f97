# Two entry points for a fresh machine (see README.md):
#   make demo   set everything up, then run the demo job on a local directory store
#   make test   set everything up, then run the linters, the type checker and the test suite
# Both are safe to run again: the set-up is redone only when its inputs change.

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup demo test lint typecheck pytest bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet -c constraints.txt -e '.[dev]'
	touch $(STAMP)

demo: setup
	$(BIN)/asyncstore demo

lint: setup
	$(BIN)/ruff check asyncstore tests benchmarks
	$(BIN)/ruff format --check asyncstore tests benchmarks

typecheck: setup
	$(BIN)/mypy

pytest: setup
	$(BIN)/python -m pytest

test: lint typecheck pytest

bench: setup
	$(BIN)/python benchmarks/bench_store.py
	$(BIN)/python benchmarks/bench_cache.py

clean:
	rm -rf $(VENV) .mypy_cache .pytest_cache .ruff_cache .hypothesis
