r"""Mean-field self-attention token dynamics and their drift under low-rank perturbations (P3).

Tokens ``x_1..x_n`` are particles driven by one attention head used as a continuous-time flow
(depth ``t`` plays the role of the layer index; Geshkovski, Letrouit, Polyanskiy & Rigollet):

.. math::

    \dot x_i = P^\perp_{x_i}\Big(\sum_j P_{ij}\, V x_j\Big),\qquad
    P_{ij} = \frac{e^{\beta\langle Q x_i, K x_j\rangle}}{\sum_k e^{\beta\langle Q x_i, K x_k\rangle}},
    \qquad P^\perp_x y = y - \langle x, y\rangle x,

on the unit sphere :math:`S^{d-1}` (``sphere=True``; :math:`P^\perp` keeps :math:`\|x_i\| = 1`),
or in :math:`\mathbb{R}^d` without :math:`P^\perp` (``sphere=False``, the unnormalised
variant). Its mean-field limit is :math:`\partial_t\mu + \nabla\cdot(\mu X[\mu]) = 0` with
:math:`X[\mu]` the same velocity against the empirical measure :math:`\mu`.

A LoRA update of the value matrix, :math:`V \to V + \Delta V` with :math:`\|\Delta V\| = \varepsilon`,
moves the flow; P3 measures the forgetting it causes as the *geometric drift*

.. math::  D(t, \varepsilon) = \max_i \|x_i(t) - \tilde x_i(t)\|,

the *time to deviation* :math:`T_{dev}(\varepsilon, \delta) = \inf\{t : D(t, \varepsilon) > \delta\}`
and the 2-Wasserstein distance between the two empirical measures. A Gronwall argument gives
:math:`D(t) \le (\varepsilon / L)(e^{L t} - 1)` with :math:`L \approx \|V\|(1 + 2\beta\|Q^\top K\|)`,
hence :math:`T_{dev} \gtrsim L^{-1}\log(1 + \delta L/\varepsilon)` — affine in
:math:`\log(1/\varepsilon)` — and the limit geometry (clusters along the top eigenvector of
:math:`V`) survives a perturbation smaller than the eigengap :math:`\lambda_1 - \lambda_2`.

Everything here is a pure JAX function (``jit``/``vmap``-able) except :func:`wasserstein2`, which
calls POT's exact solver on the host. Integration is classical RK4 in one ``lax.scan``.

References:
  P3: Koubbi, Hernandez & Boussard, "The impact of LoRA on Oversmoothing: Understanding
  Catastrophic Forgetting in Mean-Field Attention Dynamics" (ICML 2026; arXiv 2402.15415, v2
  "Understanding Catastrophic Forgetting In LoRA via Mean-Field Attention Dynamics"); their v1
  code (``HugoKoubbi/Transformers-2024-LoRA``) integrates a rescaled variant with RK4.
  Geshkovski, Letrouit, Polyanskiy & Rigollet, "A mathematical perspective on Transformers"
  (2023) and "The emergence of clusters in self-attention dynamics" (NeurIPS 2023).
  Reconstruction (specs §3): the Gronwall constant, the eigengap criterion, and the use of the
  *symmetric part* of a non-symmetric value matrix to define its gap and directions
  (:func:`value_spectrum`) are ours, not the paper's exact statements.

Example:
  >>> import jax, jax.numpy as jnp
  >>> d = 3
  >>> x0 = sample_sphere(jax.random.key(0), 16, d)
  >>> v = gap_value_matrix(d, gap=0.2)
  >>> eye = jnp.eye(d)
  >>> dv = rank_one_perturbation(jnp.eye(d)[1], eps=0.5)       # gap-crossing
  >>> drift = perturbed_drift(x0, eye, eye, v, dv[None], dt=0.05, num_steps=400)
  >>> drift.shape                                              # (directions, records)
  (1, 401)
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

__all__ = [
    "ValueSpectrum",
    "attention_lipschitz",
    "attention_velocity",
    "drift_jump_ratio",
    "drift_time_fit",
    "gap_value_matrix",
    "gronwall_time_to_deviation",
    "head_matrices",
    "perturbed_drift",
    "random_lowrank_perturbation",
    "rank_one_perturbation",
    "rk4_step",
    "sample_sphere",
    "simulate_tokens",
    "time_to_deviation",
    "token_drift",
    "value_spectrum",
    "wasserstein2",
]

_PERTURBED = ("q", "k", "v")


# ----------------------------------------------------------------------------------------------
# Input checks (host side: shapes and Python scalars only, never traced values).


def _check_tokens(x: jax.Array, name: str = "x") -> None:
    if x.ndim != 2:
        raise ValueError(f"{name} must be (n, d) tokens; got shape {x.shape}.")


def _check_weights(x: jax.Array, q: jax.Array, k: jax.Array, v: jax.Array) -> None:
    n, d = x.shape
    if v.shape != (d, d):
        raise ValueError(f"v must be (d, d) = ({d}, {d}) for tokens of width d={d}; got {v.shape}.")
    if q.ndim != 2 or k.ndim != 2 or q.shape[1] != d or k.shape[1] != d or q.shape[0] != k.shape[0]:
        raise ValueError(
            f"q and k must be (m, d) with the same m and d={d} (the token width); got q {q.shape}, "
            f"k {k.shape}."
        )


def _check_nonnegative(value: float, name: str) -> None:
    if isinstance(value, jax.core.Tracer):
        return
    if not np.isfinite(value) or value < 0:
        raise ValueError(f"{name} must be a finite number >= 0; got {value!r}.")


def _check_unit(x: jax.Array, tol: float, name: str = "x0") -> None:
    if isinstance(x, jax.core.Tracer):
        return  # under jit/vmap the caller is responsible (see sample_sphere / normalise first)
    dev = float(np.max(np.abs(np.linalg.norm(np.asarray(x, np.float64), axis=-1) - 1.0)))
    if dev > tol:
        raise ValueError(
            f"{name} must lie on the unit sphere for sphere=True (max | ||x_i|| - 1 | = {dev:.3g} > "
            f"{tol}); normalise the tokens (x / ||x||) or pass sphere=False."
        )


# ----------------------------------------------------------------------------------------------
# The vector field and its integration.


def attention_velocity(
    x: ArrayLike,
    q: ArrayLike,
    k: ArrayLike,
    v: ArrayLike,
    *,
    beta: float = 1.0,
    sphere: bool = True,
) -> jax.Array:
    r"""The token velocity :math:`\dot x_i = P^\perp_{x_i}(\sum_j P_{ij} V x_j)` of one head.

    Args:
      x: ``(n, d)`` tokens (rows).
      q: ``(m, d)`` query matrix (``m`` = head width; ``m = d`` for the square model).
      k: ``(m, d)`` key matrix.
      v: ``(d, d)`` value matrix (for a real head: the OV circuit ``W_O W_V``).
      beta: inverse temperature ``β >= 0`` of the softmax.
      sphere: project on the tangent space of the sphere at ``x_i`` (False: the unnormalised
        ``R^d`` variant).

    Returns:
      ``(n, d)`` velocities.
    """
    x = jnp.asarray(x)
    logits = beta * (x @ q.T) @ (x @ k.T).T  # (n, n): β <Q x_i, K x_j>
    p = jax.nn.softmax(logits, axis=-1)
    y = p @ (x @ v.T)  # Σ_j P_ij V x_j
    if sphere:
        y = y - jnp.sum(x * y, axis=-1, keepdims=True) * x
    return y


def rk4_step(f: Callable[[jax.Array], jax.Array], x: jax.Array, dt: float) -> jax.Array:
    """One classical Runge–Kutta step of ``ẋ = f(x)`` (global error ``O(dt⁴)``)."""
    k1 = f(x)
    k2 = f(x + 0.5 * dt * k1)
    k3 = f(x + 0.5 * dt * k2)
    k4 = f(x + dt * k3)
    return x + (dt / 6.0) * (k1 + 2.0 * k2 + 2.0 * k3 + k4)


def simulate_tokens(
    x0: ArrayLike,
    q: ArrayLike,
    k: ArrayLike,
    v: ArrayLike,
    *,
    beta: float = 1.0,
    dt: float = 0.05,
    num_steps: int,
    record_every: int = 1,
    sphere: bool = True,
    unit_tol: float = 1e-3,
) -> jax.Array:
    r"""Integrates the token flow with RK4 in one ``lax.scan``; records every ``record_every`` steps.

    No renormalisation is applied: on the sphere, :math:`\|x_i\| = 1` is preserved by the
    vector field and kept by RK4 up to its truncation error (a test checks it).

    Args:
      x0: ``(n, d)`` initial tokens (on the unit sphere when ``sphere=True``).
      q, k: ``(m, d)`` query and key matrices.
      v: ``(d, d)`` value matrix.
      beta: softmax inverse temperature ``β >= 0``.
      dt: step ``> 0``; time ``t = step * dt`` is the (continuous) depth.
      num_steps: number of RK4 steps ``>= 1`` (static).
      record_every: keep every ``record_every``-th state (static, divides ``num_steps``).
      sphere: the sphere model (True) or the unnormalised variant (False).
      unit_tol: for ``sphere=True``, concrete ``x0`` must satisfy ``| ||x_i|| - 1 | <= unit_tol``.

    Returns:
      ``(num_steps // record_every + 1, n, d)`` trajectory, ``[0] = x0``; record ``r`` is at time
      ``r * record_every * dt``.

    Raises:
      ValueError: non-2-D tokens, mismatched matrix shapes, ``β < 0``, ``dt <= 0``, bad step counts,
        or (``sphere=True``) tokens off the unit sphere.
    """
    x0, q, k, v = (jnp.asarray(a) for a in (x0, q, k, v))
    _check_tokens(x0, "x0")
    _check_weights(x0, q, k, v)
    _check_nonnegative(beta, "beta")
    if not isinstance(dt, jax.core.Tracer) and not dt > 0:
        raise ValueError(f"dt must be > 0; got {dt!r}.")
    if not isinstance(num_steps, int | np.integer) or num_steps < 1:
        raise ValueError(f"num_steps must be a positive integer; got {num_steps!r}.")
    if (
        not isinstance(record_every, int | np.integer)
        or record_every < 1
        or num_steps % record_every
    ):
        raise ValueError(
            f"record_every must be a positive integer dividing num_steps={num_steps}; got "
            f"{record_every!r}."
        )
    if sphere:
        _check_unit(x0, unit_tol)

    def f(x):
        return attention_velocity(x, q, k, v, beta=beta, sphere=sphere)

    def inner(x, _):
        return rk4_step(f, x, dt), None

    def outer(x, _):
        x, _ = jax.lax.scan(inner, x, None, length=record_every)
        return x, x

    _, traj = jax.lax.scan(outer, x0, None, length=num_steps // record_every)
    return jnp.concatenate([x0[None], traj], axis=0)


# ----------------------------------------------------------------------------------------------
# Drift, time to deviation, Wasserstein distance.


def token_drift(traj: ArrayLike, traj_ref: ArrayLike) -> jax.Array:
    r"""Geometric drift :math:`D(t) = \max_i \|x_i(t) - \tilde x_i(t)\|` of two trajectories.

    Args:
      traj, traj_ref: ``(..., n, d)`` token arrays of the same shape (e.g. ``(T, n, d)``).

    Returns:
      ``(...)`` drift (e.g. ``(T,)``).

    Raises:
      ValueError: if the shapes differ.
    """
    traj, traj_ref = jnp.asarray(traj), jnp.asarray(traj_ref)
    if traj.shape != traj_ref.shape or traj.ndim < 2:
        raise ValueError(
            f"traj and traj_ref must have the same (..., n, d) shape; got {traj.shape} and "
            f"{traj_ref.shape}."
        )
    return jnp.max(jnp.linalg.norm(traj - traj_ref, axis=-1), axis=-1)


def time_to_deviation(drift: ArrayLike, *, dt_record: float, delta: float = 0.1) -> jax.Array:
    r""":math:`T_{dev} = \min\{t_r : D(t_r) > \delta\}` on the record grid ``t_r = r * dt_record``.

    Args:
      drift: ``(..., T)`` drift curves (:func:`token_drift`), last axis = time.
      dt_record: time between records (``record_every * dt``).
      delta: deviation threshold ``δ > 0``.

    Returns:
      ``(...)`` first recorded time with ``D > δ``; ``inf`` where the curve never exceeds ``δ``.

    Raises:
      ValueError: ``delta <= 0`` or ``dt_record <= 0``.
    """
    for name, val in (("delta", delta), ("dt_record", dt_record)):
        if not isinstance(val, jax.core.Tracer) and not val > 0:
            raise ValueError(f"{name} must be > 0; got {val!r}.")
    drift = jnp.asarray(drift)
    above = drift > delta
    first = jnp.argmax(above, axis=-1)
    return jnp.where(jnp.any(above, axis=-1), first * dt_record, jnp.inf)


def wasserstein2(x: ArrayLike, y: ArrayLike) -> float:
    r"""Exact 2-Wasserstein distance between two uniform empirical measures (POT ``ot.emd2``).

    :math:`W_2(\mu, \nu)^2 = \min_\pi \sum_{ij} \pi_{ij}\|x_i - y_j\|^2` over couplings of
    :math:`\mu = \frac1n\sum\delta_{x_i}` and :math:`\nu = \frac1{n'}\sum\delta_{y_j}`; for
    ``n = n'`` the optimum is a permutation (Birkhoff), the assignment problem.

    Args:
      x: ``(n, d)`` points; y: ``(n', d)`` points.

    Returns:
      ``W_2`` as a Python float (computed in float64 on the host; not traceable).

    Raises:
      ValueError: non-2-D inputs or different widths ``d``.
      ModuleNotFoundError: POT is not installed (``pip install pot``).
    """
    x = np.asarray(x, np.float64)
    y = np.asarray(y, np.float64)
    if x.ndim != 2 or y.ndim != 2 or x.shape[1] != y.shape[1]:
        raise ValueError(
            f"x and y must be (n, d) and (n', d) point sets; got {x.shape}, {y.shape}."
        )
    try:
        import ot
    except ModuleNotFoundError as e:  # pragma: no cover - POT is a test dependency
        raise ModuleNotFoundError("wasserstein2 needs POT: pip install pot") from e
    cost = np.sum((x[:, None, :] - y[None, :, :]) ** 2, axis=-1)
    a = np.full(len(x), 1.0 / len(x))
    b = np.full(len(y), 1.0 / len(y))
    return float(np.sqrt(max(ot.emd2(a, b, cost), 0.0)))


# ----------------------------------------------------------------------------------------------
# Perturbations and spectra.


def sample_sphere(key: jax.Array, n: int, d: int) -> jax.Array:
    """``(n, d)`` points drawn uniformly on the unit sphere ``S^{d-1}``."""
    if n < 1 or d < 1:
        raise ValueError(f"n and d must be >= 1; got n={n}, d={d}.")
    z = jax.random.normal(key, (n, d))
    return z / jnp.linalg.norm(z, axis=-1, keepdims=True)


def gap_value_matrix(d: int, *, gap: float) -> jax.Array:
    """``V = diag(1, 1 - gap, ..., 1 - gap)`` (d × d): eigengap ``λ₁ - λ₂ = gap`` (specs §3 (4))."""
    if d < 2:
        raise ValueError(f"d must be >= 2 for an eigengap; got {d}.")
    _check_nonnegative(gap, "gap")
    return jnp.diag(jnp.concatenate([jnp.ones((1,)), jnp.full((d - 1,), 1.0 - gap)]))


def rank_one_perturbation(u: ArrayLike, *, eps: float | jax.Array) -> jax.Array:
    r""":math:`\Delta V = \varepsilon\, u u^\top / \|u\|^2` (spectral and Frobenius norm ``ε``).

    With ``u`` the top eigenvector of a symmetric ``V`` this only enlarges :math:`\lambda_1`
    ("aligned"); with the second one, :math:`\lambda_2 + \varepsilon` overtakes :math:`\lambda_1`
    once :math:`\varepsilon` exceeds the gap ("gap-crossing").

    Args:
      u: ``(d,)`` direction (non-zero).
      eps: perturbation size ``ε >= 0`` (a scalar; ``vmap`` over it for a grid).

    Returns:
      ``(d, d)`` perturbation.

    Raises:
      ValueError: ``u`` not 1-D, or a concrete ``ε < 0``.
    """
    u = jnp.asarray(u)
    if u.ndim != 1:
        raise ValueError(f"u must be a (d,) vector; got shape {u.shape}.")
    _check_nonnegative(eps, "eps")
    return eps * jnp.outer(u, u) / jnp.sum(u * u)


def random_lowrank_perturbation(key: jax.Array, d: int, *, rank: int, eps: float) -> jax.Array:
    r"""A random LoRA-shaped perturbation :math:`\varepsilon\, A B^\top / \|A B^\top\|_F`.

    ``A, B`` are ``(d, r)`` standard normal; the result has rank ``r`` and Frobenius norm ``ε``.

    Raises:
      ValueError: ``rank`` outside ``[1, d]`` or ``ε < 0``.
    """
    if not 1 <= rank <= d:
        raise ValueError(f"rank must lie in [1, d={d}]; got {rank}.")
    _check_nonnegative(eps, "eps")
    ka, kb = jax.random.split(key)
    ab = jax.random.normal(ka, (d, rank)) @ jax.random.normal(kb, (d, rank)).T
    return eps * ab / jnp.linalg.norm(ab)


class ValueSpectrum(NamedTuple):
    """Eigen-structure of a value matrix's symmetric part (see :func:`value_spectrum`).

    Attributes:
      eigenvalues: ``(d,)`` eigenvalues of ``(V + Vᵀ)/2``, descending.
      gap: ``λ₁ - λ₂``.
      top: ``(d,)`` unit eigenvector of ``λ₁`` (the "aligned" direction).
      second: ``(d,)`` unit eigenvector of ``λ₂`` (the "gap-crossing" direction).
    """

    eigenvalues: jax.Array
    gap: jax.Array
    top: jax.Array
    second: jax.Array


def value_spectrum(v: ArrayLike) -> ValueSpectrum:
    r"""Eigengap and leading directions of :math:`S = (V + V^\top)/2`.

    For a symmetric ``V`` (the synthetic model) this is ``V``'s own spectrum. A trained head's OV
    circuit is not symmetric and often has complex leading eigenvalues; its symmetric part is
    what sets :math:`\frac{d}{dt}\tfrac12\|x\|^2 = \langle x, Vx\rangle` along the flow, and a
    rank-one :math:`\varepsilon uu^\top` along an eigenvector of :math:`S` shifts exactly one
    eigenvalue of :math:`S` by :math:`\varepsilon`. This choice is our reconstruction (specs §3).

    Args:
      v: ``(d, d)`` value matrix, ``d >= 2``.

    Returns:
      :class:`ValueSpectrum`.
    """
    v = jnp.asarray(v)
    if v.ndim != 2 or v.shape[0] != v.shape[1] or v.shape[0] < 2:
        raise ValueError(f"v must be a square (d, d) matrix with d >= 2; got {v.shape}.")
    w, u = jnp.linalg.eigh(0.5 * (v + v.T))
    w, u = w[::-1], u[:, ::-1]
    return ValueSpectrum(w, w[0] - w[1], u[:, 0], u[:, 1])


def head_matrices(
    query_kernel: ArrayLike,
    key_kernel: ArrayLike,
    value_kernel: ArrayLike,
    out_kernel: ArrayLike,
    *,
    num_heads: int,
    head: int,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    r"""One head of a multi-head attention layer as the particle model's ``(Q, K, V)``.

    With row-convention kernels ``W_q, W_k, W_v, W_o`` (``(d, d)``, ``y = x W``; e.g.
    ``lowrank_jax.models.layers.SelfAttention``) and head ``h`` owning columns ``s`` of width
    ``k = d / num_heads``: :math:`Q = W_q[:, s]^\top`, :math:`K = W_k[:, s]^\top` (``(k, d)``) and
    the OV circuit :math:`V = (W_v[:, s] W_o[s, :])^\top` (``(d, d)``, rank ``<= k``). Then the
    head's output on tokens ``x`` (biases left out) is
    ``attention_velocity(x, Q, K, V, beta=1/sqrt(k), sphere=False)`` (a test checks it).

    Returns:
      ``(q (k, d), k (k, d), v (d, d))``.

    Raises:
      ValueError: kernels not ``(d, d)``, ``num_heads`` not dividing ``d``, or ``head`` out of range.
    """
    ws = [jnp.asarray(w) for w in (query_kernel, key_kernel, value_kernel, out_kernel)]
    d = ws[0].shape[0]
    if any(w.shape != (d, d) for w in ws):
        raise ValueError(f"kernels must all be (d, d); got {[w.shape for w in ws]}.")
    if num_heads < 1 or d % num_heads:
        raise ValueError(f"num_heads={num_heads} must be >= 1 and divide d={d}.")
    if not 0 <= head < num_heads:
        raise ValueError(f"head must lie in [0, {num_heads}); got {head}.")
    width = d // num_heads
    s = slice(width * head, width * (head + 1))
    wq, wk, wv, wo = ws
    return wq[:, s].T, wk[:, s].T, (wv[:, s] @ wo[s, :]).T


# ----------------------------------------------------------------------------------------------
# Grids of perturbed flows.


def perturbed_drift(
    x0: ArrayLike,
    q: ArrayLike,
    k: ArrayLike,
    v: ArrayLike,
    deltas: ArrayLike,
    *,
    which: str = "v",
    beta: float = 1.0,
    dt: float = 0.05,
    num_steps: int,
    record_every: int = 1,
    sphere: bool = True,
    return_final: bool = False,
) -> jax.Array | tuple[jax.Array, jax.Array, jax.Array]:
    r"""Drift curves :math:`D(t)` of the flow with ``which + Δ_p`` against the unperturbed flow.

    The unperturbed trajectory is integrated once; the ``p`` perturbed ones under ``vmap``.
    Wrap in ``jax.jit`` (with the static keywords) and ``vmap`` over ``x0``/``v`` for grids of
    initial conditions, gaps or depths.

    Args:
      x0: ``(n, d)`` initial tokens.
      q, k: ``(m, d)``; v: ``(d, d)``.
      deltas: ``(p, ...)`` perturbations of the matrix named by ``which`` (same trailing shape).
      which: ``"v"`` (LoRA on the value projection, the paper's case), ``"q"`` or ``"k"``.
      beta, dt, num_steps, record_every, sphere: as in :func:`simulate_tokens`.
      return_final: also return the final tokens of both flows (e.g. for :func:`wasserstein2`).

    Returns:
      ``(p, num_steps // record_every + 1)`` drift curves; with ``return_final``, the tuple
      ``(drift, x_ref (n, d), x (p, n, d))`` of the curves and the unperturbed and perturbed
      tokens at the final time.

    Raises:
      ValueError: unknown ``which`` or a ``deltas`` shape that does not match that matrix.
    """
    if which not in _PERTURBED:
        raise ValueError(f"which must be one of {_PERTURBED}; got {which!r}.")
    x0, q, k, v, deltas = (jnp.asarray(a) for a in (x0, q, k, v, deltas))
    mats = {"q": q, "k": k, "v": v}
    if deltas.ndim != 3 or deltas.shape[1:] != mats[which].shape:
        raise ValueError(
            f"deltas must be (p, *{which}.shape) = (p, {mats[which].shape}); got {deltas.shape}."
        )
    kw = dict(beta=beta, dt=dt, num_steps=num_steps, record_every=record_every, sphere=sphere)
    ref = simulate_tokens(x0, q, k, v, **kw)

    def one(delta):
        m = dict(mats)
        m[which] = m[which] + delta
        traj = simulate_tokens(x0, m["q"], m["k"], m["v"], **kw)
        return token_drift(traj, ref), traj[-1]

    drift, final = jax.vmap(one)(deltas)
    return (drift, ref[-1], final) if return_final else drift


def attention_lipschitz(
    q: ArrayLike, k: ArrayLike, v: ArrayLike, *, beta: float = 1.0
) -> jax.Array:
    r"""The Gronwall constant :math:`L_X = \|V\|_2 (1 + 2\beta \|Q^\top K\|_2)` (specs §3, recon)."""
    q, k, v = (jnp.asarray(a) for a in (q, k, v))
    return jnp.linalg.norm(v, 2) * (1.0 + 2.0 * beta * jnp.linalg.norm(q.T @ k, 2))


def gronwall_time_to_deviation(
    eps: ArrayLike, *, delta: float = 0.1, lipschitz: float | jax.Array
) -> jax.Array:
    r"""The Gronwall lower bound :math:`T_{dev} \ge L^{-1}\log(1 + \delta L / \varepsilon)`.

    From :math:`D(t) \le (\varepsilon/L)(e^{Lt} - 1)`: no deviation above ``δ`` before this time.
    """
    eps = jnp.asarray(eps)
    return jnp.log1p(delta * lipschitz / eps) / lipschitz


def drift_time_fit(eps: ArrayLike, t_dev: ArrayLike) -> dict[str, float]:
    r"""Least-squares fit :math:`T_{dev} \approx a\log(1/\varepsilon) + b` over finite points.

    Args:
      eps: ``(p,)`` perturbation sizes ``> 0``.
      t_dev: ``(p,)`` times to deviation (``inf`` = never deviated; left out of the fit).

    For comparison it also fits the power law :math:`\log T_{dev} \approx c + p\log(1/\varepsilon)`
    (what a drift growing polynomially, rather than exponentially, in ``t`` gives).

    Returns:
      ``{"slope": a, "intercept": b, "r2": R², "power_exponent": p, "power_r2": R²_power,
      "num_points": k}`` (float64); the fitted values are NaN with fewer than 3 finite points or
      constant ``T_dev`` (``power_*`` also when some ``T_dev <= 0``).

    Raises:
      ValueError: shapes differ or some ``ε <= 0``.
    """
    eps = np.asarray(eps, np.float64)
    t = np.asarray(t_dev, np.float64)
    if eps.shape != t.shape or eps.ndim != 1:
        raise ValueError(f"eps and t_dev must be (p,) arrays; got {eps.shape}, {t.shape}.")
    if np.any(eps <= 0):
        raise ValueError("eps must be > 0 (the fit is in log(1/eps)).")
    ok = np.isfinite(t)
    xs = np.log(1.0 / eps[ok])
    slope, intercept, r2 = _linear_fit(xs, t[ok])
    if np.all(t[ok] > 0):
        power, _, power_r2 = _linear_fit(xs, np.log(t[ok]))
    else:
        power = power_r2 = math.nan
    return {
        "slope": slope,
        "intercept": intercept,
        "r2": r2,
        "power_exponent": power,
        "power_r2": power_r2,
        "num_points": int(ok.sum()),
    }


def _linear_fit(xs: np.ndarray, ys: np.ndarray) -> tuple[float, float, float]:
    """``(slope, intercept, R²)`` of least squares ``y ≈ a x + b``; NaNs if ill-posed."""
    if len(xs) < 3 or float(np.ptp(ys)) == 0.0:
        return math.nan, math.nan, math.nan
    a, b = np.polyfit(xs, ys, 1)
    ss_tot = float(np.sum((ys - ys.mean()) ** 2))
    return float(a), float(b), 1.0 - float(np.sum((ys - (a * xs + b)) ** 2)) / ss_tot


def drift_jump_ratio(
    d_final: ArrayLike, eps: ArrayLike, *, below: float, above: float, floor: float = 1e-3
) -> float:
    r"""Sharpness of a drift transition: :math:`D(T, \varepsilon_{hi}) / D(T, \varepsilon_{lo})`.

    ``ε_lo`` is the largest grid value ``<= below`` and ``ε_hi`` the smallest ``>= above``
    (e.g. ``below = gap/2``, ``above = 2 gap``); a drift linear in ``ε`` gives
    ``ε_hi/ε_lo``, a phase transition between them much more.

    Args:
      d_final: ``(p,)`` drift at the final time for each ``ε``.
      eps: ``(p,)`` increasing grid of ``ε``.
      below, above: the window around the expected transition.
      floor: lower bound on the denominator (a drift of exactly 0 below the transition).

    Returns:
      The ratio, or NaN when the grid has no point on one side of the window.
    """
    d_final, eps = np.asarray(d_final, np.float64), np.asarray(eps, np.float64)
    if d_final.shape != eps.shape or eps.ndim != 1:
        raise ValueError(f"d_final and eps must be (p,) arrays; got {d_final.shape}, {eps.shape}.")
    lo = np.flatnonzero(eps <= below * (1 + 1e-6))
    hi = np.flatnonzero(eps >= above * (1 - 1e-6))
    if not len(lo) or not len(hi):
        return math.nan
    return float(d_final[hi[0]] / max(d_final[lo[-1]], floor))
