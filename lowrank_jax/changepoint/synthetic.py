r"""Synthetic low-rank Poisson streams of P17 §17 (4): rank-``r`` intensities, changes, AR(1).

* :func:`lowrank_intensity`: ``Λ = U Vᵀ`` with Gamma(2, 1) factors, rescaled to a mean cell count.
* :func:`change_intensity`: ``Λ' = Λ + Δ`` with ``‖Δ‖_F = κ``; ``"local"``: ``Δ = κ u vᵀ`` on a
  ``block × block`` corner (``u, v`` non-negative unit vectors), a change spread thinly over
  ``block²`` cells; ``"global"``: ``Δ ∝ Λ ⊙ a bᵀ`` (a rank-1 reweighting of every cell).
* :func:`sample_streams`: ``Y_t ~ Poisson(Λ_t e^{ε_t − σ²/2})`` with a shared AR(1) factor
  ``ε_t = ρ ε_{t−1} + σ √(1−ρ²) z_t`` (temporal dependence), ``Λ_t = Λ'`` from ``t > τ`` on.

Sampling uses NumPy's Poisson sampler seeded from the JAX ``key`` (faster on CPU).
"""

from __future__ import annotations

import jax
import numpy as np

__all__ = ["change_intensity", "lowrank_intensity", "sample_streams"]


def _rng(key: jax.Array) -> np.random.Generator:
    return np.random.default_rng(np.asarray(jax.random.key_data(key)).ravel().tolist())


def lowrank_intensity(
    key: jax.Array, *, p: int, num_cells: int, rank: int, mean: float = 2.0
) -> np.ndarray:
    """A non-negative rank-``r`` ``(p, L)`` intensity with mean cell value ``mean``."""
    rng = _rng(key)
    lam = rng.gamma(2.0, 1.0, (p, rank)) @ rng.gamma(2.0, 1.0, (rank, num_cells))
    return lam * mean / lam.mean()


def change_intensity(
    lam: np.ndarray, *, key: jax.Array, kind: str, kappa: float, block: int = 10
) -> np.ndarray:
    """``Λ + Δ`` with ``‖Δ‖_F = κ`` (``kind``: ``"local"`` or ``"global"``, see the module)."""
    rng = _rng(key)
    p, num_cells = lam.shape
    if kind == "local":
        if block > min(p, num_cells):
            raise ValueError(f"block={block} exceeds min(p, L) = {min(p, num_cells)}")
        u, v = np.abs(rng.normal(size=block)), np.abs(rng.normal(size=block))
        delta = np.zeros_like(lam)
        delta[:block, :block] = np.outer(u / np.linalg.norm(u), v / np.linalg.norm(v))
    elif kind == "global":
        delta = lam * np.outer(np.abs(rng.normal(size=p)), np.abs(rng.normal(size=num_cells)))
        delta /= np.linalg.norm(delta)
    else:
        raise ValueError(f"kind={kind!r} is invalid: pass 'local' or 'global'")
    return lam + kappa * delta


def sample_streams(
    key: jax.Array,
    lam: np.ndarray,
    *,
    num_streams: int,
    length: int,
    tau: int | None = None,
    lam_after: np.ndarray | None = None,
    rho: float = 0.0,
    sigma: float = 0.1,
) -> np.ndarray:
    """Count streams int32 ``(B, T, p, L)``; intensity ``lam`` up to ``tau``, ``lam_after`` after.

    Raises:
      ValueError: for ``|ρ| ≥ 1`` or a change time outside ``[0, T)``.
    """
    if not -1 < rho < 1:
        raise ValueError(f"rho={rho} is invalid: an AR(1) coefficient lies in (-1, 1)")
    rng = _rng(key)
    eps = np.zeros((num_streams, length))
    e = rng.normal(size=num_streams) * sigma
    for t in range(length):
        e = rho * e + sigma * np.sqrt(1 - rho**2) * rng.normal(size=num_streams)
        eps[:, t] = e
    factor = np.exp(eps - sigma**2 / 2)[..., None, None]
    means = np.broadcast_to(lam, (length, *lam.shape)).copy()
    if tau is not None:
        if lam_after is None or not 0 <= tau < length:
            raise ValueError("pass lam_after and a change time tau in [0, length)")
        means[tau:] = lam_after
    return rng.poisson(factor * means[None]).astype(np.int32)
