r"""Threshold calibration by (moving-)block bootstrap on a training stretch.

Null streams of length ``T`` are built by concatenating blocks ``Y_{s..s+ℓ-1}`` of a training
stretch ``Y_1..Y_n`` with uniform starts ``s`` (Künsch's moving-block bootstrap; ``ℓ = 1`` is the
i.i.d. bootstrap). Blocks keep the short-range temporal dependence (AR(1) intensity factors,
weekly cycles) that a Poisson model would miss. The threshold is the ``(1−α)`` quantile of
``max_{t≤T} score_t`` over ``B`` bootstrap streams, so that under the null the detector alarms
before ``T`` with probability ``≈ α``; every detector is calibrated by the same routine.

**When it is accurate (measured, issue 15).** Two conditions, both about the training stretch:

1. *Length* ``n ≳ T/α``. The threshold is a ``(1−α)`` quantile of a maximum over ``T`` steps,
   i.e. roughly a per-step tail quantile at level ``α/T``. Bootstrap streams only recombine the
   ``n`` training observations, so a statistic whose maximum is set by single observations never
   exceeds what the stretch holds, and the quantile is too low unless the stretch resolves the
   ``α/T`` tail. The scans are such statistics: their maximum sits at the window ``w = 1`` in
   19 of 30 fresh null streams (setting below), and with the multiplicative factor ``e^{ε_t}``
   (a rank-1 shift along ``Λ``) that single observation's tail is heavy. P17 synthetic setting
   (``p = L = 30``, rank 2, ``σ = 0.2``, ``ρ = 0``, ``T = 500``, ``α = 0.05``, so
   ``T/α = 10⁴``; 200 bootstrap and 200 fresh streams, detectors built from the true ``Λ``, one
   training stretch per ``n``): false-alarm rate of the low-rank scan 0.125 / 0.100 / 0.035 and
   of the Frobenius scan 0.135 / 0.125 / 0.050 for ``n`` = 600 / 3000 / 12000 (MC s.e. ≈ 0.02);
   at ``n = 600`` the largest of the 200 bootstrap maxima (0.797) barely reaches the fresh
   streams' 95% quantile (0.792). Without the factor (``σ = 0``, pure Poisson) the thresholds
   are within 1–3% of the fresh quantiles already at ``n = 600``, but the maximum is so
   concentrated that this still moves the rate (0.03–0.105). This is the method's limit, not a
   fault: the ``α/T`` tail is not in ``n < T/α`` observations. Lengthen the training stretch
   (the bootstrap's cost does not depend on ``n``), calibrate a shorter horizon and restart, or
   simulate from a fitted model.
2. *Plug-ins.* A detector built from quantities estimated on the same stretch (the Page-CUSUMs'
   rates) is exactly centred in the bootstrap world (its rate is the resampled data's mean) but
   not on fresh data, so the in-sample bootstrap never sees the estimation error. Pass
   ``refit`` to re-estimate the plug-ins on a block-bootstrap resample of the training stretch
   for every bootstrap stream (Gandy & Kvaløy 2013). Totals CUSUM of the same setting, averaged
   over 40 training stretches of ``n = 600``: false-alarm rate 0.089 in-sample (0.26 for the
   worst stretch), 0.046 with re-estimation (``python docs/notes/scripts/changepoint_calibration_diag.py cusum``). Condition 1 still
   applies: with ``n = 40``, ``T = 100``, ``α = 0.1`` (i.i.d. Poisson, total rate 60) it is 0.22
   with re-estimation and 0.35 in-sample. The scans' plug-ins (``λ̄``, the warm-start basis) only
   weigh the scales; they compare two data means and do not need it (same thresholds with the
   true ``Λ`` or the training mean).

**The SVT level** (:func:`calibrate_svt_scale`). The window estimates of the low-rank scan
threshold singular values at ``τ_S = c_τ (√(λ̄ max(p, L) ℓ_t/|S|) + ℓ_t/|S|)`` (specs §17 gives
the form up to a constant). ``c_τ`` is read off the training stretch the same way: the
``(1−α)`` quantile, over block-bootstrap stretches of ``2^J`` observations, of
``max_w ‖Ȳ_w − Ȳ_train‖_op / τ_w(c_τ = 1)`` (``Ȳ_w`` the mean of the last ``w``, ``t`` the
horizon): the smallest level that the window means' deviation from the training mean stays
below at every scale. It needs no change and no data beyond the training stretch.

References: Künsch 1989 (moving-block bootstrap); Gandy & Kvaløy 2013, "Guaranteed conditional
performance of control charts via bootstrap methods" (Scand. J. Statist.); P17 ``papers/specs.md``
§17 ("calibrate C by simulation or block bootstrap on a burn-in segment").
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from lowrank_jax.changepoint import detectors as det
from lowrank_jax.changepoint import lowrank

__all__ = [
    "Calibration",
    "block_bootstrap_indices",
    "calibrate_svt_scale",
    "calibrate_threshold",
    "quantile_threshold",
]


class Calibration(NamedTuple):
    """A calibrated threshold and the bootstrap maxima it came from (``(B,)``)."""

    threshold: float
    maxima: np.ndarray


def block_bootstrap_indices(
    key: jax.Array, num_train: int, *, horizon: int, block_len: int, num_streams: int
) -> jax.Array:
    """Indices ``(B, T)`` into a training stretch of length ``n`` for moving-block bootstrap
    streams: ``⌈T/ℓ⌉`` blocks with uniform starts in ``[0, n−ℓ]``, concatenated and cut to ``T``.

    Raises:
      ValueError: if ``block_len`` is not in ``[1, num_train]`` or a size is not positive.
    """
    if not isinstance(block_len, int) or not 1 <= block_len <= num_train:
        raise ValueError(
            f"block_len={block_len!r} is invalid: pass an integer in [1, {num_train}] (the "
            "training stretch length)"
        )
    if horizon < 1 or num_streams < 1:
        raise ValueError("horizon and num_streams must be positive integers")
    nb = -(-horizon // block_len)
    starts = jax.random.randint(key, (num_streams, nb), 0, num_train - block_len + 1)
    idx = starts[:, :, None] + jnp.arange(block_len)[None, None]
    return idx.reshape(num_streams, nb * block_len)[:, :horizon]


def quantile_threshold(maxima: np.ndarray, alpha: float) -> float:
    """The ``(1−α)`` quantile (the ``⌈(B+1)(1−α)⌉``-th order statistic, capped at ``B``)."""
    if not 0 < alpha < 1:
        raise ValueError(f"alpha={alpha} is invalid: pass a level in (0, 1)")
    m = np.sort(np.asarray(maxima, np.float64).ravel())
    k = min(int(np.ceil((len(m) + 1) * (1 - alpha))), len(m))
    return float(m[k - 1])


def calibrate_threshold(
    detector: det.Detector,
    train: jax.typing.ArrayLike,
    *,
    key: jax.Array,
    alpha: float,
    horizon: int,
    block_len: int = 1,
    num_streams: int = 200,
    batch: int = 50,
    chunk: int = 1,
    refit: Callable[[jax.Array], det.Detector] | None = None,
) -> Calibration:
    """Calibrates ``detector``'s threshold on block-bootstrap streams of ``train``.

    Args:
      detector: a :class:`~lowrank_jax.changepoint.detectors.Detector`.
      train: the training stretch ``(n, p, L)`` of counts.
      key: PRNG key of the bootstrap.
      alpha: target probability of a false alarm before ``horizon``.
      horizon: monitoring length ``T`` (accurate for ``n ≳ T/α``, see the module).
      block_len: ``ℓ`` (1 for independent observations; longer under dependence).
      num_streams: ``B``.
      batch: streams run at once (memory; with ``refit`` each stream also gathers its own
        ``(n, p, L)`` stretch unless the factory's reductions fuse with the gather).
      chunk: observations per scan step (:func:`run_detector`).
      refit: optional factory ``stretch (n, p, L) int32 -> Detector`` that builds ``detector``
        from a training stretch, written in ``jnp`` (it is traced; e.g.
        ``lambda s: totals_cusum(s.sum((1, 2)).mean(), rel_change=0.05)``). When given,
        bootstrap stream ``b`` is monitored by ``refit(train[I_b])`` for its own block-bootstrap
        resample ``I_b`` of length ``n`` (Gandy & Kvaløy's re-estimating bootstrap) instead of
        by ``detector``, so the threshold includes the plug-ins' estimation error.

    Returns:
      :class:`Calibration` with the threshold and the ``B`` maxima.

    Raises:
      TypeError: if ``refit`` is not callable or cannot be traced by JAX.
    """
    train = np.asarray(train)
    key_mon, key_fit = jax.random.split(key) if refit is not None else (key, None)
    idx = block_bootstrap_indices(
        key_mon, train.shape[0], horizon=horizon, block_len=block_len, num_streams=num_streams
    )
    if refit is None:
        maxima = []
        for i in range(0, num_streams, batch):
            scores = det.run_detector(detector, train, index=idx[i : i + batch], chunk=chunk)
            maxima.append(np.asarray(scores.max(-1)))
        return Calibration(
            quantile_threshold(np.concatenate(maxima), alpha), np.concatenate(maxima)
        )
    if not callable(refit):
        raise TypeError(f"refit={refit!r} is invalid: pass a function stretch -> Detector")
    src = jnp.asarray(lowrank.check_counts(train, name="train"))
    fit_idx = block_bootstrap_indices(
        key_fit,
        train.shape[0],
        horizon=train.shape[0],
        block_len=block_len,
        num_streams=num_streams,
    )
    pad = -horizon % chunk
    idx = jnp.concatenate([idx, jnp.zeros((num_streams, pad), idx.dtype)], 1)
    maxima = []
    try:
        for i in range(0, num_streams, batch):
            scores = _run_refit(refit, src, fit_idx[i : i + batch], idx[i : i + batch], chunk)
            maxima.append(np.asarray(scores[:, :horizon].max(-1)))
    except (
        jax.errors.ConcretizationTypeError,
        jax.errors.TracerArrayConversionError,
        jax.errors.TracerBoolConversionError,
    ) as e:
        raise TypeError(
            "refit must build its Detector with jnp operations (it is traced under jit and vmap); "
            f"JAX could not trace it: {type(e).__name__}"
        ) from e
    maxima = np.concatenate(maxima)
    return Calibration(quantile_threshold(maxima, alpha), maxima)


def calibrate_svt_scale(
    train: jax.typing.ArrayLike,
    *,
    key: jax.Array,
    alpha: float,
    horizon: int,
    num_scales: int,
    block_len: int = 1,
    num_streams: int = 200,
    rate_bound: float | None = None,
) -> float:
    """``c_τ`` of the SVT level from a training stretch (see the module docstring).

    Args:
      train: the training stretch ``(n, p, L)`` of counts (``n ≥ 2^J``).
      key: PRNG key of the bootstrap.
      alpha: the quantile level (and the level inside ``ℓ_t``).
      horizon: ``t`` at which ``ℓ_t`` is evaluated (the monitoring length ``T``).
      num_scales: ``J``; windows ``1, 2, …, 2^J``.
      block_len: ``ℓ`` of the moving-block bootstrap (longer under dependence).
      num_streams: ``B`` bootstrap stretches of ``2^J`` observations.
      rate_bound: ``λ̄`` (default: the largest cell mean of ``train``), as the detector's.

    Returns:
      ``c_τ`` to pass as ``lowrank_scan(..., svt_scale=c_τ)``.

    Raises:
      ValueError: a stretch shorter than ``2^J`` or than ``block_len``, or a bad level.
    """
    src = lowrank.check_counts(train, name="train")
    if src.ndim != 3:
        raise ValueError(f"train must be count matrices (n, p, L), got shape {src.shape}")
    n, p, num_cells = src.shape
    w = lowrank.scales(num_scales)
    if n < w[-1]:
        raise ValueError(f"train has {n} observations: pass at least 2^J = {w[-1]}")
    mean = src.mean(0)
    lam = float(mean.max()) if rate_bound is None else float(rate_bound)
    svt = lowrank.check_svt(lowrank.SVT(lam, float(alpha), 1.0))
    idx = np.asarray(
        block_bootstrap_indices(
            key, n, horizon=int(w[-1]), block_len=block_len, num_streams=num_streams
        )
    )
    tau = np.asarray(
        lowrank.svt_threshold(
            horizon, w.astype(np.float32), svt, p=p, num_cells=num_cells, num_scales=num_scales
        ),
        np.float64,
    )
    ratios = []
    for i in range(0, num_streams, 50):  # (50, 2^J, p, L) stretches at a time (memory)
        stretches = src[idx[i : i + 50]].astype(np.float64)
        top = [
            np.linalg.svd(stretches[:, -int(size) :].mean(1) - mean, compute_uv=False)[:, 0]
            / tau[j]
            for j, size in enumerate(w)
        ]
        ratios.append(np.stack(top, axis=1).max(1))
    return quantile_threshold(np.concatenate(ratios), alpha)


@functools.partial(jax.jit, static_argnums=(0, 4))
def _run_refit(refit, source, fit_index, index, chunk):
    """Scores ``(B, T')`` of ``refit(source[fit_index[b]])`` on ``source[index[b]]``."""

    def one(fit_idx, idx):
        detector = refit(source[fit_idx])

        def step(state, i):
            return detector.update(state, source[i])

        scores = jax.lax.scan(step, detector.init(), idx.reshape(-1, chunk))[1]
        return scores.reshape(-1)

    return jax.vmap(one)(fit_index, index)
