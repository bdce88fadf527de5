"""mergekit's SLERP, Model Stock, Breadcrumbs and DELLA, on task vectors.

Each merge works per kernel matrix (per stacked layer: one tensor of the Hugging Face model) on
the products ``ΔW_k`` of task vectors (:mod:`~lowrank_jax.merging.task_vectors`: adapter sets or
dense updates), and re-factorises the result as a LoRA of the stated rank (``None``: exact).
With ``δ_k`` the ``(n, m)`` matrix views:

* **SLERP** (Shoemake 1985; mergekit ``slerp``): ``θ = arccos⟨δ_0/‖δ_0‖, δ_1/‖δ_1‖⟩``,
  ``slerp = sin((1-t)θ)/sin θ · δ_0 + sin(tθ)/sin θ · δ_1``; linear interpolation when
  ``|cos θ| > 0.9995`` (nearly colinear), as mergekit. mergekit interpolates whole weights;
  here the task vectors (``t = 0``: ``δ_0``, ``t = 1``: ``δ_1``).
* **Model Stock** (Jang et al. 2024, Model Stock: all we need is just a few fine-tuned models):
  ``w_H = t · w̄ + (1 - t) w_0`` with ``t = K cos θ / (1 + (K - 1) cos θ)``, so the task vector is
  ``t · mean_k δ_k``; ``cos θ`` is the mean pairwise cosine of the ``δ_k`` of this tensor (the paper
  defines it for ``K = 2``; the mean over pairs is mergekit's choice).
* **Breadcrumbs** (Davari & Belilovsky 2023, Model Breadcrumbs): per task and tensor, drop the
  ``⌊γ D⌋`` largest magnitudes (outliers) and the smallest ones, keeping ``⌊density · D⌋`` entries
  (fewer outliers dropped if ``density + γ > 1``, as mergekit); merge ``Σ_k w_k M_k ⊙ δ_k``.
* **DELLA** (Deep et al. 2024, DELLA-Merging; mergekit ``della``): MagPrune keeps entry ``i`` of a
  row with probability ``p_i = density - ε + 2ε · (rank_i - 1)/(D_row - 1)`` (``rank`` of its
  magnitude within its row, 1 the smallest) and rescales it by ``1/p_i`` (unbiased); the
  rows are those of PyTorch's ``(out, in)`` weight, i.e. the columns of our ``(n, m)`` view. Then
  the TIES sign election on the weighted pruned updates, ``γ = sign(Σ_k w_k T_k)``, and the fuse
  ``Σ_k w_k T_k [agree] / Σ_k w_k [agree]`` (mergekit's ``normalize``), scaled by ``λ``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp

from lowrank_jax.adapters.core import Adapter
from lowrank_jax.merging import task_vectors as tv
from lowrank_jax.merging.per_kernel import merge_per_kernel
from lowrank_jax.merging.sparsify import task_weights

__all__ = [
    "breadcrumbs_delta",
    "della_delta",
    "della_keep_probabilities",
    "merge_breadcrumbs",
    "merge_della",
    "merge_model_stock",
    "merge_slerp",
    "model_stock_delta",
    "slerp_delta",
]

_COLINEAR = 0.9995  # mergekit's DOT_THRESHOLD
Rank = int | Mapping[str, int | None] | None


def _fraction(value: float, name: str, *, low_open: bool = True) -> float:
    ok = (
        isinstance(value, int | float)
        and (value > 0.0 if low_open else value >= 0.0)
        and value <= 1
    )
    if not ok:
        interval = "(0, 1]" if low_open else "[0, 1]"
        raise ValueError(f"{name} must lie in {interval}; got {value!r}.")
    return float(value)


def slerp_delta(d0: jax.Array, d1: jax.Array, *, t: float) -> jax.Array:
    """Spherical interpolation of two updates of one tensor (mergekit's ``slerp``).

    Args:
      d0, d1: updates of the same shape (any, flattened for the angle).
      t: interpolation position (0: ``d0``, 1: ``d1``).

    Returns:
      ``sin((1-t)θ)/sin θ · d0 + sin(tθ)/sin θ · d1`` (``θ`` the angle between them), or
      ``(1-t) d0 + t d1`` when ``|cos θ| > 0.9995``.

    Raises:
      ValueError: ``d0`` and ``d1`` differ in shape.

    References:
      Shoemake 1985; mergekit ``merge_methods/slerp.py``.
    """
    if d0.shape != d1.shape:
        raise ValueError(f"slerp needs updates of one shape; got {d0.shape} and {d1.shape}.")
    n0, n1 = jnp.linalg.norm(d0), jnp.linalg.norm(d1)
    u0 = jnp.where(n0 > 1e-8, d0 / n0, d0)
    u1 = jnp.where(n1 > 1e-8, d1 / n1, d1)
    dot = jnp.sum(u0 * u1)
    theta = jnp.arccos(jnp.clip(dot, -1.0, 1.0))
    sin = jnp.sin(theta)
    safe = jnp.where(sin > 0, sin, 1.0)
    spherical = (jnp.sin((1 - t) * theta) * d0 + jnp.sin(t * theta) * d1) / safe
    return jnp.where(jnp.abs(dot) > _COLINEAR, (1 - t) * d0 + t * d1, spherical)


def model_stock_delta(deltas: jax.Array) -> jax.Array:
    """Model Stock's task vector ``t · mean_k δ_k`` for ``K ≥ 2`` updates of one tensor.

    Args:
      deltas: ``(K, ...)`` updates ``w_k - w_0``.

    Returns:
      ``t · mean_k δ_k`` with ``t = K c / (1 + (K-1) c)``, ``c`` the mean pairwise cosine
      (norms clamped at 1e-6, ``c`` clipped to [-1, 1], as mergekit).

    Raises:
      ValueError: fewer than 2 updates.

    References:
      Jang et al. 2024 (Model Stock), eq. for ``t``; mergekit ``model_stock`` (mean over pairs).
    """
    k = deltas.shape[0]
    if k < 2:
        raise ValueError(f"Model Stock needs at least 2 fine-tuned task vectors; got {k}.")
    flat = deltas.reshape(k, -1)
    norms = jnp.linalg.norm(flat, axis=1)
    gram = (flat @ flat.T) / jnp.maximum(norms[:, None] * norms[None, :], 1e-6)
    i, j = jnp.triu_indices(k, 1)
    c = jnp.mean(jnp.clip(gram[i, j], -1.0, 1.0))
    denom = 1 + (k - 1) * c  # 0 only for exactly opposed updates (K = 2, c = -1): then t = 0
    t = jnp.where(denom > 1e-6, k * c / jnp.where(denom > 1e-6, denom, 1.0), 0.0)
    return t * deltas.mean(0)


def breadcrumbs_delta(
    deltas: jax.Array,
    *,
    density: float,
    gamma: float = 0.01,
    weights: Sequence[float] | jax.Array | None = None,
) -> jax.Array:
    """Model Breadcrumbs of ``K`` updates of one tensor: ``Σ_k w_k M_k ⊙ δ_k``.

    ``M_k`` keeps the entries of magnitude rank (ascending, ties by position) in
    ``[D - ⌊density D⌋ - ⌊γ D⌋, D - ⌊γ D⌋)``: the ``⌊γ D⌋`` largest and all below the kept band
    are dropped (the dropped outliers shrink to ``D - ⌊density D⌋`` when ``density + γ > 1``).

    Args:
      deltas: ``(K, ...)`` updates.
      density: kept fraction in ``(0, 1]``.
      gamma: fraction of the largest magnitudes dropped, in ``[0, 1]``.
      weights: ``K`` weights (default 1).

    Returns:
      The merged update, shaped as one ``deltas[k]``.

    Raises:
      ValueError: ``density`` outside ``(0, 1]``, ``gamma`` outside ``[0, 1]``, or weights that
        are not one per update.

    References:
      Davari & Belilovsky 2023 (Model Breadcrumbs); mergekit ``magnitude_outliers``.
    """
    density = _fraction(density, "density")
    gamma = _fraction(gamma, "gamma", low_open=False)
    k = deltas.shape[0]
    w = task_weights(weights, k)
    flat = deltas.reshape(k, -1)
    size = flat.shape[1]
    kept, top = int(density * size), int(gamma * size)
    top = min(top, size - kept)
    low = size - kept - top
    order = jnp.argsort(jnp.abs(flat), axis=1, stable=True)
    ranks = jnp.argsort(order, axis=1, stable=True)
    keep = (ranks >= low) & (ranks < size - top)
    return jnp.tensordot(w, jnp.where(keep, flat, 0.0), axes=1).reshape(deltas.shape[1:])


def della_keep_probabilities(delta: jax.Array, *, density: float, epsilon: float) -> jax.Array:
    """DELLA's MagPrune keep probabilities for one ``(n, m)`` update, per column.

    ``p_i = density - ε + 2ε (rank_i - 1)/(n - 1)``, ``rank_i`` the ascending magnitude rank of
    entry ``i`` in its column (a row of PyTorch's ``(out, in)`` weight; ties by position).

    Args:
      delta: ``(n, m)`` update.
      density: mean keep probability.
      epsilon: half-width of the keep probabilities' range.

    Returns:
      ``(n, m)`` keep probabilities in ``[density - ε, density + ε]``.

    Raises:
      ValueError: ``density ± ε`` leaves ``(0, 1)``, or ``delta`` is not 2-D.
    """
    if delta.ndim != 2:
        raise ValueError(f"delta must be an (n, m) matrix; got shape {delta.shape}.")
    if not (epsilon >= 0 and density - epsilon > 0 and density + epsilon < 1):
        raise ValueError(
            f"DELLA needs 0 <= epsilon and density ± epsilon in (0, 1); got density={density!r}, "
            f"epsilon={epsilon!r}."
        )
    n = delta.shape[0]
    order = jnp.argsort(jnp.abs(delta), axis=0, stable=True)
    ranks = jnp.argsort(order, axis=0, stable=True).astype(jnp.float32)  # 0 .. n-1
    spread = ranks / max(n - 1, 1)
    return density - epsilon + 2 * epsilon * spread


def della_delta(
    deltas: jax.Array,
    keep: jax.Array,
    *,
    density: float,
    epsilon: float,
    weights: Sequence[float] | jax.Array | None = None,
    scale: float = 1.0,
) -> jax.Array:
    """DELLA of ``K`` updates of one ``(n, m)`` tensor, given the MagPrune keep masks.

    ``T_k = M_k ⊙ δ_k / p_k`` (:func:`della_keep_probabilities`); ``γ = sign(Σ_k w_k T_k)``
    (+1 at 0); ``Δ = λ Σ_k w_k T_k [sign(w_k T_k) = γ] / Σ_k w_k [sign(w_k T_k) = γ]`` (a zero
    divisor counts as 1).

    Args:
      deltas: ``(K, n, m)`` updates.
      keep: ``(K, n, m)`` keep masks drawn with probabilities ``p_k`` (``merge_della`` draws
        ``Bernoulli(p_k)``).
      density: mean keep probability.
      epsilon: spread of the keep probabilities.
      weights: ``K`` weights (default 1).
      scale: ``λ``, applied after the fuse.

    Returns:
      ``(n, m)`` merged update.

    Raises:
      ValueError: ``deltas`` not ``(K, n, m)`` or ``keep`` of another shape; a bad density or
        epsilon (:func:`della_keep_probabilities`).

    References:
      Deep et al. 2024 (DELLA-Merging); mergekit ``della`` (its weighted ``normalize``).
    """
    if deltas.ndim != 3 or keep.shape != deltas.shape:
        raise ValueError(
            f"deltas must be (K, n, m) and keep the same shape; got {deltas.shape}, {keep.shape}."
        )
    k = deltas.shape[0]
    w = task_weights(weights, k)
    probs = jax.vmap(lambda d: della_keep_probabilities(d, density=density, epsilon=epsilon))(
        deltas
    )
    pruned = jnp.where(keep.astype(bool), deltas / probs, 0.0)
    weighted = w[:, None, None] * pruned
    elected = jnp.where(weighted.sum(0) >= 0, 1.0, -1.0)
    agree = jnp.sign(weighted) == elected
    divisor = jnp.sum(jnp.where(agree, w[:, None, None], 0.0), 0)
    divisor = jnp.where(divisor == 0, 1.0, divisor)
    return scale * jnp.sum(jnp.where(agree, weighted, 0.0), 0) / divisor


def merge_slerp(
    tv0: tv.TaskVector, tv1: tv.TaskVector, *, t: float, rank: Rank = None
) -> dict[str, Adapter]:
    """SLERP of two task vectors per kernel (per stacked layer), as a rank-``r`` LoRA.

    Args:
      tv0, tv1: ``{path: Adapter | dense update}`` over the same paths.
      t: interpolation position (0: ``tv0``, 1: ``tv1``).
      rank: as :func:`~lowrank_jax.merging.merge_task_arithmetic` (``None``: exact).

    Returns:
      ``{path: Adapter}`` (LoRA, scale 1).

    Example:
      >>> halfway = merge_slerp(lora_a, lora_b, t=0.5)
    """
    if not isinstance(t, int | float):
        raise TypeError(f"t must be a float; got {type(t).__name__}.")
    return merge_per_kernel([tv0, tv1], lambda d, w: slerp_delta(d[0], d[1], t=t), rank=rank)


def merge_model_stock(
    task_vectors: Sequence[tv.TaskVector], *, rank: Rank = None
) -> dict[str, Adapter]:
    """Model Stock of ``K ≥ 2`` task vectors per kernel (:func:`model_stock_delta`).

    Returns ``{path: Adapter}`` (LoRA, scale 1) encoding ``w_H - w_0``; ``rank`` as
    :func:`~lowrank_jax.merging.merge_task_arithmetic`.
    """
    return merge_per_kernel(task_vectors, lambda d, w: model_stock_delta(d), rank=rank)


def merge_breadcrumbs(
    task_vectors: Sequence[tv.TaskVector],
    *,
    density: float,
    gamma: float = 0.01,
    weights: Sequence[float] | None = None,
    rank: Rank = None,
) -> dict[str, Adapter]:
    """Model Breadcrumbs per kernel (:func:`breadcrumbs_delta`), as a rank-``r`` LoRA.

    Defaults as mergekit's ``breadcrumbs`` (``gamma=0.01``); returns ``{path: Adapter}``.
    """
    _fraction(density, "density")
    _fraction(gamma, "gamma", low_open=False)
    return merge_per_kernel(
        task_vectors,
        lambda d, w: breadcrumbs_delta(d, density=density, gamma=gamma, weights=w),
        weights=weights,
        rank=rank,
    )


def merge_della(
    task_vectors: Sequence[tv.TaskVector],
    key: jax.Array,
    *,
    density: float,
    epsilon: float = 0.15,
    scale: float = 1.0,
    weights: Sequence[float] | None = None,
    rank: Rank = None,
) -> dict[str, Adapter]:
    """DELLA per kernel (:func:`della_delta`, masks ``Bernoulli(p)`` from ``key``), as a LoRA.

    Kernel ``i`` (path order) and layer ``l`` draw from ``fold_in(fold_in(key, i), l)``.
    Defaults as mergekit's ``della`` (``epsilon=0.15``, ``lambda`` = ``scale`` = 1).
    Returns ``{path: Adapter}`` (LoRA, scale 1); ``rank`` as ``merge_task_arithmetic``.
    """
    della_keep_probabilities(jnp.zeros((2, 1)), density=density, epsilon=epsilon)  # validates

    def combine(d, w, key_l):
        probs = jax.vmap(lambda x: della_keep_probabilities(x, density=density, epsilon=epsilon))
        keep = jax.random.bernoulli(key_l, probs(d))
        return della_delta(d, keep, density=density, epsilon=epsilon, weights=w, scale=scale)

    return merge_per_kernel(task_vectors, combine, weights=weights, key=key, rank=rank)
