"""The knobs of P14's geometry-aware FP8 scale in one frozen dataclass, :class:`ScaleRule`.

Every route to per-head scales maps ``σ_max(W^Q_h W^{K⊤}_h)`` to a scale with the same rule
``s = c R √d_h / (g² σ √(γ r log(2n²/δ)))`` (or its rank-agnostic form): the offline
:func:`~lowrank_jax.fp8.sigma.attention_scales` (exact σ), the training-loop
:func:`~lowrank_jax.fp8.policies.geometry_scaling_policy` (tracked σ) and the diagnostics'
:func:`~lowrank_jax.fp8.diagnostics.attention_logit_report`. The rule's knobs (``seq_len``,
``delta``, ``gamma``, ``rank_aware``, ``fmt``, ``calibration``) are written once, here.

References:
    P14, arXiv 2602.18851; reconstruction of the scale rule in specs.md §14.
"""

from __future__ import annotations

import dataclasses

import jax

from lowrank_jax.fp8.bounds import (
    geometry_aware_scale,
    logit_bound,
    rank_agnostic_alpha,
    rank_agnostic_scale,
    rank_aware_alpha,
)
from lowrank_jax.fp8.emulation import fp8_max

__all__ = ["ScaleRule"]


@dataclasses.dataclass(frozen=True)
class ScaleRule:
    """P14's map from ``σ_max(W^Q_h W^{K⊤}_h)`` to a per-head FP8 logit scale (validated knobs).

    Attributes:
        seq_len: sequence length ``n``.
        delta: failure probability ``δ ∈ (0, 1)``.
        gamma: typicality ``γ > 0`` (``None``: :func:`~lowrank_jax.fp8.bounds.chernoff_gamma`,
            valid for every spectrum; rank-aware only).
        rank_aware: rank-aware (default) or rank-agnostic bound.
        fmt: FP8 format, ``"e4m3"`` or ``"e5m2"``.
        calibration: calibration factor ``c > 0``.

    Example:
        >>> rule = ScaleRule(seq_len=2048)
        >>> s = rule.scales(sigma, d=4096, head_dim=128, norm_gain=1.0)   # sigma (L, H)

    Raises:
        ValueError: on invalid knobs (at construction).
    """

    seq_len: int
    delta: float = 1e-6
    gamma: float | None = None
    rank_aware: bool = True
    fmt: str = "e4m3"
    calibration: float = 1.0

    def __post_init__(self):
        fp8_max(self.fmt)  # validates the format
        if int(self.seq_len) < 1 or not (0 < self.delta < 1) or not self.calibration > 0:
            raise ValueError(
                f"need seq_len >= 1, 0 < delta < 1, calibration > 0; got {self.seq_len}, "
                f"{self.delta}, {self.calibration}."
            )
        if self.gamma is not None and not self.gamma > 0:
            raise ValueError(f"gamma must be positive (or None), got {self.gamma}.")

    def alpha(self, *, d: int, head_dim: int) -> float:
        """``α(δ)`` of the bound ``B = α B_wc``, clipped to 1 (``B ≤ B_wc``)."""
        if self.rank_aware:
            a = rank_aware_alpha(
                d=d, rank=head_dim, seq_len=self.seq_len, delta=self.delta, gamma=self.gamma
            )
        else:
            a = rank_agnostic_alpha(d=d, seq_len=self.seq_len, delta=self.delta)
        return min(a, 1.0)

    def bound(
        self,
        sigma: jax.typing.ArrayLike,
        *,
        d: int,
        head_dim: int,
        norm_gain: jax.typing.ArrayLike = 1.0,
    ) -> jax.Array:
        """The logit bound ``B = α(δ) B_wc`` (:func:`~lowrank_jax.fp8.bounds.logit_bound`)."""
        return logit_bound(
            sigma,
            d=d,
            head_dim=head_dim,
            seq_len=self.seq_len,
            norm_gain=norm_gain,
            delta=self.delta,
            gamma=self.gamma,
            rank_aware=self.rank_aware,
        )

    def scales(
        self,
        sigma: jax.typing.ArrayLike,
        *,
        d: int,
        head_dim: int,
        norm_gain: jax.typing.ArrayLike = 1.0,
    ) -> jax.Array:
        """Per-head scales ``c R / B``, shape of ``sigma`` broadcast with ``norm_gain``.

        Args:
            sigma: ``σ_max(W^Q_h W^{K⊤}_h)``, any shape (e.g. ``(L, H)``).
            d: model width.
            head_dim: ``d_h``.
            norm_gain: effective gain ``g`` of the norm feeding the layer, broadcastable.

        Returns:
            float32 scales (``geometry_aware_scale`` or ``rank_agnostic_scale``).
        """
        kw = dict(
            d=d,
            head_dim=head_dim,
            seq_len=self.seq_len,
            norm_gain=norm_gain,
            delta=self.delta,
            fmt=self.fmt,
            calibration=self.calibration,
        )
        if self.rank_aware:
            return geometry_aware_scale(sigma, gamma=self.gamma, **kw)
        return rank_agnostic_scale(sigma, **kw)
