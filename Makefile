# Two entry points for a fresh machine (see README.md):
#   make demo   set everything up, then run the demo job on a local directory store
#   make test   set everything up, then run the linters, the type checker and the test suite
# Both are safe to run again: the set-up is redone only when its inputs change.

# The Python a fresh machine has: the system's python3 (Debian 12: 3.11.2) ahead of any
# pyenv or other shim on PATH, so that CI runs what users run; any python3 >= 3.11 else.
PYTHON ?= $(shell for p in /usr/bin/python3 python3; do \
	$$p -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null && { echo $$p; break; }; \
	done)
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup demo test lint imports typecheck pytest docs-api bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet -c constraints.txt -e '.[dev]'
	touch $(STAMP)

demo: setup
	$(BIN)/asyncstore demo

lint: setup
	$(BIN)/ruff check asyncstore tests benchmarks examples
	$(BIN)/ruff format --check asyncstore tests benchmarks examples

# The layers and the packages' seams ([tool.importlinter] in pyproject.toml).
imports: setup
	$(BIN)/lint-imports

typecheck: setup
	$(BIN)/mypy

pytest: setup
	$(BIN)/python -m pytest

# The API reference, from the docstrings of the public modules, into build/api/ (git-ignored).
# Every warning pdoc raises (an annotation it cannot resolve, an import that fails, a docstring
# it cannot process) is an error, so a broken reference fails `make test`.
API_MODULES := asyncstore asyncstore.errors asyncstore.stores asyncstore.cache \
	asyncstore.checkpoint asyncstore.torch asyncstore.torch.dcp asyncstore.metrics \
	asyncstore.metrics.prometheus asyncstore.testing asyncstore.cli

docs-api: setup
	rm -rf build/api
	$(BIN)/python -W error -m pdoc --docformat restructuredtext \
		--output-directory build/api $(API_MODULES)

test: lint imports typecheck docs-api pytest

bench: setup
	$(BIN)/python benchmarks/bench_store.py
	$(BIN)/python benchmarks/bench_cache.py

clean:
	rm -rf $(VENV) .mypy_cache .pytest_cache .ruff_cache .hypothesis
