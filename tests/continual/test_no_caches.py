"""No hidden state in ``lowrank_jax.continual``: no ``functools`` cache (keyed on methods,
closures or data) anywhere in the package; compiled helpers live on the method values."""

from __future__ import annotations

import ast
import pathlib

from lowrank_jax import continual

CACHES = {"cache", "lru_cache", "cached_property"}


def _caches(source: str) -> list[int]:
    """Lines that use a ``functools`` cache (``functools.lru_cache``, ``from functools import
    cache``)."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if (
            isinstance(node, ast.Attribute)
            and node.attr in CACHES
            and isinstance(node.value, ast.Name)
            and node.value.id == "functools"
        ):
            lines.append(node.lineno)
        if isinstance(node, ast.ImportFrom) and node.module == "functools":
            lines += [node.lineno for alias in node.names if alias.name in CACHES]
    return lines


def test_the_check_finds_caches():
    assert _caches("import functools\n@functools.lru_cache(maxsize=1)\ndef f(): pass\n") == [2]
    assert _caches("from functools import cache, partial\n") == [1]
    assert _caches("import functools\ng = functools.partial(print)\n") == []


def test_no_functools_cache_in_the_continual_package():
    root = pathlib.Path(continual.__file__).parent
    found = {
        str(path.relative_to(root)): lines
        for path in sorted(root.rglob("*.py"))
        if (lines := _caches(path.read_text()))
    }
    assert not found, f"functools caches in lowrank_jax/continual: {found}"
