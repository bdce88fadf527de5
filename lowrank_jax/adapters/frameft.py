"""FrameFT: sparse trainable coefficients of ``ΔW`` in a shared tight-fusion-frame basis.

``ΔW = (scale / √(n·m)) · Φ_inᵀ S Φ_out`` with fixed orthogonal bases ``Φ_in ∈ R^{n×n}``,
``Φ_out ∈ R^{m×m}`` (:func:`lowrank_jax.spectral.frame_basis`, generated from the width and shared
by every layer of that width) and ``S ∈ R^{n×m}`` zero except at ``n_coeff`` fixed positions that
hold the trainable coefficients ``c``. The positions are a deterministic function of the shape and
a static seed, so the trainable tree holds ``c`` only.

Application strategies for ``x @ ΔW`` (``x: (b, n)``):

* ``"fft"`` (frame basis): ``x Φ_inᵀ`` and ``t Φ_out`` are block DFTs (see
  :func:`lowrank_jax.spectral.frame_analysis`), so the cost is ``O(b (n log n + m log m + n_coeff))``;
  neither ``Φ`` nor ``ΔW`` nor a gradient of their size is formed.
* ``"gather"``: uses only the ``R`` rows of ``Φ_in`` and ``C`` rows of ``Φ_out`` that carry a
  coefficient: ``((x Φ_in[R]ᵀ) S[R, C]) Φ_out[C]``, cost ``O(b (n R + C m))``; the only choice for
  the random basis that never forms ``ΔW``; identity bases index ``x`` directly.
* ``"dense"``: **materialises** ``ΔW`` (``O(n R m)``) and computes ``x @ ΔW``; its gradient forms an
  ``(n, m)`` matrix. Cheaper for large batches when ``R ≈ n`` and ``C ≈ m``.
* ``"auto"``: ``"fft"`` for frames, ``"gather"`` for identity, otherwise the cheaper of
  ``"gather"`` and ``"dense"`` for the (static) batch size.

References:
  P10 FrameFT (Adepu, Zhang, Kumar, Singh, ICML 2026); the update, scale, positions and defaults
  follow the public code as summarised in specs §10. Positions are drawn with NumPy's generator,
  so they match the code's distribution but not its ``torch.randperm`` draw.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np

from lowrank_jax.adapters.kinds import AdapterKind, matrix_dims
from lowrank_jax.spectral.frames import BASES, Basis, frame_analysis, frame_basis, frame_synthesis

__all__ = [
    "FrameFT",
    "Strategy",
    "frame_positions",
    "frameft",
]

Strategy = Literal["auto", "fft", "gather", "dense"]
_STRATEGIES = ("auto", "fft", "gather", "dense")


@functools.lru_cache(maxsize=256)
def _positions(n: int, m: int, n_coeff: int, seed: int, num_blocks: int):
    cb_in, cb_out = n // num_blocks, m // num_blocks
    per_block = cb_in * cb_out
    idx = np.random.default_rng(seed).permutation(num_blocks * per_block)[:n_coeff]
    block, within = np.divmod(idx, per_block)
    row, col = np.divmod(within, cb_out)
    rows, cols = row + block * cb_in, col + block * cb_out
    rows_used, row_pos = np.unique(rows, return_inverse=True)
    cols_used, col_pos = np.unique(cols, return_inverse=True)
    out = (rows, cols, rows_used, row_pos, cols_used, col_pos)
    for a in out:
        a.setflags(write=False)
    return out


def frame_positions(
    n: int, m: int, *, n_coeff: int, seed: int = 2024, num_blocks: int = 1
) -> tuple[np.ndarray, np.ndarray]:
    """The fixed ``(row, col)`` positions of FrameFT's coefficients in ``S ∈ R^{n×m}``.

    The ``num_blocks`` diagonal blocks of size ``(n/num_blocks, m/num_blocks)`` are enumerated,
    permuted by ``seed`` and truncated to ``n_coeff`` entries (FrameFT's ``share_entry`` layout:
    every layer of one shape uses the same positions; give layers distinct seeds to vary them).

    Returns:
      ``(rows, cols)``: int arrays of shape ``(n_coeff,)``, distinct pairs.
    """
    rows, cols, *_ = _positions(int(n), int(m), int(n_coeff), int(seed), int(num_blocks))
    return rows, cols


@dataclasses.dataclass(frozen=True)
class FrameFT(AdapterKind):
    """FrameFT adapter ``ΔW = (scale/√(nm)) Φ_inᵀ S Φ_out`` with ``n_coeff`` trainable entries of ``S``.

    Factors: ``{"coeffs": (n_coeff,)}``, so the trainable count is ``n_coeff`` per kernel; the
    matrix view ``shape = (n, m)`` (``Adapter.matrix``) is passed to ``apply_delta``,
    ``apply_delta_transposed`` and ``materialize``. Coefficients start at ``c ~ N(0, init_std²)`` (FrameFT's default
    ``init_std = 1``, a small non-zero ``ΔW`` thanks to ``1/√(nm)``); ``init_std=0`` starts at the
    base model exactly.

    Attributes:
      n_coeff: trainable coefficients per kernel, at most ``n·m/num_blocks``.
      scale: the ``scale`` numerator (FrameFT's GLUE default 50).
      l, l_out: frame parameter ``L`` of ``Φ_in`` and ``Φ_out`` (even, dividing the width;
        ``l_out=None`` uses ``l``). ``L = 2`` is a realified DFT; larger ``L`` is sparser.
      basis: ``"frame"`` (default), or the ablations ``"random"`` (Haar orthogonal) and
        ``"identity"`` (coefficients on weight entries).
      basis_seed: seed of the random basis.
      entry_seed: seed of the coefficient positions (shared by all layers of a shape).
      num_blocks: block-diagonal layout of the positions (1 = anywhere).
      init_std: standard deviation of the initial coefficients.
      strategy: ``"auto"``, ``"fft"``, ``"gather"`` or ``"dense"`` (see the module docstring).
      in_ndim, out_ndim, dtype: as for :class:`lowrank_jax.adapters.LoRA`.

    References:
      P10 FrameFT (ICML 2026), specs §10.
    """

    n_coeff: int
    scale: float = 50.0
    l: int = 2  # noqa: E741
    l_out: int | None = None
    basis: Basis = "frame"
    basis_seed: int = 0
    entry_seed: int = 2024
    num_blocks: int = 1
    init_std: float = 1.0
    strategy: Strategy = "auto"
    in_ndim: int | None = None
    out_ndim: int | None = None
    dtype: str | None = None

    def __post_init__(self):
        for name in ("n_coeff", "l", "num_blocks"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"frameft({name}=...) must be a positive int, got {v!r}.")
        if self.l_out is not None and (not isinstance(self.l_out, int) or self.l_out < 1):
            raise ValueError(
                f"frameft(l_out=...) must be a positive int or None, got {self.l_out!r}."
            )
        if self.basis not in BASES:
            raise ValueError(f"frameft(basis=...) must be one of {BASES}, got {self.basis!r}.")
        if self.strategy not in _STRATEGIES:
            raise ValueError(
                f"frameft(strategy=...) must be one of {_STRATEGIES}, got {self.strategy!r}."
            )
        if self.strategy == "fft" and self.basis != "frame":
            raise ValueError("frameft(strategy='fft') needs basis='frame'; use 'gather' or 'auto'.")
        if not self.init_std >= 0:
            raise ValueError(f"frameft(init_std=...) must be >= 0, got {self.init_std!r}.")
        for name in ("in_ndim", "out_ndim"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or v < 1):
                raise ValueError(f"frameft({name}=...) must be a positive int or None, got {v!r}.")

    @property
    def _l_out(self) -> int:
        return self.l if self.l_out is None else self.l_out

    def check_shape(self, n: int, m: int, path: str) -> None:
        if n % self.num_blocks or m % self.num_blocks:
            raise ValueError(
                f"frameft(num_blocks={self.num_blocks}) must divide both sides of the ({n}, {m}) "
                f"matrix view of {path!r}."
            )
        total = n * m // self.num_blocks
        if self.n_coeff > total:
            raise ValueError(
                f"frameft(n_coeff={self.n_coeff}) at {path!r} exceeds the {total} positions of its "
                f"({n}, {m}) matrix view with num_blocks={self.num_blocks}; use at most {total}."
            )
        if self.basis == "frame":
            for dim, ell, side in ((n, self.l, "l"), (m, self._l_out, "l_out")):
                if ell % 2 or dim % ell:
                    raise ValueError(
                        f"frameft({side}={ell}) at {path!r} must be even and divide the width "
                        f"{dim}; pick another {side} (e.g. 2) or a rule per layer."
                    )

    def _layout(self, n: int, m: int):
        return _positions(n, m, self.n_coeff, self.entry_seed, self.num_blocks)

    def _basis(self, dim: int, ell: int) -> np.ndarray:
        return frame_basis(dim, l=ell, basis=self.basis, seed=self.basis_seed)

    def init_factors(self, key: jax.Array, kernel: jax.Array) -> dict[str, jax.Array]:
        dtype = jnp.dtype(self.dtype or kernel.dtype)
        return {"coeffs": self.init_std * jax.random.normal(key, (self.n_coeff,), dtype)}

    def coefficient_scale(self, n: int, m: int) -> float:
        """``scale / √(n·m)``, the factor in front of ``Φ_inᵀ S Φ_out``."""
        return self.scale / math.sqrt(n * m)

    def choose_strategy(self, batch: int, n: int, m: int) -> str:
        """The strategy ``"auto"`` resolves to for a batch of ``batch`` rows (a static choice)."""
        if self.strategy != "auto":
            return self.strategy
        if self.basis == "frame":
            return "fft"
        if self.basis == "identity":
            return "gather"
        _, _, rows_used, _, cols_used, _ = self._layout(n, m)
        r, c = len(rows_used), len(cols_used)
        gather = batch * (n * r + c * m)
        dense = n * r * m + batch * n * m
        return "gather" if gather <= dense else "dense"

    def _sparse_mid(self, u, coeffs, src_pos, dst_pos, dst_size):
        """``t[..., dst_pos[p]] += u[..., src_pos[p]] · c_p``: the product with the sparse ``S``."""
        vals = u[..., src_pos] * coeffs
        t = jnp.zeros((*u.shape[:-1], dst_size), vals.dtype)
        return t.at[..., dst_pos].add(vals)

    def _apply(self, factors, x, shape, transposed: bool) -> jax.Array:
        c = factors["coeffs"]
        n, m = matrix_dims(shape, "frameft")
        rows, cols, rows_used, row_pos, cols_used, col_pos = self._layout(n, m)
        x = x.astype(c.dtype)
        d_in, d_out = (m, n) if transposed else (n, m)
        l_in, l_out = (self._l_out, self.l) if transposed else (self.l, self._l_out)
        src, dst = (cols, rows) if transposed else (rows, cols)
        batch = math.prod(x.shape[:-1])
        strategy = self.choose_strategy(batch, n, m)
        s = jnp.asarray(self.coefficient_scale(n, m), c.dtype)
        if strategy == "fft":
            u = frame_analysis(x, l=l_in)
            t = self._sparse_mid(u, c, src, dst, d_out)
            return frame_synthesis(t, l=l_out) * s
        if strategy == "gather":
            src_used, src_pos, dst_used, dst_pos = (
                (cols_used, col_pos, rows_used, row_pos)
                if transposed
                else (rows_used, row_pos, cols_used, col_pos)
            )
            if self.basis == "identity":
                u = x[..., src_used]
            else:
                u = x @ jnp.asarray(self._basis(d_in, l_in)[src_used].T, c.dtype)
            t = self._sparse_mid(u, c, src_pos, dst_pos, len(dst_used))
            if self.basis == "identity":
                out = jnp.zeros((*x.shape[:-1], d_out), t.dtype)
                return out.at[..., dst_used].add(t) * s
            return (t @ jnp.asarray(self._basis(d_out, l_out)[dst_used], c.dtype)) * s
        dw = self.materialize(factors, shape=(n, m))
        return x @ (dw.T if transposed else dw)

    def apply_delta(
        self,
        factors: dict[str, jax.Array],
        x: jax.Array,
        *,
        shape: tuple[int, int],
        key: jax.Array | None = None,
    ) -> jax.Array:
        del key  # FrameFT has no dropout.
        return self._apply(factors, x, shape, transposed=False)

    def apply_delta_transposed(
        self, factors: dict[str, jax.Array], y: jax.Array, *, shape: tuple[int, int]
    ) -> jax.Array:
        return self._apply(factors, y, shape, transposed=True)

    def materialize(self, factors: dict[str, jax.Array], *, shape: tuple[int, int]) -> jax.Array:
        """``ΔW = (scale/√(nm)) Φ_in[R]ᵀ S[R, C] Φ_out[C]`` from the used basis rows only."""
        c = factors["coeffs"]
        n, m = matrix_dims(shape, "frameft")
        _, _, rows_used, row_pos, cols_used, col_pos = self._layout(n, m)
        core = jnp.zeros((len(rows_used), len(cols_used)), c.dtype).at[row_pos, col_pos].add(c)
        p_in = jnp.asarray(self._basis(n, self.l)[rows_used], c.dtype)
        p_out = jnp.asarray(self._basis(m, self._l_out)[cols_used], c.dtype)
        return (p_in.T @ core @ p_out) * jnp.asarray(self.coefficient_scale(n, m), c.dtype)

    def delta_flops(self, n: int, m: int) -> int:
        """Multiply-add FLOPs of forming ``ΔW`` with sparse bases: ``(Φ_inᵀ (S Φ_out))``.

        ``2·Σ_p nnz(Φ_out[col_p])`` for ``S Φ_out`` plus ``2·nnz(Φ_in[R])·m`` for the product with
        ``Φ_inᵀ`` restricted to the used rows ``R``: the count that shrinks with the frame's
        sparsity (about ``2/L`` non-zeros per row).
        """
        rows, cols, rows_used, _, _, _ = self._layout(n, m)
        nz_in = np.count_nonzero(np.abs(self._basis(n, self.l)) > 1e-12, axis=1)
        nz_out = np.count_nonzero(np.abs(self._basis(m, self._l_out)) > 1e-12, axis=1)
        return int(2 * nz_out[cols].sum() + 2 * nz_in[rows_used].sum() * m)

    def factor_specs(self, in_spec: Any, out_spec: Any) -> dict[str, tuple[Any, ...]]:
        return {"coeffs": (None,)}


def frameft(
    n_coeff: int,
    *,
    scale: float = 50.0,
    l: int = 2,  # noqa: E741
    l_out: int | None = None,
    basis: Basis = "frame",
    basis_seed: int = 0,
    entry_seed: int = 2024,
    num_blocks: int = 1,
    init_std: float = 1.0,
    strategy: Strategy = "auto",
    in_ndim: int | None = None,
    out_ndim: int | None = None,
    dtype: str | None = None,
) -> FrameFT:
    """A FrameFT spec for a target rule: ``(r".*(query|value)/kernel", frameft(1000))``.

    See :class:`FrameFT` for the arguments and the maths.

    Example:
      >>> ad = adapters.init(key, variables, [(r".*Dense_1/kernel", frameft(256, l=8))])
      >>> out = adapters.adapt(model.apply)(variables, ad, x)
    """
    return FrameFT(
        n_coeff=n_coeff,
        scale=scale,
        l=l,
        l_out=l_out,
        basis=basis,
        basis_seed=basis_seed,
        entry_seed=entry_seed,
        num_blocks=num_blocks,
        init_std=init_std,
        strategy=strategy,
        in_ndim=in_ndim,
        out_ndim=out_ndim,
        dtype=None if dtype is None else jnp.dtype(dtype).name,
    )
