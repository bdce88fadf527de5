r"""Online low-rank Poisson change-point statistic (P17), constant work per observation.

A stream of count matrices ``Y_t ∈ ℕ^{p×L}`` (``p`` components × ``L`` bins of the domain) has
mean ``Λ_t = E[Y_t]`` of rank ``≤ r`` that changes at an unknown time ``τ``. At time ``t`` the
statistic compares, for every scale ``w ∈ {2^0, …, 2^J}`` with ``w < t``, a low-rank estimate of
the mean of the last ``w`` observations with one of the mean of everything before them:

.. math::

    D_{t,w} = \sqrt{\tfrac{w (t-w)}{t}}\;
              \big\| \hat\Lambda\big(\bar Y_{(t-w, t]}\big) - \hat\Lambda\big(\bar Y_{[1, t-w]}\big)
              \big\|_F ,
    \qquad
    b_{t,w} = \sqrt{\bar\lambda\, r \max(p, L)\, \ell_t} + \ell_t / \sqrt{w},
    \quad \ell_t = \log(t^2 (J+1) / \alpha),

and alarms at the first ``t`` with ``max_w D_{t,w} / b_{t,w} > C`` (``D_{t,w} = 0`` for ``w ≥ t``).
``λ̄`` is the largest cell mean (from a training stretch), the ``log t²`` term a union bound over
time, and ``C`` is calibrated by block bootstrap (:mod:`lowrank_jax.changepoint.calibration`).

Constant cost: the state holds the running sum ``A_t = Σ_{u≤t} Y_u``, the window sums
``S_w = Σ_{u∈(t-w,t]} Y_u`` of every scale and a ring buffer of the last ``2^J`` observations;
each observation updates every ``S_w`` incrementally (``+ Y_t − Y_{t−w}``, integer, exact),
and the past mean is ``(A_t − S_w)/(t − w)``. Per observation the work is ``O(J p L)`` for the
sums (not ``O(2^J p L)``: long windows cost no more than short ones) plus the rank-``r``
estimates of ``2(J+1)`` ``p×L`` means, whatever ``t``.

``Λ̂`` is, by default, **adaptive singular-value thresholding** (specs §17): the hard SVT of the
window's mean at the level its size allows,

.. math::

    \hat\Lambda(S) = \sum_{i:\, \sigma_i > \tau_S} \sigma_i u_i v_i^\top
    \quad (\bar Y_S = \textstyle\sum_i \sigma_i u_i v_i^\top),
    \qquad
    \tau_S = c_\tau \Big(\sqrt{\bar\lambda \max(p, L)\, \ell_t / |S|} + \ell_t / |S|\Big),

so the rank is chosen per window and per observation: a short recent window (large ``τ``) keeps
only the directions it can resolve, the long past window keeps every direction of ``Λ`` above the
noise, and a change outside ``Λ``'s span enters the recent estimate as soon as it clears ``τ``.
``τ_S`` is the matrix-Bernstein scale of ``‖Ȳ_S − Λ‖_op`` with the ``ℓ_t`` of ``b_{t,w}``; the
spec leaves the constant ``c_τ`` (``SVT.scale``) open: it is best calibrated on the training
stretch (:func:`~lowrank_jax.changepoint.calibration.calibrate_svt_scale`), and
:func:`~lowrank_jax.changepoint.detectors.lowrank_scan` defaults to 0.5. Hard rather than
soft thresholding: it leaves the kept singular values unbiased (a soft threshold shrinks the
recent and past estimates by different ``τ``, a bias of order ``τ_w`` in every ``D_{t,w}``).
``fixed rank`` (``svt=None``) is the rank-``r`` truncation, and ``rank=None`` no truncation (the
Frobenius scan, ``r = min(p, L)`` in ``b``).

Both are computed either exactly from an SVD of every mean (``method="svd"``,
``O(J p L min(p, L))``) or by warm-started subspace iteration (``method="subspace"``, default,
``O(J p L k)``): each of the ``2(J+1)`` means ``M`` keeps ``k`` right vectors ``V (L×k)`` from the
previous observation; a step is ``U = orth(M V)``, ``W = Mᵀ U = V' R`` (Gram–Schmidt, ``R`` upper
triangular), so ``U Uᵀ M = U Rᵀ V'ᵀ``, and ``diag R`` estimates the top ``k`` singular values
(exactly when converged). The estimate keeps the columns with ``R_ii > τ_S`` (SVT; ``k`` caps
the rank a window may choose, ``rank`` argument) or all ``k = r`` (fixed rank). Means move by
``O(1/w)`` between observations, so one step tracks the top subspace; with many steps it
converges to the exact estimates (tested).

References:
  P17: X. Luo, H. Xu, C. M. Madrid Padilla, O. H. Madrid Padilla, "Online change-point detection
  for multivariate inhomogeneous Poisson processes with low-rank intensity" (arXiv 2601.20192).
  No code was published; this is the reconstruction of ``papers/specs.md`` §17 (the statistic,
  threshold shape and SVT level above, their constants calibrated on a training stretch, the
  rank of a window capped at ``k`` for
  the subspace iteration, the constant ``C`` calibrated by bootstrap instead of from the paper's
  matrix Bernstein bound).

Example::

    svt = SVT(rate_bound=lam.max(), alpha=0.05)
    state = init_lowrank_scan(initial_basis(lam, rank=4), p=30, num_cells=30, num_scales=5)
    state, d = update_lowrank_scan(state, y[None], rank=4, svt=svt)  # d: (1, J+1), D_{t,w}
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from lowrank_jax.changepoint.params import (
    SVT,
    check_counts,
    check_rank,
    check_svt,
    scales,
    svt_threshold,
)
from lowrank_jax.spectral import svd

__all__ = [
    "SVT",
    "LowRankScanState",
    "check_counts",
    "check_rank",
    "check_svt",
    "init_lowrank_scan",
    "initial_basis",
    "lowrank_statistics",
    "lowrank_threshold",
    "scales",
    "svt_threshold",
    "update_lowrank_scan",
]

METHODS = ("subspace", "svd")


class LowRankScanState(NamedTuple):
    """Fixed-size state of the online statistic (its size does not depend on ``t``).

    Attributes:
      t: number of observations seen, int32 scalar.
      total: ``A_t``, running sum of all observations, int32 ``(p, L)``.
      recent: ring buffer of the last ``2^J`` observations, ``Y_u`` in slot ``(u − 1) mod 2^J``
        (zeros before the stream starts), int32 ``(2^J, p, L)``.
      sums: the window sums ``S_w`` of the scales ``2^0..2^J``, int32 ``(J+1, p, L)``.
      basis: right bases of the recent (first ``J+1``) and past (last ``J+1``) means,
        float32 ``(2(J+1), L, r)`` (``r = 0`` columns when there is no truncation).
    """

    t: jax.Array
    total: jax.Array
    recent: jax.Array
    sums: jax.Array
    basis: jax.Array


def initial_basis(mean_counts, *, rank: int | None) -> jax.Array:
    """Top-``r`` right singular vectors of a ``(p, L)`` mean (e.g. of a training stretch),
    float32 ``(L, r)``: the warm start of the subspace iteration."""
    m = np.asarray(mean_counts, np.float64)
    if m.ndim != 2:
        raise ValueError(f"mean_counts must be (p, L), got shape {m.shape}")
    rank = check_rank(rank, *m.shape)
    if rank is None:
        return jnp.zeros((m.shape[1], 0), jnp.float32)
    _, _, vt = np.linalg.svd(m, full_matrices=False)
    return jnp.asarray(vt[:rank].T, jnp.float32)


def init_lowrank_scan(
    basis: jax.typing.ArrayLike, *, p: int, num_cells: int, num_scales: int
) -> LowRankScanState:
    """The state before the first observation.

    Args:
      basis: warm-start right basis ``(L, r)`` (:func:`initial_basis`), ``(L, 0)`` for no
        truncation.
      p: number of components (rows of ``Y_t``).
      num_cells: number of bins ``L`` (columns of ``Y_t``).
      num_scales: ``J``; windows ``2^0..2^J``, the state keeps ``2^J`` observations.
    """
    w = scales(num_scales)
    basis = jnp.asarray(basis, jnp.float32)
    if basis.ndim != 2 or basis.shape[0] != num_cells:
        raise ValueError(f"basis must be (L, r) = ({num_cells}, r), got shape {basis.shape}")
    k = len(w)
    return LowRankScanState(
        t=jnp.zeros((), jnp.int32),
        total=jnp.zeros((p, num_cells), jnp.int32),
        recent=jnp.zeros((int(w[-1]), p, num_cells), jnp.int32),
        sums=jnp.zeros((k, p, num_cells), jnp.int32),
        basis=jnp.broadcast_to(basis, (2 * k, *basis.shape)),
    )


def _orth(
    x: jax.Array, fallback: jax.Array | None = None, *, with_r: bool = False
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Orthonormal columns spanning ``x`` (``(..., n, r)``) by modified Gram–Schmidt (``r`` is
    small). A column that vanishes (rank-deficient ``x``, e.g. an all-zero mean) is replaced by
    the same column of ``fallback`` (orthogonalised), else left zero. ``with_r``: also the
    ``(..., r, r)`` upper-triangular ``R`` with ``x = Q R`` (its diagonal: the norms left after
    orthogonalisation; 0 where a column was replaced)."""
    cols, rows = [], []
    for j in range(x.shape[-1]):
        v = x[..., j]
        scale = jnp.sqrt(jnp.sum(v * v, -1, keepdims=True))
        live = jnp.ones_like(scale, dtype=bool)
        if fallback is not None:
            live = scale > 1e-6 * (1.0 + jnp.max(scale))
            v = jnp.where(live, v, fallback[..., j])
        coef = []
        for q in cols:
            c = jnp.sum(q * v, -1, keepdims=True)
            v = v - c * q
            coef.append(c)
        norm = jnp.sqrt(jnp.sum(v * v, -1, keepdims=True))
        cols.append(jnp.where(norm > 1e-12, v / jnp.maximum(norm, 1e-30), 0.0))
        if with_r:
            upper = [jnp.where(live, c, 0.0)[..., 0] for c in coef]
            diag = jnp.where(live, norm, 0.0)[..., 0]
            zeros = [jnp.zeros_like(diag)] * (x.shape[-1] - j - 1)
            rows.append(jnp.stack([*upper, diag, *zeros], -1))  # column j of R
    q = jnp.stack(cols, -1)
    return (q, jnp.stack(rows, -1)) if with_r else q


def _gram_frobenius(pa, va, pb, vb) -> jax.Array:
    """``‖pa vaᵀ − pb vbᵀ‖_F²`` from ``k × k`` Gram matrices (``pa: (..., p, k)``, ``va: (..., L, k)``),
    without forming the ``p × L`` matrices."""

    def inner(p1, v1, p2, v2):
        return jnp.sum(
            jnp.einsum("...pi,...pj->...ij", p1, p2) * jnp.einsum("...li,...lj->...ij", v1, v2),
            axis=(-2, -1),
        )

    sq = inner(pa, va, pa, va) + inner(pb, vb, pb, vb) - 2.0 * inner(pa, va, pb, vb)
    return jnp.maximum(sq, 0.0)


def update_lowrank_scan(
    state: LowRankScanState,
    ys: jax.typing.ArrayLike,
    *,
    rank: int | None,
    svt: SVT | None = None,
    method: str = "subspace",
    power_iters: int = 1,
) -> tuple[LowRankScanState, jax.Array]:
    """Adds a chunk of ``B ≥ 1`` observations and returns ``D_{t,w}`` after each of them.

    ``B = 1`` is the plain online update; a chunk only batches the same per-observation work
    (``O(1)`` in ``t``: window sums updated incrementally, ``2(J+1)`` estimates per observation). With ``method="subspace"`` every observation of a
    chunk warm-starts from the basis carried into the chunk, and the basis of the chunk's last
    observation is carried out.

    Args:
      state: from :func:`init_lowrank_scan` or the previous update.
      ys: new count matrices ``(B, p, L)`` (integers; validate streams with
        :func:`check_counts` outside ``jit``).
      rank: with ``svt``, the largest rank a window's estimate may take (``k``, the columns the
        subspace iteration tracks; ``min(p, L)`` with ``method="svd"`` for no cap); without,
        the fixed rank ``r`` of the truncation; None for no estimate at all (Frobenius scan).
      svt: :class:`SVT`: adaptive hard thresholding at ``τ_S`` (the rank chosen per window);
        None: fixed rank-``rank`` truncation.
      method: ``"subspace"`` (warm-started subspace iteration) or ``"svd"`` (exact).
      power_iters: subspace steps per observation (``method="subspace"``).

    Returns:
      ``(new_state, d)`` with ``d: (B, J+1)`` float32, zero for scales ``w ≥ t``.
    """
    if method not in METHODS:
        raise ValueError(f"method={method!r} is invalid: pass one of {METHODS}")
    size, p, num_cells = state.recent.shape
    k = state.basis.shape[0] // 2
    w = jnp.asarray(scales(k - 1), jnp.int32)
    ys = jnp.asarray(ys).astype(jnp.int32)
    b = ys.shape[0]
    t = state.t + 1 + jnp.arange(b)  # (B,)
    # Y_{t_i − w} leaves window w at t_i: from the ring (times up to state.t), the chunk, or 0.
    gone = t[:, None] - w[None]  # (B, J+1)
    old = state.recent[jnp.maximum(gone - 1, 0) % size]
    new = ys[jnp.clip(gone - state.t - 1, 0, b - 1)]
    out = jnp.where(
        (gone > state.t)[..., None, None], new, jnp.where((gone >= 1)[..., None, None], old, 0)
    )
    window_sums = (
        state.sums[None] + jnp.cumsum(ys, 0)[:, None] - jnp.cumsum(out, 0)
    )  # (B, J+1, p, L)
    totals = state.total[None] + jnp.cumsum(ys, 0)  # (B, p, L)
    keep = min(b, size)  # only the chunk's last 2^J observations stay in the ring
    ring = state.recent.at[(state.t + b - keep + jnp.arange(keep)) % size].set(ys[b - keep :])

    tf = t.astype(jnp.float32)[:, None]
    wf = w.astype(jnp.float32)[None]
    valid = w[None] < t[:, None]
    past_n = jnp.maximum(tf - wf, 1.0)
    recent = window_sums.astype(jnp.float32) / wf[..., None, None]
    past = (totals[:, None] - window_sums).astype(jnp.float32) / past_n[..., None, None]
    means = jnp.concatenate([recent, past], 1)  # (B, 2(J+1), p, L)
    if svt is not None:
        sizes = jnp.concatenate([jnp.broadcast_to(wf, past_n.shape), past_n], 1)
        tau = svt_threshold(tf, sizes, svt, p=p, num_cells=num_cells, num_scales=k - 1)
    else:
        tau = None

    basis = state.basis
    if rank is None:
        diff = means[:, :k] - means[:, k:]
        sq = jnp.sum(diff * diff, axis=(2, 3))
    elif method == "svd":
        est = means if rank is None else svd.lowrank_approximation(means, rank=rank, threshold=tau)
        diff = est[:, :k] - est[:, k:]
        sq = jnp.sum(diff * diff, axis=(2, 3))
    else:
        prev = jnp.broadcast_to(basis, (b, *basis.shape))

        def power_step(v):
            u = _orth(jnp.einsum("bkpl,bklr->bkpr", means, v))
            wt = jnp.einsum("bkpl,bkpr->bklr", means, u)  # W = Mᵀ U = V' R (Gram–Schmidt)
            v_new, r = _orth(wt, prev, with_r=True)
            return v_new, u, r

        v = prev
        if power_iters > 1:
            v = jax.lax.fori_loop(0, power_iters - 1, lambda _, x: power_step(x)[0], v)
        v, u, r = power_step(v)  # U Uᵀ M = U Wᵀ = (U Rᵀ) V'ᵀ
        basis = v[-1]
        if tau is not None:
            keep = jnp.diagonal(r, axis1=-2, axis2=-1) > tau[..., None]
            r = jnp.where(keep[..., :, None], r, 0.0)  # rows of R: directions v_i
        factor = jnp.einsum("bkpi,bkji->bkpj", u, r)  # U Rᵀ (B, 2(J+1), p, k)
        sq = _gram_frobenius(factor[:, :k], v[:, :k], factor[:, k:], v[:, k:])
    weight = jnp.sqrt(wf * (tf - wf) / tf)
    d = jnp.where(valid, weight * jnp.sqrt(sq), 0.0)
    return LowRankScanState(t[-1], totals[-1], ring, window_sums[-1], basis), d


def lowrank_threshold(
    t: jax.typing.ArrayLike,
    *,
    rate_bound: float,
    p: int,
    num_cells: int,
    num_scales: int,
    rank: int | None,
    alpha: float,
) -> jax.Array:
    """``b_{t,w}`` for every scale, float32 ``(..., J+1)`` (the un-calibrated ``C = 1`` form).

    ``rate_bound`` is ``λ̄``, the largest cell mean; ``rank=None`` uses ``r = min(p, L)``.
    """
    if not 0 < alpha < 1:
        raise ValueError(f"alpha={alpha} is invalid: pass a level in (0, 1)")
    if rate_bound <= 0:
        raise ValueError(f"rate_bound={rate_bound} is invalid: pass the max cell mean (> 0)")
    r = min(p, num_cells) if rank is None else rank
    w = jnp.asarray(scales(num_scales), jnp.float32)
    tf = jnp.asarray(t, jnp.float32)[..., None]
    ell = jnp.log(jnp.maximum(tf, 1.0) ** 2 * (num_scales + 1) / alpha)
    return jnp.sqrt(rate_bound * r * max(p, num_cells) * ell) + ell / jnp.sqrt(w)


def lowrank_statistics(
    ys: jax.typing.ArrayLike,
    basis: jax.typing.ArrayLike,
    *,
    rank: int | None,
    num_scales: int,
    svt: SVT | None = None,
    method: str = "subspace",
    power_iters: int = 1,
    chunk: int = 1,
) -> jax.Array:
    """``D_{t,w}`` for a whole stream ``ys: (T, p, L)`` by ``lax.scan`` over chunks of
    ``chunk`` observations, float32 ``(T, J+1)`` (arguments of :func:`update_lowrank_scan`).

    Validates the counts, the rank and ``svt`` (ValueError) before tracing.
    """
    ys = check_counts(ys, name="ys")
    if ys.ndim != 3:
        raise ValueError(f"ys must be a stream of count matrices (T, p, L), got {ys.shape}")
    n, p, num_cells = ys.shape
    check_rank(rank, p, num_cells)
    svt = check_svt(svt)
    state = init_lowrank_scan(basis, p=p, num_cells=num_cells, num_scales=num_scales)
    pad = -n % chunk
    ys = np.concatenate([ys, np.zeros((pad, p, num_cells), ys.dtype)]).reshape(
        -1, chunk, p, num_cells
    )
    d = _scan_statistics(state, jnp.asarray(ys), rank, svt, method, power_iters)
    return d.reshape(-1, d.shape[-1])[:n]


@functools.partial(jax.jit, static_argnums=(2, 3, 4, 5))
def _scan_statistics(state, ys, rank, svt, method, power_iters):
    def step(s, y):
        return update_lowrank_scan(s, y, rank=rank, svt=svt, method=method, power_iters=power_iters)

    return jax.lax.scan(step, state, ys)[1]
