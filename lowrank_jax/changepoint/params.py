"""Parameters and input checks of the P17 statistic (:mod:`lowrank_jax.changepoint.lowrank`,
which re-exports them): the adaptive SVT level, the window scales, counts and ranks."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["SVT", "check_counts", "check_rank", "check_svt", "scales", "svt_threshold"]


class SVT(NamedTuple):
    """Adaptive hard singular-value thresholding of the window means (specs §17).

    ``τ_S = scale · (√(rate_bound · max(p, L) · ℓ_t / |S|) + ℓ_t / |S|)`` with
    ``ℓ_t = log(t² (J+1) / alpha)`` (:func:`svt_threshold`).

    Attributes:
      rate_bound: ``λ̄``, the largest cell mean (of a training stretch).
      alpha: the level inside ``ℓ_t`` (that of ``b_{t,w}``).
      scale: ``c_τ`` (the spec's form is up to this constant).
    """

    rate_bound: float
    alpha: float
    scale: float = 1.0


def svt_threshold(
    t: jax.typing.ArrayLike,
    size: jax.typing.ArrayLike,
    svt: SVT,
    *,
    p: int,
    num_cells: int,
    num_scales: int,
) -> jax.Array:
    """``τ_S`` of :class:`SVT` at time ``t`` for a window of ``size = |S|`` observations
    (broadcast), float32."""
    tf = jnp.maximum(jnp.asarray(t, jnp.float32), 1.0)
    n = jnp.maximum(jnp.asarray(size, jnp.float32), 1.0)
    ell = jnp.log(tf**2 * (num_scales + 1) / svt.alpha)
    return svt.scale * (jnp.sqrt(svt.rate_bound * max(p, num_cells) * ell / n) + ell / n)


def check_svt(svt: SVT | None) -> SVT | None:
    """Validates an :class:`SVT` on the host (``None`` passes)."""
    if svt is None:
        return None
    if not isinstance(svt, SVT):
        raise TypeError(f"svt={svt!r} is invalid: pass lowrank.SVT(rate_bound, alpha, scale)")
    if not svt.rate_bound > 0:
        raise ValueError(f"SVT rate_bound={svt.rate_bound} is invalid: the max cell mean (> 0)")
    if not 0 < svt.alpha < 1:
        raise ValueError(f"SVT alpha={svt.alpha} is invalid: pass a level in (0, 1)")
    if not svt.scale > 0:
        raise ValueError(f"SVT scale={svt.scale} is invalid: pass c_tau > 0")
    return svt


def scales(num_scales: int) -> np.ndarray:
    """The window lengths ``2^0, …, 2^J`` for ``num_scales = J``, int ``(J+1,)``."""
    if not isinstance(num_scales, int | np.integer) or num_scales < 0:
        raise ValueError(f"num_scales={num_scales!r} is invalid: pass an integer J >= 0")
    return 2 ** np.arange(num_scales + 1)


def check_counts(y, *, name: str = "counts") -> np.ndarray:
    """Validates a count array on the host and returns it as int32.

    Raises:
      TypeError: if ``y`` is not numeric.
      ValueError: if it holds negative, non-integer or non-finite values.
    """
    arr = np.asarray(y)
    if arr.dtype == bool or not np.issubdtype(arr.dtype, np.number):
        raise TypeError(f"{name} must be a numeric array of counts, got dtype {arr.dtype}")
    if arr.size and not np.all(np.isfinite(arr)):
        raise ValueError(f"{name} holds NaN or inf: pass finite non-negative integer counts")
    if arr.size and arr.min() < 0:
        raise ValueError(
            f"{name} holds negative values (min {arr.min()}): a Poisson stream needs counts >= 0"
        )
    if np.issubdtype(arr.dtype, np.floating) and not np.all(arr == np.round(arr)):
        bad = arr[arr != np.round(arr)].ravel()[0]
        raise ValueError(
            f"{name} holds non-integer values (e.g. {bad}): pass integer event counts, not rates"
        )
    if arr.size and arr.max() > np.iinfo(np.int32).max:
        raise ValueError(f"{name} holds counts above 2^31-1: rescale the bins")
    return arr.astype(np.int32)


def check_rank(rank: int | None, p: int, num_cells: int) -> int | None:
    """Validates ``rank`` against the ``p × L`` shape (``None`` = no truncation)."""
    if rank is None:
        return None
    if not isinstance(rank, int | np.integer) or isinstance(rank, bool) or rank < 1:
        raise ValueError(f"rank={rank!r} is invalid: pass a positive integer (or None)")
    if rank > min(p, num_cells):
        raise ValueError(
            f"rank={rank} exceeds min(p, L) = min({p}, {num_cells}): a p×L intensity has rank "
            f"at most {min(p, num_cells)}; lower the rank or pass rank=None (Frobenius scan)"
        )
    return int(rank)
