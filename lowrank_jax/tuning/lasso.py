r"""Weighted group lasso and weighted fused lasso: FISTA inner solvers, vmapped (P12).

Both inner problems of P12 (specs §12, Le, Nguyen & Nguyen, arXiv 2602.02406) are solved in
one form, a smooth quadratic plus a separable penalty in coordinates ``θ`` with ``β = T θ``:

.. math::

   \min_θ\; \tfrac12 θ^\top H θ - b^\top θ + R_w(θ), \qquad
   H = T^\top (X^\top X / n + ρ I) T, \quad b = T^\top X^\top y / n,

i.e. :math:`\min_β \frac{1}{2n}\|y - Xβ\|^2 + \frac{ρ}{2}\|β\|^2 + \mathrm{pen}_w(β)` with

* **weighted group lasso** (``T = I``): :math:`\mathrm{pen}_w(β) = \sum_g w_g \|β_g\|_2`, whose
  prox is block soft-thresholding :math:`β_g \max(0, 1 - t w_g / \|β_g\|)`;
* **weighted fused lasso**: :math:`\mathrm{pen}_w(β) = \sum_{j=1}^{d-1} w_j |β_{j+1} - β_j|`.
  Choice of prox (documented reconstruction): instead of an inner 1-D total-variation solve
  (Condat's direct algorithm, or a dual projected-gradient loop), the problem is rewritten in
  increment coordinates ``θ = (β_1, β_2 - β_1, …, β_d - β_{d-1})``, ``β = T θ`` with ``T`` the
  lower-triangular matrix of ones (cumulative sum). The penalty becomes a weighted ℓ1 norm of
  ``θ_{2:d}`` with ``θ_1`` unpenalised, whose prox is exact elementwise soft-thresholding, so
  FISTA runs with an exact prox and no inner loop, and weights per edge cost nothing extra. The
  price is conditioning: ``T`` has condition number ``O(d^2)``, so the fused problem needs more
  FISTA iterations than the group one (``num_iters`` is explicit).

The datafit is ``1/(2n)`` for both (the spec writes ``½`` for the fused lasso; the two differ by
the rescaling ``w -> w / n`` of the weights, which a tuner on a log scale absorbs). FISTA uses the
exact step ``1 / λ_max(H)``, Nesterov momentum and the gradient adaptive restart of O'Donoghue &
Candès (2015), a fixed number of iterations (jit/vmap-friendly; no value-dependent Python
branching).

References:
  P12: T. Q. Le, A. T. Nguyen, V. A. Nguyen, "Provably Data-driven Multiple Hyper-parameter
  Tuning with Structured Loss Function", arXiv 2602.02406 (the inner problems; the paper is
  theoretical and gives no solver). Beck & Teboulle (2009), FISTA. Tibshirani et al. (2005),
  the fused lasso.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "Penalty",
    "Prepared",
    "fista",
    "fused_lasso",
    "group_lasso",
    "lasso_objective",
    "prepare",
    "prepare_instances",
    "prox_group_lasso",
    "prox_weighted_l1",
    "solve",
    "tie_weights",
    "validation_loss",
    "validation_losses",
]


@dataclasses.dataclass(
    frozen=True
)  # equal by value: a static jit argument, one compile per structure
class Penalty:
    """A weighted penalty in FISTA form (build it with :func:`group_lasso` / :func:`fused_lasso`).

    A value: two penalties of the same structure are equal and hash alike, so jitted solvers that
    take one as a static argument compile once per structure.

    Attributes:
      name: ``"group_lasso"`` or ``"fused_lasso"``.
      group_sizes: the ``G`` contiguous group sizes (group lasso); ``(d,)`` for the fused lasso.
    """

    name: str
    group_sizes: tuple[int, ...]

    @property
    def num_features(self) -> int:
        """``d``, the length of ``β``."""
        return sum(self.group_sizes)

    @property
    def num_weights(self) -> int:
        """The length of the weight vector ``w`` (``G`` groups or ``d - 1`` edges)."""
        if self.name == "group_lasso":
            return len(self.group_sizes)
        return self.num_features - 1

    @property
    def coef_matrix(self) -> np.ndarray:
        """``(d, d)`` float64 NumPy ``T`` with ``β = T θ`` (``I``, or lower-triangular ones)."""
        d = self.num_features
        return np.eye(d) if self.name == "group_lasso" else np.tril(np.ones((d, d)))

    def prox(self, theta: jax.Array, w: jax.Array, step: jax.Array) -> jax.Array:
        """``θ'``, the prox of ``step · R_w`` at ``θ`` (``θ``: ``(d,)``)."""
        if self.name == "group_lasso":
            return prox_group_lasso(theta, step * w, group_sizes=self.group_sizes)
        return prox_weighted_l1(theta, step * jnp.concatenate([jnp.zeros((1,), w.dtype), w]))

    def value(self, beta: jax.Array, w: jax.Array) -> jax.Array:
        """``pen_w(β)``, the penalty in the original coordinates."""
        if self.name == "group_lasso":
            ids = _group_ids(self.group_sizes)
            norms = jnp.sqrt(jax.ops.segment_sum(beta * beta, ids, len(self.group_sizes)))
            return jnp.sum(w * norms)
        return jnp.sum(w * jnp.abs(jnp.diff(beta)))


def _check_sizes(group_sizes: Sequence[int]) -> tuple[int, ...]:
    try:
        sizes = tuple(int(s) for s in group_sizes)
    except TypeError as e:
        raise TypeError(f"group_sizes must be a sequence of ints, got {group_sizes!r}") from e
    if not sizes or min(sizes) < 1:
        raise ValueError(f"group_sizes must be non-empty positive ints, got {sizes}")
    return sizes


def _group_ids(sizes: tuple[int, ...]) -> np.ndarray:
    return np.repeat(np.arange(len(sizes)), sizes)


def prox_group_lasso(
    v: jax.typing.ArrayLike, thresholds: jax.typing.ArrayLike, *, group_sizes: Sequence[int]
) -> jax.Array:
    r"""Block soft-thresholding: the prox of :math:`\sum_g τ_g \|v_g\|_2`.

    .. math:: \mathrm{prox}(v)_g = v_g \max(0,\, 1 - τ_g / \|v_g\|_2)

    Args:
      v: ``(d,)`` point, groups contiguous in the order of ``group_sizes``.
      thresholds: ``(G,)`` non-negative ``τ_g`` (step size times weight).
      group_sizes: ``G`` positive ints summing to ``d`` (static).

    Returns:
      ``(d,)`` the prox.

    Raises:
      ValueError: ``sum(group_sizes) != d`` or ``thresholds`` not of length ``G``.
    """
    sizes = _check_sizes(group_sizes)
    v, tau = jnp.asarray(v), jnp.asarray(thresholds)
    if v.shape != (sum(sizes),) or tau.shape != (len(sizes),):
        raise ValueError(
            f"prox_group_lasso: v {v.shape} and thresholds {tau.shape} do not match "
            f"group_sizes {sizes} (need v of shape ({sum(sizes)},), thresholds ({len(sizes)},))"
        )
    ids = _group_ids(sizes)
    norms = jnp.sqrt(jax.ops.segment_sum(v * v, ids, num_segments=len(sizes)))
    scale = jnp.maximum(0.0, 1.0 - tau / jnp.maximum(norms, jnp.finfo(v.dtype).tiny))
    return v * scale[ids]


def prox_weighted_l1(v: jax.typing.ArrayLike, thresholds: jax.typing.ArrayLike) -> jax.Array:
    r"""Elementwise soft-thresholding: the prox of :math:`\sum_j τ_j |v_j|` (``τ_j = 0``: free).

    Args:
      v: ``(d,)`` point.
      thresholds: ``(d,)`` non-negative ``τ_j``.

    Returns:
      ``(d,)`` :math:`\mathrm{sign}(v) \max(|v| - τ, 0)`.
    """
    v, tau = jnp.asarray(v), jnp.asarray(thresholds)
    if v.shape != tau.shape:
        raise ValueError(f"prox_weighted_l1: v {v.shape} and thresholds {tau.shape} differ")
    return jnp.sign(v) * jnp.maximum(jnp.abs(v) - tau, 0.0)


def group_lasso(group_sizes: Sequence[int]) -> Penalty:
    r"""The weighted group lasso penalty :math:`\sum_g w_g \|β_g\|_2` (contiguous groups).

    Args:
      group_sizes: ``G`` positive ints.

    Raises:
      ValueError: an empty list or a size below 1.

    Example:
      >>> pen = group_lasso((5,) * 8)   # d = 40 features in G = 8 groups of 5
    """
    return Penalty("group_lasso", _check_sizes(group_sizes))


def fused_lasso(num_features: int) -> Penalty:
    r"""The weighted fused lasso penalty :math:`\sum_{j<d} w_j |β_{j+1} - β_j|` (``d - 1`` weights).

    Solved in increment coordinates ``β = T θ`` (``T`` lower-triangular ones), where the prox is
    exact soft-thresholding of ``θ_{2:d}`` (see the module docstring).

    Raises:
      ValueError: ``num_features < 2``.
    """
    if int(num_features) < 2:
        raise ValueError(f"fused_lasso needs num_features >= 2, got {num_features}")
    return Penalty("fused_lasso", (int(num_features),))


def _check_weights(penalty: Penalty, weights: jax.Array) -> None:
    if weights.shape[-1:] != (penalty.num_weights,):
        raise ValueError(
            f"{penalty.name} takes {penalty.num_weights} weights, got shape {weights.shape}"
        )


def tie_weights(alpha: jax.typing.ArrayLike, *, num_weights: int) -> jax.Array:
    """Expands ``p`` tied block weights to ``num_weights`` penalty weights (blocks contiguous).

    Weight ``j`` of the penalty is ``alpha[j // (num_weights // p)]``: ``p = 1`` is one shared
    λ, ``p = num_weights`` one weight per group (or edge).

    Args:
      alpha: ``(..., p)`` block weights.
      num_weights: ``G`` (group lasso) or ``d - 1`` (fused lasso).

    Returns:
      ``(..., num_weights)`` (a NumPy array for a concrete ``alpha``).

    Raises:
      ValueError: ``p`` does not divide ``num_weights``.
    """
    xp = jnp if isinstance(alpha, jax.core.Tracer) else np  # eager NumPy: no compilation
    alpha = xp.asarray(alpha)
    p = alpha.shape[-1] if alpha.ndim else 0
    if p < 1 or num_weights % p:
        raise ValueError(
            f"{p} tied weight blocks do not divide the {num_weights} penalty weights: choose p "
            f"among the divisors of {num_weights}"
        )
    return xp.repeat(alpha, num_weights // p, axis=-1)


def _check_xy(x: jax.Array, y: jax.Array, penalty: Penalty, ridge: float) -> None:
    if x.ndim != 2 or y.shape != x.shape[:1] or x.shape[1] != penalty.num_features:
        raise ValueError(
            f"x {x.shape} and y {y.shape} must be (n, {penalty.num_features}) and (n,) "
            f"for {penalty.name} over {penalty.num_features} features"
        )
    if ridge < 0:
        raise ValueError(f"ridge must be >= 0, got {ridge}")


class Prepared(NamedTuple):
    """One instance's training data in FISTA form: ``H`` ``(d, d)``, ``b`` ``(d,)``, step."""

    h: jax.Array
    b: jax.Array
    step: jax.Array


def prepare(
    x: jax.typing.ArrayLike, y: jax.typing.ArrayLike, penalty: Penalty, *, ridge: float = 0.0
) -> Prepared:
    """``H = Tᵀ(XᵀX/n + ρI)T``, ``b = TᵀXᵀy/n`` and the step ``1/λ_max(H)`` of one instance.

    Args:
      x: ``(n, d)`` training design.
      y: ``(n,)`` training targets.
      penalty: from :func:`group_lasso` / :func:`fused_lasso`.
      ridge: ``ρ ≥ 0``, the optional ``(ρ/2)‖β‖²`` term (uniqueness).
    """
    x, y = jnp.asarray(x), jnp.asarray(y)
    _check_xy(x, y, penalty, ridge)
    n, d = x.shape
    t = jnp.asarray(penalty.coef_matrix, x.dtype)
    h = t.T @ ((x.T @ x) / n + ridge * jnp.eye(d, dtype=x.dtype)) @ t
    b = t.T @ (x.T @ y) / n
    return Prepared(h, b, 1.0 / jnp.linalg.eigvalsh(h)[-1])


def fista(prep: Prepared, weights: jax.Array, penalty: Penalty, *, num_iters: int) -> jax.Array:
    """FISTA with gradient adaptive restart on ``½θᵀHθ − bᵀθ + R_w(θ)``; returns ``β = Tθ``.

    Args:
      prep: :func:`prepare` of one instance.
      weights: ``(num_weights,)`` non-negative penalty weights (not checked here: traced).
      penalty: the penalty.
      num_iters: FISTA iterations (static).

    Returns:
      ``(d,)`` the coefficients ``β``.
    """
    h, b, step = prep

    def body(_, carry):
        x, z, t = carry
        x_new = penalty.prox(z - step * (h @ z - b), weights, step)
        t_new = 0.5 * (1.0 + jnp.sqrt(1.0 + 4.0 * t * t))
        restart = jnp.vdot(z - x_new, x_new - x) > 0
        z_new = jnp.where(restart, x_new, x_new + ((t - 1.0) / t_new) * (x_new - x))
        return x_new, z_new, jnp.where(restart, 1.0, t_new)

    x0 = jnp.zeros_like(b)
    theta, _, _ = jax.lax.fori_loop(0, num_iters, body, (x0, x0, jnp.ones((), b.dtype)))
    return jnp.asarray(penalty.coef_matrix, b.dtype) @ theta


def _validate(weights: jax.Array, penalty: Penalty) -> None:
    _check_weights(penalty, weights)
    if not isinstance(weights, jax.core.Tracer) and bool(np.any(np.asarray(weights) < 0)):
        raise ValueError(f"{penalty.name} weights must be non-negative, got {weights}")


def solve(
    x: jax.typing.ArrayLike,
    y: jax.typing.ArrayLike,
    weights: jax.typing.ArrayLike,
    penalty: Penalty,
    *,
    num_iters: int = 500,
    ridge: float = 0.0,
) -> jax.Array:
    r"""``β̂(w) = argmin_β (1/2n)‖y − Xβ‖² + (ρ/2)‖β‖² + pen_w(β)`` by FISTA (one instance).

    Args:
      x: ``(n, d)`` design.
      y: ``(n,)`` targets.
      weights: ``(num_weights,)`` non-negative weights (``G`` for the group lasso, ``d - 1``
        for the fused lasso).
      penalty: :func:`group_lasso` or :func:`fused_lasso`.
      num_iters: FISTA iterations.
      ridge: ``ρ ≥ 0``.

    Returns:
      ``(d,)`` the coefficients.

    Raises:
      ValueError: negative weights (when concrete), or shapes that do not match ``penalty``.

    Example:
      >>> pen = group_lasso((5,) * 8)
      >>> beta = solve(x, y, jnp.full(8, 0.1), pen, num_iters=300)
    """
    weights = jnp.asarray(weights)
    _validate(weights, penalty)
    x, y = jnp.asarray(x), jnp.asarray(y)
    _check_xy(x, y, penalty, ridge)
    return _solve(x, y, weights.astype(x.dtype), penalty=penalty, num_iters=num_iters, ridge=ridge)


@functools.partial(jax.jit, static_argnames=("penalty", "num_iters", "ridge"))
def _solve(x, y, weights, *, penalty, num_iters, ridge):
    prep = prepare(x, y, penalty, ridge=ridge)
    return fista(prep, weights, penalty, num_iters=num_iters)


def lasso_objective(
    beta: jax.typing.ArrayLike,
    x: jax.typing.ArrayLike,
    y: jax.typing.ArrayLike,
    weights: jax.typing.ArrayLike,
    penalty: Penalty,
    *,
    ridge: float = 0.0,
) -> jax.Array:
    """``(1/2n)‖y − Xβ‖² + (ρ/2)‖β‖² + pen_w(β)``, the training objective ``g(x; w, β)``."""
    beta, x, y, w = (jnp.asarray(a) for a in (beta, x, y, weights))
    r = y - x @ beta
    return 0.5 * jnp.mean(r * r) + 0.5 * ridge * jnp.vdot(beta, beta) + penalty.value(beta, w)


def validation_loss(beta: jax.typing.ArrayLike, x_val: jax.typing.ArrayLike, y_val) -> jax.Array:
    """The outer loss ``u = ‖y_val − X_val β‖² / n_val`` (specs §12)."""
    r = jnp.asarray(y_val) - jnp.asarray(x_val) @ jnp.asarray(beta)
    return jnp.mean(r * r)


@functools.partial(jax.jit, static_argnames=("penalty", "ridge"))
def prepare_instances(
    train: tuple[jax.typing.ArrayLike, jax.typing.ArrayLike],
    penalty: Penalty,
    *,
    ridge: float = 0.0,
) -> Prepared:
    """:func:`prepare` vmapped over ``N`` instances: ``H (N, d, d)``, ``b (N, d)``, steps ``(N,)``.

    Args:
      train: ``(X (N, n, d), y (N, n))`` training splits.
    """
    xt, yt = (jnp.asarray(a) for a in train)
    if xt.ndim != 3:
        raise ValueError(f"train X must be (N, n, d), got {xt.shape}")
    return jax.vmap(lambda x, y: prepare(x, y, penalty, ridge=ridge))(xt, yt)


@functools.partial(jax.jit, static_argnames=("penalty", "num_iters"))
def _losses(prep, xv, yv, weights, *, penalty, num_iters):
    def per_instance(prep, xv, yv):
        def per_weight(w):
            return validation_loss(fista(prep, w, penalty, num_iters=num_iters), xv, yv)

        return jax.vmap(per_weight)(weights)

    return jax.vmap(per_instance)(prep, xv, yv)


def validation_losses(
    train: tuple[jax.typing.ArrayLike, jax.typing.ArrayLike] | Prepared,
    val: tuple[jax.typing.ArrayLike, jax.typing.ArrayLike],
    weights: jax.typing.ArrayLike,
    penalty: Penalty,
    *,
    num_iters: int = 300,
    ridge: float = 0.0,
    chunk_size: int | None = None,
) -> jax.Array:
    """``u(x_i, w_c)`` for ``N`` instances × ``C`` weight vectors: one jitted double ``vmap``.

    Each instance's ``H``, ``b`` and step are formed once and shared by its ``C`` solves (pass
    :func:`prepare_instances` output as ``train`` to reuse them across calls).

    Args:
      train: ``(X (N, n, d), y (N, n))`` training splits, or their :func:`prepare_instances`.
      val: ``(X (N, m, d), y (N, m))`` validation splits.
      weights: ``(C, num_weights)`` non-negative candidate weight vectors (already expanded by
        :func:`tie_weights`).
      penalty: the penalty.
      num_iters: FISTA iterations per solve.
      ridge: ``ρ ≥ 0`` (ignored when ``train`` is already prepared).
      chunk_size: instances per jitted call when ``N`` exceeds it (bounds memory and fixes
        the compiled shape: the last chunk is padded; ``None``: all ``N`` at once).

    Returns:
      ``(N, C)`` validation losses.

    Raises:
      ValueError: negative weights, or shapes that do not match.
    """
    prep = train if isinstance(train, Prepared) else prepare_instances(train, penalty, ridge=ridge)
    # chunks are cut on the host (NumPy), so no slicing op is compiled per shape
    prep = jax.tree.map(np.asarray, prep)
    xv, yv = (np.asarray(a) for a in val)
    weights = np.asarray(weights, prep.b.dtype)
    if weights.ndim != 2:
        raise ValueError(f"weights must be (C, {penalty.num_weights}), got {weights.shape}")
    _validate(weights, penalty)
    if xv.ndim != 3 or prep.b.shape[0] != xv.shape[0]:
        raise ValueError(
            f"val X {xv.shape} must be (N, m, d) with the N = {prep.b.shape[0]} training instances"
        )
    n = xv.shape[0]
    step = n if chunk_size is None else min(n, max(1, int(chunk_size)))
    out = []
    for i in range(0, n, step):
        # every call sees `step` instances (the last chunk padded with copies of its last
        # instance, whose losses are dropped): one compilation per number of candidates
        idx = np.minimum(np.arange(i, i + step), n - 1)
        chunk = _losses(
            jax.tree.map(lambda a, idx=idx: a[idx], prep),
            xv[idx],
            yv[idx],
            weights,
            penalty=penalty,
            num_iters=num_iters,
        )
        out.append(np.asarray(chunk)[: min(step, n - i)])
    return jnp.asarray(np.concatenate(out, axis=0))
