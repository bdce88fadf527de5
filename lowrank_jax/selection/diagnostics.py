"""How far from diagonal a gradient second moment is: GIST's off-diagonal energy diagnostic.

GIST (P11, specs §11 (4a)) argues that LoRA-factor gradients are strongly correlated across
coordinates, so an axis-aligned (diagonal, Adam-like) geometry misses most of their structure
and the SVD of the validation-gradient matrix (GIST) beats its diagonal variant (GIST-diag).
The diagnostic is the off-diagonal energy ratio of the per-example gradient second moment

    F = (1/N) Σ_i g_i g_iᵀ = GᵀG / N,        G = (g_1, …, g_N)ᵀ ∈ R^{N×D},
    ρ(F) = ‖F − diag(F)‖_F / ‖diag(F)‖_F,

compared between the LoRA factors (``D`` = number of factor parameters) and an equal-size
random subset of the full model's parameters. :func:`offdiag_energy_ratio` computes ρ without
forming the ``D × D`` matrix (through the ``N × N`` Gram matrix, ``‖GᵀG‖_F = ‖GGᵀ‖_F``);
:func:`lora_vs_full_offdiag` draws the gradients with the chunked per-example machinery of
:func:`~lowrank_jax.selection.gradient_features`, keeping only the sampled coordinates of the
full-parameter gradients.

ρ = 0 iff F is diagonal. It depends on N and D (F has rank ≤ N): compare ρ only at equal N and D.
Even then it mixes two things: genuine correlation between coordinates, and the finite-sample
off-diagonal noise of N examples, which grows with the number of coordinates of comparable
variance (for independent coordinates with variances σ_j², ρ² ≈ D_eff/N with the participation
ratio D_eff = (Σσ_j²)²/Σσ_j⁴; i.i.d. ones give ρ ≈ √((D − 1)/(N + 2))). :func:`permutation_null`
separates them: ρ of the same gradients with every coordinate permuted independently across the
examples (marginals kept, dependence destroyed); ρ / ρ_null > 1 measures real correlation.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from lowrank_jax.adapters import core as adapter_core
from lowrank_jax.adapters import paths as adapter_paths
from lowrank_jax.selection import gradients

__all__ = [
    "coordinate_subset",
    "lora_vs_full_offdiag",
    "offdiag_energy_ratio",
    "permutation_null",
    "take_columns",
]


def offdiag_energy_ratio(grads: jax.typing.ArrayLike, *, center: bool = False) -> jax.Array:
    """``ρ = ‖offdiag(F)‖_F / ‖diag(F)‖_F`` of ``F = GᵀG / N`` (the gradient second moment).

    Computed as ``‖offdiag F‖²_F = ‖GGᵀ‖²_F / N² − Σ_j F_jj²`` (``O(N²D)`` time, ``O(N² + D)``
    memory; the subtraction loses about ``√ε`` of relative accuracy when ρ ≪ 1, e.g. ~1e-3
    in float32, so ρ below that reads as ~0).

    Args:
      grads: ``(N, D)`` per-example gradients (rows), ``N ≥ 1``, ``D ≥ 2``.
      center: subtract the mean gradient first (``F`` becomes the covariance).

    Returns:
      A scalar (NaN if every gradient is zero).

    Raises:
      ValueError: ``grads`` is not ``(N, D)`` with ``D ≥ 2``.
    """
    g = jnp.asarray(grads)
    if g.ndim != 2 or g.shape[0] < 1 or g.shape[1] < 2:
        raise ValueError(f"grads must be (N, D) with N >= 1 and D >= 2; got {g.shape}")
    if not jnp.issubdtype(g.dtype, jnp.floating):
        g = g.astype(jnp.float32)
    if center:
        g = g - g.mean(0)
    n = g.shape[0]
    diag = jnp.sum(g * g, axis=0) / n  # F_jj, (D,)
    gram = g @ g.T / n  # (N, N); ‖F‖_F = ‖gram‖_F
    diag_sq = jnp.sum(diag * diag)
    off_sq = jnp.maximum(jnp.sum(gram * gram) - diag_sq, 0.0)
    return jnp.sqrt(off_sq / diag_sq)


def permutation_null(grads: jax.typing.ArrayLike, *, key: jax.Array) -> jax.Array:
    """``grads`` with each column permuted independently across the rows (examples).

    Keeps every coordinate's values (so ``diag(F)`` exactly) and removes any dependence between
    coordinates: ``offdiag_energy_ratio(permutation_null(G))`` is the ratio that independent
    coordinates with the same marginals would give at the same ``N`` and ``D``.
    """
    g = jnp.asarray(grads)
    order = jnp.argsort(jax.random.uniform(key, g.shape), axis=0)
    return jnp.take_along_axis(g, order, axis=0)


def take_columns(flat: jax.Array, idx: jax.Array) -> jax.Array:
    """``flat[:, idx]``: a coordinate subset of ``(c, D)`` gradients (a ``transform`` for
    :func:`~lowrank_jax.selection.gradient_features`)."""
    return jnp.take(flat, idx, axis=1)


def coordinate_subset(
    params: Any, size: int, *, key: jax.Array, paths: Iterable[str] | None = None
) -> np.ndarray:
    """``size`` distinct coordinates of ``params`` flattened in ``jax.tree.leaves`` order.

    The order is that of :func:`~lowrank_jax.selection.gradients.flatten_per_example` on gradients
    of ``params``. ``paths`` restricts the draw to the leaves with those '/'-joined paths (e.g. the
    kernels an adapter set targets); None: all leaves. Sorted int32 indices, uniform without
    replacement.

    Raises:
      ValueError: ``size`` exceeds the number of eligible coordinates, or a path is unknown.
    """
    leaves = adapter_paths.named_leaves(params)
    keep = set(leaves) if paths is None else set(paths)
    unknown = sorted(keep - set(leaves))
    if unknown:
        raise ValueError(f"paths {unknown[:3]} are not leaves of params; known: {list(leaves)[:5]}")
    offsets = np.cumsum([0] + [int(np.size(v)) for v in leaves.values()])
    pool = np.concatenate(
        [np.arange(offsets[i], offsets[i + 1]) for i, p in enumerate(leaves) if p in keep]
    )
    if not 1 <= size <= len(pool):
        raise ValueError(f"size must be in [1, {len(pool)}] (eligible coordinates); got {size}")
    rng = np.random.default_rng(np.asarray(jax.random.key_data(key)).ravel().tolist())
    return np.sort(rng.choice(pool, size, replace=False)).astype(np.int32)


@dataclasses.dataclass(frozen=True)  # equal per loss_fn: the jitted gradients compile once
class _WrtFrozen:
    loss_fn: Callable

    def __call__(self, frozen, trainable, example):
        return self.loss_fn(trainable, frozen, example)


def lora_vs_full_offdiag(
    loss_fn: Callable[[Any, Any, Any], jax.Array],
    adapters: Any,
    variables: Any,
    examples: Any,
    *,
    key: jax.Array,
    chunk_size: int = 64,
    center: bool = False,
) -> dict[str, float]:
    """ρ of the LoRA-factor gradients vs equal-size random subsets of full-parameter gradients.

    All three at the same point (base ``variables`` with ``adapters`` applied) and on the same
    ``N`` examples: ``"lora"``: the ``D`` factor coordinates of ``adapters``; ``"full"``: ``D``
    random coordinates of the gradient with respect to all of ``variables``; ``"full_adapted"``:
    ``D`` random coordinates of the kernels the adapters target (the same weight matrices
    as the LoRA factors). Each also as ``"<name>_null"``: the ratio after
    :func:`permutation_null` (independent coordinates, same marginals). Also ``"num_params"``
    (``D``) and ``"num_examples"`` (``N``).

    Args:
      loss_fn: ``(adapters, variables, one example) -> scalar`` (hashable, as in
        :func:`~lowrank_jax.selection.gradient_features`).
      adapters: an adapter set (``{kernel path: factors}``; paths are those of ``variables``).
      variables: the frozen base pytree.
      examples: pytree with a leading example axis.
      key: PRNG key of the coordinate subsets.
      chunk_size, center: as in :func:`~lowrank_jax.selection.gradient_features` and
        :func:`offdiag_energy_ratio`.
    """
    kw = {"chunk_size": chunk_size}
    lora = gradients.gradient_features(loss_fn, adapters, variables, examples, **kw)
    n, d = lora.shape

    def ratios(name, g, k):
        null = permutation_null(g, key=jax.random.fold_in(key, 100 + k))
        rho = offdiag_energy_ratio(g, center=center)
        return {name: float(rho), f"{name}_null": float(offdiag_energy_ratio(null, center=center))}

    out = ratios("lora", lora, 0)
    targets = sorted({p for s in adapter_core.as_sets(adapters) for p in s})
    for i, (name, sub) in enumerate((("full", None), ("full_adapted", targets))):
        idx = coordinate_subset(variables, d, key=jax.random.fold_in(key, i), paths=sub)
        g = gradients.gradient_features(
            _WrtFrozen(loss_fn), variables, adapters, examples,
            transform=take_columns, transform_args=(jnp.asarray(idx),), **kw,
        )  # fmt: skip
        out.update(ratios(name, g, i + 1))
    return {**out, "num_params": int(d), "num_examples": int(n)}
