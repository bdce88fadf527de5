"""No hidden process-wide state in the library: at most three ``functools`` caches, each of a
constant (a function of ints and strings only, e.g. a shape and a seed), none keyed on functions,
methods, closures or data."""

from __future__ import annotations

import ast
import pathlib

import lowrank_jax

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


def _cached_functions(source: str) -> list[ast.FunctionDef]:
    return [
        node
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.FunctionDef)
        and any(d.lineno in _caches(source) for d in node.decorator_list)
    ]


def test_at_most_three_caches_each_of_a_constant():
    root = pathlib.Path(lowrank_jax.__file__).parent
    found, not_constant = [], []
    for path in sorted(root.rglob("*.py")):
        source = path.read_text()
        if not _caches(source):
            continue
        cached = _cached_functions(source)
        assert len(cached) == len(_caches(source)), f"{path}: a cache that decorates no function"
        for fn in cached:
            where = f"{path.relative_to(root)}:{fn.name}"
            found.append(where)
            kinds = {ast.unparse(a.annotation) if a.annotation else None for a in fn.args.args}
            if not kinds <= {"int", "str"}:
                not_constant.append(f"{where} takes {sorted(map(str, kinds))}")
    assert len(found) <= 3, f"more than three functools caches in lowrank_jax: {found}"
    assert not not_constant, f"caches keyed on more than ints and strings: {not_constant}"
