"""Checks that parameter pytrees can be merged: same paths, shapes and dtypes."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from lowrank_jax.adapters import paths

__all__ = ["check_same_tree", "leaf_signature"]


def leaf_signature(tree: Any) -> list[tuple[str, tuple[int, ...], str]]:
    """``[(path, shape, dtype name), ...]`` of a pytree's leaves in flattening order."""
    out = []
    for keypath, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        shape = tuple(np.shape(leaf))
        dtype = str(getattr(leaf, "dtype", np.asarray(leaf).dtype))
        out.append((paths.path_to_str(keypath), shape, dtype))
    return out


def check_same_tree(
    reference: Any,
    tree: Any,
    *,
    what: str = "tree",
    reference_what: str = "the reference tree",
    signature: list[tuple[str, tuple[int, ...], str]] | None = None,
) -> list[tuple[str, tuple[int, ...], str]]:
    """Raises if ``tree`` differs from ``reference`` in paths, shapes or dtypes.

    The message names the first differing '/'-joined parameter path (in the reference's
    flattening order) and what differs there, so a checkpoint of another model, or one saved with
    a different dtype, is caught before it is averaged in.

    Args:
      reference: a parameter pytree.
      tree: the pytree to compare with it.
      what: how the message names ``tree`` (e.g. ``"checkpoint 3"``).
      reference_what: how the message names ``reference``.
      signature: ``leaf_signature(reference)`` if already computed (saves re-flattening).

    Returns:
      ``leaf_signature(reference)``, to pass back in for the next comparison.

    Raises:
      ValueError: naming the first path that is missing, extra, or has another shape or dtype.
    """
    ref = leaf_signature(reference) if signature is None else signature
    got = leaf_signature(tree)
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
        raise ValueError(
            f"{problem}. Merged trees must have the same parameter paths, shapes and dtypes as "
            f"{reference_what}: load them from the same model (cast with jax.tree.map if only "
            "the dtype differs)."
        )
    return ref
