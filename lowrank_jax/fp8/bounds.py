"""Rank-aware bounds on attention logits and the geometry-aware FP8 scales they give (P14).

Attention logits are bilinear forms ``S_ij = x_iᵀ M x_j / √d_h`` with ``M = W^Q W^{K⊤}`` of rank
``r ≤ d_h``. After an RMSNorm/LayerNorm with gain ``g`` the tokens satisfy ``‖x‖² ≈ d g²``, so
deterministically ``|S_ij| ≤ B_wc = σ_max(M) d g² / √d_h``. For isotropic tokens the rank-aware
concentration of P14 gives::

    P(max_ij |S_ij| > α B_wc) ≤ 2 n² exp(−d² α² / (γ r)),

against ``2 n² exp(−d α²)`` for a rank-agnostic bound. Inverting at failure probability ``δ``:

    α(δ) = √(γ r log(2n²/δ)) / d              (rank-aware)
    α(δ) = √(log(2n²/δ) / d)                  (rank-agnostic)

and the scale that maps the bound onto the FP8 range ``R`` (E4M3: 448, E5M2: 57344) is

    s = c · R / (α(δ) B_wc) = c · R √d_h / (g² σ_max(M) √(γ r log(2n²/δ))),

with a calibration factor ``c`` (1 by default; the paper's burn-in "auto-α" would set it ≥ 1).
``σ_max(M)`` comes from the weights (a warm-started power iteration in
:mod:`lowrank_jax.fp8.policies`); nothing observes activations. Why ``γ``: for tokens uniform on the sphere, ``Var(x_iᵀMx_j) ≈ g⁴‖M‖_F²`` and
``‖M‖_F² ≤ r σ²``; a Gaussian tail ``exp(−t²/2Var)`` for a flat spectrum would need ``γ = 2``, but
a bilinear form of two independent vectors is sub-exponential, so at the relevant ``t`` slightly
more is needed: :func:`chernoff_gamma` gives the smallest ``γ`` (≈ 2.4–3.5) for which the bound is a
valid Chernoff bound for *every* ``M`` of rank ``r`` (the flat spectrum is the worst case); it is
the default (``gamma=None``). ``γ = 1, 2`` rely on a decaying spectrum (effective rank
``‖M‖_F²/σ² < r``). The diagonal ``i = j`` has mean ``g² tr(M)/√d_h``, which the isotropic model
ignores (trained attention can have a large ``tr(M)``), and real tokens are not isotropic: the
deterministic ``B_wc`` is the only unconditional bound.

Scale convention: the quantised value is ``cast(S · s)``, the dequantised ``cast(S · s) / s``
(see :mod:`lowrank_jax.fp8.emulation`). Delayed scaling, the baseline, is in
:mod:`lowrank_jax.fp8.delayed`; the per-step policies that use these scales in
:mod:`lowrank_jax.fp8.policies`.

References:
    P14, S. M. Emadi, "Rank-Aware Spectral Bounds on Attention Logits for Stable Low-Precision
    Training", arXiv 2602.18851 (abstract). The concrete scale rule (union bound over ``n²``
    pairs, the meaning of ``α`` and ``γ``) is a **reconstruction** from the abstract
    (specs.md §14 [R]); ``gamma``, ``delta`` and ``calibration`` are explicit knobs so that the
    paper's exact constants can be dropped in.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from lowrank_jax.fp8.emulation import fp8_max

__all__ = [
    "chernoff_gamma",
    "geometry_aware_scale",
    "logit_bound",
    "norm_gain_bound",
    "rank_agnostic_alpha",
    "rank_agnostic_scale",
    "rank_agnostic_tail_bound",
    "rank_aware_alpha",
    "rank_aware_tail_bound",
    "rank_aware_tightness",
    "worst_case_logit_bound",
]


def _check_pos(**kw: float) -> None:
    for name, val in kw.items():
        if not val > 0:
            raise ValueError(f"{name} must be positive, got {val}.")


def _log_term(seq_len: int, delta: float) -> float:
    _check_pos(seq_len=seq_len, delta=delta)
    if not delta < 1:
        raise ValueError(f"delta is a failure probability in (0, 1), got {delta}.")
    return math.log(2.0 * float(seq_len) ** 2 / float(delta))


def chernoff_gamma(*, rank: int, seq_len: int, delta: float) -> float:
    """Smallest ``γ`` making the rank-aware bound a Chernoff bound for every ``M`` of rank ``≤ r``.

    For Gaussian-like isotropic tokens, ``x_iᵀ M x_j = g² Σ_k σ_k z_k z'_k`` with independent
    standard normal ``z, z' ∈ R^r``; its moment generating function ``Π_k (1 − λ²σ_k²)^{−1/2}``
    is largest for a flat spectrum ``σ_k = σ``. The Chernoff bound
    ``P(z·z' > t) ≤ exp(−sup_λ [λt + (r/2) log(1 − λ²)])`` is sub-exponential (heavier than the
    Gaussian ``exp(−t²/2r)``), so the Gaussian-form bound ``2n² exp(−d²α²/(γr))`` needs
    ``γ = t*²/(r L)`` with ``L = log(2n²/δ)`` and ``t*`` solving ``sup_λ[…] = L``. Typical values:
    ``γ ≈ 2.4`` for ``r = 128, n = 4096, δ = 10⁻⁶``; ``γ ≈ 3.5`` for ``r = 16, n = 64, δ = 10⁻³``.

    Args:
        rank: rank ``r`` of ``M``.
        seq_len: sequence length ``n``.
        delta: failure probability ``δ``.

    Returns:
        ``γ > 2`` (a Python float).

    References:
        This choice of ``γ`` is ours (P14 only says ``γ > 1``); part of the reconstruction.
    """
    _check_pos(rank=rank)
    target = _log_term(seq_len, delta)
    r = float(rank)

    def exponent(lam: float) -> float:  # sup_λ value at the λ where t = rλ/(1 − λ²)
        return r * lam**2 / (1 - lam**2) + 0.5 * r * math.log1p(-(lam**2))

    lo, hi = 0.0, 1.0 - 1e-15
    for _ in range(200):  # exponent() increases on (0, 1) from 0 to inf
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if exponent(mid) < target else (lo, mid)
    lam = 0.5 * (lo + hi)
    t = r * lam / (1 - lam**2)
    return t**2 / (r * target)


def _gamma(gamma: float | None, rank: int, seq_len: int, delta: float) -> float:
    return chernoff_gamma(rank=rank, seq_len=seq_len, delta=delta) if gamma is None else gamma


def rank_aware_alpha(
    *, d: int, rank: int, seq_len: int, delta: float, gamma: float | None = None
) -> float:
    """Rank-aware threshold ratio ``α(δ) = √(γ r log(2n²/δ)) / d`` (reconstruction).

    Args:
        d: model width (token dimension).
        rank: rank ``r`` of ``M = W^Q W^{K⊤}`` (``d_h`` per head; an effective rank also works).
        seq_len: sequence length ``n``.
        delta: failure probability ``δ ∈ (0, 1)``.
        gamma: typicality ``γ > 0``; ``None`` uses :func:`chernoff_gamma` (valid for every ``M``
            of rank ``r`` under isotropic Gaussian-like tokens).

    Returns:
        ``α`` such that ``2n² exp(−d²α²/(γr)) = δ``.

    Raises:
        ValueError: on non-positive arguments or ``delta >= 1``.

    References:
        P14 (arXiv 2602.18851); union-bound inversion of specs.md §14 [R].
    """
    gamma = _gamma(gamma, rank, seq_len, delta)
    _check_pos(d=d, rank=rank, gamma=gamma)
    return math.sqrt(gamma * rank * _log_term(seq_len, delta)) / d


def rank_agnostic_alpha(*, d: int, seq_len: int, delta: float) -> float:
    """Rank-agnostic threshold ratio ``α(δ) = √(log(2n²/δ) / d)``, from ``2n² exp(−dα²) = δ``.

    Args:
        d: model width.
        seq_len: sequence length ``n``.
        delta: failure probability ``δ ∈ (0, 1)``.

    Returns:
        ``α`` of the rank-agnostic bound.

    Raises:
        ValueError: on non-positive arguments or ``delta >= 1``.
    """
    _check_pos(d=d)
    return math.sqrt(_log_term(seq_len, delta) / d)


def rank_aware_tail_bound(
    alpha: jax.typing.ArrayLike, *, d: int, rank: int, seq_len: int, gamma: float
) -> jax.Array:
    """``P(max|S| > α B_wc) ≤ min(1, 2n² exp(−d²α²/(γ r)))`` (rank-aware, reconstruction).

    Args:
        alpha: threshold ratio(s), any shape.
        d: model width.
        rank: rank ``r`` of ``M``.
        seq_len: sequence length ``n``.
        gamma: typicality ``γ``.

    Returns:
        Bound on the overflow probability, same shape as ``alpha``.
    """
    _check_pos(d=d, rank=rank, seq_len=seq_len, gamma=gamma)
    alpha = jnp.asarray(alpha, jnp.float32)
    return jnp.minimum(1.0, 2.0 * seq_len**2 * jnp.exp(-(d**2) * alpha**2 / (gamma * rank)))


def rank_agnostic_tail_bound(alpha: jax.typing.ArrayLike, *, d: int, seq_len: int) -> jax.Array:
    """``P(max|S| > α B_wc) ≤ min(1, 2n² exp(−d α²))`` (rank-agnostic)."""
    _check_pos(d=d, seq_len=seq_len)
    alpha = jnp.asarray(alpha, jnp.float32)
    return jnp.minimum(1.0, 2.0 * seq_len**2 * jnp.exp(-d * alpha**2))


def rank_aware_tightness(*, d: int, rank: int, gamma: float = 1.0) -> tuple[float, float]:
    """How much tighter the rank-aware bound is: ``(d/(γr), √(d/(γr)))``.

    The first number is the ratio of the tail exponents (``d²α²/(γr)`` over ``dα²``), the form
    of the abstract's "8–28×" / "25–64×"; the second is the ratio of the thresholds
    ``α_agnostic(δ)/α_aware(δ)``, i.e. how much larger the rank-aware FP8 scale is (independent of
    ``n`` and ``δ``).

    Raises:
        ValueError: on non-positive arguments.
    """
    _check_pos(d=d, rank=rank, gamma=gamma)
    ratio = d / (gamma * rank)
    return ratio, math.sqrt(ratio)


def norm_gain_bound(
    gain: jax.typing.ArrayLike, bias: jax.typing.ArrayLike | None = None
) -> jax.Array:
    """Effective gain ``g`` with ``‖x‖ ≤ g √d`` for ``x = gain ⊙ x̂ + bias``, ``‖x̂‖² = d``.

    ``g = max_k |gain_k| + ‖bias‖/√d`` (triangle inequality); without bias ``g = max|gain|``.

    Args:
        gain: ``(..., d)`` RMSNorm/LayerNorm scale (or a scalar).
        bias: optional ``(..., d)`` LayerNorm bias.

    Returns:
        ``(...)`` effective gains.
    """
    gain = jnp.abs(jnp.asarray(gain, jnp.float32))
    if gain.ndim == 0:
        if bias is not None:
            raise ValueError("A bias needs a gain vector (..., d) to know d.")
        return gain
    g = jnp.max(gain, axis=-1)
    if bias is not None:
        bias = jnp.asarray(bias, jnp.float32)
        g = g + jnp.linalg.norm(bias, axis=-1) / math.sqrt(gain.shape[-1])
    return g


def worst_case_logit_bound(
    sigma: jax.typing.ArrayLike, *, d: int, head_dim: int, norm_gain: jax.typing.ArrayLike = 1.0
) -> jax.Array:
    """Deterministic bound ``B_wc = σ_max(M) d g² / √d_h ≥ max_ij |S_ij|`` for ``‖x‖ ≤ g√d``.

    Args:
        sigma: ``σ_max(W^Q W^{K⊤})``, any shape (per head ``(H,)``, per layer ``(L, H)``).
        d: model width.
        head_dim: ``d_h`` (the ``1/√d_h`` softmax temperature).
        norm_gain: effective gain ``g`` (see :func:`norm_gain_bound`), broadcastable to ``sigma``.

    Returns:
        ``B_wc`` with the broadcast shape of ``sigma`` and ``norm_gain``.
    """
    _check_pos(d=d, head_dim=head_dim)
    sigma = jnp.asarray(sigma, jnp.float32)
    g = jnp.asarray(norm_gain, jnp.float32)
    return sigma * d * g**2 / math.sqrt(head_dim)


def logit_bound(
    sigma: jax.typing.ArrayLike,
    *,
    d: int,
    head_dim: int,
    seq_len: int,
    norm_gain: jax.typing.ArrayLike = 1.0,
    delta: float = 1e-6,
    gamma: float | None = None,
    rank: int | None = None,
    rank_aware: bool = True,
) -> jax.Array:
    """High-probability bound ``α(δ) · B_wc`` on ``max_ij |S_ij|`` (reconstruction).

    Args:
        sigma: ``σ_max(M)``, any shape.
        d: model width.
        head_dim: ``d_h``.
        seq_len: sequence length ``n``.
        norm_gain: effective gain ``g``.
        delta: failure probability.
        gamma: typicality ``γ`` (rank-aware only; ``None``: :func:`chernoff_gamma`).
        rank: rank of ``M``; defaults to ``head_dim``.
        rank_aware: rank-aware (default) or rank-agnostic ``α``.

    Returns:
        The bound, shape of ``sigma``; at most ``B_wc`` (``α`` is clipped to 1).
    """
    if rank_aware:
        alpha = rank_aware_alpha(
            d=d, rank=head_dim if rank is None else rank, seq_len=seq_len, delta=delta, gamma=gamma
        )
    else:
        alpha = rank_agnostic_alpha(d=d, seq_len=seq_len, delta=delta)
    b_wc = worst_case_logit_bound(sigma, d=d, head_dim=head_dim, norm_gain=norm_gain)
    return min(alpha, 1.0) * b_wc


def geometry_aware_scale(
    sigma: jax.typing.ArrayLike,
    *,
    d: int,
    head_dim: int,
    seq_len: int,
    norm_gain: jax.typing.ArrayLike = 1.0,
    delta: float = 1e-6,
    gamma: float | None = None,
    fmt: str = "e4m3",
    calibration: float = 1.0,
    rank: int | None = None,
) -> jax.Array:
    """Rank-aware FP8 scale ``s = c R √d_h / (g² σ √(γ r log(2n²/δ)))`` (reconstruction).

    ``s · max_ij|S_ij| ≤ c R`` with probability ``≥ 1 − δ`` for isotropic tokens with
    ``‖x‖ ≤ g√d``. Computed from the weights only.

    Args:
        sigma: ``σ_max(W^Q W^{K⊤})``, any shape (e.g. ``(L, H)``).
        d: model width.
        head_dim: ``d_h``.
        seq_len: sequence length ``n``.
        norm_gain: effective gain ``g`` (see :func:`norm_gain_bound`), broadcastable.
        delta: failure probability ``δ``.
        gamma: typicality ``γ``; ``None`` (default): :func:`chernoff_gamma`, which makes the bound
            hold for every ``M`` of rank ``r``; ``1`` or ``2`` are the paper-style choices.
        fmt: ``"e4m3"`` (``R = 448``) or ``"e5m2"`` (``R = 57344``).
        calibration: factor ``c > 0`` (``> 1`` raises utilisation, burn-in "auto-α").
        rank: rank of ``M`` (default ``head_dim``).

    Returns:
        float32 scales, shape of ``sigma`` — what a fused FP8 attention kernel takes as the
        logit scale (its descale is ``1/s``). Zero ``σ`` gives ``inf``; clip if needed.

    Raises:
        ValueError: on non-positive knobs, ``delta ∉ (0, 1)`` or an unknown format.

    References:
        P14 (arXiv 2602.18851); scale rule reconstructed in specs.md §14 [R].

    Example:
        >>> s = geometry_aware_scale(jnp.array([3.0, 5.0]), d=4096, head_dim=128, seq_len=4096)
    """
    _check_pos(calibration=calibration)
    bound = logit_bound(
        sigma,
        d=d,
        head_dim=head_dim,
        seq_len=seq_len,
        norm_gain=norm_gain,
        delta=delta,
        gamma=gamma,
        rank=rank,
        rank_aware=True,
    )
    return calibration * fp8_max(fmt) / bound


def rank_agnostic_scale(
    sigma: jax.typing.ArrayLike,
    *,
    d: int,
    head_dim: int,
    seq_len: int,
    norm_gain: jax.typing.ArrayLike = 1.0,
    delta: float = 1e-6,
    fmt: str = "e4m3",
    calibration: float = 1.0,
) -> jax.Array:
    """FP8 scale ``s = c R / (α_agn(δ) B_wc)`` from the rank-agnostic bound (baseline).

    Same arguments as :func:`geometry_aware_scale` without ``gamma`` and ``rank``; smaller than
    the rank-aware scale by ``√(d/(γ r))``.
    """
    _check_pos(calibration=calibration)
    bound = logit_bound(
        sigma,
        d=d,
        head_dim=head_dim,
        seq_len=seq_len,
        norm_gain=norm_gain,
        delta=delta,
        rank_aware=False,
    )
    return calibration * fp8_max(fmt) / bound
