"""The tier rules of tests/tiers.py point at tests that exist, and every tier holds tests."""

from __future__ import annotations

import ast
import fnmatch
import pathlib

from tests.tiers import RULES, TIERS, tier_of

REPO = pathlib.Path(__file__).resolve().parents[1]


def _test_names(path: pathlib.Path) -> list[str]:
    tree = ast.parse(path.read_text())
    return [
        node.name
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name.startswith("test")
    ]


def test_every_rule_matches_a_test_that_exists():
    stale = []
    for pattern, tier in RULES:
        assert tier in TIERS, f"{pattern}: unknown tier {tier!r}"
        file, _, name = pattern.partition("::")
        files = [p for p in REPO.glob(file) if p.is_file()]
        if not any(fnmatch.fnmatchcase(n, name) for p in files for n in _test_names(p)):
            stale.append(pattern)
    assert not stale, f"rules of tests/tiers.py that match no test (renamed or removed?): {stale}"


def test_every_tier_holds_tests():
    ids = [
        f"{path.relative_to(REPO).as_posix()}::{name}"
        for path in sorted((REPO / "tests").rglob("test_*.py"))
        for name in _test_names(path)
    ]
    counts = {tier: sum(tier_of(i) == tier for i in ids) for tier in TIERS}
    assert all(counts.values()), counts
    assert tier_of("tests/spectral/test_new.py::test_anything") == "unit"
