r"""Data on a union of linear subspaces, intrinsic dimension by local PCA, and exact W₁ (P7).

* :func:`sample_union_of_subspaces`: ``μ = Σ_j w_j μ_j``, ``μ_j`` the push-forward of a
  non-smooth law on ``R^{k_j}`` by an orthonormal basis ``U_j ∈ R^{D×k_j}`` (specs.md §7 (4)).
* :func:`class_subspaces` / :func:`project_onto_class_subspaces`: real data made an exact union
  of subspaces — each class projected onto the span of its own top-``k`` right singular vectors
  (uncentred, so the subspaces are linear), and an isometric embedding into a smaller ``D``.
* :func:`estimate_intrinsic_dim`: local PCA around anchor points.
* :func:`wasserstein1`: exact W₁ between two empirical measures (POT's network simplex, or
  ``scipy.optimize.linear_sum_assignment`` for equal sizes).
* :func:`log_log_slope`: the rate ``a`` of ``W₁ ≈ c n^a`` by least squares on log-log axes,
  optionally of the excess ``W₁ - floor`` over the finite-sample floor ``W₁(true, true')``.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

__all__ = [
    "LAWS",
    "class_subspaces",
    "estimate_intrinsic_dim",
    "isometric_embedding",
    "log_log_slope",
    "project_onto_class_subspaces",
    "random_subspaces",
    "sample_union_of_subspaces",
    "wasserstein1",
]

LAWS = ("uniform", "laplace", "two_point")


def _sample_law(rng: np.random.Generator, law: str, num: int, k: int) -> np.ndarray:
    if law == "uniform":  # uniform on the cube [-1, 1]^k: a density with jumps
        return rng.uniform(-1.0, 1.0, (num, k))
    if law == "laplace":  # i.i.d. Laplace(0, 1/2): a cusp at 0, exponential tails
        return rng.laplace(0.0, 0.5, (num, k))
    if law == "two_point":  # ±(0.75, …) plus U[-0.25, 0.25]^k: two separated flat modes
        sign = np.where(rng.random((num, 1)) < 0.5, 1.0, -1.0)
        return 0.75 * sign + rng.uniform(-0.25, 0.25, (num, k))
    raise ValueError(f"unknown law {law!r}: allowed are {LAWS}.")


def _numpy_rng(key: jax.Array) -> np.random.Generator:
    """A NumPy generator seeded from a JAX key (host-side sampling compiles nothing)."""
    return np.random.default_rng(np.asarray(jax.random.bits(key, (4,), jnp.uint32)).tolist())


def random_subspaces(key: jax.Array, dim: int, ks: Sequence[int]) -> list[jax.Array]:
    """Independent uniformly random orthonormal bases ``U_j ∈ R^{D×k_j}`` (QR of Gaussians).

    Raises:
      ValueError: if some ``k_j > D`` or ``k_j < 0``.
    """
    for k in ks:
        if not 0 <= k <= dim:
            raise ValueError(f"subspace dimension k={k} must lie in [0, D={dim}].")
    gauss = np.asarray(jax.random.normal(key, (len(ks), dim, max(max(ks, default=1), 1))))
    bases = []
    for j, k in enumerate(ks):
        q, r = np.linalg.qr(gauss[j, :, : max(k, 1)])
        bases.append(jnp.asarray((q * np.sign(np.diag(r)))[:, :k], jnp.float32))
    return bases


def sample_union_of_subspaces(
    key: jax.Array,
    bases: Sequence[jax.Array],
    *,
    num: int,
    weights: Sequence[float],
    laws: Sequence[str],
) -> tuple[jax.Array, jax.Array]:
    """``num`` i.i.d. points of ``Σ_j w_j (U_j)_# ν_j`` with ``ν_j`` one of :data:`LAWS`.

    Args:
      key: PRNG key.
      bases: ``U_j``, each ``(D, k_j)`` with orthonormal columns (``k_j = 0`` gives ``δ_0``).
      num: number of points.
      weights: mixture weights (positive, normalised here).
      laws: the within-subspace law of each component.

    Returns:
      ``(x (num, D), component (num,))``.

    Raises:
      ValueError: for mismatched lengths, non-positive weights or an unknown law.
    """
    if not (len(bases) == len(weights) == len(laws)) or not bases:
        raise ValueError("bases, weights and laws must be non-empty and of equal length.")
    w = np.asarray(weights, np.float64)
    if np.any(w <= 0):
        raise ValueError(f"weights must be positive, got {weights}.")
    for law in laws:
        if law not in LAWS:
            raise ValueError(f"unknown law {law!r}: allowed are {LAWS}.")
    rng = _numpy_rng(key)
    comp = rng.choice(len(bases), size=num, p=w / w.sum())
    x = np.zeros((num, bases[0].shape[0]), np.float32)
    for j, (u, law) in enumerate(zip(bases, laws, strict=True)):
        u = np.asarray(u, np.float64)
        rows = comp == j
        if u.shape[1] and rows.any():
            x[rows] = _sample_law(rng, law, int(rows.sum()), u.shape[1]) @ u.T
    return jnp.asarray(x), jnp.asarray(comp)


def class_subspaces(x: ArrayLike, labels: ArrayLike, *, k: int) -> np.ndarray:
    """Per class, the top-``k`` right singular vectors of its (uncentred) rows: ``(C, D, k)``.

    Raises:
      ValueError: if ``k`` exceeds ``D`` or a class has fewer than ``k`` rows.
    """
    x = np.asarray(x, np.float64)
    labels = np.asarray(labels)
    if not 1 <= k <= x.shape[1]:
        raise ValueError(f"k={k} must lie in [1, D={x.shape[1]}].")
    bases = []
    for c in np.unique(labels):
        rows = x[labels == c]
        if len(rows) < k:
            raise ValueError(f"class {c} has {len(rows)} rows, fewer than k={k}.")
        _, _, vt = np.linalg.svd(rows, full_matrices=False)
        bases.append(vt[:k].T)
    return np.stack(bases)


def project_onto_class_subspaces(x: ArrayLike, labels: ArrayLike, bases: np.ndarray) -> np.ndarray:
    """``x_i ↦ U_c U_cᵀ x_i`` with ``c`` the label of ``x_i`` (labels ``0..C-1``)."""
    x = np.asarray(x, np.float64)
    labels = np.asarray(labels)
    out = np.empty_like(x)
    for c, u in enumerate(bases):
        rows = labels == c
        out[rows] = (x[rows] @ u) @ u.T
    return out


def isometric_embedding(bases: np.ndarray, *, dim: int) -> np.ndarray:
    """An orthonormal ``Q ∈ R^{D×dim}`` whose span contains every ``U_c`` (``x ↦ Qᵀx`` keeps all
    distances on the union).

    Raises:
      ValueError: if the union spans more than ``dim`` dimensions.
    """
    stacked = np.concatenate(list(bases), axis=1)
    u, s, _ = np.linalg.svd(stacked, full_matrices=False)
    r = int(np.sum(s > 1e-8 * s[0]))
    if r > dim:
        raise ValueError(f"the subspaces span {r} dimensions, more than dim={dim}.")
    q = u[:, :r]
    if r < dim:  # complete with orthonormal directions orthogonal to the span
        perp = np.linalg.svd(np.eye(stacked.shape[0]) - q @ q.T)[0][:, : dim - r]
        q = np.concatenate([q, perp], axis=1)
    return q


def estimate_intrinsic_dim(
    key: jax.Array,
    data: ArrayLike,
    *,
    num_anchors: int = 200,
    num_neighbors: int = 50,
    variance_threshold: float = 0.95,
    min_fraction: float = 0.1,
) -> tuple[int, np.ndarray]:
    """Intrinsic dimension by local PCA (specs.md §7: "k estimated by local PCA").

    Around each of ``num_anchors`` random training points, the covariance of its
    ``num_neighbors`` nearest neighbours; its local dimension is the number of eigenvalues needed
    to explain ``variance_threshold`` of the variance. Anchors near an intersection of subspaces
    see a larger local dimension, so the estimate of the *maximal* dimension ``k`` is the largest
    local dimension shared by at least ``min_fraction`` of the anchors.

    Args:
      key: PRNG key (choice of anchors).
      data: ``(n, D)`` points.
      num_anchors, num_neighbors: sizes (clipped to ``n``; at least 2 neighbours).
      variance_threshold: in (0, 1].
      min_fraction: in (0, 1].

    Returns:
      ``(k_hat, local_dims (num_anchors,))``.

    Raises:
      ValueError: for fewer than 3 points or thresholds outside (0, 1].
    """
    data = np.asarray(data, np.float64)
    n = data.shape[0]
    if data.ndim != 2 or n < 3:
        raise ValueError(f"data must be (n, D) with n >= 3, got shape {data.shape}.")
    for name, v in (("variance_threshold", variance_threshold), ("min_fraction", min_fraction)):
        if not 0.0 < v <= 1.0:
            raise ValueError(f"{name} must lie in (0, 1], got {v}.")
    num_anchors = min(int(num_anchors), n)
    kk = max(2, min(int(num_neighbors), n - 1))
    idx = np.asarray(jax.random.choice(key, n, (num_anchors,), replace=False))
    sq = np.sum(data**2, axis=1)
    dims = np.zeros(num_anchors, np.int64)
    for a, i in enumerate(idx):
        d2 = sq - 2.0 * data @ data[i] + sq[i]
        nb = data[np.argpartition(d2, kk)[: kk + 1]]
        # covariance eigenvalues from the singular values of the small (K+1, D) block
        ev = np.linalg.svd(nb - nb.mean(0), compute_uv=False) ** 2
        total = ev.sum()
        dims[a] = (
            0
            if total <= 1e-12
            else int(np.searchsorted(np.cumsum(ev) / total, variance_threshold - 1e-12) + 1)
        )
    counts = np.bincount(dims)
    frac = counts / num_anchors
    k_hat = int(np.max(np.nonzero(frac >= min_fraction)[0])) if np.any(frac >= min_fraction) else 0
    return k_hat, dims


def wasserstein1(x: ArrayLike, y: ArrayLike, *, num_iter_max: int = 10_000_000) -> float:
    """Exact ``W₁`` between the uniform empirical measures of ``x (a, D)`` and ``y (b, D)``.

    Uses POT's ``ot.emd2`` (network simplex) when installed (``pip install pot``; if POT is not
    imported yet, its PyTorch/TensorFlow backends are disabled through POT's environment
    variables to keep the import light), else, for
    ``a == b``, ``scipy.optimize.linear_sum_assignment`` (an optimal plan between two uniform
    measures of equal size is a permutation).

    Raises:
      ValueError: for mismatched dimensions; ImportError when sizes differ and POT is missing.
    """
    x = np.asarray(x, np.float64)
    y = np.asarray(y, np.float64)
    if x.ndim != 2 or y.ndim != 2 or x.shape[1] != y.shape[1]:
        raise ValueError(f"need (a, D) and (b, D) point sets, got {x.shape} and {y.shape}.")
    cost = np.sqrt(
        np.maximum(np.sum(x**2, 1)[:, None] + np.sum(y**2, 1)[None, :] - 2.0 * x @ y.T, 0.0)
    )
    if importlib.util.find_spec("ot") is not None:
        if "ot" not in sys.modules:  # POT would import torch/TF backends it does not need here
            os.environ.setdefault("POT_BACKEND_DISABLE_PYTORCH", "1")
            os.environ.setdefault("POT_BACKEND_DISABLE_TENSORFLOW", "1")
        import ot

        a = np.full(len(x), 1.0 / len(x))
        b = np.full(len(y), 1.0 / len(y))
        return float(ot.emd2(a, b, cost, numItermax=num_iter_max))
    if len(x) != len(y):
        raise ImportError("W₁ between sets of different sizes needs POT: pip install pot")
    from scipy.optimize import linear_sum_assignment

    rows, cols = linear_sum_assignment(cost)
    return float(cost[rows, cols].mean())


def log_log_slope(
    sizes: ArrayLike, errors: ArrayLike, *, floor: ArrayLike = 0.0
) -> tuple[float, int]:
    r"""Least-squares slope of ``log(error - floor)`` against ``log(size)``.

    With ``floor = 0`` it is the rate ``a`` of ``error ≈ c · size^a``. With the finite-sample floor
    ``W₁(true, true')`` of an ``m``-sample evaluation (the ``W₁`` a perfect sampler would get), it is
    the rate of the excess over that floor: near the floor the raw slope flattens towards 0 whatever
    the true rate. Points whose error does not exceed the floor carry no information on the rate and
    are left out (their number is returned).

    Args:
      sizes: ``(p,)`` positive sample sizes ``n``.
      errors: ``(p,)`` errors (``W₁``).
      floor: scalar or ``(p,)`` floors subtracted from ``errors``.

    Returns:
      ``(slope, num_points)``: the slope (NaN when fewer than 2 points exceed the floor) and the
      number of points it was fitted on.

    Raises:
      ValueError: for shapes that differ or sizes that are not positive.

    Example:
      >>> log_log_slope([100, 400], [0.5, 0.25])
      (-0.5, 2)
    """
    sizes = np.asarray(sizes, np.float64)
    errors = np.asarray(errors, np.float64)
    floor = np.broadcast_to(np.asarray(floor, np.float64), errors.shape) if errors.ndim else None
    if sizes.ndim != 1 or errors.shape != sizes.shape or floor is None:
        raise ValueError(
            f"sizes and errors must be 1-D of the same length, got {sizes.shape}, {errors.shape}."
        )
    if np.any(sizes <= 0):
        raise ValueError(f"sizes must be positive, got {sizes.tolist()}.")
    excess = errors - floor
    keep = np.isfinite(excess) & (excess > 0)
    if int(keep.sum()) < 2 or np.ptp(sizes[keep]) == 0:
        return float("nan"), int(keep.sum())
    slope = np.polyfit(np.log(sizes[keep]), np.log(excess[keep]), 1)[0]
    return float(round(slope, 12)), int(keep.sum())
