r"""Kernel-score diffusion on a union of low-dimensional subspaces (P7).

The forward Ornstein–Uhlenbeck process ``dX = -X dt + √2 dW`` has marginals

.. math::  X_t = m_t X_0 + σ_t Z,\qquad m_t = e^{-t},\quad σ_t^2 = 1 - e^{-2t}.

Given training points ``X_1..X_n`` the kernel-smoothed empirical density and its score are

.. math::  \hat p_t(x) = \frac1n \sum_i φ_{σ_t}(x - m_t X_i),\qquad
           \hat s_t(x) = -\frac{x - m_t \sum_i w_i(x) X_i}{σ_t^2},\quad
           w_i(x) = \operatorname{softmax}_i\Big(-\frac{\|x - m_t X_i\|^2}{2σ_t^2}\Big),

i.e. the exact score of ``p̂_t``; ``x̂₀(x) = Σ_i w_i(x) X_i = (x + σ_t² ŝ_t(x)) / m_t`` is its
Tweedie denoiser. The sum over ``i`` is ``O(n·m·D)`` for ``m`` query points; it is computed over
blocks of training points with a running log-sum-exp (:func:`kernel_denoiser`,
``chunk_size``), so memory is ``O(m·(chunk + D))`` whatever ``n``.

Sampling starts from ``N(0, I_D)`` at ``T = c_T log n``, runs the reverse SDE or the
probability-flow ODE down to an early-stopping time ``t₀`` with ``σ_{t₀} ≈ n^{-1/max(k,2)}`` on a
geometric time grid, with the first-order *exponential integrator in data-prediction form*
(DDIM for the ODE, the DDPM posterior for the SDE; Lu et al. 2022, DPM-Solver++): in each step the
denoiser ``x̂₀`` is frozen and the linear OU part is integrated exactly, so the step is exact
whenever ``x̂₀`` is constant along the path — e.g. for a Gaussian ``p_t = N(m_t a, σ_t² I)``
(one training point). An optional final Tweedie step returns ``x̂₀(x_{t₀})``.

References:
  P7: J. Wu, C. Cai, "Diffusion Models Are Statistically Optimal for Learning Low-Dimensional
  Multi-Modal Distributions" (ICML 2026, arXiv 2605.30153): W₁ error ``Õ(n^{-1/max(k,2)})`` for
  a kernel-based score on a union of subspaces. The estimator follows Zhang, Yin, Liang & Liu
  (2024), "Minimax optimality of score-based diffusion models: beyond the density lower bound";
  the truncation (density floor, score clip) and early-stopping constants are a reconstruction
  (specs.md §7: [RECON]); the paper's constants were not found.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

__all__ = [
    "early_stopping_time",
    "geometric_time_grid",
    "kernel_denoiser",
    "kernel_log_density",
    "kernel_score",
    "ou_forward",
    "ou_mean_std",
    "reverse_diffusion",
    "sample_kernel_diffusion",
    "score_to_denoiser",
    "terminal_time",
]

DenoiseFn = Callable[[jax.Array, jax.Array], jax.Array]


# --------------------------------------------------------------------------------------------
# The forward process


def ou_mean_std(t: ArrayLike) -> tuple[jax.Array, jax.Array]:
    """``(m_t, σ_t) = (e^{-t}, √(1 - e^{-2t}))`` of the OU process ``dX = -X dt + √2 dW``.

    ``σ_t`` is computed as ``√(-expm1(-2t))``, accurate for small ``t``.
    """
    t = jnp.asarray(t)
    return jnp.exp(-t), jnp.sqrt(-jnp.expm1(-2.0 * t))


def ou_forward(key: jax.Array, x0: ArrayLike, t: ArrayLike) -> jax.Array:
    """Samples ``X_t = m_t X_0 + σ_t Z`` given ``X_0`` (``(b, D)``; ``t`` scalar or ``(b,)``)."""
    x0 = jnp.asarray(x0)
    m, s = ou_mean_std(t)
    if jnp.ndim(t):
        m, s = m[:, None], s[:, None]
    return m * x0 + s * jax.random.normal(key, x0.shape, x0.dtype)


def _check_time(t: float, name: str) -> float:
    t = float(t)
    if not (t > 0.0 and math.isfinite(t)):
        raise ValueError(f"{name} must be a positive finite time, got {t}.")
    return t


def early_stopping_time(n: int, k: int, *, scale: float = 1.0) -> float:
    """``t₀`` with ``σ_{t₀} = scale · n^{-1/max(k,2)}`` (specs.md §7; ``scale`` is [RECON]).

    Raises:
      ValueError: if ``n < 1``, ``k < 0`` or the target noise level is not in (0, 1).
    """
    if int(n) < 1 or int(k) < 0:
        raise ValueError(f"need n >= 1 training points and k >= 0, got n={n}, k={k}.")
    sigma = float(scale) * float(n) ** (-1.0 / max(int(k), 2))
    if not 0.0 < sigma < 1.0:
        raise ValueError(
            f"scale * n^(-1/max(k,2)) = {sigma:.3g} must lie in (0, 1) (σ_t < 1 for the OU "
            f"process); lower scale={scale}."
        )
    return -0.5 * math.log1p(-(sigma**2))


def terminal_time(n: int, *, scale: float = 1.0) -> float:
    """``T = scale · log n`` (at least 1), where ``m_T = n^{-scale}`` and ``N(0, I)`` is close."""
    if int(n) < 1 or not scale > 0:
        raise ValueError(f"need n >= 1 and scale > 0, got n={n}, scale={scale}.")
    return max(1.0, float(scale) * math.log(max(int(n), 2)))


def geometric_time_grid(t_max: float, t_min: float, num_steps: int) -> jax.Array:
    """Decreasing times ``t_j = t_min (t_max/t_min)^{1 - j/N}``, ``j = 0..N`` (``(N+1,)``).

    Raises:
      ValueError: unless ``0 < t_min < t_max`` are finite and ``num_steps >= 1``.
    """
    t_max, t_min = _check_time(t_max, "t_max"), _check_time(t_min, "t_min")
    if not t_min < t_max:
        raise ValueError(f"need t_min < t_max for a reverse-time grid, got {t_min=}, {t_max=}.")
    if int(num_steps) != num_steps or num_steps < 1:
        raise ValueError(f"num_steps must be a positive integer, got {num_steps}.")
    j = jnp.arange(num_steps + 1) / num_steps
    grid = t_min * (t_max / t_min) ** (1.0 - j)
    return grid.at[0].set(t_max).at[-1].set(t_min)


# --------------------------------------------------------------------------------------------
# The kernel-smoothed empirical score


def _check_points(x: jax.Array, data: jax.Array) -> None:
    if x.ndim != 2 or data.ndim != 2:
        raise ValueError(
            f"x and data must be 2-D (m, D) and (n, D) arrays, got shapes {x.shape}, {data.shape}."
        )
    if x.shape[1] != data.shape[1]:
        raise ValueError(
            f"x has dimension D={x.shape[1]} but the training data D={data.shape[1]}: embed both "
            "in the same space."
        )
    if data.shape[0] < 1:
        raise ValueError("data holds no training points.")


@functools.partial(jax.jit, static_argnames=("chunk_size",))
def _kernel_stats(x, data, t, chunk_size):
    """``(log Σ_i e^{ℓ_i}, Σ_i w_i X_i)`` with ``ℓ_i = -‖x - m X_i‖²/(2σ²)``, blocked over i."""
    m_t, s_t = ou_mean_std(t)
    var = s_t**2
    n, d = data.shape
    sq_x = jnp.sum(x * x, axis=1)

    def logits(block, valid):
        cross = x @ block.T  # (m, B)
        sq_b = jnp.sum(block * block, axis=1)
        ell = -(sq_x[:, None] - 2.0 * m_t * cross + (m_t**2) * sq_b[None, :]) / (2.0 * var)
        return jnp.where(valid[None, :], ell, -jnp.inf)

    if chunk_size is None or chunk_size >= n:
        ell = logits(data, jnp.ones((n,), bool))
        lse = jax.nn.logsumexp(ell, axis=1)
        mean = jax.nn.softmax(ell, axis=1) @ data
        return lse, mean
    num_chunks = -(-n // chunk_size)
    pad = num_chunks * chunk_size - n
    blocks = jnp.pad(data, ((0, pad), (0, 0))).reshape(num_chunks, chunk_size, d)
    valid = (jnp.arange(num_chunks * chunk_size) < n).reshape(num_chunks, chunk_size)

    def body(carry, inputs):
        run_max, run_sum, run_vec = carry
        block, ok = inputs
        ell = logits(block, ok)
        new_max = jnp.maximum(run_max, jnp.max(ell, axis=1))
        decay = jnp.exp(run_max - new_max)  # 0 when run_max = -inf (first block)
        p = jnp.exp(ell - new_max[:, None])
        return (
            new_max,
            run_sum * decay + jnp.sum(p, axis=1),
            run_vec * decay[:, None] + p @ block,
        ), None

    m = x.shape[0]
    init = (
        jnp.full((m,), -jnp.inf, x.dtype),
        jnp.zeros((m,), x.dtype),
        jnp.zeros((m, d), x.dtype),
    )
    (run_max, run_sum, run_vec), _ = jax.lax.scan(body, init, (blocks, valid))
    return run_max + jnp.log(run_sum), run_vec / run_sum[:, None]


def _log_normaliser(n: int, d: int, t) -> jax.Array:
    _, s_t = ou_mean_std(t)
    return -math.log(n) - 0.5 * d * jnp.log(2.0 * jnp.pi * s_t**2)


def kernel_log_density(
    x: ArrayLike, data: ArrayLike, t: ArrayLike, *, chunk_size: int | None = None
) -> jax.Array:
    """``log p̂_t(x)``, ``p̂_t(x) = (1/n) Σ_i N(x; m_t X_i, σ_t² I)``.

    Args:
      x: query points ``(m, D)``.
      data: training points ``(n, D)``.
      t: a positive time (scalar).
      chunk_size: training points per block (``None``: all at once).

    Returns:
      ``(m,)`` log densities.
    """
    x, data = jnp.asarray(x), jnp.asarray(data)
    _check_points(x, data)
    lse, _ = _kernel_stats(x, data, t, _check_chunk(chunk_size))
    return lse + _log_normaliser(data.shape[0], data.shape[1], t)


def _check_chunk(chunk_size):
    if chunk_size is not None and (int(chunk_size) != chunk_size or chunk_size < 1):
        raise ValueError(f"chunk_size must be a positive integer or None, got {chunk_size}.")
    return None if chunk_size is None else int(chunk_size)


def kernel_denoiser(
    x: ArrayLike,
    data: ArrayLike,
    t: ArrayLike,
    *,
    chunk_size: int | None = None,
    clip: float | None = None,
    log_density_floor: float | None = None,
) -> jax.Array:
    """Tweedie denoiser of the kernel score: ``x̂₀ = (x + σ_t² ŝ_t(x)) / m_t``.

    Without regularisation ``x̂₀ = Σ_i w_i(x) X_i``. Regularisation ([RECON], Zhang et al. 2024):

    * ``log_density_floor = log ρ``: ``ŝ = ∇p̂_t / max(p̂_t, ρ)``, i.e. the score times
      ``min(1, p̂_t/ρ)`` (pulls the score to 0 where the estimate is unreliable);
    * ``clip = C``: ``ŝ`` rescaled to norm at most ``C √(log n) / σ_t``. The score of D-dimensional
      noise has norm ``≈ √D / σ_t``, so ``C`` must be ``≳ √(D / log n)`` not to bias it.

    Args:
      x: ``(m, D)`` noisy points at time ``t``.
      data: ``(n, D)`` training points.
      t: a positive scalar time.
      chunk_size: training points per block of the running log-sum-exp (``None``: one block).
        Memory ``O(m · (chunk_size + D))``; the result does not depend on it.
      clip: ``C`` of the score clip (``None``: no clip).
      log_density_floor: ``log ρ`` (``None``: no floor).

    Returns:
      ``(m, D)`` denoised points.

    Raises:
      ValueError: for shapes that do not match or a bad ``chunk_size``/``clip``.
    """
    x, data = jnp.asarray(x), jnp.asarray(data)
    _check_points(x, data)
    chunk_size = _check_chunk(chunk_size)
    if clip is not None and not clip > 0:
        raise ValueError(f"clip must be positive (or None for no clip), got {clip}.")
    lse, mean = _kernel_stats(x, data, t, chunk_size)
    if clip is None and log_density_floor is None:
        return mean
    m_t, s_t = ou_mean_std(t)
    score = -(x - m_t * mean) / s_t**2
    if log_density_floor is not None:
        log_p = lse + _log_normaliser(data.shape[0], data.shape[1], t)
        score = score * jnp.exp(jnp.minimum(0.0, log_p - log_density_floor))[:, None]
    if clip is not None:
        bound = clip * math.sqrt(max(math.log(data.shape[0]), 1.0)) / s_t
        norm = jnp.linalg.norm(score, axis=1, keepdims=True)
        score = score * jnp.minimum(1.0, bound / jnp.maximum(norm, 1e-30))
    return (x + s_t**2 * score) / m_t


def kernel_score(x: ArrayLike, data: ArrayLike, t: ArrayLike, **kwargs) -> jax.Array:
    """``ŝ_t(x) = -(x - m_t x̂₀(x)) / σ_t² = ∇ log p̂_t(x)`` (``(m, D)``); keyword arguments as
    :func:`kernel_denoiser` (chunking, clip, density floor)."""
    x = jnp.asarray(x)
    m_t, s_t = ou_mean_std(t)
    return -(x - m_t * kernel_denoiser(x, data, t, **kwargs)) / s_t**2


def score_to_denoiser(score_fn: Callable[[jax.Array, jax.Array], jax.Array]) -> DenoiseFn:
    """Turns ``score_fn(x, t)`` into the Tweedie denoiser ``(x + σ_t² s) / m_t``."""

    def denoise(x, t):
        m_t, s_t = ou_mean_std(t)
        return (x + s_t**2 * score_fn(x, t)) / m_t

    return denoise


# --------------------------------------------------------------------------------------------
# The reverse process


def _exp_step(x, x0_hat, t, t_next, noise):
    """One exponential-integrator step from ``t`` to ``t_next < t`` with ``x̂₀`` frozen.

    ODE (DDIM): ``x' = m' x̂₀ + σ' (x - m x̂₀)/σ``. SDE (DDPM posterior
    ``q(x_{t'} | x_t, x₀ = x̂₀)``): with ``a = m/m'`` and ``b² = 1 - a²``,
    ``x' = (m' b²/σ²) x̂₀ + (a σ'²/σ²) x + (σ' b/σ) ξ``.
    """
    m, s = ou_mean_std(t)
    m1, s1 = ou_mean_std(t_next)
    if noise is None:
        return m1 * x0_hat + s1 * (x - m * x0_hat) / s
    a = jnp.exp(-(t - t_next))
    b2 = -jnp.expm1(-2.0 * (t - t_next))
    return (m1 * b2 / s**2) * x0_hat + (a * s1**2 / s**2) * x + (s1 * jnp.sqrt(b2) / s) * noise


def reverse_diffusion(
    key: jax.Array | None,
    denoise_fn: DenoiseFn,
    x_init: ArrayLike,
    times: ArrayLike,
    *,
    stochastic: bool = False,
    tweedie: bool = True,
) -> jax.Array:
    """Integrates the reverse OU process from ``times[0]`` down to ``times[-1]``.

    Each step freezes ``x̂₀ = denoise_fn(x, t)`` and integrates the rest exactly
    (``_exp_step``): the probability-flow ODE (``stochastic=False``) or the reverse SDE
    ``dY = (Y + 2 s(Y)) dτ + √2 dW̄``. With ``tweedie`` the output is ``x̂₀(x_{t₀})``.

    Args:
      key: PRNG key (used only when ``stochastic``; may be ``None`` otherwise).
      denoise_fn: ``(x (m, D), t scalar) -> x̂₀ (m, D)`` (see :func:`score_to_denoiser`).
      x_init: ``(m, D)`` points at ``times[0]`` (e.g. ``N(0, I)``).
      times: ``(N+1,)`` strictly decreasing positive times (:func:`geometric_time_grid`).
      stochastic: reverse SDE instead of the ODE.
      tweedie: finish with the Tweedie denoising step.

    Returns:
      ``(m, D)`` samples.

    Raises:
      ValueError: for a time grid that is not strictly decreasing and positive, or a missing key.
    """
    times = jnp.asarray(times)
    x = jnp.asarray(x_init)
    if times.ndim != 1 or times.shape[0] < 2:
        raise ValueError(f"times must be a 1-D grid of >= 2 times, got shape {times.shape}.")
    try:
        grid = np.asarray(times)
    except jax.errors.TracerArrayConversionError:  # traced: checked by the caller
        grid = None
    if grid is not None and not (np.all(grid > 0) and np.all(np.diff(grid) < 0)):
        raise ValueError(
            "times must be positive and strictly decreasing (from T down to t0): use "
            "geometric_time_grid(t_max, t_min, num_steps)."
        )
    if stochastic and key is None:
        raise ValueError("stochastic=True needs a PRNG key.")
    keys = jax.random.split(key, times.shape[0] - 1) if stochastic else None

    def body(x, inputs):
        t, t_next, k = inputs
        noise = jax.random.normal(k, x.shape, x.dtype) if stochastic else None
        return _exp_step(x, denoise_fn(x, t), t, t_next, noise).astype(x.dtype), None

    dummy = keys if stochastic else jnp.zeros((times.shape[0] - 1,))
    x, _ = jax.lax.scan(body, x, (times[:-1], times[1:], dummy))
    return denoise_fn(x, times[-1]) if tweedie else x


def sample_kernel_diffusion(
    key: jax.Array,
    data: ArrayLike,
    *,
    num_samples: int,
    k: int,
    num_steps: int = 100,
    stochastic: bool = False,
    tweedie: bool = True,
    sigma_scale: float = 1.0,
    horizon_scale: float = 1.0,
    chunk_size: int | None = 4096,
    sample_chunk_size: int | None = None,
    clip: float | None = None,
    log_density_floor: float | None = None,
) -> jax.Array:
    """Samples the kernel-score diffusion of specs.md §7 (P7) from training points.

    ``T = horizon_scale · log n`` (:func:`terminal_time`), ``t₀`` with
    ``σ_{t₀} = sigma_scale · n^{-1/max(k,2)}`` (:func:`early_stopping_time`), a geometric grid of
    ``num_steps`` steps, the exponential integrator of :func:`reverse_diffusion`.

    Args:
      key: PRNG key.
      data: ``(n, D)`` training points.
      num_samples: ``m``, samples to draw.
      k: (maximal) intrinsic dimension; e.g. from :func:`~lowrank_jax.generative.estimate_intrinsic_dim`.
      num_steps: reverse steps.
      stochastic: reverse SDE (True) or probability-flow ODE (False).
      tweedie: final Tweedie step.
      sigma_scale, horizon_scale: constants of ``t₀`` and ``T`` ([RECON]).
      chunk_size: training points per block of the score (memory ``O(m·chunk)``).
      sample_chunk_size: samples integrated at once (``None``: all ``m``); bounds memory for
        large ``m`` (the samples are independent).
      clip, log_density_floor: regularisation of :func:`kernel_denoiser`.

    Returns:
      ``(m, D)`` samples.

    Raises:
      ValueError: if ``k > D``, ``k < 0``, ``num_samples < 1`` or another argument is invalid.

    Example:
      >>> x = sample_kernel_diffusion(jax.random.key(0), data, num_samples=100, k=2)  # doctest: +SKIP
    """
    data = jnp.asarray(data)
    if data.ndim != 2:
        raise ValueError(f"data must be (n, D), got shape {data.shape}.")
    n, d = data.shape
    if int(k) != k or not 0 <= k <= d:
        raise ValueError(
            f"k={k} must be an integer in [0, D={d}] (the intrinsic dimension cannot exceed the "
            "ambient one)."
        )
    if int(num_samples) != num_samples or num_samples < 1:
        raise ValueError(f"num_samples must be a positive integer, got {num_samples}.")
    if sample_chunk_size is not None and sample_chunk_size < 1:
        raise ValueError(f"sample_chunk_size must be positive or None, got {sample_chunk_size}.")
    t0 = early_stopping_time(n, k, scale=sigma_scale)
    t_max = terminal_time(n, scale=horizon_scale)
    if not t0 < t_max:
        raise ValueError(f"early-stopping time t0={t0:.3g} >= T={t_max:.3g}: lower sigma_scale.")
    times = geometric_time_grid(t_max, t0, num_steps)
    _check_chunk(chunk_size)

    return _sample_kernel(
        key,
        data,
        times.astype(data.dtype),
        None if log_density_floor is None else jnp.asarray(log_density_floor, data.dtype),
        num_samples=int(num_samples),
        stochastic=bool(stochastic),
        tweedie=bool(tweedie),
        chunk_size=chunk_size,
        sample_chunk_size=sample_chunk_size,
        clip=clip,
    )


@functools.partial(
    jax.jit,
    static_argnames=(
        "num_samples",
        "stochastic",
        "tweedie",
        "chunk_size",
        "sample_chunk_size",
        "clip",
    ),
)
def _sample_kernel(
    key,
    data,
    times,
    log_density_floor,
    *,
    num_samples,
    stochastic,
    tweedie,
    chunk_size,
    sample_chunk_size,
    clip,
):
    """The jitted body of :func:`sample_kernel_diffusion` (compiled once per shape, so that
    different ``k``, ``n``-independent grids and keys reuse it)."""
    d = data.shape[1]

    def denoise(x, t):
        return kernel_denoiser(
            x, data, t, chunk_size=chunk_size, clip=clip, log_density_floor=log_density_floor
        )

    k_init, k_noise = jax.random.split(key)
    x = jax.random.normal(k_init, (num_samples, d), data.dtype)
    if sample_chunk_size is None or sample_chunk_size >= num_samples:
        return reverse_diffusion(k_noise, denoise, x, times, stochastic=stochastic, tweedie=tweedie)
    b = sample_chunk_size
    num = -(-num_samples // b)
    xs = jnp.pad(x, ((0, num * b - num_samples), (0, 0))).reshape(num, b, d)
    ks = jax.random.split(k_noise, num)
    out = jax.lax.map(
        lambda a: reverse_diffusion(
            a[1], denoise, a[0], times, stochastic=stochastic, tweedie=tweedie
        ),
        (xs, ks),
    )
    return out.reshape(num * b, d)[:num_samples]
