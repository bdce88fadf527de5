r"""Per-class Gaussian feature statistics, kept instead of exemplars.

One record, :class:`ClassStatistics`, serves both users in :mod:`lowrank_jax.continual`:

* GR-LoRA (:func:`~lowrank_jax.continual.gr_lora`) keeps means and diagonal variances of its
  inputs to synthesise out-of-distribution points;
* the class-incremental heads (:mod:`lowrank_jax.continual.heads`) keep means and full
  covariances of the features the classifier head reads, to re-fit the head on Gaussian
  pseudo-features of every seen class (SLCA's classifier alignment) or to write a prototype head.

For class ``c`` with rows ``X_c: (N_c, d)``: ``μ_c = mean(X_c)``, ``S_c = cov(X_c)`` (``1/N_c``
normalisation), pooled ``s² = var(X)`` over all rows of the call (per dimension), and with
shrinkage ``ρ``

    ``σ²_c = (1 − ρ) diag(S_c) + ρ s²``,   ``Σ_c = (1 − ρ) S_c + ρ diag(s²)``

so ``diag(Σ_c) = σ²_c``. :func:`sample_class_features` draws ``x̃ = μ_c + L_c z``, ``z ~ N(0, I)``,
``L_c L_cᵀ = Σ_c``.

References:
  Zhang et al. 2023, "SLCA: Slow Learner with Classifier Alignment for Continual Learning on a
  Pre-trained Model" (Gaussian class statistics in place of exemplars).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["ClassStatistics", "class_statistics", "covariance_factors", "sample_class_features"]


class ClassStatistics(NamedTuple):
    """Per-class Gaussian statistics (no exemplars are kept).

    Attributes:
      mean: ``(C, d)`` class means.
      var: ``(C, d)`` diagonal variances (shrunk towards the pooled variance).
      count: ``(C,)`` number of examples seen per class (0: unseen).
      cov: ``(C, d, d)`` full covariances (shrunk likewise; ``diag(cov[c]) == var[c]``), or None
        when only the diagonal was asked for.
    """

    mean: np.ndarray
    var: np.ndarray
    count: np.ndarray
    cov: np.ndarray | None = None


def class_statistics(
    x: Any,
    y: np.ndarray,
    num_classes: int,
    *,
    shrinkage: float = 0.1,
    covariance: bool = False,
    previous: ClassStatistics | None = None,
    chunk_size: int = 256,
) -> ClassStatistics:
    """Means and shrunk (co)variances of ``x`` per class, merged into ``previous``.

    ``x`` is read ``chunk_size`` rows at a time (``x[i : i + chunk_size]``), the chunks' moments
    combined exactly (Chan, Golub, LeVeque 1979), so ``x`` may be any row-sliceable sequence
    whose rows are read on demand (e.g. :class:`lowrank_jax.data.ImageRows`): no more than a
    chunk of it is ever held, in float64.

    Args:
      x: ``(N, ...)`` features (flattened to ``(N, d)``): an array or a row-sliceable sequence.
      y: ``(N,)`` integer classes in ``[0, num_classes)``.
      num_classes: ``C``.
      shrinkage: ``ρ``, the weight of the pooled (all-class) variance (module docstring).
      covariance: also keep full ``(C, d, d)`` covariances (``cov``).
      previous: statistics of earlier tasks; classes present in ``y`` are overwritten.
      chunk_size: rows read at a time.

    Returns:
      :class:`ClassStatistics` (float32; counts int64).

    Raises:
      ValueError: labels out of range or not one per row, ``shrinkage`` outside ``[0, 1]``, or
        ``previous`` without ``cov`` when ``covariance`` is asked for.
    """
    y = np.asarray(y)
    if y.shape != (len(x),):
        raise ValueError(f"y must hold one label per row of x ({len(x)}); got shape {y.shape}.")
    if y.size and (y.min() < 0 or y.max() >= num_classes):
        raise ValueError(f"labels must lie in [0, {num_classes}); got {y.min()}..{y.max()}.")
    if not 0.0 <= shrinkage <= 1.0:
        raise ValueError(f"shrinkage must lie in [0, 1], got {shrinkage!r}.")
    if covariance and previous is not None and previous.cov is None:
        raise ValueError("covariance=True needs previous statistics with covariances.")
    if not len(x):
        raise ValueError("x has no rows.")
    n = np.zeros(num_classes + 1, np.int64)  # row C: every row of the call (the pooled variance)
    d = int(np.prod(np.shape(x[:1])[1:]))
    mean, m2 = np.zeros((num_classes + 1, d)), np.zeros((num_classes + 1, d))
    cross = np.zeros((num_classes, d, d)) if covariance else None
    for i in range(0, len(x), chunk_size):
        xb = np.asarray(x[i : i + chunk_size], np.float64).reshape(-1, d)
        yb = y[i : i + chunk_size]
        groups = [(c, xb[yb == c]) for c in np.unique(yb)] + [(num_classes, xb)]
        for c, xc in groups:
            nb, mb = len(xc), xc.mean(axis=0)
            delta, total = mb - mean[c], n[c] + nb
            centred = xc - mb
            m2[c] += (centred**2).sum(axis=0) + delta**2 * n[c] * nb / total
            if covariance and c < num_classes:
                cross[c] += centred.T @ centred + np.outer(delta, delta) * n[c] * nb / total
            mean[c] += delta * nb / total
            n[c] = total
    return _shrunk(n, mean, m2, cross, num_classes, shrinkage, covariance, previous)


def _shrunk(n, mean, m2, cross, num_classes, shrinkage, covariance, previous) -> ClassStatistics:
    """The statistics from the per-class moments (row ``C``: all rows), merged into ``previous``."""
    d = mean.shape[1]
    if previous is None:
        out_mean, var = np.zeros((num_classes, d)), np.ones((num_classes, d))
        count = np.zeros(num_classes, np.int64)
        cov = np.broadcast_to(np.eye(d), (num_classes, d, d)).copy() if covariance else None
    else:
        out_mean, var, count = (np.array(a) for a in previous[:3])
        cov = np.array(previous.cov) if covariance else None
    pooled = m2[num_classes] / n[num_classes] if n[num_classes] > 1 else np.ones(d)
    for c in np.flatnonzero(n[:num_classes]):
        out_mean[c] = mean[c]
        vc = m2[c] / n[c] if n[c] > 1 else pooled
        var[c] = (1.0 - shrinkage) * vc + shrinkage * pooled
        count[c] = n[c]
        if covariance:
            sc = cross[c] / n[c] if n[c] > 1 else np.diag(pooled)
            cov[c] = (1.0 - shrinkage) * sc + shrinkage * np.diag(pooled)
    return ClassStatistics(
        out_mean.astype(np.float32),
        var.astype(np.float32),
        count,
        None if cov is None else cov.astype(np.float32),
    )


def covariance_factors(cov: jax.typing.ArrayLike) -> jax.Array:
    r"""``L`` with ``L Lᵀ = Σ`` for each covariance (symmetric square root; PSD-clipped).

    ``Σ = V diag(λ) Vᵀ`` (``eigh``), ``L = V diag(√max(λ, 0))``: works for singular ``Σ`` (fewer
    examples than dimensions), where a Cholesky factor would not exist.

    Args:
      cov: ``(..., d, d)`` symmetric positive semi-definite matrices.

    Returns:
      ``(..., d, d)`` float32 factors.
    """
    cov = jnp.asarray(cov, jnp.float32)
    lam, v = jnp.linalg.eigh(0.5 * (cov + jnp.swapaxes(cov, -1, -2)))
    return v * jnp.sqrt(jnp.maximum(lam, 0.0))[..., None, :]


def sample_class_features(
    key: jax.Array,
    mean: jax.typing.ArrayLike,
    factors: jax.typing.ArrayLike,
    classes: jax.typing.ArrayLike,
    *,
    num_per_class: int,
) -> tuple[jax.Array, jax.Array]:
    r"""Pseudo-features ``x̃ = μ_c + L_c z``, ``z ~ N(0, I_d)``, ``num_per_class`` for each class.

    Class-balanced, as SLCA samples its classifier-alignment features.

    Args:
      key: PRNG key.
      mean: ``(C, d)`` class means (:attr:`ClassStatistics.mean`).
      factors: ``(C, d, d)`` covariance factors (:func:`covariance_factors` of
        :attr:`ClassStatistics.cov`).
      classes: ``(k,)`` class ids to sample, ``k ≥ 1``.
      num_per_class: ``m``, samples per class (static).

    Returns:
      ``(features (k·m, d) float32, labels (k·m,) int32)``, class by class.

    Example:
      >>> stats = class_statistics(feats, y, 10, covariance=True)
      >>> f, c = sample_class_features(key, stats.mean, covariance_factors(stats.cov),
      ...                              np.flatnonzero(stats.count), num_per_class=256)
    """
    classes = jnp.asarray(classes, jnp.int32)
    mean = jnp.asarray(mean, jnp.float32)[classes]  # (k, d)
    factors = jnp.asarray(factors, jnp.float32)[classes]  # (k, d, d)
    k, d = mean.shape
    z = jax.random.normal(key, (k, num_per_class, d))
    x = mean[:, None, :] + jnp.einsum("kij,kmj->kmi", factors, z)
    return x.reshape(k * num_per_class, d), jnp.repeat(classes, num_per_class)
