# Installs into the active Python environment (use a virtualenv).
PYTHON ?= python
PYTEST_WORKERS ?= 2

.PHONY: install install-core demo test lint format bench

# The test extra and the peers (PyTorch PEFT, PyKEEN, ... ; torch==2.13.0 is a CPU wheel): the tests
# that compare against the peers run in CI, so the test install includes them.
install:
	$(PYTHON) -m pip install -e ".[test,peers]"
	$(PYTHON) -m pip install --no-deps -r requirements-data.txt

# The library alone (no test tools, no PyTorch peers).
install-core:
	$(PYTHON) -m pip install -e .
	$(PYTHON) -m pip install --no-deps -r requirements-data.txt

demo: install-core
	$(PYTHON) -m experiments.train --config=configs/saber.py

test: install
	$(PYTHON) -m ruff check lowrank_jax experiments configs tests
	$(PYTHON) -m pytest -n $(PYTEST_WORKERS) --dist worksteal -q --durations=30 tests

lint:
	$(PYTHON) -m ruff check lowrank_jax experiments configs tests colabs
	$(PYTHON) -m ruff format --check lowrank_jax experiments configs tests

format:
	$(PYTHON) -m ruff format lowrank_jax experiments configs tests
	$(PYTHON) -m ruff check --fix lowrank_jax experiments configs tests
