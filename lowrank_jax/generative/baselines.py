r"""Baselines of the kernel-score sampler (P7, specs.md §7 (5)).

* :func:`sample_empirical`: draws from the empirical measure ``(1/n) Σ δ_{X_i}`` (its W₁ error is
  the ``n^{-1/k}`` reference).
* :func:`select_kde_bandwidth`, :func:`silverman_bandwidth`, :func:`sample_kde`: a Gaussian KDE in
  the ambient dimension ``D`` (bandwidth by held-out log-likelihood with scikit-learn's
  ``KernelDensity``, or Silverman's rule); a sample is ``X_I + h Z``, which adds noise of norm
  ``≈ h √D`` off the subspaces.
* :class:`ScoreMLP`, :func:`dsm_loss`, :func:`mlp_denoiser`: a learned score — an MLP
  predicting the noise ``ε`` of ``x_t = m_t x₀ + σ_t ε`` trained by denoising score matching
  (Vincent 2011; ``s_θ = -ε_θ/σ_t``), sampled with the same integrator
  (:func:`~lowrank_jax.generative.kernel_score.reverse_diffusion`). With ``data_std`` the same
  network is read as a preconditioned denoiser instead (Karras et al. 2022, EDM, in the OU time
  variable): ``x̂₀ = c_skip x + c_out F_θ(c_in x, t)``, with ``v = m_t² σ_d² + σ_t²``,
  ``c_in = 1/√v``, ``c_skip = m_t σ_d²/v``, ``c_out = σ_t σ_d/√v``, trained on the unit-variance
  target ``(x₀ - c_skip x)/c_out``; the ε-parameterisation divides by ``m_t`` in ``x̂₀ = (x - σ_t
  ε̂)/m_t``, which amplifies the network's errors ``1/m_T = n`` times at the start of sampling.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from lowrank_jax.generative.kernel_score import DenoiseFn, ou_mean_std

__all__ = [
    "ScoreMLP",
    "dsm_loss",
    "mlp_denoiser",
    "sample_empirical",
    "sample_kde",
    "select_kde_bandwidth",
    "silverman_bandwidth",
]


def sample_empirical(key: jax.Array, data: ArrayLike, *, num_samples: int) -> jax.Array:
    """``num_samples`` draws with replacement from the rows of ``data (n, D)``."""
    data = jnp.asarray(data)
    return data[jax.random.randint(key, (num_samples,), 0, data.shape[0])]


def silverman_bandwidth(data: ArrayLike) -> float:
    """Silverman's rule in ``D`` dimensions: ``h = (4/(D+2))^{1/(D+4)} n^{-1/(D+4)} σ̂``, with
    ``σ̂²`` the mean per-coordinate variance."""
    data = np.asarray(data, np.float64)
    n, d = data.shape
    sigma = math.sqrt(float(np.mean(np.var(data, axis=0, ddof=1))))
    return (4.0 / (d + 2)) ** (1.0 / (d + 4)) * n ** (-1.0 / (d + 4)) * sigma


def select_kde_bandwidth(
    train: ArrayLike, valid: ArrayLike, *, bandwidths: Sequence[float]
) -> tuple[float, dict[float, float]]:
    """The bandwidth of a Gaussian KDE on ``train`` maximising the mean log-likelihood of ``valid``.

    Uses ``sklearn.neighbors.KernelDensity``. Returns ``(best, {h: mean held-out log-lik})``.

    Raises:
      ValueError: for an empty or non-positive bandwidth grid.
    """
    if not bandwidths or min(bandwidths) <= 0:
        raise ValueError(f"bandwidths must be a non-empty list of positive values: {bandwidths}")
    from sklearn.neighbors import KernelDensity

    train, valid = np.asarray(train, np.float64), np.asarray(valid, np.float64)
    scores = {}
    for h in bandwidths:
        kde = KernelDensity(kernel="gaussian", bandwidth=float(h)).fit(train)
        scores[float(h)] = float(kde.score(valid)) / len(valid)
    return max(scores, key=scores.get), scores


def sample_kde(key: jax.Array, data: ArrayLike, *, bandwidth: float, num_samples: int) -> jax.Array:
    """Samples the Gaussian KDE ``(1/n) Σ_i N(X_i, h² I_D)``: ``X_I + h Z`` (as
    ``KernelDensity.sample``)."""
    if not bandwidth > 0:
        raise ValueError(f"bandwidth must be positive, got {bandwidth}.")
    k1, k2 = jax.random.split(key)
    x = sample_empirical(k1, data, num_samples=num_samples)
    return x + bandwidth * jax.random.normal(k2, x.shape, x.dtype)


def _time_features(t: jax.Array) -> jax.Array:
    m_t, s_t = ou_mean_std(t)
    return jnp.stack([jnp.log(t), m_t, s_t], axis=-1)


class ScoreMLP(nn.Module):
    """``ε_θ(x, t)``: an MLP on ``[x, log t, m_t, σ_t]`` with SiLU activations.

    Attributes:
      features: hidden widths (e.g. ``(256, 256, 256)``, "3-layer" of specs.md §7).
    """

    features: Sequence[int]

    @nn.compact
    def __call__(self, x: jax.Array, t: jax.Array) -> jax.Array:
        """``x (b, D)``, ``t`` scalar or ``(b,)`` -> predicted noise ``(b, D)``."""
        t = jnp.broadcast_to(jnp.asarray(t, x.dtype), x.shape[:1])
        h = jnp.concatenate([x, _time_features(t)], axis=-1)
        for i, w in enumerate(self.features):
            h = nn.silu(nn.Dense(w, name=f"dense_{i}")(h))
        return nn.Dense(x.shape[-1], name="head", kernel_init=nn.initializers.zeros)(h)


def _preconditioning(t, data_std):
    """``(c_in, c_skip, c_out)`` of the EDM-preconditioned denoiser at OU time ``t``."""
    m_t, s_t = ou_mean_std(t)
    v = m_t**2 * data_std**2 + s_t**2
    return jax.lax.rsqrt(v), m_t * data_std**2 / v, s_t * data_std * jax.lax.rsqrt(v)


def _check_data_std(data_std):
    if data_std is not None and not data_std > 0:
        raise ValueError(f"data_std must be positive (or None for the ε-network), got {data_std}.")


def dsm_loss(
    params,
    apply_fn,
    key: jax.Array,
    x0: jax.Array,
    *,
    t_min: float,
    t_max: float,
    data_std: float | None = None,
) -> jax.Array:
    """Denoising score matching ``E_{t, ε} ‖ε_θ(m_t x₀ + σ_t ε, t) - ε‖²`` (mean over batch and
    coordinates), ``t`` log-uniform on ``[t_min, t_max]`` (the geometric grid's law).

    With ``data_std = σ_d`` the network is the preconditioned denoiser of the module docstring and
    the loss ``E ‖F_θ(c_in x_t, t) - (x₀ - c_skip x_t)/c_out‖²`` (EDM's weighting).

    Args:
      params: the network's parameters.
      apply_fn: ``(params, x, t) -> ε̂`` (or ``F``).
      key: PRNG key.
      x0: ``(b, D)`` clean data.
      t_min, t_max: time range, ``0 < t_min < t_max``.
      data_std: per-coordinate scale ``σ_d`` of the data for the preconditioned denoiser
        (``None``: the ε-network).

    Raises:
      ValueError: for a bad time range or a non-positive ``data_std``.
    """
    if not 0 < t_min < t_max:
        raise ValueError(f"need 0 < t_min < t_max, got {t_min=}, {t_max=}.")
    _check_data_std(data_std)
    kt, ke = jax.random.split(key)
    u = jax.random.uniform(kt, x0.shape[:1], x0.dtype)
    t = t_min * (t_max / t_min) ** u
    m_t, s_t = ou_mean_std(t)
    eps = jax.random.normal(ke, x0.shape, x0.dtype)
    xt = m_t[:, None] * x0 + s_t[:, None] * eps
    if data_std is None:
        return jnp.mean((apply_fn(params, xt, t) - eps) ** 2)
    c_in, c_skip, c_out = (c[:, None] for c in _preconditioning(t, data_std))
    target = (x0 - c_skip * xt) / c_out
    return jnp.mean((apply_fn(params, c_in * xt, t) - target) ** 2)


def mlp_denoiser(apply_fn, params, *, data_std: float | None = None) -> DenoiseFn:
    """``x̂₀(x, t) = (x - σ_t ε_θ(x, t)) / m_t`` for :func:`reverse_diffusion`; with
    ``data_std``, ``x̂₀ = c_skip x + c_out F_θ(c_in x, t)`` (see :func:`dsm_loss`)."""
    _check_data_std(data_std)

    def denoise(x, t):
        if data_std is not None:
            c_in, c_skip, c_out = _preconditioning(t, data_std)
            return c_skip * x + c_out * apply_fn(params, c_in * x, t)
        m_t, s_t = ou_mean_std(t)
        return (x - s_t * apply_fn(params, x, t)) / m_t

    return denoise
