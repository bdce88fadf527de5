"""Per-matrix cores of TIES, DARE and magnitude pruning, on stacks of updates ``(K, n, m)``.

Each function takes the ``K`` task updates of one kernel matrix (any views of the same shape) and
returns the merged update; :mod:`lowrank_jax.merging.task_merges` applies them to every kernel
of a task vector (and :func:`~lowrank_jax.merging.per_kernel.merge_per_kernel` applies any of
them). The rules, with weights ``w_k``:

* TIES (Yadav et al. 2023): trim each update to its ``⌊density · D⌋`` largest-magnitude entries
  (``T_k``); elect a sign per entry, ``γ = sign(Σ_k T_k)`` (``"total"``) or
  ``sign(Σ_k sign T_k)`` (``"frequency"``), with ``γ = +1`` at 0; disjoint mean
  ``Δ = Σ_k w_k T_k [sign T_k = γ] / max(1, Σ_k [sign T_k = γ])``;
* DARE (Yu et al. 2024): keep each entry with probability ``density`` and rescale,
  ``Δ = Σ_k w_k (M_k ⊙ Δ_k) / density`` with ``M_k ~ Bernoulli(density)``; DARE-TIES: the DARE
  masks, then TIES's sign election and disjoint mean;
* magnitude pruning (PEFT's ``magnitude_prune``): ``Δ = Σ_k w_k trim(Δ_k)``.

The steps follow PEFT's ``peft.utils.merge_utils`` (exactly ``⌊density · D⌋`` entries kept, ties
broken by position).

References:
  Yadav et al. 2023, TIES-Merging; Yu et al. 2024, Language models are Super Mario (DARE);
  PEFT ``peft.utils.merge_utils``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import jax
import jax.numpy as jnp

__all__ = [
    "dare_delta",
    "dare_masks",
    "dare_ties_delta",
    "magnitude_prune_delta",
    "ties_delta",
]

Majority = Literal["total", "frequency"]


def check_density(density: float) -> float:
    if not isinstance(density, int | float) or not 0.0 < density <= 1.0:
        raise ValueError(f"density must lie in (0, 1] (the kept fraction); got {density!r}.")
    return float(density)


def task_weights(weights: Sequence[float] | None, k: int) -> jax.Array:
    if weights is None:
        return jnp.ones((k,), jnp.float32)
    w = jnp.asarray(weights, jnp.float32)
    if w.shape != (k,):
        raise ValueError(f"weights must hold one float per task vector ({k}); got {weights!r}.")
    return w


def keep_largest(flat: jax.Array, count: int) -> jax.Array:
    """Boolean mask of the ``count`` largest ``|flat|`` entries of a 1-D array (ties: by position)."""
    _, idx = jax.lax.top_k(jnp.abs(flat), count)
    return jnp.zeros(flat.shape, bool).at[idx].set(True)


def trim_matrix(delta: jax.Array, density: float) -> jax.Array:
    """Keeps the ``⌊density · size⌋`` largest-magnitude entries of one matrix (PEFT's rule)."""
    if density >= 1.0:
        return delta
    flat = delta.reshape(-1)
    keep = keep_largest(flat, int(density * flat.size))
    return jnp.where(keep, flat, 0.0).reshape(delta.shape)


def check_trim(trim: str) -> None:
    if trim not in ("global", "per_kernel"):
        raise ValueError(
            f"trim must be 'global' (the TIES paper: one ranking over the whole task vector) or "
            f"'per_kernel' (PEFT: each kernel ranked alone); got {trim!r}."
        )


def ties_delta(
    deltas: jax.Array,
    *,
    density: float,
    weights: Sequence[float] | None = None,
    majority: Majority = "total",
) -> jax.Array:
    """TIES merge of ``K`` updates of one kernel: trim, elect sign, disjoint mean.

    ``T_k = trim(Δ_k)`` keeps the ``⌊density · n m⌋`` largest ``|Δ_k|`` entries of this matrix
    (per-kernel trimming; :func:`merge_ties` trims whole task vectors by default and then calls
    this with ``density=1``);
    ``γ = sign(Σ_k T_k)`` (or ``sign(Σ_k sign T_k)`` for ``majority="frequency"``), +1 at 0;
    ``Δ = Σ_k w_k T_k [sign T_k = γ] / max(1, Σ_k [sign T_k = γ])``.

    Args:
      deltas: ``(K, n, m)`` updates (dense matrix views).
      density: kept fraction in ``(0, 1]`` (1: no trimming).
      weights: ``K`` weights (default 1), applied in the disjoint mean as in PEFT.
      majority: ``"total"`` (sign of the summed mass, the TIES paper) or ``"frequency"``.

    Returns:
      ``(n, m)`` merged update.

    References:
      Yadav et al. 2023 (TIES-Merging); PEFT ``merge_utils.ties``.
    """
    density = check_density(density)
    if majority not in ("total", "frequency"):
        raise ValueError(f"majority must be 'total' or 'frequency'; got {majority!r}.")
    if deltas.ndim != 3:
        raise ValueError(f"deltas must be (K, n, m); got shape {deltas.shape}.")
    w = task_weights(weights, deltas.shape[0])
    trimmed = jax.vmap(lambda d: trim_matrix(d, density))(deltas)
    signs = jnp.sign(trimmed)
    mass = trimmed.sum(0) if majority == "total" else signs.sum(0)
    elected = jnp.where(mass >= 0, 1.0, -1.0)
    agree = signs == elected
    total = jnp.sum(jnp.where(agree, w[:, None, None] * trimmed, 0.0), 0)
    return total / jnp.maximum(agree.sum(0), 1)


def dare_masks(key: jax.Array, shape: Sequence[int], *, density: float) -> jax.Array:
    """Bernoulli(``density``) keep masks of ``shape`` (``True``: kept)."""
    return jax.random.bernoulli(key, check_density(density), tuple(shape))


def dare_delta(
    deltas: jax.Array,
    keep: jax.Array,
    *,
    density: float,
    weights: Sequence[float] | None = None,
) -> jax.Array:
    """DARE (drop and rescale, linear combination) of ``K`` updates of one kernel.

    ``Δ = Σ_k w_k (M_k ⊙ Δ_k) / density``: unbiased, ``E[Δ] = Σ_k w_k Δ_k``.

    Args:
      deltas: ``(K, n, m)`` updates.
      keep: ``(K, n, m)`` boolean (or 0/1) keep masks, e.g. :func:`dare_masks`; injecting them
        makes the merge deterministic (PEFT draws them with ``torch.bernoulli``).
      density: the keep probability the masks were drawn with, in ``(0, 1]``.
      weights: ``K`` weights (default 1).

    Returns:
      ``(n, m)`` merged update.

    References:
      Yu et al. 2024 (DARE); PEFT ``merge_utils.dare_linear``.
    """
    density = check_density(density)
    if keep.shape != deltas.shape:
        raise ValueError(f"keep has shape {keep.shape}; it must match deltas {deltas.shape}.")
    w = task_weights(weights, deltas.shape[0])
    kept = jnp.where(keep.astype(bool), deltas, 0.0) / density
    return jnp.tensordot(w, kept, axes=1)


def dare_ties_delta(
    deltas: jax.Array,
    keep: jax.Array,
    *,
    density: float,
    weights: Sequence[float] | None = None,
    majority: Majority = "total",
) -> jax.Array:
    """DARE-TIES of ``K`` updates of one kernel: drop and rescale, then elect sign, disjoint mean.

    ``T_k = M_k ⊙ Δ_k / density``, then :func:`ties_delta` of the ``T_k`` without trimming.

    Args:
      deltas: ``(K, n, m)`` updates.
      keep: ``(K, n, m)`` keep masks (:func:`dare_masks`, or injected).
      density: the keep probability, in ``(0, 1]``.
      weights: ``K`` weights (default 1), applied in the disjoint mean.
      majority: ``"total"`` or ``"frequency"`` (see :func:`ties_delta`).

    Returns:
      ``(n, m)`` merged update.

    Raises:
      ValueError: ``keep`` and ``deltas`` differ in shape; a bad density, weights or majority.

    References:
      Yu et al. 2024 (DARE) with Yadav et al. 2023 (TIES); PEFT ``merge_utils.dare_ties``.
    """
    density = check_density(density)
    if keep.shape != deltas.shape:
        raise ValueError(f"keep has shape {keep.shape}; it must match deltas {deltas.shape}.")
    kept = jnp.where(keep.astype(bool), deltas, 0.0) / density
    return ties_delta(kept, density=1.0, weights=weights, majority=majority)


def magnitude_prune_delta(
    deltas: jax.Array, *, density: float, weights: Sequence[float] | None = None
) -> jax.Array:
    """Magnitude pruning then a weighted sum, for ``K`` updates of one kernel.

    ``Δ = Σ_k w_k T_k`` with ``T_k`` the ``⌊density · n m⌋`` largest ``|Δ_k|`` entries of ``Δ_k``
    (ties by position), PEFT's ``magnitude_prune``.

    Args:
      deltas: ``(K, n, m)`` updates.
      density: kept fraction in ``(0, 1]``.
      weights: ``K`` weights (default 1).

    Returns:
      ``(n, m)`` merged update.

    Raises:
      ValueError: a bad density or weights, or ``deltas`` not 3-D.
    """
    density = check_density(density)
    if deltas.ndim != 3:
        raise ValueError(f"deltas must be (K, n, m); got shape {deltas.shape}.")
    w = task_weights(weights, deltas.shape[0])
    return jnp.tensordot(w, jax.vmap(lambda d: trim_matrix(d, density))(deltas), axes=1)
