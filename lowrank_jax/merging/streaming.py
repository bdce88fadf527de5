r"""Reading checkpoints one at a time, and the one-pass weighted sum every merge builds on.

Checkpoints θ₁ … θ_N are parameter pytrees of identical paths, shapes and dtypes, given as any
iterable (one pass), or for multi-pass methods as a list, a lazy ``Sequence`` (loading each
checkpoint in ``__getitem__``) or a zero-argument function returning a fresh iterator
(:func:`reiterable`). :func:`stream_checkpoints` yields them checking each against the first
(:func:`~lowrank_jax.merging.trees.check_same_tree`), and :func:`weighted_sums` accumulates
Σ_i w_i θ_i for several weight vectors (global or per tensor) in one pass: LAWA, the window
merges and both passes of Extra-Merge are weighted sums.

Memory: the accumulators (float32, or float64 for float64 leaves) plus the checkpoint in flight;
a checkpoint loaded as NumPy arrays is consumed leaf by leaf (each leaf is added and dropped
before the next is converted), so only one leaf of it exists in two copies at a time.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from lowrank_jax.merging import trees

__all__ = [
    "Checkpoints",
    "accumulate",
    "accumulator_dtype",
    "axpby",
    "cast_like",
    "check_floating",
    "finish",
    "new_accumulator",
    "reiterable",
    "shape_tree",
    "stream_checkpoints",
    "weighted_sum",
    "weighted_sums",
]

PyTree = Any
Checkpoints = Iterable[PyTree] | Callable[[], Iterable[PyTree]]


def stream_checkpoints(checkpoints: Iterable[PyTree], indices: Iterable[int] | None = None):
    """Yields ``(i, tree)`` over the checkpoints, checking each tree against the first one.

    Args:
      checkpoints: any iterable of parameter pytrees.
      indices: with a Sequence, read only these items (in this order); ignored otherwise.

    Raises:
      ValueError: a tree differs from the first one (naming the first differing path).
    """
    if isinstance(checkpoints, Sequence):
        # Indexing, not iter(): a Sequence's iterator keeps the previous item alive while the
        # next one loads (two checkpoints in memory instead of one).
        indices = range(len(checkpoints)) if indices is None else indices
        items = ((i, checkpoints[i]) for i in indices)
    else:
        items = enumerate(checkpoints)
    signature = None
    first = None
    for i, tree in items:
        if signature is None:
            signature, first = trees.leaf_signature(tree), i
        else:
            trees.check_same_tree(
                None,
                tree,
                what=f"checkpoint {i}",
                reference_what=f"checkpoint {first}",
                signature=signature,
            )
        yield i, tree
        del tree  # before the next one is loaded


def reiterable(checkpoints: Checkpoints, what: str) -> Callable[[], Iterable[PyTree]]:
    """A function returning a fresh iterable over the checkpoints, for multi-pass methods."""
    if callable(checkpoints) and not isinstance(checkpoints, Sequence | Mapping):
        return checkpoints
    if isinstance(checkpoints, Sequence):
        return lambda: checkpoints
    raise TypeError(
        f"{what} reads the checkpoints more than once: pass a list, a lazy Sequence (loading "
        "each checkpoint in __getitem__), or a zero-argument function returning a fresh iterator "
        f"— not a one-shot {type(checkpoints).__name__}."
    )


def accumulator_dtype(dtype) -> jnp.dtype:
    """The dtype sums are accumulated in: float32, or wider if the leaf is wider."""
    return jnp.promote_types(dtype, jnp.float32)


def check_floating(tree: PyTree, what: str) -> None:
    """Raises TypeError naming the first non-floating leaf (e.g. a step counter) of ``tree``."""
    for path, _, dtype in trees.leaf_signature(tree):
        if not jnp.issubdtype(jnp.dtype(dtype), jnp.floating):
            raise TypeError(
                f"{what} has a non-floating leaf at {path!r} ({dtype}); merge only the float "
                "parameters (e.g. state['params'], not the optimizer step count)."
            )


_BLOCK = 1 << 20  # elements per block of host-side (NumPy) arithmetic


@functools.partial(jax.jit, donate_argnums=(0,))
def _axpby_device(acc: jax.Array, x: jax.Array, a: jax.Array, b: jax.Array) -> jax.Array:
    return a.astype(acc.dtype) * acc + b.astype(acc.dtype) * x.astype(acc.dtype)


def axpby(acc: Any, x: Any, a: float, b: float) -> Any:
    """``a·acc + b·x`` for one leaf, without a parameter-sized temporary.

    A NumPy accumulator is updated in place, block by block (``x`` is read through
    ``np.asarray``, a view for NumPy leaves and CPU arrays); a JAX accumulator is donated to a
    jitted update (in place where the backend supports donation). So a checkpoint loaded as NumPy
    arrays (e.g. from ``.npz``) is never converted to device arrays as a whole.
    """
    if not isinstance(acc, np.ndarray):
        return _axpby_device(acc, x, np.float64(a), np.float64(b))
    flat, xs = acc.reshape(-1), np.asarray(x).reshape(-1)
    scale_a, scale_b = acc.dtype.type(a), acc.dtype.type(b)
    tmp = np.empty(min(_BLOCK, flat.size), acc.dtype)
    for start in range(0, flat.size, _BLOCK):
        stop = min(start + _BLOCK, flat.size)
        t = tmp[: stop - start]
        np.multiply(xs[start:stop], scale_b, out=t, casting="unsafe")
        if scale_a != 1:
            flat[start:stop] *= scale_a
        flat[start:stop] += t
    return acc


def accumulate(acc: list[Any], leaves: Sequence[Any], a: float, b: Sequence[float]) -> None:
    """``acc[j] ← a·acc[j] + b[j]·leaves[j]`` for every leaf ``j`` (``acc`` updated in place)."""
    for j, (x, w) in enumerate(zip(leaves, b, strict=True)):
        if a != 1 or w != 0:
            acc[j] = axpby(acc[j], x, a, w)
    # Blocking keeps one checkpoint in flight: asynchronous dispatch would otherwise let the
    # loader run ahead and hold many checkpoints at once.
    jax.block_until_ready([x for x in acc if not isinstance(x, np.ndarray)])


def new_accumulator(tree: PyTree, *, copy: bool = False) -> list[Any]:
    """Zeros (or, with ``copy``, a copy of ``tree``) as a list of leaves in
    :func:`accumulator_dtype`: NumPy arrays for NumPy leaves (kept on the host, updated in place),
    JAX arrays otherwise."""

    def one(x):
        d = accumulator_dtype(x.dtype)
        if isinstance(x, np.ndarray):
            return np.array(x, d) if copy else np.zeros(x.shape, d)
        return jnp.array(x, d, copy=True) if copy else jnp.zeros(jnp.shape(x), d)

    return [one(x) for x in jax.tree.leaves(tree)]


def finish(acc: list[Any], template: PyTree, *, scale: float = 1.0) -> PyTree:
    """The accumulator as a pytree of JAX arrays in ``template``'s structure and dtypes, times
    ``scale``; ``acc``'s entries are released one by one (so the result and the accumulator
    together hold one copy plus one leaf)."""
    specs, treedef = jax.tree.flatten(template)
    out = []
    for j, spec in enumerate(specs):
        a, acc[j] = acc[j], None
        if scale != 1:
            a = a * a.dtype.type(scale) if isinstance(a, np.ndarray) else a * scale
        out.append(jnp.asarray(a).astype(spec.dtype))
        del a
    return jax.tree.unflatten(treedef, out)


def cast_like(acc: PyTree, signature_tree: PyTree) -> PyTree:
    """``acc`` cast leaf by leaf to the dtypes of ``signature_tree`` (arrays or shape structs)."""
    return jax.tree.map(lambda a, x: a.astype(x.dtype), acc, signature_tree)


def shape_tree(tree: PyTree) -> PyTree:
    """``jax.ShapeDtypeStruct`` leaves of ``tree`` (a template that holds no memory)."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(jnp.shape(x), x.dtype), tree)


def weighted_sums(
    checkpoints: Iterable[PyTree],
    weights: Sequence[Any],
) -> list[PyTree]:
    r"""Σ_i w_i θ_i for several weight vectors in one pass over the checkpoints.

    Each entry of ``weights`` is either an array of shape (N,) (the same weights for every
    parameter) or a mapping ``{path: (N,) array}`` over all '/'-joined parameter paths (one
    weight vector per tensor, as the per-tensor Extra-Merge needs). Accumulation is in float32
    (float64 for float64 leaves); results have the checkpoints' dtypes. A checkpoint whose
    weights are all zero is not read when ``checkpoints`` is a Sequence.

    Args:
      checkpoints: θ₁ … θ_N, any iterable of parameter pytrees (read once).
      weights: R weight specifications, each (N,) or ``{path: (N,)}``.

    Returns:
      A list of R pytrees.

    Raises:
      ValueError: the number of checkpoints is not N, a per-tensor mapping misses a path, or a
        checkpoint's tree differs from the first (naming the first differing path).
    """
    if isinstance(weights, np.ndarray | jax.Array) or not isinstance(weights, Sequence):
        raise TypeError("weights must be a list of weight vectors (wrap a single one in a list)")
    if not weights:
        raise ValueError("weights is empty: pass at least one weight vector")
    specs = [w if isinstance(w, Mapping) else np.asarray(w, np.float64) for w in weights]
    lengths = {
        (len(np.asarray(v)) if isinstance(s, Mapping) else len(s))
        for s in specs
        for v in (s.values() if isinstance(s, Mapping) else [s])
    }
    if len(lengths) != 1:
        raise ValueError(
            f"all weight vectors must have one length N; got lengths {sorted(lengths)}"
        )
    (n,) = lengths
    for s in specs:
        if not isinstance(s, Mapping) and s.ndim != 1:
            raise ValueError(f"a weight vector must be 1-D (N,); got shape {s.shape}")

    def nonzero(i: int) -> bool:
        return any(
            (
                np.any(np.asarray([v[i] for v in s.values()]) != 0)
                if isinstance(s, Mapping)
                else s[i] != 0
            )
            for s in specs
        )

    indices = [i for i in range(n) if nonzero(i)] if isinstance(checkpoints, Sequence) else None
    if isinstance(checkpoints, Sequence) and len(checkpoints) != n:
        raise ValueError(f"got {len(checkpoints)} checkpoints for weight vectors of length {n}")
    accs: list[list[Any]] | None = None
    template = names = None
    count = 0
    for i, tree in stream_checkpoints(checkpoints, indices):
        if i >= n:
            raise ValueError(f"got more than {n} checkpoints for weight vectors of length {n}")
        if accs is None:
            check_floating(tree, f"checkpoint {i}")
            template = shape_tree(tree)
            accs = [new_accumulator(tree) for _ in specs]
            names = [p for p, _, _ in trees.leaf_signature(tree)]
            for s in specs:
                missing = [p for p in names if p not in s] if isinstance(s, Mapping) else []
                if missing:
                    raise ValueError(
                        f"per-tensor weights have no entry for {missing[0]!r} (and "
                        f"{len(missing) - 1} more paths); give one (N,) vector per path"
                    )
        leaves = jax.tree.leaves(tree)
        del tree  # the leaves are dropped after the update, before the next checkpoint loads
        for acc, s in zip(accs, specs, strict=True):
            accumulate(acc, leaves, 1.0, _leaf_weights(s, names, i))
        count = i + 1
        del leaves
    if accs is None:
        raise ValueError("no checkpoints to merge (the iterable was empty)")
    if indices is None and count != n:
        raise ValueError(f"got {count} checkpoints for weight vectors of length {n}")
    return [finish(acc, template) for acc in accs]


def _leaf_weights(spec: Any, names: list[str], i: int) -> list[float]:
    if isinstance(spec, Mapping):
        return [float(np.asarray(spec[p])[i]) for p in names]
    return [float(spec[i])] * len(names)


def weighted_sum(checkpoints: Iterable[PyTree], weights: Any) -> PyTree:
    """Σ_i w_i θ_i in one pass; ``weights`` (N,) or ``{path: (N,)}`` (see :func:`weighted_sums`)."""
    return weighted_sums(checkpoints, [weights])[0]
