"""Parameter paths and target rules.

A parameter is named by the '/'-joined keys that lead to it in its pytree: ``params/encoder/layer_0/
attention/query/kernel`` for a linen variables dict, ``layers/0/kernel`` for an nnx ``State`` (the
``.value`` of an nnx ``Variable`` is not part of the name). Target rules are an ordered list of
``(regex, spec)`` pairs; a path is claimed by the first regex that *fully* matches it, and a rule whose
spec is ``None`` freezes what it matches.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import jax

__all__ = [
    "Rules",
    "check_rules",
    "drop_path",
    "get_path",
    "is_param_leaf",
    "key_name",
    "match_rules",
    "named_leaves",
    "path_to_str",
    "set_path",
]

Rules = Sequence[tuple[str, Any]]


def key_name(key: Any) -> str | None:
    """The name one pytree key contributes to a path (``None`` for an nnx ``Variable.value``)."""
    if isinstance(key, jax.tree_util.DictKey):
        return str(key.key)
    if isinstance(key, jax.tree_util.GetAttrKey):
        return None if key.name == "value" else key.name
    if isinstance(key, jax.tree_util.SequenceKey):
        return str(key.idx)
    if isinstance(key, jax.tree_util.FlattenedIndexKey):
        return str(key.key)
    return str(key)


def path_to_str(keypath: Iterable[Any]) -> str:
    """Joins a ``jax.tree_util`` key path into a '/'-separated name."""
    return "/".join(n for n in map(key_name, keypath) if n is not None)


def is_param_leaf(x: Any) -> bool:
    """Whether ``x`` is one parameter although a pytree: a quantised kernel (``qwix.QArray``)."""
    qwix = sys.modules.get("qwix")
    return qwix is not None and isinstance(x, qwix.QArray)


def named_leaves(tree: Any, is_leaf: Callable[[Any], bool] | None = None) -> dict[str, Any]:
    """Maps each leaf's path to the leaf, in flattening order (``is_leaf`` as in ``jax.tree``;
    by default a quantised kernel, ``is_param_leaf``, is one leaf).

    Raises:
      ValueError: two leaves share a path (e.g. keys that contain '/').
    """
    out: dict[str, Any] = {}
    for keypath, leaf in jax.tree_util.tree_flatten_with_path(tree, is_leaf or is_param_leaf)[0]:
        name = path_to_str(keypath)
        if name in out:
            raise ValueError(f"two parameters share the path {name!r}; rename one of them.")
        out[name] = leaf
    return out


def check_rules(rules: Rules) -> list[tuple[re.Pattern[str], Any]]:
    if isinstance(rules, tuple) and len(rules) == 2 and isinstance(rules[0], str):
        raise TypeError(
            "rules must be a list of (regex, spec) pairs; wrap the single pair in a list."
        )
    compiled = []
    for i, rule in enumerate(rules):
        if not (isinstance(rule, tuple | list) and len(rule) == 2 and isinstance(rule[0], str)):
            raise TypeError(f"rule {i} is {rule!r}; each rule must be a (regex, spec) pair.")
        try:
            compiled.append((re.compile(rule[0]), rule[1]))
        except re.error as e:
            raise ValueError(f"rule {i} has an invalid regex {rule[0]!r}: {e}") from None
    return compiled


def _listing(paths: Iterable[str], limit: int = 40) -> str:
    paths = list(paths)
    shown = "\n  ".join(paths[:limit])
    more = f"\n  ... and {len(paths) - limit} more" if len(paths) > limit else ""
    return f"  {shown}{more}"


def match_rules(tree: Any, rules: Rules) -> dict[str, tuple[Any, Any]]:
    """Assigns each leaf to the first rule that fully matches its path.

    Args:
      tree: a parameter pytree (linen variables, nnx ``State``, a plain dict, ...).
      rules: ordered ``(regex, spec)`` pairs; ``spec=None`` freezes the matched leaves.

    Returns:
      ``{path: (leaf, spec)}`` for every leaf claimed by a rule with a non-``None`` spec, in
      flattening order.

    Raises:
      ValueError: no rule with a spec matches any path (the message lists the available paths).
    """
    compiled = check_rules(rules)
    leaves = named_leaves(tree)
    targets: dict[str, tuple[Any, Any]] = {}
    for name, leaf in leaves.items():
        for pattern, spec in compiled:
            if pattern.fullmatch(name):
                if spec is not None:
                    targets[name] = (leaf, spec)
                break
    if not targets:
        shapes = (f"{p}  {getattr(v, 'shape', '')}" for p, v in leaves.items())
        raise ValueError(
            "the adapter rules match no parameter. Regexes must fully match a '/'-joined path; "
            f"the available paths are:\n{_listing(shapes)}"
        )
    return targets


def get_path(tree: Any, path: str) -> Any:
    """The subtree of nested dicts at the '/'-joined ``path``."""
    for part in path.split("/"):
        tree = tree[part]
    return tree


def set_path(tree: Any, path: str, value: Any) -> Any:
    """A copy of nested dicts ``tree`` with ``value`` at ``path`` (copies along the path only)."""
    head, _, rest = path.partition("/")
    out = dict(tree)
    out[head] = value if not rest else set_path(tree[head], rest, value)
    return out


def drop_path(tree: Any, path: str) -> Any:
    """A copy of nested dicts ``tree`` without the subtree at ``path`` (copies along the path)."""
    head, _, rest = path.partition("/")
    out = dict(tree)
    if rest:
        out[head] = drop_path(tree[head], rest)
    else:
        del out[head]
    return out
