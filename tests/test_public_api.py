"""The public surface stays in two tiers (docs/guides/contributing.md): each subpackage's namespace
holds what a user calls, within a budget; building blocks stay in their submodules. These tests fail
when a subpackage exports a module object or a validator, when two subpackages export one name, or
when a budget is exceeded. (That every ``__all__`` is one sorted list is ruff's RUF022.)"""

from __future__ import annotations

import collections
import importlib
import pkgutil
import types

import pytest

import lowrank_jax

MAX_PER_PACKAGE = 40
MAX_TOTAL = 320
PACKAGES = sorted(m.name for m in pkgutil.iter_modules(lowrank_jax.__path__) if m.ispkg)


def _exports(name: str) -> tuple[types.ModuleType, list[str]]:
    package = importlib.import_module(f"lowrank_jax.{name}")
    return package, list(package.__all__)


@pytest.mark.parametrize("name", PACKAGES)
def test_the_namespace_exports_what_users_call(name):
    package, exported = _exports(name)
    assert len(exported) <= MAX_PER_PACKAGE, (
        f"lowrank_jax.{name} exports {len(exported)} names (at most {MAX_PER_PACKAGE}): leave "
        "building blocks in their submodules"
    )
    assert len(set(exported)) == len(exported), f"lowrank_jax.{name}.__all__ repeats a name"
    missing = [n for n in exported if not hasattr(package, n)]
    assert not missing, f"lowrank_jax.{name}.__all__ names what it does not define: {missing}"
    modules = [n for n in exported if isinstance(getattr(package, n), types.ModuleType)]
    assert not modules, f"lowrank_jax.{name} exports module objects: {modules}"
    validators = [n for n in exported if n.startswith("check_")]
    assert not validators, f"lowrank_jax.{name} exports validators: {validators}"


def test_no_name_is_exported_by_two_subpackages_and_the_total_is_within_budget():
    owners = collections.defaultdict(list)
    for name in PACKAGES:
        for public in _exports(name)[1]:
            owners[public].append(name)
    shared = {public: pkgs for public, pkgs in owners.items() if len(pkgs) > 1}
    assert not shared, f"one name, one owner: {shared}"
    assert len(owners) <= MAX_TOTAL, (
        f"the subpackages export {len(owners)} names (at most {MAX_TOTAL})"
    )
