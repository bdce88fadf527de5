r"""Online detectors as values: the low-rank scan (P17) and its baselines, one interface.

A :class:`Detector` is a pair of pure functions ``init() -> state`` and
``update(state, y) -> (state, score)``: ``y`` is one ``(p, L)`` count matrix and ``score`` a
scalar that is compared with a threshold ``h`` (alarm at the first ``t`` with ``score_t > h``).
Every detector's ``h`` is calibrated the same way (:mod:`lowrank_jax.changepoint.calibration`),
so methods are compared at equal false-alarm rate.

* :func:`lowrank_scan`: ``score_t = max_w D_{t,w} / b_{t,w}`` of
  :mod:`lowrank_jax.changepoint.lowrank` (``h`` plays the role of the constant ``C``), window
  estimates by adaptive SVT (default) or a fixed rank.
* :func:`frobenius_scan`: the same multi-scale scan without truncation (non-low-rank).
* :func:`totals_cusum`: two-sided Poisson Page-CUSUM on the total count ``Σ_ij Y_t,ij`` with
  known pre-change rate ``μ₀`` and a relative change ``±δ``:
  ``S⁺_t = max(0, S⁺_{t-1} + x_t log(1+δ) − μ₀ δ)``, ``S⁻_t = max(0, S⁻_{t-1} + x_t log(1−δ) + μ₀ δ)``,
  ``score = max(S⁺, S⁻)``.
* :func:`entrywise_cusum`: the same two-sided CUSUM in every cell with known cell rates
  ``λ_ij``; ``score = max_ij``. :func:`bonferroni_cusum_threshold` gives its Bonferroni threshold
  ``h = log(2 p L T / α)`` (by Ville's inequality each of the ``T`` start points of each one-sided
  cell CUSUM crosses ``e^h`` with probability ``≤ e^{−h}``).

All updates are ``O(1)`` in ``t``. :func:`run_detector` scans a stream (optionally given as a source
array plus an index stream, as the bootstrap produces) and maps over streams with ``vmap``.

References: P17 (``papers/specs.md`` §17, baselines of (5)); Page 1954 (CUSUM); Lorden 1971.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from lowrank_jax.changepoint import lowrank

__all__ = [
    "Detector",
    "bonferroni_cusum_threshold",
    "entrywise_cusum",
    "first_alarm",
    "frobenius_scan",
    "lowrank_scan",
    "run_detector",
    "totals_cusum",
]


class Detector(NamedTuple):
    """An online detector: ``init() -> state``, ``update(state, ys) -> (state, scores)`` for a chunk
    ``ys: (B, p, L)`` of ``B ≥ 1`` observations (``scores: (B,)``, one per observation)."""

    init: Callable[[], Any]
    update: Callable[[Any, jax.Array], tuple[Any, jax.Array]]


def lowrank_scan(
    train_mean: jax.typing.ArrayLike,
    *,
    rank: int | None,
    estimator: str = "svt",
    max_rank: int | None = None,
    svt_scale: float = 0.5,
    num_scales: int = 5,
    alpha: float = 0.05,
    method: str = "subspace",
    power_iters: int = 1,
    rate_bound: float | None = None,
) -> Detector:
    """The P17 low-rank scan as a :class:`Detector`.

    Args:
      train_mean: ``(p, L)`` mean counts of a training stretch: gives ``λ̄ = max`` (unless
        ``rate_bound`` is passed) and the warm-start basis.
      rank: ``r``, the intensity's rank in the threshold shape ``b_{t,w}`` (``1 ≤ r ≤ min(p,
        L)``) and, with ``estimator="rank"``, the rank of the truncation; None for no estimate
        (the Frobenius scan, ``r = min(p, L)`` in ``b``).
      estimator: ``"svt"`` (default, specs §17): each window's estimate is the hard SVT of its
        mean at ``τ_S`` (:class:`lowrank.SVT`), its rank chosen per window and observation;
        ``"rank"``: the fixed rank-``r`` truncation.
      max_rank: with ``"svt"``, the largest rank a window may choose (the directions the
        subspace iteration tracks); default ``min(p, L, r + 2)``, and ``min(p, L)`` (no cap)
        with ``method="svd"``.
      svt_scale: ``c_τ`` of ``τ_S``; best calibrated on the training stretch
        (:func:`~lowrank_jax.changepoint.calibration.calibrate_svt_scale`). The default 0.5 is
        what that calibration gives on the synthetic streams of specs §17 without dependence
        (0.46–0.52 with blocks of 10; 0.64–0.69 with AR(1) ρ = 0.5; ``docs/notes/scripts/changepoint_svt_diag.py``).
        With the spec's constant 1, a single
        observation's top singular value lies near ``τ_1``, so the window of 1 is estimated as 0
        in some observations and as rank 1 in others, and those jumps set the null maximum.
      num_scales: ``J``, windows ``1, 2, …, 2^J``.
      alpha: level inside ``log(t² (J+1)/α)`` (of ``b_{t,w}`` and ``τ_S``).
      method, power_iters: see :func:`lowrank.update_lowrank_scan`.
      rate_bound: ``λ̄`` if not the max of ``train_mean``.

    Raises:
      ValueError: rank above ``min(p, L)``, a bad mean, level, estimator or method.
    """
    m = np.asarray(train_mean, np.float64)
    if m.ndim != 2:
        raise ValueError(f"train_mean must be (p, L), got shape {m.shape}")
    if np.any(m < 0) or not np.all(np.isfinite(m)):
        raise ValueError("train_mean must be finite and >= 0 (mean counts of a training stretch)")
    p, num_cells = m.shape
    rank = lowrank.check_rank(rank, p, num_cells)
    if method not in lowrank.METHODS:
        raise ValueError(f"method={method!r} is invalid: pass one of {lowrank.METHODS}")
    if estimator not in ("svt", "rank"):
        raise ValueError(f"estimator={estimator!r} is invalid: pass 'svt' or 'rank'")
    lam = float(m.max()) if rate_bound is None else float(rate_bound)
    # b_{t,w} checks alpha and lam here, once, on the host.
    lowrank.lowrank_threshold(
        1, rate_bound=lam, p=p, num_cells=num_cells, num_scales=num_scales, rank=rank, alpha=alpha
    )
    svt, k = None, rank
    if rank is not None and estimator == "svt":
        svt = lowrank.check_svt(lowrank.SVT(lam, float(alpha), float(svt_scale)))
        if max_rank is None:
            max_rank = min(p, num_cells) if method == "svd" else min(p, num_cells, rank + 2)
        k = lowrank.check_rank(max_rank, p, num_cells)
    elif max_rank is not None:
        raise ValueError("max_rank applies to estimator='svt' only; pass rank= for the fixed rank")
    basis = lowrank.initial_basis(m, rank=k)

    def init():
        return lowrank.init_lowrank_scan(basis, p=p, num_cells=num_cells, num_scales=num_scales)

    def update(state, y):
        state, d = lowrank.update_lowrank_scan(
            state, y, rank=k, svt=svt, method=method, power_iters=power_iters
        )
        t = state.t - d.shape[0] + 1 + jnp.arange(d.shape[0])  # time of each observation
        b = lowrank.lowrank_threshold(
            t,
            rate_bound=lam,
            p=p,
            num_cells=num_cells,
            num_scales=num_scales,
            rank=rank,
            alpha=alpha,
        )
        return state, jnp.max(d / b, axis=-1)

    return Detector(init, update)


def frobenius_scan(train_mean: jax.typing.ArrayLike, **kw: Any) -> Detector:
    """The multi-scale scan without low-rank truncation (``rank=None``), same threshold shape."""
    return lowrank_scan(train_mean, rank=None, **kw)


def _check_change(rel_change: float) -> float:
    if not 0 < rel_change < 1:
        raise ValueError(f"rel_change={rel_change} is invalid: pass a relative change in (0, 1)")
    return float(rel_change)


def _cusum_step(s_up, s_down, x, rate, delta):
    s_up = jnp.maximum(0.0, s_up + x * math.log1p(delta) - rate * delta)
    s_down = jnp.maximum(0.0, s_down + x * math.log1p(-delta) + rate * delta)
    return s_up, s_down


def totals_cusum(rate: float, *, rel_change: float = 0.1) -> Detector:
    """Two-sided Poisson Page-CUSUM on the totals ``Σ Y_t`` with known pre-change rate ``μ₀``.

    Args:
      rate: ``μ₀ > 0``, the pre-change mean of the total count (a traced scalar inside a
        ``refit`` of :func:`~lowrank_jax.changepoint.calibration.calibrate_threshold`).
      rel_change: ``δ``; the CUSUM is tuned to rates ``μ₀ (1 ± δ)``.
    """
    if isinstance(rate, jax.core.Tracer):  # built inside a traced refit (calibration)
        mu = jnp.asarray(rate, jnp.float32)
    elif not rate > 0:
        raise ValueError(f"rate={rate} is invalid: pass the pre-change mean total count (> 0)")
    else:
        mu = float(rate)
    delta = _check_change(rel_change)

    def init():
        return jnp.zeros((2,), jnp.float32)

    def update(state, y):
        def step(s, x):
            up, down = _cusum_step(s[0], s[1], x, mu, delta)
            return jnp.stack([up, down]), jnp.maximum(up, down)

        return jax.lax.scan(step, state, jnp.sum(jnp.asarray(y, jnp.float32), (1, 2)))

    return Detector(init, update)


def entrywise_cusum(
    rates: jax.typing.ArrayLike, *, rel_change: float = 0.5, min_rate: float = 0.05
) -> Detector:
    """Two-sided Poisson Page-CUSUM in every cell, ``score = max_ij``.

    Args:
      rates: ``(p, L)`` known pre-change cell means (clipped below at ``min_rate``).
      rel_change: ``δ`` of every cell's CUSUM.
      min_rate: floor for cells never seen in training.
    """
    lam = np.asarray(rates, np.float64)
    if lam.ndim != 2 or np.any(lam < 0) or not np.all(np.isfinite(lam)):
        raise ValueError("rates must be a finite (p, L) array of pre-change means >= 0")
    delta = _check_change(rel_change)
    lam = jnp.asarray(np.maximum(lam, min_rate), jnp.float32)

    def init():
        return jnp.zeros((2, *lam.shape), jnp.float32)

    def update(state, y):
        def step(s, x):
            up, down = _cusum_step(s[0], s[1], x, lam, delta)
            return jnp.stack([up, down]), jnp.maximum(up.max(), down.max())

        return jax.lax.scan(step, state, jnp.asarray(y, jnp.float32))

    return Detector(init, update)


def bonferroni_cusum_threshold(alpha: float, *, num_cells: int, horizon: int) -> float:
    """``h = log(2 · num_cells · horizon / α)``: the entrywise two-sided CUSUM's Bonferroni
    threshold, false alarm before ``horizon`` with probability ``≤ α`` under independence."""
    if not 0 < alpha < 1:
        raise ValueError(f"alpha={alpha} is invalid: pass a level in (0, 1)")
    return math.log(2 * num_cells * horizon / alpha)


@functools.partial(jax.jit, static_argnums=(0, 3))
def _run(detector, source, index, chunk):
    def one(idx):
        def step(state, i):
            return detector.update(state, source[i])

        scores = jax.lax.scan(step, detector.init(), idx.reshape(-1, chunk))[1]
        return scores.reshape(-1)

    return jax.vmap(one)(index)


def run_detector(
    detector: Detector,
    ys: jax.typing.ArrayLike,
    *,
    index: jax.typing.ArrayLike | None = None,
    chunk: int = 1,
) -> jax.Array:
    """Scores of ``detector`` along one or many streams, by ``lax.scan`` (``vmap`` over streams).

    Args:
      detector: a :class:`Detector`.
      ys: a stream ``(T, p, L)``; with ``index``, the source observations ``(n, p, L)``.
      index: optional int ``(T,)`` or ``(B, T)``: stream ``b`` is ``ys[index[b]]`` (the bootstrap
        streams of :func:`calibration.block_bootstrap_indices`, without materialising them).
      chunk: observations per scan step (the detector sees them one chunk at a time; scores are
        per observation either way). The stream is padded at its end to a multiple of ``chunk``
        and the padded scores dropped.

    Returns:
      float32 scores ``(T,)`` or ``(B, T)``.
    """
    if not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"chunk={chunk!r} is invalid: pass a positive integer")
    src = jnp.asarray(lowrank.check_counts(ys, name="ys"))
    if src.ndim != 3:
        raise ValueError(f"ys must be count matrices (T, p, L), got shape {src.shape}")
    if index is None:
        index = jnp.arange(src.shape[0])
    idx = jnp.asarray(index, jnp.int32)
    single = idx.ndim == 1
    idx = idx[None] if single else idx
    if idx.size and (int(idx.min()) < 0 or int(idx.max()) >= src.shape[0]):
        raise ValueError(f"index must lie in [0, {src.shape[0]}) (rows of ys)")
    n = idx.shape[1]
    pad = -n % chunk
    idx = jnp.concatenate([idx, jnp.zeros((idx.shape[0], pad), jnp.int32)], 1)
    out = _run(detector, src, idx, chunk)[:, :n]
    return out[0] if single else out


def first_alarm(scores: jax.typing.ArrayLike, threshold: float) -> np.ndarray:
    """1-based time of the first ``score > threshold`` along the last axis, 0 if none."""
    s = np.asarray(scores)
    hit = s > threshold
    return np.where(hit.any(-1), hit.argmax(-1) + 1, 0)
