"""Tight fusion frames by spectral tetris, realified into exactly orthogonal bases (FrameFT).

A *fusion frame* for ``C^n`` is a family of subspaces ``W_1..W_K`` with weights; it is *tight* when
``Σ_k P_{W_k} = A·I`` (Casazza–Kutyniok). The construction used by FrameFT (P10) is:

1. **Spectral tetris** builds ``T ∈ R^{l×n}`` with orthogonal rows of squared norm ``n/l`` and unit
   columns: each row is filled with 1's left to right; when a residual norm ``x ∈ (0, 1)`` is left,
   the 2×2 block ``(1/√2)[[√x, √x], [√(2−x), −√(2−x)]]`` is placed over this row and the next.
2. **Modulation** makes ``K`` copies ``T_k = T ⊙ ω^{k c} / √K`` (``ω = e^{2πi/K}``, ``c`` the column).
   Each ``T_k`` has orthogonal rows, so its row space ``W_k`` is an ``l``-dimensional subspace, and
   ``Σ_k T_kᴴ T_k = I_n`` whenever every row of ``T`` spans at most ``K`` consecutive columns: the
   stacked ``F ∈ C^{Kl×n}`` is a Parseval frame and ``Σ_k P_{W_k} = (Kl/n)·I`` is tight.
3. **Realification** maps each complex entry ``z`` to ``[[Re z, −Im z], [Im z, Re z]]``; it is a
   ``*``-homomorphism, so the real ``Φ ∈ R^{2Kl×2n}`` keeps ``ΦᵀΦ = I``. With FrameFT's parameters
   ``(K, l, n) = (N/L, L/2, N/2)`` the matrix is square, ``Φ ∈ R^{N×N}``, and **exactly orthogonal**.

For ``L = 2`` the basis is a realified DFT of size ``N/2`` (close to FourierFT's); for larger ``L`` it is
block-diagonal with ``L/2`` DFT blocks of size ``N/L`` (a fraction ``≈ 2/L`` of non-zeros). Because
every block is a DFT, ``x ↦ Φx`` and ``y ↦ Φᵀy`` cost ``O(N log N)`` with FFTs
(:func:`frame_analysis`, :func:`frame_synthesis`) and never form ``Φ``.

Bases are generated algorithmically from ``(N, L)`` and memoised per shape
(:func:`frame_basis`), so every layer of a given width shares one read-only copy.

References:
  P10 FrameFT: Adepu, Zhang, Kumar, Singh, "Fine-Tuning of Transformer models with Frames",
  ICML 2026; construction from the public code (``construct_real_tff``) as summarised in specs §10.
  Casazza, Fickus, Mixon, Wang, Zhou, "Constructing tight fusion frames", ACHA 30 (2011).
"""

from __future__ import annotations

import functools
import math
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np

Basis = Literal["frame", "random", "identity"]
BASES = ("frame", "random", "identity")

__all__ = [
    "BASES",
    "frame_analysis",
    "frame_basis",
    "frame_nnz",
    "frame_synthesis",
    "real_tight_fusion_frame",
    "realify",
    "spectral_tetris",
    "tight_fusion_frame",
    "tight_fusion_frame_exists",
]

_TOL = 1e-9


def _positive_int(name: str, v: object) -> int:
    if not isinstance(v, int | np.integer) or isinstance(v, bool) or v < 1:
        raise ValueError(f"{name} must be a positive int, got {v!r}.")
    return int(v)


def tight_fusion_frame_exists(*, k: int, l: int, n: int) -> bool:  # noqa: E741
    """Whether a tight fusion frame of ``k`` subspaces of dimension ``l`` in ``C^n`` exists.

    The existence test of Casazza et al. (2011), Thm. 4.3 (the ``tffet`` routine of the FrameFT
    code): reduce ``l`` to ``min(l, n − l)``; if ``l | n`` it exists iff ``k ≥ n/l``; otherwise it
    exists if ``k > ⌈n/l⌉ + 1``, not if ``k < ⌈n/l⌉ + 1``, and at equality the question recurses on
    ``(k, kl − n)`` with the complementary dimension.

    Args:
      k: number of subspaces ``K``.
      l: subspace dimension.
      n: ambient dimension.

    Returns:
      ``True`` if such a frame exists.
    """
    k, l, n = (_positive_int(s, v) for s, v in (("k", k), ("l", l), ("n", n)))  # noqa: E741
    if l > n:
        return False
    if l == n:
        return k >= 1
    if 2 * l > n:
        l = n - l  # noqa: E741
    for _ in range(64):
        if n % l == 0:
            return k >= n // l
        c = math.ceil(n / l) + 1
        if k != c:
            return k > c
        n = k * l - n
        l = n - l  # noqa: E741
        if l <= 0:
            return False
    return False


def spectral_tetris(*, l: int, n: int) -> np.ndarray:  # noqa: E741
    """The ``(l, n)`` spectral-tetris matrix: orthogonal rows of squared norm ``n/l``, unit columns.

    Row ``r`` is filled with 1's from the current column; when the residual ``x = n/l − ‖T_r‖²`` is
    in ``(0, 1)``, ``(1/√2)[[√x, √x], [√(2−x), −√(2−x)]]`` fills rows ``r, r+1`` and two columns.
    ``T Tᵀ = (n/l)·I_l`` and every column has unit norm.

    Args:
      l: number of rows (the subspace dimension), ``1 ≤ l ≤ n/2`` unless ``l | n``.
      n: number of columns (the ambient dimension).

    Returns:
      ``T`` as a float64 NumPy array of shape ``(l, n)``.

    Raises:
      ValueError: spectral tetris does not apply to ``(l, n)`` (``n/l < 2`` without ``l | n``).

    References:
      Casazza, Fickus, Mixon, Wang, Zhou (2011), "Spectral tetris".
    """
    l, n = _positive_int("l", l), _positive_int("n", n)  # noqa: E741
    if l > n or (n % l and n < 2 * l):
        raise ValueError(
            f"spectral tetris needs n/l >= 2 (or l dividing n); got l={l}, n={n}. Use a smaller l."
        )
    t = np.zeros((l, n))
    target = n / l
    col = 0
    for row in range(l):
        req = target - float(t[row, :col] @ t[row, :col])
        while req >= 1.0 - 1e-9:
            t[row, col] = 1.0
            req -= 1.0
            col += 1
        if req > 1e-9:
            if row == l - 1 or col + 2 > n:
                raise ValueError(f"spectral tetris ran out of columns for l={l}, n={n}.")
            a, b = math.sqrt(req / 2), math.sqrt((2 - req) / 2)
            t[row : row + 2, col : col + 2] = [[a, a], [b, -b]]
            col += 2
    if col != n:
        raise ValueError(
            f"spectral tetris filled {col} of {n} columns for l={l}; use l dividing n."
        )
    return t


def tight_fusion_frame(*, k: int, l: int, n: int) -> np.ndarray:  # noqa: E741
    """``K`` modulated copies of the spectral-tetris matrix: a tight fusion frame of ``C^n``.

    ``F_k = T ⊙ ω^{k c} / √K`` with ``ω = e^{2πi/K}``; the stack ``F ∈ C^{Kl×n}`` satisfies
    ``Fᴴ F = I_n`` (Parseval) and ``Σ_k P_{row(F_k)} = (Kl/n) I_n``.

    Args:
      k: number of subspaces ``K``.
      l: subspace dimension.
      n: ambient dimension, ``Kl ≥ n``.

    Returns:
      complex128 NumPy array of shape ``(k, l, n)``.

    Raises:
      ValueError: no tight fusion frame with these parameters comes out of this construction (the
        message says what to change).
    """
    k = _positive_int("k", k)
    t = spectral_tetris(l=l, n=n)
    span = max(int(np.ptp(np.flatnonzero(row))) + 1 for row in t)
    if span > k:
        raise ValueError(
            f"k={k} copies are too few for l={l}, n={n}: a row of T spans {span} columns, so use "
            f"k >= {span} (tight_fusion_frame_exists(k=..., l=..., n=...) tells which exist)."
        )
    phase = np.exp(2j * np.pi * np.outer(np.arange(k), np.arange(n)) / k)  # (k, n)
    return t[None, :, :] * phase[:, None, :] / math.sqrt(k)


def realify(frames: np.ndarray) -> np.ndarray:
    """Real form of complex frame matrices: ``z ↦ [[Re z, −Im z], [Im z, Re z]]`` per entry.

    Args:
      frames: complex array ``(..., l, n)``.

    Returns:
      real array ``(..., 2l, 2n)``; rows ``2r, 2r+1`` and columns ``2c, 2c+1`` hold entry ``(r, c)``,
      so ``realify(F) @ [Re z₀, Im z₀, Re z₁, ...] = [Re (Fz)₀, Im (Fz)₀, ...]``.
    """
    frames = np.asarray(frames)
    re, im = frames.real, frames.imag
    top = np.stack([re, -im], axis=-1).reshape(*frames.shape[:-1], -1)
    bottom = np.stack([im, re], axis=-1).reshape(*frames.shape[:-1], -1)
    out = np.stack([top, bottom], axis=-2)
    return out.reshape(*frames.shape[:-2], 2 * frames.shape[-2], 2 * frames.shape[-1])


def real_tight_fusion_frame(*, k: int, l: int, n: int) -> np.ndarray:  # noqa: E741
    """The realified tight fusion frame ``(k, 2l, 2n)`` (FrameFT's ``construct_real_tff``).

    Stacked to ``Φ ∈ R^{2kl×2n}`` it has ``ΦᵀΦ = I_{2n}``; with ``kl = n`` it is square orthogonal.
    """
    return realify(tight_fusion_frame(k=k, l=l, n=n))


def _check_dim(dim: int, l: int) -> tuple[int, int, int]:  # noqa: E741
    dim, l = _positive_int("dim", dim), _positive_int("l", l)  # noqa: E741
    if l % 2 or dim % l:
        raise ValueError(
            f"a frame basis of size {dim} with l={l} needs an even l that divides {dim} (FrameFT "
            "uses (K, l, n) = (dim/l, l/2, dim/2)); pick l in {2, 4, 8, ...} dividing the width."
        )
    return dim // l, l // 2, dim // 2


@functools.lru_cache(maxsize=64)
def _basis(dim: int, l: int, kind: str, seed: int) -> np.ndarray:  # noqa: E741
    if kind == "frame":
        k, half_l, half_n = _check_dim(dim, l)
        phi = real_tight_fusion_frame(k=k, l=half_l, n=half_n).reshape(dim, dim)
    elif kind == "random":
        g = np.random.default_rng(seed)
        q, r = np.linalg.qr(g.standard_normal((dim, dim)))
        phi = q * np.sign(np.diag(r))
    else:
        phi = np.eye(dim)
    phi = np.ascontiguousarray(phi, dtype=np.float64)
    phi.setflags(write=False)
    return phi


def frame_basis(dim: int, *, l: int = 2, basis: Basis = "frame", seed: int = 0) -> np.ndarray:  # noqa: E741
    """The ``(dim, dim)`` orthogonal basis FrameFT expands ``ΔW`` in, shared per shape.

    ``"frame"``: the realified tight fusion frame with ``(K, l, n) = (dim/L, L/2, dim/2)`` (rows
    ``(k, r, re/im)``, columns ``(c, re/im)``); ``"random"``: a Haar-random orthogonal matrix from
    ``seed``; ``"identity"``: ``I`` (each coefficient sits on one weight). Memoised per arguments
    and returned read-only, so all layers of one width share one copy; it is a pure function of its
    arguments.

    Args:
      dim: ``N``, the layer width (even and divisible by ``l`` for ``"frame"``).
      l: ``L``, the frame parameter (even); the basis has a non-zero fraction of about ``2/L``.
      basis: ``"frame"``, ``"random"`` or ``"identity"``.
      seed: seed of the ``"random"`` basis.

    Returns:
      float64 NumPy array ``Φ`` with ``ΦᵀΦ = ΦΦᵀ = I`` (to float64 rounding).

    Raises:
      ValueError: unknown ``basis`` or an ``l`` that does not fit ``dim``.

    Example:
      >>> phi = frame_basis(16, l=4)
      >>> np.allclose(phi @ phi.T, np.eye(16))
      True
    """
    if basis not in BASES:
        raise ValueError(f"basis must be one of {BASES}, got {basis!r}.")
    dim = _positive_int("dim", dim)
    if basis == "frame":
        _check_dim(dim, l)
    return _basis(dim, int(l), basis, int(seed))


def frame_nnz(dim: int, *, l: int = 2, basis: Basis = "frame") -> int:  # noqa: E741
    """Non-zeros per row of :func:`frame_basis` (at most ``2·dim/L`` for a frame, 1 for identity).

    The frame count is the maximum over rows; it is what FLOP counts of forming ``ΔW`` with a sparse
    basis use.
    """
    phi = frame_basis(dim, l=l, basis=basis)
    return int(np.max(np.count_nonzero(np.abs(phi) > _TOL, axis=1)))


def frame_analysis(x: jax.typing.ArrayLike, *, l: int = 2) -> jax.Array:  # noqa: E741
    """``x @ Φᵀ`` (the frame coefficients ``Φx`` of each row) for the ``"frame"`` basis, by FFT.

    With ``z_c = x_{2c} + i x_{2c+1}`` and ``K = N/L``:
    ``(Fz)_{k,r} = √K · IFFT_K(fold_K(T_r ⊙ z))_k`` where ``fold_K`` sums the entries whose column
    index is congruent mod ``K``; the output interleaves real and imaginary parts in the row order
    ``(k, r, re/im)`` of :func:`frame_basis`. Cost ``O(N log N)`` per row; ``Φ`` is never formed.

    Args:
      x: ``(..., N)`` real array.
      l: the frame parameter ``L``.

    Returns:
      ``(..., N)`` array equal to ``x @ frame_basis(N, l=l).T``.
    """
    x = jnp.asarray(x)
    dim = x.shape[-1]
    k, half_l, half_n = _check_dim(dim, l)
    t = spectral_tetris(l=half_l, n=half_n)
    z = x[..., 0::2] + 1j * x[..., 1::2]  # (..., n)
    v = z[..., None, :] * jnp.asarray(t, x.dtype)  # (..., l, n)
    pad = (-half_n) % k
    v = jnp.pad(v, [(0, 0)] * (v.ndim - 1) + [(0, pad)])
    v = v.reshape(*v.shape[:-1], -1, k).sum(-2)  # fold: (..., l, K)
    w = jnp.fft.ifft(v, axis=-1) * math.sqrt(k)  # (..., l, K)
    w = jnp.swapaxes(w, -1, -2)  # (..., K, l)
    out = jnp.stack([w.real, w.imag], axis=-1)  # (..., K, l, 2)
    return out.reshape(*x.shape[:-1], dim).astype(x.dtype)


def frame_synthesis(y: jax.typing.ArrayLike, *, l: int = 2) -> jax.Array:  # noqa: E741
    """``y @ Φ`` (the inverse of :func:`frame_analysis`) for the ``"frame"`` basis, by FFT.

    ``z_c = (1/√K) Σ_r T_{r,c} FFT_K(w_{·,r})_{c mod K}`` with ``w`` the complex form of ``y``; the
    output interleaves ``Re z_c, Im z_c``. Cost ``O(N log N)`` per row.

    Args:
      y: ``(..., N)`` real array.
      l: the frame parameter ``L``.

    Returns:
      ``(..., N)`` array equal to ``y @ frame_basis(N, l=l)``.
    """
    y = jnp.asarray(y)
    dim = y.shape[-1]
    k, half_l, half_n = _check_dim(dim, l)
    t = spectral_tetris(l=half_l, n=half_n)
    w = y.reshape(*y.shape[:-1], k, half_l, 2)
    w = w[..., 0] + 1j * w[..., 1]  # (..., K, l)
    f = jnp.fft.fft(w, axis=-2) / math.sqrt(k)  # (..., K, l)
    reps = -(-half_n // k)
    f = jnp.concatenate([f] * reps, axis=-2)[..., :half_n, :]  # (..., n, l): index c mod K
    z = jnp.einsum("...cr,rc->...c", f, jnp.asarray(t, f.real.dtype))
    out = jnp.stack([z.real, z.imag], axis=-1)
    return out.reshape(*y.shape[:-1], dim).astype(y.dtype)
