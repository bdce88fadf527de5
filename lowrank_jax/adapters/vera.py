"""VeRA: shared frozen random projections with trainable scaling vectors (baseline).

``x @ ΔW = (((x @ Aᵀ) ⊙ d) @ Bᵀ) ⊙ b``, i.e. ``ΔW = Aᵀ diag(d) Bᵀ diag(b)`` with frozen random
``A ∈ R^{r×n}``, ``B ∈ R^{m×r}`` and trainable ``d ∈ R^r`` (init ``d_initial = 0.1``) and
``b ∈ R^m`` (init 0, so the adapted model starts at the base model). ``A`` and ``B`` are not in the
trainable tree: they are regenerated deterministically from ``projection_seed`` and the shape
(Kaiming-uniform with gain ``√2``, as PEFT's ``_kaiming_init``), so all layers of one shape share
the same matrices. Trainable parameters per kernel: ``r + m``.

References:
  Kopiczko, Blankevoort, Asano 2024, "VeRA: Vector-based Random Matrix Adaptation" (ICLR), and
  PEFT's ``VeraModel``; a baseline of P10 FrameFT (specs §10). PEFT slices one ``(r, max_in)``
  pair for all shapes; here each shape has its own pair from the same seed.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from lowrank_jax.adapters.kinds import AdapterKind, matrix_dims

__all__ = [
    "VeRA",
    "vera",
    "vera_projections",
]


def _projections(n: int, m: int, r: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    g = np.random.default_rng(seed)
    a = g.uniform(-math.sqrt(6.0 / n), math.sqrt(6.0 / n), (r, n))
    b = g.uniform(-math.sqrt(6.0 / r), math.sqrt(6.0 / r), (m, r))
    a.setflags(write=False)
    b.setflags(write=False)
    return a, b


def vera_projections(n: int, m: int, *, rank: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """The shared frozen ``(A: (r, n), B: (m, r))`` of VeRA for an ``(n, m)`` kernel."""
    return _projections(int(n), int(m), int(rank), int(seed))


@dataclasses.dataclass(frozen=True)
class VeRA(AdapterKind):
    """VeRA adapter ``ΔW = Aᵀ diag(d) Bᵀ diag(b)`` with shared frozen ``A``, ``B``.

    Factors ``{"d": (r,), "b": (m,)}``; the methods take the matrix view ``shape = (n, m)``
    (``Adapter.matrix``), from which the shared ``A``, ``B`` are regenerated.

    Attributes:
      rank: ``r`` of the shared projections (may exceed ``min(n, m)``, as in VeRA).
      d_initial: initial value of ``d``.
      projection_seed: seed of ``A``, ``B``.
      in_ndim, out_ndim, dtype: as for :class:`lowrank_jax.adapters.LoRA`.
    """

    rank: int
    d_initial: float = 0.1
    projection_seed: int = 0
    in_ndim: int | None = None
    out_ndim: int | None = None
    dtype: str | None = None

    def __post_init__(self):
        if not isinstance(self.rank, int) or isinstance(self.rank, bool) or self.rank < 1:
            raise ValueError(f"vera(rank=...) must be a positive int, got {self.rank!r}.")

    def check_shape(self, n: int, m: int, path: str) -> None:
        pass

    def init_factors(self, key: jax.Array, kernel: jax.Array) -> dict[str, Any]:
        del key
        _, m = kernel.shape
        dtype = jnp.dtype(self.dtype or kernel.dtype)
        return {"d": jnp.full((self.rank,), self.d_initial, dtype), "b": jnp.zeros((m,), dtype)}

    def _ab(self, factors, shape):
        n, m = matrix_dims(shape, "vera")
        a, b = _projections(n, m, self.rank, self.projection_seed)
        dt = factors["d"].dtype
        return jnp.asarray(a, dt), jnp.asarray(b, dt)

    def apply_delta(
        self,
        factors: dict[str, Any],
        x: jax.Array,
        *,
        shape: tuple[int, int],
        key: jax.Array | None = None,
    ) -> jax.Array:
        del key
        a, b = self._ab(factors, shape)
        return (((x.astype(a.dtype) @ a.T) * factors["d"]) @ b.T) * factors["b"]

    def apply_delta_transposed(
        self, factors: dict[str, Any], y: jax.Array, *, shape: tuple[int, int]
    ) -> jax.Array:
        a, b = self._ab(factors, shape)
        return (((y.astype(a.dtype) * factors["b"]) @ b) * factors["d"]) @ a

    def materialize(self, factors: dict[str, Any], *, shape: tuple[int, int]) -> jax.Array:
        a, b = self._ab(factors, shape)
        return ((a.T * factors["d"]) @ b.T) * factors["b"]

    def factor_specs(self, in_spec: Any, out_spec: Any) -> dict[str, tuple[Any, ...]]:
        return {"d": (None,), "b": (out_spec,)}


def vera(
    rank: int,
    *,
    d_initial: float = 0.1,
    projection_seed: int = 0,
    in_ndim: int | None = None,
    out_ndim: int | None = None,
    dtype: str | None = None,
) -> VeRA:
    """A VeRA spec for a target rule: ``(r".*kernel", vera(256))``. See :class:`VeRA`."""
    return VeRA(
        rank=rank,
        d_initial=d_initial,
        projection_seed=projection_seed,
        in_ndim=in_ndim,
        out_ndim=out_ndim,
        dtype=None if dtype is None else jnp.dtype(dtype).name,
    )
