"""Test configuration: float64 available for references, CPU only, quiet logs, and one XLA
compilation cache for the whole run."""

import os
import shutil
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

# The pytest workers and every process they start (CLI runs, notebook kernels, the two-process
# runs) inherit one persistent compilation cache, so a program compiled by one of them (the same
# smoke config run by several tests) is compiled once. Made by the controlling process, before
# the workers start; removed when the run ends. An outer JAX_COMPILATION_CACHE_DIR is kept.
_OWN_CACHE = (
    "PYTEST_XDIST_WORKER" not in os.environ and "JAX_COMPILATION_CACHE_DIR" not in os.environ
)
if _OWN_CACHE:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="lowrank_jax_xla_cache_")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

import jax  # noqa: E402

from tests.tiers import TIERS, tier_of  # noqa: E402

jax.config.update("jax_enable_x64", False)


def pytest_configure(config):
    for tier, holds in TIERS.items():
        config.addinivalue_line("markers", f"{tier}: {holds}")


def pytest_unconfigure(config):
    if _OWN_CACHE:
        shutil.rmtree(os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)


def pytest_collection_modifyitems(config, items):
    # One tier marker per test, from its path (tests/tiers.py): `pytest -m unit` is make test-fast.
    for item in items:
        item.add_marker(tier_of(item.nodeid))
