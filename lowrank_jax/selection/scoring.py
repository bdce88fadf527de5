"""Targeted data selection scores: GIST (P11), LESS, raw gradient cosine, random; top-p% selection.

Every scorer maps gradient features of a training pool and of a few-shot validation set (grouped
into subtasks) to one influence score per training example; :func:`select_top` keeps the best
``fraction``. Features come from :func:`lowrank_jax.selection.gradient_features`.

* **GIST** (specs §11, from the GIST code ``get_gist_gradients.py``/``matching_gist.py``): the
  top-``k`` right singular vectors ``V_k`` of the validation-gradient matrix ``G: (N, D)``
  (from the eigendecomposition of ``G Gᵀ``) span the target subspace; training gradients are
  projected isometrically, ``f(z) = V_kᵀ g(z)``; validation features ``G V_k = U_k S_k`` are
  averaged within each subtask; score = max over subtasks of the cosine, summed over checkpoints
  with normalised weights. Plain gradients (no Adam state); ``k`` floats per example.
* **LESS** (Xia et al. 2024): Adam-normalised training features and plain validation gradients,
  both randomly projected to ``d``; score = max over subtasks of the subtask-mean cosine,
  summed over warm-up checkpoints weighted by their mean learning rate; ``d·C`` floats.
* **cosine**: cosine of the full (unprojected) gradient with the mean validation gradient.
* **random**: uniform scores.

References:
  Min, Huang, Wan, Chen 2026, "GIST: Targeted Data Selection for Instruction Tuning via Coupled
  Optimization Geometry", arXiv 2602.18584 (P11); Xia et al. 2024, "LESS", ICML.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "GistBasis",
    "cosine_scores",
    "feature_storage_bytes",
    "gist_basis",
    "gist_scores",
    "less_scores",
    "random_scores",
    "select_top",
    "subtask_means",
]


class GistBasis(NamedTuple):
    """GIST's target subspace from validation gradients ``G = U S Vᵀ``.

    Attributes:
      projection: ``(D, k)`` ``P = Gᵀ U_k S_k⁻¹ = V_k``, orthonormal columns (an isometry on the
        span of ``G``'s top-``k`` directions).
      singular_values: ``(k,)`` ``S_k``, descending.
      val_features: ``(N, k)`` ``G P = U_k S_k``.
    """

    projection: jax.Array
    singular_values: jax.Array
    val_features: jax.Array


def _normalize(x: jax.Array, eps: float = 1e-12) -> jax.Array:
    return x / jnp.maximum(jnp.linalg.norm(x, axis=-1, keepdims=True), eps)


def gist_basis(val_grads: jax.Array, *, k: int, rtol: float = 1e-6) -> GistBasis:
    """The top-``k`` right singular directions of the validation gradients (GIST's steps 1-5).

    ``K = G Gᵀ = U Λ Uᵀ`` (eigenvalues descending), ``S = √max(Λ, 0)``, ``P = Gᵀ U_k S_k⁻¹``, as
    the GIST code computes it (``N ≪ D``: an ``N×N`` eigenproblem instead of a ``D``-wide SVD).
    ``P`` equals the top-``k`` right singular vectors ``V_k`` of ``G``, so for any ``g`` and any
    ``v`` in the span of those directions ``⟨Pᵀg, Pᵀv⟩ = ⟨g, v⟩``; with ``k = rank(G)`` this holds
    for every validation gradient. Directions with ``S_i ≤ rtol·S_1`` (beyond the rank of
    ``G``) get a zero column instead of a division by zero.

    Args:
      val_grads: ``(N, D)`` validation gradients (flat; plain gradients in GIST, Adam-scaled ones
        for GIST-diag).
      k: ``target_dim``, ``1 ≤ k ≤ N`` (the GIST README uses 9 for TydiQA).
      rtol: relative cut-off for numerically zero singular values.

    Returns:
      :class:`GistBasis`.

    Raises:
      ValueError: if ``val_grads`` is not 2-D or ``k`` is out of range.
    """
    g = jnp.asarray(val_grads)
    if g.ndim != 2:
        raise ValueError(f"val_grads must be (N, D); got shape {g.shape}.")
    if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= g.shape[0]:
        raise ValueError(
            f"k must be an int in [1, N={g.shape[0]}] (at most the number of validation "
            f"gradients); got {k!r}."
        )
    lam, u = jnp.linalg.eigh(g @ g.T)
    lam, u = lam[::-1][:k], u[:, ::-1][:, :k]
    s = jnp.sqrt(jnp.maximum(lam, 0.0))
    keep = s > rtol * s[0]
    p = (g.T @ u) * jnp.where(keep, 1.0 / jnp.where(keep, s, 1.0), 0.0)
    return GistBasis(projection=p, singular_values=s, val_features=g @ p)


def subtask_means(features: jax.Array, subtasks: jax.Array, *, num_subtasks: int) -> jax.Array:
    """``(T, k)`` mean feature of each subtask; ``subtasks: (N,)`` ids in ``[0, T)``.

    Raises:
      ValueError: if a subtask has no example.
    """
    ids = np.asarray(subtasks)
    counts = np.bincount(ids, minlength=num_subtasks)
    if ids.ndim != 1 or len(counts) != num_subtasks or (counts == 0).any():
        raise ValueError(
            f"subtasks must be (N,) ids covering every subtask in [0, {num_subtasks}); got "
            f"counts {counts.tolist()}."
        )
    sums = jax.ops.segment_sum(features, jnp.asarray(ids), num_segments=num_subtasks)
    return sums / jnp.asarray(counts, features.dtype)[:, None]


def _weights(weights: Sequence[float] | jax.Array | None, c: int) -> jax.Array:
    w = jnp.ones(c) if weights is None else jnp.asarray(weights, jnp.float32)
    if w.shape != (c,) or not bool(jnp.all(w >= 0)) or not float(w.sum()) > 0:
        raise ValueError(
            f"weights must be {c} non-negative numbers (one per checkpoint), not all zero; "
            f"got {w.tolist()}."
        )
    return w / w.sum()


def _check_ckpt_stack(train: jax.Array, val: jax.Array, name: str) -> None:
    if train.ndim != 3 or val.ndim != 3 or train.shape[::2] != val.shape[::2]:
        raise ValueError(
            f"{name} takes per-checkpoint features train (C, n, k) and val (C, N, k) with the "
            f"same C and k; got {train.shape} and {val.shape}. Stack checkpoints with jnp.stack."
        )


def gist_scores(
    train_features: jax.Array,
    val_features: jax.Array,
    subtasks: jax.Array,
    *,
    num_subtasks: int,
    weights: Sequence[float] | None = None,
) -> jax.Array:
    """GIST's matching (``matching_gist.py``): max over subtasks of the checkpoint-weighted cosine.

    ``score(z) = max_t Σ_c w̄_c cos(f_c(z), mean_{i ∈ t} f_c(val_i))`` with ``w̄ = w/Σw``: the
    validation features are averaged within each subtask *before* the cosine.

    Args:
      train_features: ``(C, n, k)`` projected training gradients ``Pᵀ g`` per checkpoint.
      val_features: ``(C, N, k)`` (``GistBasis.val_features``) per checkpoint.
      subtasks: ``(N,)`` subtask ids of the validation examples.
      num_subtasks: ``T``.
      weights: ``(C,)`` checkpoint weights (None: equal; the GIST README uses one checkpoint).

    Returns:
      ``(n,)`` scores.
    """
    train_features, val_features = jnp.asarray(train_features), jnp.asarray(val_features)
    _check_ckpt_stack(train_features, val_features, "gist_scores")
    w = _weights(weights, train_features.shape[0])
    means = jax.vmap(lambda v: subtask_means(v, subtasks, num_subtasks=num_subtasks))
    targets = _normalize(means(val_features))  # (C, T, k)
    cos = jnp.einsum("cnk,ctk->cnt", _normalize(train_features), targets)
    return jnp.einsum("c,cnt->nt", w, cos).max(-1)


def less_scores(
    train_features: jax.Array,
    val_features: jax.Array,
    subtasks: jax.Array,
    *,
    num_subtasks: int,
    weights: Sequence[float] | None = None,
) -> jax.Array:
    """LESS's matching: ``max_t mean_{i ∈ t} Σ_c w̄_c cos(Γ_c(z), ∇ℓ_c(val_i))``.

    Cosines with every validation example, summed over checkpoints with weights ``w̄ = w/Σw``
    (LESS weighs checkpoint ``c`` by its average learning rate ``η̄_c``; the normalisation does
    not change the ranking), averaged within each subtask, max over subtasks (LESS's
    ``matching.py``).

    Args:
      train_features: ``(C, n, d)`` projected Adam-normalised training gradients ``Γ_c``.
      val_features: ``(C, N, d)`` projected plain validation gradients.
      subtasks: ``(N,)`` subtask ids.
      num_subtasks: ``T``.
      weights: ``(C,)`` checkpoint learning-rate weights (None: equal).

    Returns:
      ``(n,)`` scores.
    """
    train_features, val_features = jnp.asarray(train_features), jnp.asarray(val_features)
    _check_ckpt_stack(train_features, val_features, "less_scores")
    w = _weights(weights, train_features.shape[0])
    cos = jnp.einsum("cnd,cmd->cnm", _normalize(train_features), _normalize(val_features))
    per_val = jnp.einsum("c,cnm->nm", w, cos)  # (n, N)
    return subtask_means(per_val.T, subtasks, num_subtasks=num_subtasks).max(0)


def cosine_scores(train_grads: jax.Array, val_grads: jax.Array) -> jax.Array:
    """``cos(g(z), ḡ_val)``: raw cosine with the mean validation gradient (no projection).

    Args:
      train_grads: ``(n, D)``; val_grads: ``(N, D)``.

    Returns:
      ``(n,)`` scores.
    """
    if train_grads.ndim != 2 or val_grads.ndim != 2 or train_grads.shape[1] != val_grads.shape[1]:
        raise ValueError(
            f"cosine_scores needs (n, D) and (N, D); got {train_grads.shape}, {val_grads.shape}."
        )
    return _normalize(train_grads) @ _normalize(val_grads.mean(0))


def random_scores(key: jax.Array, num_examples: int) -> jax.Array:
    """``(n,)`` i.i.d. uniform scores: the random-selection baseline."""
    return jax.random.uniform(key, (num_examples,))


def select_top(scores: jax.Array, *, fraction: float) -> np.ndarray:
    """Indices of the ``ceil(fraction·n)`` highest scores, best first (ties: lower index first).

    Raises:
      ValueError: unless ``0 < fraction ≤ 1``.
    """
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"fraction must be in (0, 1]; got {fraction!r}.")
    s = np.asarray(scores)
    m = max(1, int(np.ceil(fraction * len(s) - 1e-9)))
    return np.argsort(-s, kind="stable")[:m]


def feature_storage_bytes(*, dim: int, num_checkpoints: int = 1, dtype=np.float32) -> int:
    """Bytes stored per training example: ``dim`` features per checkpoint in ``dtype``.

    LESS keeps ``d`` (8192) projected features for each of its ``C`` (4) checkpoints, GIST
    ``k`` per checkpoint (1 in its README), so the ratio is ``k·C_GIST/(d·C_LESS)``.
    """
    for name, v in (("dim", dim), ("num_checkpoints", num_checkpoints)):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive int; got {v!r}.")
    return dim * num_checkpoints * np.dtype(dtype).itemsize
