"""The synthetic instance distributions of P12 (specs §12 (4)), vectorised over instances.

* :func:`sample_group_instances`: ``d = Σ group_sizes`` Gaussian features; group ``g`` is active
  with probability ``π_g`` and then has N(0, 1) coefficients; ``y = Xβ + σ ε``; independent
  training and validation splits of the same ``β``.
* :func:`sample_fused_instances`: a piecewise-constant ``β`` over ``d`` indices whose jump
  probability varies along the index (per block of edges, ``jump_probs``), N(0, 1) jumps,
  Gaussian design, same splits (the spec's "fused-lasso variant"; the exact densities are a
  reconstruction).
* :func:`sample_signal_instances`: the same design and splits around coefficient vectors drawn
  from a given bank of (real) signals, e.g. the windows of
  :func:`lowrank_jax.tuning.signal_banks.weekly_windows`.
* :func:`sample_row_instances`: instances from one real regression data set, each a random subset
  of its rows split into training and validation (the true ``β`` is unknown).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "Instances",
    "sample_fused_instances",
    "sample_group_instances",
    "sample_row_instances",
    "sample_signal_instances",
]

SPEC_ACTIVE_PROBS = (0.9, 0.8, 0.5, 0.3, 0.1, 0.1, 0.05, 0.05)


class Instances(NamedTuple):
    """``N`` problem instances: training ``(xt (N, n, d), yt (N, n))``, validation
    ``(xv (N, m, d), yv (N, m))`` and the true coefficients ``beta (N, d)``."""

    xt: jax.Array
    yt: jax.Array
    xv: jax.Array
    yv: jax.Array
    beta: jax.Array

    @property
    def train(self) -> tuple[jax.Array, jax.Array]:
        return self.xt, self.yt

    @property
    def val(self) -> tuple[jax.Array, jax.Array]:
        return self.xv, self.yv


def _splits(key, beta, n_train, n_val, noise):
    num, d = beta.shape
    k1, k2, k3, k4 = jax.random.split(key, 4)
    xt = jax.random.normal(k1, (num, n_train, d))
    xv = jax.random.normal(k2, (num, n_val, d))
    yt = jnp.einsum("knd,kd->kn", xt, beta) + noise * jax.random.normal(k3, (num, n_train))
    yv = jnp.einsum("knd,kd->kn", xv, beta) + noise * jax.random.normal(k4, (num, n_val))
    return Instances(xt, yt, xv, yv, beta)


def _check(num: int, n_train: int, n_val: int, noise: float) -> None:
    if min(num, n_train, n_val) < 1 or noise < 0:
        raise ValueError(
            f"need num, n_train, n_val >= 1 and noise >= 0, got {num}, {n_train}, {n_val}, {noise}"
        )


def sample_group_instances(
    key: jax.Array,
    num: int,
    *,
    group_sizes: Sequence[int] = (5,) * 8,
    active_probs: Sequence[float] = SPEC_ACTIVE_PROBS,
    n_train: int = 50,
    n_val: int = 50,
    noise: float = 1.0,
) -> Instances:
    """``num`` group-lasso instances of specs §12 (defaults: d = 40, G = 8, π as in the spec).

    Raises:
      ValueError: ``active_probs`` and ``group_sizes`` differ in length, or a probability is
        outside [0, 1].
    """
    _check(num, n_train, n_val, noise)
    sizes = np.asarray(group_sizes, int)
    probs = np.asarray(active_probs, np.float32)
    if probs.shape != sizes.shape or np.any((probs < 0) | (probs > 1)):
        raise ValueError(
            f"active_probs {tuple(probs)} must be one probability in [0, 1] per group "
            f"({len(sizes)} groups)"
        )
    return _sample_group(
        key, int(num), tuple(sizes.tolist()), tuple(probs.tolist()), n_train, n_val, float(noise)
    )


@functools.partial(jax.jit, static_argnums=(1, 2, 3, 4, 5, 6))
def _sample_group(key, num, sizes, probs, n_train, n_val, noise):
    ka, kb, ks = jax.random.split(key, 3)
    active = jax.random.bernoulli(ka, jnp.asarray(probs), (num, len(sizes)))
    mask = jnp.repeat(active, np.asarray(sizes), axis=1, total_repeat_length=sum(sizes))
    beta = jax.random.normal(kb, (num, sum(sizes))) * mask
    return _splits(ks, beta, n_train, n_val, noise)


def sample_fused_instances(
    key: jax.Array,
    num: int,
    *,
    num_features: int = 41,
    jump_probs: Sequence[float] = (0.4, 0.2, 0.1, 0.05, 0.4, 0.2, 0.1, 0.05),
    n_train: int = 50,
    n_val: int = 50,
    noise: float = 1.0,
) -> Instances:
    """``num`` fused-lasso instances: piecewise-constant ``β`` with block-varying jump density.

    The ``d − 1`` edges are split into ``len(jump_probs)`` contiguous blocks; edge ``j`` jumps
    with its block's probability, by N(0, 1); ``β_1 ~ N(0, 1)``.

    Raises:
      ValueError: ``len(jump_probs)`` does not divide ``num_features − 1``.
    """
    _check(num, n_train, n_val, noise)
    probs = np.asarray(jump_probs, np.float32)
    edges = int(num_features) - 1
    if edges < 1 or probs.ndim != 1 or edges % len(probs):
        raise ValueError(
            f"{len(probs)} jump-probability blocks must divide the {edges} edges of "
            f"{num_features} features"
        )
    return _sample_fused(key, int(num), edges, tuple(probs.tolist()), n_train, n_val, float(noise))


@functools.partial(jax.jit, static_argnums=(1, 2, 3, 4, 5, 6))
def _sample_fused(key, num, edges, probs, n_train, n_val, noise):
    ka, kb, kc, ks = jax.random.split(key, 4)
    pe = jnp.repeat(jnp.asarray(probs), edges // len(probs))
    jumps = jax.random.bernoulli(ka, pe, (num, edges)) * jax.random.normal(kb, (num, edges))
    start = jax.random.normal(kc, (num, 1))
    beta = jnp.concatenate([start, start + jnp.cumsum(jumps, axis=1)], axis=1)
    return _splits(ks, beta, n_train, n_val, noise)


def sample_signal_instances(
    key: jax.Array,
    num: int,
    signals: jax.typing.ArrayLike,
    *,
    n_train: int = 50,
    n_val: int = 50,
    noise: float = 1.0,
) -> Instances:
    """``num`` instances whose true ``β`` are rows of ``signals`` drawn uniformly with replacement.

    Each instance: ``β = signals[s]`` for a uniform ``s``, then the Gaussian design and splits
    of the other families (``X`` with N(0, 1) entries, ``y = Xβ + σ ε``, independent training
    and validation splits of the same ``β``). Fresh instances share the signal bank but not the
    design or the noise.

    Args:
      key: PRNG key.
      num: number of instances.
      signals: ``(S, d)`` bank of coefficient vectors (e.g. standardised real series).
      n_train, n_val, noise: split sizes and noise level ``σ``.

    Raises:
      ValueError: ``signals`` is not a non-empty finite ``(S, d)`` array.
    """
    _check(num, n_train, n_val, noise)
    bank = np.asarray(signals, np.float32)
    if bank.ndim != 2 or 0 in bank.shape or not np.all(np.isfinite(bank)):
        raise ValueError(f"signals must be a finite (S, d) array with S, d >= 1; got {bank.shape}")
    k1, k2 = jax.random.split(key)
    rows = jax.random.randint(k1, (int(num),), 0, len(bank))
    return _sample_signal(k2, jnp.asarray(bank)[rows], int(n_train), int(n_val), float(noise))


@functools.partial(jax.jit, static_argnums=(2, 3, 4))
def _sample_signal(key, beta, n_train, n_val, noise):
    return _splits(key, beta, n_train, n_val, noise)


def sample_row_instances(
    key: jax.Array,
    x: np.ndarray,
    y: np.ndarray,
    num: int,
    *,
    n_train: int = 50,
    n_val: int = 50,
) -> Instances:
    """``num`` instances of one real data set, each ``n_train + n_val`` distinct random rows.

    Instance ``i`` takes the first ``n_train + n_val`` rows of an independent random permutation
    of ``x``'s rows (NumPy's ``default_rng`` seeded by ``key``'s data, drawn on the host); the
    first ``n_train`` are its training split and the rest its validation split, so the two splits
    share no row. The true coefficients are unknown: ``beta`` is NaN.

    Args:
      key: PRNG key (its raw data seeds the NumPy generator).
      x: ``(R, d)`` design matrix (e.g. standardised spline features); ``y``: ``(R,)`` targets.
      num: number of instances.
      n_train, n_val: rows per training and validation split (``n_train + n_val <= R``).

    Returns:
      :class:`Instances` of NumPy arrays: ``xt (num, n_train, d)``, ``yt (num, n_train)``,
      ``xv (num, n_val, d)``, ``yv (num, n_val)``, ``beta (num, d)`` float32 NaN.

    Raises:
      ValueError: ``x`` is not 2-D, ``y`` is not ``(R,)``, or the splits need more than ``R`` rows.
    """
    _check(num, n_train, n_val, 0.0)
    x, y = np.asarray(x), np.asarray(y)
    if x.ndim != 2 or y.shape != (len(x),):
        raise ValueError(f"need x (R, d) and y (R,), got {x.shape} and {y.shape}")
    if n_train + n_val > len(x):
        raise ValueError(f"n_train + n_val = {n_train + n_val} exceeds the {len(x)} rows of x")
    rng = np.random.default_rng(np.asarray(jax.random.key_data(key)).tolist())
    rows = np.stack([rng.permutation(len(x))[: n_train + n_val] for _ in range(num)])
    xs, ys = x[rows], y[rows]
    nan = np.full((num, x.shape[1]), np.nan, np.float32)
    return Instances(xs[:, :n_train], ys[:, :n_train], xs[:, n_train:], ys[:, n_train:], nan)
