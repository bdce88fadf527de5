r"""Generalisation bounds for data-driven tuning from the pseudo-dimension (P12).

The guarantee of P12 (arXiv 2602.02406) is a uniform-convergence bound over the loss class
:math:`\mathcal U = \{x \mapsto u(x, α) : α \in \mathbb R_{>0}^p\}`, with :math:`u(x, α)` the
validation loss of instance :math:`x` after the inner solve with weights :math:`α`. The paper's
own constants are not public (``papers/specs.md`` §12: "the exact bound in the paper: not
found"), so this module computes the standard bound that such results instantiate, with every
constant explicit (a reconstruction):

1. **Pseudo-dimension from a polynomial count** (:func:`pseudo_dimension_bound`). Suppose that for
   every instance :math:`x` and level :math:`r`, the function :math:`α \mapsto u(x, α)` is
   continuous and :math:`u(x, α) = r` only on the zero set of at most ``num_polys`` nonzero
   polynomials of degree at most ``degree`` in :math:`α`. Then for ``N`` instances with levels
   :math:`r_i`, the labelling :math:`(\mathbb 1[u(x_i, α) > r_i])_i` is constant on each connected
   component of the complement (in :math:`\mathbb R^p`) of the zero sets of the
   :math:`m = N \cdot` ``num_polys`` polynomials and the :math:`p` coordinate hyperplanes, of which
   there are at most :math:`(4 e Δ m' / p)^p` with :math:`m' = m + p` (Warren 1968, Theorem 3).
   Shattering needs :math:`2^N` labellings, so

   .. math:: \mathrm{Pdim}(\mathcal U) \le \max\{N : 2^N \le (4 e Δ (N\,\mathrm{num\_polys} + p)/p)^p\}.

2. **Counts for the two lasso families** (:func:`lasso_loss_polynomials`), both with a ridge
   term :math:`ρ > 0` (strictly convex inner problem, so :math:`\hat β(α)` and ``u`` are continuous
   in :math:`α`) and ``p`` tied weights (:func:`lowrank_jax.tuning.lasso.tie_weights`, linear in α):

   * weighted **fused** lasso on ``d`` features: in increment coordinates the penalty is a
     weighted ℓ1 on ``d − 1`` coordinates; on each of the :math:`3^{d-1}` sign patterns the KKT
     system is linear with right-hand side affine in α, so :math:`\hat β` is affine and ``u`` is
     quadratic in α: ``num_polys`` :math:`= 3^{d-1}`, ``degree`` :math:`= 2`;
   * weighted **group** lasso with ``G`` groups over ``d`` features: on each of the :math:`2^G`
     active sets ``A``, :math:`\hat β` solves :math:`t_g (Hβ - b)_g + λ_g β_g = 0`,
     :math:`t_g^2 = \lVert β_g\rVert^2` (:math:`g \in A`), equations of degree 2 in
     :math:`(β_A, t_A, λ)`; with :math:`u(β) - r = 0` the variety has degree at most
     :math:`2^{d_A + |A| + 1}` (Bézout), and so does the hypersurface of :math:`(λ, r)` it
     projects into: ``num_polys`` :math:`= 2^G`, ``degree`` :math:`= 2^{d + G + 1}`.

3. **Uniform convergence** (:func:`uniform_convergence_bound`): for a loss class with values in
   :math:`[0, H]` and pseudo-dimension ``d``, with probability at least :math:`1 - δ` over ``N``
   i.i.d. instances, for every α (Mohri, Rostamizadeh & Talwalkar 2018, Theorem 11.8 — their
   Corollary 3.19 applied to the thresholded class — made two-sided by a union bound):

   .. math:: \Bigl|\frac1N\sum_i u(x_i, α) - \mathbb E\,u(x, α)\Bigr|
             \le H\Bigl(\sqrt{\tfrac{2 \log Π_d(N)}{N}} + \sqrt{\tfrac{\log(2/δ)}{2N}}\Bigr),

   with :math:`\log Π_d(N) = \min(N \log 2,\, d \log(eN/d))` for ``N ≥ d`` (Sauer's lemma) and
   :math:`N \log 2` below (then the bound exceeds ``H``: vacuous). The squared validation loss is not
   bounded; with a plug-in ``H`` the bound is a statement about the clipped loss
   :math:`\min(u, H)`, whose pseudo-dimension is no larger.

These are worst-case bounds on :math:`\sup_α` of the gap; the gap of a tuned :math:`\hat α` is one
point under that supremum. They ignore that the experiments tune the loss after a fixed number of
FISTA iterations (the paper's "approximate inner optimisation" case).

References:
  P12 (specs §12): arXiv 2602.02406. H. E. Warren, "Lower bounds for approximation by nonlinear
  manifolds", Trans. AMS 133 (1968). M. Mohri, A. Rostamizadeh, A. Talwalkar, *Foundations of
  Machine Learning*, 2nd ed. (2018), Cor. 3.19, Thm. 11.8.
"""

from __future__ import annotations

import math

import numpy as np

from lowrank_jax.tuning import lasso

__all__ = [
    "lasso_loss_polynomials",
    "pseudo_dimension_bound",
    "uniform_convergence_bound",
    "uniform_convergence_sample_size",
]

_LOG2_4E = math.log2(4 * math.e)


def _check_int(name: str, value: int, least: int) -> int:
    if isinstance(value, bool) or int(value) != value or value < least:
        raise ValueError(f"{name} must be an integer >= {least}, got {value!r}")
    return int(value)


def pseudo_dimension_bound(p: int, *, num_polys: int, degree: int) -> int:
    r"""Warren's bound on the pseudo-dimension of a loss class cut by polynomials in ``p`` weights.

    The largest ``N`` with :math:`2^N \le (4 e \cdot \mathrm{degree} \cdot (N\,\mathrm{num\_polys}
    + p)/p)^p` (see the module docstring for the argument and its assumption: each instance's loss
    is continuous in α and crosses a level only on the zero set of ``num_polys`` polynomials of
    degree ≤ ``degree``).

    Args:
      p: the number of tuned hyperparameters (α ∈ R^p).
      num_polys: polynomials per instance (a Python int; may be huge, e.g. ``3 ** 40``).
      degree: their largest degree in α (a Python int; may be huge).

    Returns:
      An upper bound on the pseudo-dimension (an int ≥ 1).

    Raises:
      ValueError: ``p``, ``num_polys`` or ``degree`` is not a positive integer.

    Example:
      >>> pseudo_dimension_bound(1, num_polys=1, degree=1)   # 2^6 <= 4e*7, 2^7 > 4e*8
      6
    """
    p = _check_int("p", p, 1)
    num_polys = _check_int("num_polys", num_polys, 1)
    degree = _check_int("degree", degree, 1)
    log2_deg = math.log2(degree)

    def shatterable(n: int) -> bool:  # 2^n <= (4e deg (n m + p) / p)^p, in log2 (exact ints)
        return n <= p * (_LOG2_4E + log2_deg + math.log2(n * num_polys + p) - math.log2(p))

    hi = 1
    while shatterable(2 * hi):  # the feasible set is an interval [1, N*]: the right side is concave
        hi *= 2
    lo, hi = hi, 2 * hi  # shatterable(lo) holds (n = 1 always does), shatterable(hi) does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if shatterable(mid) else (lo, mid)
    return lo


def lasso_loss_polynomials(penalty: lasso.Penalty) -> tuple[int, int]:
    """``(num_polys, degree)`` of a weighted lasso's validation loss (module docstring, item 2).

    Args:
      penalty: :func:`lowrank_jax.tuning.group_lasso` (G groups over d features) or
        :func:`lowrank_jax.tuning.lasso.fused_lasso` (d features); the inner problem must carry a
        ridge term ρ > 0 (``ridge`` of :func:`lowrank_jax.tuning.lasso.prepare`) for the continuity
        the count relies on.

    Returns:
      ``(3 ** (d - 1), 2)`` for the fused lasso, ``(2 ** G, 2 ** (d + G + 1))`` for the group
      lasso (Python ints), to pass to :func:`pseudo_dimension_bound`.

    Raises:
      ValueError: a penalty of another kind.
    """
    d = penalty.num_features
    if penalty.name == "fused_lasso":
        return 3 ** (d - 1), 2
    if penalty.name == "group_lasso":
        g = penalty.num_weights
        return 2**g, 2 ** (d + g + 1)
    raise ValueError(
        f"no polynomial count for a {penalty.name!r} penalty: use group or fused lasso"
    )


def uniform_convergence_bound(
    num_instances: np.ndarray | int, *, pdim: int, loss_bound: float, delta: float = 0.05
) -> np.ndarray:
    r"""The two-sided uniform-convergence bound on the generalisation gap (module docstring, 3).

    .. math:: H\Bigl(\sqrt{2 \log Π_d(N)/N} + \sqrt{\log(2/δ)/(2N)}\Bigr),

    :math:`\log Π_d(N) = \min(N \log 2, d \log(eN/d))` for ``N ≥ d``, :math:`N \log 2` below.

    Args:
      num_instances: ``N`` (an int or an array of them, any shape).
      pdim: the pseudo-dimension ``d`` (or an upper bound, e.g. :func:`pseudo_dimension_bound`).
      loss_bound: ``H``, the loss range ``[0, H]``.
      delta: the failure probability δ ∈ (0, 1).

    Returns:
      float64 array of the shape of ``num_instances``: with probability ≥ 1 − δ,
      :math:`\sup_α |\hat R_N(α) - R(α)|` is at most this.

    Raises:
      ValueError: ``N < 1``, ``pdim < 1``, ``loss_bound <= 0`` or δ outside (0, 1).

    Example:
      >>> round(float(uniform_convergence_bound(100, pdim=10, loss_bound=1.0)), 4)
      0.9485
    """
    n = np.asarray(num_instances, np.float64)
    if n.size == 0 or np.any(n < 1) or np.any(n != np.round(n)):
        raise ValueError(f"num_instances must be integers >= 1, got {num_instances!r}")
    pdim = _check_int("pdim", pdim, 1)
    if not loss_bound > 0:
        raise ValueError(f"loss_bound must be > 0, got {loss_bound}")
    if not 0 < delta < 1:
        raise ValueError(f"delta must lie in (0, 1), got {delta}")
    sauer = pdim * np.log(math.e * np.maximum(n, pdim) / pdim)  # valid for N >= d
    log_growth = np.where(n >= pdim, np.minimum(n * math.log(2), sauer), n * math.log(2))
    return loss_bound * (np.sqrt(2 * log_growth / n) + np.sqrt(math.log(2 / delta) / (2 * n)))


def uniform_convergence_sample_size(
    epsilon: float, *, pdim: int, loss_bound: float, delta: float = 0.05
) -> int:
    """The sample complexity ``N(ε, δ)``: the least ``N`` at which
    :func:`uniform_convergence_bound` is at most ``epsilon``.

    Args:
      epsilon: the target gap ε > 0 (in loss units, like ``loss_bound``).
      pdim: the pseudo-dimension ``d``; loss_bound: ``H``; delta: δ ∈ (0, 1).

    Returns:
      The least such ``N`` (an int; the bound is non-increasing in ``N``).

    Raises:
      ValueError: ``epsilon <= 0`` or the arguments :func:`uniform_convergence_bound` rejects.

    Example:
      >>> uniform_convergence_sample_size(0.5, pdim=10, loss_bound=1.0)
      510
    """
    if not epsilon > 0:
        raise ValueError(f"epsilon must be > 0, got {epsilon}")

    def ok(n: int) -> bool:
        return (
            float(uniform_convergence_bound(n, pdim=pdim, loss_bound=loss_bound, delta=delta))
            <= epsilon
        )

    if ok(1):
        return 1
    lo, hi = 1, 2  # the bound is non-increasing in N: ok(lo) fails, find the first ok(hi)
    while not ok(hi):
        lo, hi = hi, 2 * hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if ok(mid) else (mid, hi)
    return hi
