"""Checks that parameter pytrees or task vectors can be merged: same paths (shapes, dtypes)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

import jax
import numpy as np

from lowrank_jax.adapters import paths

__all__ = ["check_same_tree", "leaf_signature"]

Signature = list[tuple[str, tuple[int, ...], str]]


def leaf_signature(tree: Any) -> Signature:
    """``[(path, shape, dtype name), ...]`` of a pytree's leaves in flattening order."""
    out = []
    for keypath, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        shape = tuple(np.shape(leaf))
        dtype = str(getattr(leaf, "dtype", np.asarray(leaf).dtype))
        out.append((paths.path_to_str(keypath), shape, dtype))
    return out


def _path_signature(tree: Any, what: str) -> Signature:
    """``[(path, (), ""), ...]`` over the sorted keys of a flat ``{path: value}`` mapping."""
    if not isinstance(tree, Mapping):
        raise TypeError(
            f"{what} is a {type(tree).__name__}; pass a flat {{path: value}} dict (an adapter "
            "set from adapters.init, task_vector(finetuned, base), or "
            "adapters.paths.named_leaves(params))."
        )
    return [(str(p), (), "") for p in sorted(tree)]


def check_same_tree(
    reference: Any,
    tree: Any,
    *,
    what: str = "tree",
    reference_what: str = "the reference tree",
    signature: Signature | None = None,
    compare: Literal["leaves", "paths"] = "leaves",
) -> Signature:
    """Raises if ``tree`` differs from ``reference`` in paths (and leaf shapes and dtypes).

    The one check behind every merge in :mod:`lowrank_jax.merging`. The message names the first
    differing '/'-joined parameter path and what differs there, so a checkpoint of another model,
    one saved with a different dtype, or a task vector over other kernels is caught before it is
    merged in.

    * ``compare="leaves"`` (parameter pytrees, checkpoints): every leaf's path, shape and dtype,
      in the reference's flattening order (a different order is an error too).
    * ``compare="paths"`` (flat ``{path: value}`` dicts such as task vectors and adapter sets,
      whose values may be an Adapter at one and a dense update at another): only the sets of
      keys, first differing key in sorted order.

    Args:
      reference: a parameter pytree (``"paths"``: a mapping), or None with ``signature``.
      tree: the pytree to compare with it.
      what: how the message names ``tree`` (e.g. ``"checkpoint 3"``).
      reference_what: how the message names ``reference``.
      signature: the signature returned by an earlier call on ``reference`` (saves re-flattening).
      compare: ``"leaves"`` or ``"paths"`` (see above).

    Returns:
      The reference's signature, to pass back in for the next comparison.

    Raises:
      TypeError: ``compare="paths"`` and an argument is not a mapping.
      ValueError: naming the first path that is missing, extra, or has another shape or dtype.
    """
    if compare == "leaves":
        ref = leaf_signature(reference) if signature is None else signature
        got = leaf_signature(tree)
    elif compare == "paths":
        ref = _path_signature(reference, reference_what) if signature is None else signature
        got = _path_signature(tree, what)
    else:
        raise ValueError(f"compare must be 'leaves' or 'paths'; got {compare!r}")
    if ref == got:
        return ref
    got_paths = {p for p, _, _ in got}
    ref_paths = {p for p, _, _ in ref}
    for i in range(max(len(ref), len(got))):
        r = ref[i] if i < len(ref) else None
        g = got[i] if i < len(got) else None
        if r == g:
            continue
        if r is not None and r[0] not in got_paths:
            problem = f"{what} has no parameter at {r[0]!r}"
        elif g is not None and g[0] not in ref_paths:
            problem = f"{what} has an extra parameter at {g[0]!r}"
        elif r is not None and g is not None and r[0] == g[0]:
            kind = "shape" if r[1] != g[1] else "dtype"
            a, b = (r[1], g[1]) if kind == "shape" else (r[2], g[2])
            problem = f"{what} differs at {r[0]!r}: {kind} {b} vs {a} in {reference_what}"
        else:  # same set of paths, another order (e.g. a list where a dict was)
            path = r[0] if r is not None else g[0]
            problem = f"{what} orders its parameters differently, first at {path!r}"
        if compare == "paths":
            advice = (
                f"Merged task vectors and parameter trees must cover the same kernels as "
                f"{reference_what}: restrict each to the common paths first."
            )
        else:
            advice = (
                f"Merged trees must have the same parameter paths, shapes and dtypes as "
                f"{reference_what}: load them from the same model (cast with jax.tree.map if "
                "only the dtype differs)."
            )
        raise ValueError(f"{problem}. {advice}")
    return ref
