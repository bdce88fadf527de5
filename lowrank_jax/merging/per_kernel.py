"""The one merge driver: a rule per kernel matrix, over every kernel and stacked layer.

:func:`merge_per_kernel` reads ``K`` task vectors as matrix views
(:func:`~lowrank_jax.merging.task_vectors.task_vector_matrices`), runs a rule ``(K, n, m) -> (n, m)``
on every kernel and stacked layer (``vmap``-ed and jitted), and re-factorises each merged update as
a LoRA of the stated rank by a truncated SVD (:func:`~lowrank_jax.merging.task_vectors.to_lora`).
The merges of :mod:`~lowrank_jax.merging.task_merges` and :mod:`~lowrank_jax.merging.mergekit` are
such rules, run by :func:`merge_matrices`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from lowrank_jax.adapters.core import Adapter
from lowrank_jax.merging.sparsify import task_weights
from lowrank_jax.merging.task_vectors import TaskVector, task_vector_matrices, to_lora
from lowrank_jax.spectral import svd

__all__ = ["Rank", "merge_matrices", "merge_per_kernel"]

Rank = int | Mapping[str, int | None] | None


def _check_rank(rank: int | None, n: int, m: int, path: str) -> int:
    if rank is None:
        return min(n, m)
    if not isinstance(rank, int) or isinstance(rank, bool) or not 1 <= rank <= min(n, m):
        raise ValueError(
            f"rank={rank!r} does not fit {path!r}, a ({n}, {m}) matrix view: pass an int in "
            f"[1, {min(n, m)}] (or None for the exact, untruncated update)."
        )
    return rank


@functools.partial(jax.jit, static_argnums=1)
def _factorize(merged: jax.Array, rank: int) -> tuple[jax.Array, jax.Array]:
    return svd.balanced_factors(merged, rank=rank)


# ----------------------------------------------------------------------------------------------
# The driver: one rule per kernel matrix, over every kernel and stacked layer.


@functools.partial(jax.jit, static_argnames=("rule", "options"))
def _over_layers(ds, w, key, *, rule, options):
    """``rule(d, w[, key], **options)`` on each stacked layer ``d = ds[:, l]`` of ``(K, L, n, m)``;
    layer ``l`` gets ``fold_in(key, l)``."""
    kw = dict(options)
    if key is None:
        return jax.vmap(lambda d: rule(d, w, **kw), in_axes=1)(ds)
    keys = jax.vmap(lambda layer: jax.random.fold_in(key, layer))(jnp.arange(ds.shape[1]))
    return jax.vmap(lambda d, k: rule(d, w, k, **kw), in_axes=(1, 0))(ds, keys)


def merge_matrices(
    task_vectors: Sequence[TaskVector],
    rule: Callable[..., jax.Array],
    *,
    weights: Sequence[float] | None = None,
    key: jax.Array | None = None,
    rank: Rank = None,
    relative_to: TaskVector | None = None,
    base: Any = None,
    options: tuple[tuple[str, Any], ...] = (),
    prepare: Callable[[dict[str, jax.Array]], dict[str, jax.Array]] | None = None,
    shortcut: Callable[..., tuple[jax.Array, jax.Array] | None] | None = None,
) -> dict[str, Adapter]:
    """The one merge driver: :func:`merge_per_kernel` with the hooks the built-in rules use.

    Args:
      task_vectors, weights, key, rank, relative_to, base: as :func:`merge_per_kernel`.
      rule: ``rule(deltas, w[, key], **options)``, ``(K, n, m) -> (n, m)`` (a static argument of
        a jitted function: pass a function defined at module level where it is called often).
      options: ``rule``'s keyword arguments as hashable ``(name, value)`` pairs.
      prepare: ``{path: (K, L, n, m)} -> same`` applied to all kernels' updates first (TIES's
        global trimming).
      shortcut: ``shortcut(task_vectors, path, w, rank) -> (a, b) | None``: factors computed
        without the matrix views (task arithmetic of product forms), tried first when there is no
        ``relative_to``.
    """
    tvs = task_vectors
    if not isinstance(tvs, Sequence) or isinstance(tvs, Mapping) or not tvs:
        raise TypeError("task_vectors must be a non-empty list of {path: update} dicts.")
    w = task_weights(weights, len(tvs))
    extra = [relative_to] if relative_to is not None else []
    mats = task_vector_matrices([*tvs, *extra], base=base)
    if isinstance(rank, Mapping) and set(rank) != set(mats):
        raise ValueError(
            f"rank as a dict must give one rank per kernel path; missing "
            f"{sorted(set(mats) - set(rank))[:5]}, extra {sorted(set(rank) - set(mats))[:5]}."
        )
    num = len(tvs)
    views = {path: stacked[:num] for path, (stacked, _) in mats.items()}
    if prepare is not None:
        views = prepare(views)
    out = {}
    for index, (path, (stacked, layout)) in enumerate(mats.items()):
        _, _, n, m = stacked.shape
        wanted = rank.get(path) if isinstance(rank, Mapping) else rank
        r = _check_rank(wanted, n, m, path)
        factors = None
        if shortcut is not None and relative_to is None:
            factors = shortcut(tvs, path, w, wanted)
        if factors is None:
            rel = stacked[-1] if relative_to is not None else jnp.zeros_like(stacked[0])
            key_i = None if key is None else jax.random.fold_in(key, index)
            merged = _over_layers(views[path], w, key_i, rule=rule, options=tuple(options))
            factors = _factorize(merged - rel, r)
        out[path] = to_lora(factors, layout, n, m)
    return out


def merge_per_kernel(
    task_vectors: Sequence[TaskVector],
    combine: Callable[..., jax.Array],
    *,
    weights: Sequence[float] | None = None,
    key: jax.Array | None = None,
    rank: Rank = None,
    relative_to: TaskVector | None = None,
    base: Any = None,
) -> dict[str, Adapter]:
    """Any per-matrix merge rule over task vectors, re-factorised as a rank-``r`` LoRA.

    For every kernel path and stacked layer, ``combine(deltas, w)`` (``combine(deltas, w, key)``
    when ``key`` is given) gets the ``(K, n, m)`` matrix views of the ``K`` updates (float32),
    the ``(K,)`` weights (and a key, ``fold_in(fold_in(key, i), l)`` for kernel ``i`` in path
    order and layer ``l``) and returns the ``(n, m)`` merged update; it is ``vmap``-ed over
    stacked layers and jitted. Every merge of :mod:`~lowrank_jax.merging.task_merges` and
    :mod:`~lowrank_jax.merging.mergekit` is such a rule.

    Args:
      task_vectors: ``K`` ``{path: Adapter | dense update}`` dicts with the same paths.
      combine: the per-matrix rule, e.g. ``lambda d, w: jnp.tensordot(w, d, 1)``.
      weights: ``K`` weights (default 1 each).
      key: optional PRNG key for random rules.
      rank: output rank per kernel (``None``: ``min(n, m)``, exact), or ``{path: rank | None}``,
        one per kernel (per-module ranks, which :func:`lowrank_jax.adapters.save_peft` writes as
        PEFT's ``rank_pattern``).
      relative_to: optional task vector ``τ_0`` subtracted before re-factorising: the adapter then
        encodes ``merge - τ_0``, to be loaded on a model that already holds ``τ_0`` (a target
        ``W_t = W_s + τ_0``).
      base: the parameters the adapters were trained on, needed (only) by kinds whose update
        depends on the frozen kernel (DoRA sets merge through their dense ``ΔW``).

    Returns:
      ``{path: Adapter}`` of kind ``LoRA(rank, alpha=rank)`` (scale 1), ready for
      :func:`lowrank_jax.adapters.fold` or the adapted forward.

    Raises:
      ValueError: the task vectors have different paths or shapes (naming the first differing
        path), a bad rank or weights, a DoRA adapter without ``base``.
      TypeError: an entry is not a ``{path: update}`` dict.

    Example:
      >>> mean = merge_per_kernel([tv_a, tv_b], lambda d, w: d.mean(0), rank=8)
    """
    return merge_matrices(
        task_vectors,
        combine,
        weights=weights,
        key=key,
        rank=rank,
        relative_to=relative_to,
        base=base,
    )
