"""FourierFT: sparse trainable spectral coefficients of ``ΔW`` under a 2-D inverse DFT (baseline).

``ΔW = α · Re(IDFT₂(F))`` with ``F ∈ R^{n×m}`` zero except at ``n_coeff`` random frequencies
``(k_j, l_j)`` (shared by every layer of a shape through a static seed) that hold the trainable
coefficients ``c``; ``IDFT₂`` has NumPy's ``1/(nm)`` normalisation. Applied by FFTs, never forming
``ΔW``:

.. math::  x ΔW = (α/n) · Re\\big(\\mathrm{IFFT}_m(\\mathrm{scatter}_{l}(c ⊙ n\\,\\mathrm{IFFT}_n(x)[k]))\\big),

i.e. ``O(b (n log n + m log m + n_coeff))`` per batch of ``b`` rows. The frequencies index the
kernel-convention matrix ``(n, m)`` (PEFT indexes PyTorch's ``(out, in)`` weight; since
``IDFT₂(Fᵀ) = IDFT₂(F)ᵀ`` the two are the same family).

References:
  Gao et al. 2024, "Parameter-Efficient Fine-Tuning with Discrete Fourier Transform" (FourierFT),
  and PEFT's ``FourierFTLayer`` (defaults ``scaling = 150``, ``random_loc_seed = 777``, normal
  initial coefficients); a baseline of P10 FrameFT (specs §10, Appendix A).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from lowrank_jax.adapters.kinds import AdapterKind, matrix_dims

__all__ = [
    "FourierFT",
    "fourier_frequencies",
    "fourierft",
]


@functools.lru_cache(maxsize=256)
def _frequencies(n: int, m: int, n_coeff: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    idx = np.random.default_rng(seed).permutation(n * m)[:n_coeff]
    k, ell = np.divmod(idx, m)
    k.setflags(write=False)
    ell.setflags(write=False)
    return k, ell


def fourier_frequencies(n: int, m: int, *, n_coeff: int, seed: int = 777):
    """The fixed frequencies ``(k, l)`` (each ``(n_coeff,)``) of FourierFT's coefficients."""
    return _frequencies(int(n), int(m), int(n_coeff), int(seed))


@dataclasses.dataclass(frozen=True)
class FourierFT(AdapterKind):
    """FourierFT adapter ``ΔW = α Re(IDFT₂(F))`` with ``n_coeff`` trainable frequencies.

    Factors ``{"coeffs": (n_coeff,)}``; the methods take the matrix view ``shape = (n, m)``
    (``Adapter.matrix``), as for :class:`lowrank_jax.adapters.FrameFT`.

    Attributes:
      n_coeff: number of trainable frequencies, at most ``n·m``.
      scale: ``α`` (PEFT's default 150).
      seed: seed of the frequencies (shared by all layers of a shape).
      init_std: coefficients start at ``N(0, init_std²)`` (PEFT's default 1; 0 = base model).
      in_ndim, out_ndim, dtype: as for :class:`lowrank_jax.adapters.LoRA`.
    """

    n_coeff: int
    scale: float = 150.0
    seed: int = 777
    init_std: float = 1.0
    in_ndim: int | None = None
    out_ndim: int | None = None
    dtype: str | None = None

    def __post_init__(self):
        if not isinstance(self.n_coeff, int) or isinstance(self.n_coeff, bool) or self.n_coeff < 1:
            raise ValueError(
                f"fourierft(n_coeff=...) must be a positive int, got {self.n_coeff!r}."
            )
        if not self.init_std >= 0:
            raise ValueError(f"fourierft(init_std=...) must be >= 0, got {self.init_std!r}.")

    def check_shape(self, n: int, m: int, path: str) -> None:
        if self.n_coeff > n * m:
            raise ValueError(
                f"fourierft(n_coeff={self.n_coeff}) at {path!r} exceeds the {n * m} entries of "
                f"its ({n}, {m}) matrix view."
            )

    def init_factors(self, key: jax.Array, kernel: jax.Array) -> dict[str, Any]:
        dtype = jnp.dtype(self.dtype or kernel.dtype)
        return {"coeffs": self.init_std * jax.random.normal(key, (self.n_coeff,), dtype)}

    def _apply(self, factors, x, shape, transposed: bool) -> jax.Array:
        c = factors["coeffs"]
        n, m = matrix_dims(shape, "fourierft")
        k, ell = _frequencies(n, m, self.n_coeff, self.seed)
        src, dst, d_out = (ell, k, n) if transposed else (k, ell, m)
        xh = jnp.fft.ifft(x.astype(c.dtype), axis=-1) * x.shape[-1]
        vals = xh[..., src] * c
        spec = jnp.zeros((*x.shape[:-1], d_out), vals.dtype).at[..., dst].add(vals)
        out = jnp.fft.ifft(spec, axis=-1).real
        return (out * (self.scale / x.shape[-1])).astype(c.dtype)

    def apply_delta(
        self,
        factors: dict[str, Any],
        x: jax.Array,
        *,
        shape: tuple[int, int],
        key: jax.Array | None = None,
    ) -> jax.Array:
        del key
        return self._apply(factors, x, shape, transposed=False)

    def apply_delta_transposed(
        self, factors: dict[str, Any], y: jax.Array, *, shape: tuple[int, int]
    ) -> jax.Array:
        return self._apply(factors, y, shape, transposed=True)

    def materialize(self, factors: dict[str, Any], *, shape: tuple[int, int]) -> jax.Array:
        c = factors["coeffs"]
        n, m = matrix_dims(shape, "fourierft")
        k, ell = _frequencies(n, m, self.n_coeff, self.seed)
        f = jnp.zeros((n, m), c.dtype).at[k, ell].add(c)
        return (jnp.fft.ifft2(f).real * self.scale).astype(c.dtype)

    def factor_specs(self, in_spec: Any, out_spec: Any) -> dict[str, tuple[Any, ...]]:
        return {"coeffs": (None,)}


def fourierft(
    n_coeff: int,
    *,
    scale: float = 150.0,
    seed: int = 777,
    init_std: float = 1.0,
    in_ndim: int | None = None,
    out_ndim: int | None = None,
    dtype: str | None = None,
) -> FourierFT:
    """A FourierFT spec for a target rule: ``(r".*(query|value)/kernel", fourierft(1000))``."""
    return FourierFT(
        n_coeff=n_coeff,
        scale=scale,
        seed=seed,
        init_std=init_std,
        in_ndim=in_ndim,
        out_ndim=out_ndim,
        dtype=None if dtype is None else jnp.dtype(dtype).name,
    )
