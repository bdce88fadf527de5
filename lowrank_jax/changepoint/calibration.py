r"""Threshold calibration by (moving-)block bootstrap on a training stretch.

Null streams of length ``T`` are built by concatenating blocks ``Y_{s..s+ℓ-1}`` of a training
stretch ``Y_1..Y_n`` with uniform starts ``s`` (Künsch's moving-block bootstrap; ``ℓ = 1`` is the
i.i.d. bootstrap). Blocks keep the short-range temporal dependence (AR(1) intensity factors,
weekly cycles) that a Poisson model would miss. The threshold is the ``(1−α)`` quantile of
``max_{t≤T} score_t`` over ``B`` bootstrap streams, so that under the null the detector alarms
before ``T`` with probability ``≈ α``; every detector is calibrated by the same routine.

References: Künsch 1989 (moving-block bootstrap); P17 ``papers/specs.md`` §17 ("calibrate C by
simulation or block bootstrap on a burn-in segment").
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from lowrank_jax.changepoint import detectors as det

__all__ = ["Calibration", "block_bootstrap_indices", "calibrate_threshold", "quantile_threshold"]


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
) -> Calibration:
    """Calibrates ``detector``'s threshold on block-bootstrap streams of ``train``.

    Args:
      detector: a :class:`~lowrank_jax.changepoint.detectors.Detector`.
      train: the training stretch ``(n, p, L)`` of counts.
      key: PRNG key of the bootstrap.
      alpha: target probability of a false alarm before ``horizon``.
      horizon: monitoring length ``T``.
      block_len: ``ℓ`` (1 for independent observations; longer under dependence).
      num_streams: ``B``.
      batch: streams run at once (memory).
      chunk: observations per scan step (:func:`run_detector`).

    Returns:
      :class:`Calibration` with the threshold and the ``B`` maxima.
    """
    train = np.asarray(train)
    idx = block_bootstrap_indices(
        key, train.shape[0], horizon=horizon, block_len=block_len, num_streams=num_streams
    )
    maxima = []
    for i in range(0, num_streams, batch):
        scores = det.run_detector(detector, train, index=idx[i : i + batch], chunk=chunk)
        maxima.append(np.asarray(scores.max(-1)))
    maxima = np.concatenate(maxima)
    return Calibration(quantile_threshold(maxima, alpha), maxima)
