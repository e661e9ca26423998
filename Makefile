# The two set-up commands of the README. Both work on a fresh machine with Python >= 3.10.
PYTHON ?= python3
VENV   ?= .venv
BIN     = $(VENV)/bin

.PHONY: demo test test-quick install lint bench clean

$(BIN)/mirrax: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	PYTHONWARNINGS=ignore $(BIN)/pip install --quiet -e ".[test]"
	touch $(BIN)/mirrax

install: $(BIN)/mirrax

# The main job: train the tutorial CNN on the bundled digits over every device
# (4 fake CPU devices on a machine without an accelerator).
demo: install
	$(BIN)/mirrax train

# The test suite, on 8 fake CPU devices (tests/conftest.py sets them up), in two processes
# (pytest-xdist). Tests go one by one to whichever process is free; a module whose tests share a
# module-scoped set-up (a Ray cluster, a multi-worker run) is one xdist_group, kept on one
# process. Compiled programs persist in .cache/xla (tests/conftest.py), shared by every process
# the suite starts. CONTRIBUTING.md describes the tiers.
test: lint
	$(BIN)/python -m pytest -q -n 2 --dist loadgroup

# The quick tier for the inner loop: no subprocess, cluster, notebook or slow test (pytest
# markers; a test that starts a process without its marker fails here).
test-quick: install
	MIRRAX_TEST_QUICK=1 $(BIN)/python -m pytest -q -n 2 --dist loadgroup \
		-m "not subprocess and not cluster and not notebook and not slow"

# Formatting, lint and types (config in pyproject.toml). mypy's errors are held to
# .ci/mypy-baseline.txt, which may only shrink: a new error fails, and so does a fixed one until
# `$(BIN)/python -m tools.mypy_baseline $(BIN)/mypy --update` removes it from the baseline
# (`--rewrite` after moving code between files, whose errors then carry the new path).
lint: install
	$(BIN)/ruff format --check .
	$(BIN)/ruff check .
	$(BIN)/python -m tools.mypy_baseline $(BIN)/mypy

bench: install
	$(BIN)/python -m benchmarks.overhead --variants run

clean:
	rm -rf $(VENV) .pytest_cache .cache build *.egg-info
