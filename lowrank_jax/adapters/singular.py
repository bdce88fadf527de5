"""Spectral adapters ``ΔW = scale · U diag(σ) Vᵀ`` (SBVI) and AdaLoRA's ``P Λ Q``.

The factors ``{"u": (n, r), "s": (r,), "v": (m, r)}`` parameterise the update by its singular
triplets: ``x @ ΔW = scale · ((x @ U) ⊙ σ) @ Vᵀ`` costs ``O(b r (n + m))`` and never forms ``ΔW``.
:func:`lowrank_jax.optim.scale_by_sbvi` keeps ``U``, ``V`` on the Stiefel manifolds and evolves
``σ`` by a singular-value SDE that prunes modes; :func:`lowrank_jax.optim.scale_by_adalora` trains
the same triple as AdaLoRA (orthogonality by a regulariser, ``Λ`` masked by importance).

Initialisations:

* ``"stiefel"`` (SBVI): ``U``, ``V`` Haar-random with orthonormal columns (QR of Gaussians),
  ``σ = sigma_init`` (0 by default: the adapted model starts at the base model, and ``∂L/∂σ_i =
  scale · u_iᵀ (∂L/∂W) v_i`` is non-zero, so the modes can grow).
* ``"adalora"``: ``U``, ``V ~ N(0, 0.02²)`` and ``Λ = 0`` (PEFT's AdaLoRA); ``scale`` is then
  AdaLoRA's ``alpha / r``.

References:
  P8 SBVI (ICML 2026, abstract only; the parameterisation is the reconstruction of specs §8);
  Zhang et al. 2023, AdaLoRA (``P Λ Q``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

import jax
import jax.numpy as jnp

from lowrank_jax.adapters.kinds import AdapterKind

__all__ = [
    "Spectral",
    "SpectralInit",
    "random_stiefel",
    "spectral",
]

SpectralInit = Literal["stiefel", "adalora"]
_INITS = ("stiefel", "adalora")


def random_stiefel(key: jax.Array, n: int, r: int, dtype: Any = jnp.float32) -> jax.Array:
    """A Haar-random ``(n, r)`` matrix with orthonormal columns (QR with the sign fix)."""
    q, rr = jnp.linalg.qr(jax.random.normal(key, (n, r), jnp.float32))
    return (q * jnp.sign(jnp.diagonal(rr))).astype(dtype)


@dataclasses.dataclass(frozen=True)
class Spectral(AdapterKind):
    """Spectral adapter ``ΔW = scale · U diag(σ) Vᵀ`` with ``r = rank`` (``r_max`` for SBVI).

    Attributes:
      rank: number of modes ``r``, at most ``min(n, m)``.
      scale: constant in front of the update.
      init: ``"stiefel"`` (SBVI) or ``"adalora"``.
      sigma_init: initial singular values for ``"stiefel"``.
      in_ndim, out_ndim, dtype: as for :class:`lowrank_jax.adapters.LoRA`.

    References:
      P8 SBVI (reconstruction, specs §8); AdaLoRA (Zhang et al. 2023).
    """

    rank: int
    scale: float = 1.0
    init: SpectralInit = "stiefel"
    sigma_init: float = 0.0
    in_ndim: int | None = None
    out_ndim: int | None = None
    dtype: str | None = None

    def __post_init__(self):
        if not isinstance(self.rank, int) or isinstance(self.rank, bool) or self.rank < 1:
            raise ValueError(f"spectral(rank=...) must be a positive int, got {self.rank!r}.")
        if self.init not in _INITS:
            raise ValueError(f"spectral(init=...) must be one of {_INITS}, got {self.init!r}.")
        if not self.sigma_init >= 0:
            raise ValueError(f"spectral(sigma_init=...) must be >= 0, got {self.sigma_init!r}.")
        for name in ("in_ndim", "out_ndim"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or v < 1):
                raise ValueError(f"spectral({name}=...) must be a positive int or None, got {v!r}.")

    def check_shape(self, n: int, m: int, path: str) -> None:
        if self.rank > min(n, m):
            raise ValueError(
                f"spectral(rank={self.rank}) at {path!r} exceeds min(n, m) = {min(n, m)} of its "
                f"({n}, {m}) matrix view; use a rank of at most {min(n, m)}."
            )

    def init_factors(self, key: jax.Array, kernel: jax.Array) -> dict[str, jax.Array]:
        n, m = kernel.shape
        dtype = jnp.dtype(self.dtype or kernel.dtype)
        ku, kv = jax.random.split(key)
        if self.init == "stiefel":
            u, v = random_stiefel(ku, n, self.rank, dtype), random_stiefel(kv, m, self.rank, dtype)
            s = jnp.full((self.rank,), self.sigma_init, dtype)
        else:
            u = 0.02 * jax.random.normal(ku, (n, self.rank), dtype)
            v = 0.02 * jax.random.normal(kv, (m, self.rank), dtype)
            s = jnp.zeros((self.rank,), dtype)
        return {"u": u, "s": s, "v": v}

    def apply_delta(
        self,
        factors: dict[str, jax.Array],
        x: jax.Array,
        *,
        shape: tuple[int, int] | None = None,
        key: jax.Array | None = None,
    ) -> jax.Array:
        del key, shape  # U and V carry the shape.
        u, s, v = factors["u"], factors["s"], factors["v"]
        return (((x.astype(u.dtype) @ u) * s) @ v.T) * jnp.asarray(self.scale, u.dtype)

    def apply_delta_transposed(
        self, factors: dict[str, jax.Array], y: jax.Array, *, shape: tuple[int, int] | None = None
    ) -> jax.Array:
        del shape
        u, s, v = factors["u"], factors["s"], factors["v"]
        return (((y.astype(v.dtype) @ v) * s) @ u.T) * jnp.asarray(self.scale, u.dtype)

    def materialize(
        self, factors: dict[str, jax.Array], *, shape: tuple[int, int] | None = None
    ) -> jax.Array:
        del shape
        u, s, v = factors["u"], factors["s"], factors["v"]
        return ((u * s) @ v.T) * jnp.asarray(self.scale, u.dtype)

    def factor_specs(self, in_spec: Any, out_spec: Any) -> dict[str, tuple[Any, ...]]:
        return {"u": (in_spec, None), "s": (None,), "v": (out_spec, None)}


def spectral(
    rank: int,
    *,
    scale: float = 1.0,
    init: SpectralInit = "stiefel",
    sigma_init: float = 0.0,
    in_ndim: int | None = None,
    out_ndim: int | None = None,
    dtype: str | None = None,
) -> Spectral:
    """A spectral-adapter spec for a target rule: ``(r".*kernel", spectral(16))`` (SBVI ``r_max``).

    See :class:`Spectral` for the arguments and the maths; AdaLoRA uses
    ``spectral(r, init="adalora", scale=alpha / r)``.
    """
    return Spectral(
        rank=rank,
        scale=scale,
        init=init,
        sigma_init=sigma_init,
        in_ndim=in_ndim,
        out_ndim=out_ndim,
        dtype=None if dtype is None else jnp.dtype(dtype).name,
    )
