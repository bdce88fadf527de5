r"""Adjoint matching for the flow models of :mod:`lowrank_jax.generative.flows`, and their exact
log-likelihood (P16, TFFT stage 2 and its measured KL).

**Adjoint matching** (Domingo-Enrich, Drozdzal, Karrer, Chen 2025) fine-tunes a flow ``v_base``
towards the tilt ``p* ∝ p_base·exp(f)`` (``f = r̃/α``) by regressing the model onto the lean
adjoint along trajectories of the *memoryless* noise schedule. For the linear path
``x_t = (1 − t)·x₀ + t·x₁`` of :mod:`~lowrank_jax.generative.flows` (``x₀ ~ N(0, I)``), the score
is ``∇log p_t(x) = (t·v(x, t) − x)/(1 − t)`` and the memoryless schedule is
``σ(t)² = 2(1 − t)/t``, giving the SDE ``dX = (2v(X, t) − X/t)dt + σ(t)dB`` whose ``X₀`` and
``X₁`` are independent (so the KL-regularised optimum has no value-function bias).

* :func:`simulate_memoryless` discretises that SDE by its exact Gaussian-path transition (the
  ancestral "DDPM" step: ``X_s | X_t, x̂₁`` with ``x̂₁ = X_t + (1 − t)·v(X_t, t)``), which is
  well posed at ``t = 0`` where the drift ``−X/t`` is not.
* :func:`lean_adjoint` runs ``ã(1) = −∇f(X₁)``, ``ã_k = J_kᵀ ã_{k+1}`` with ``J_k`` the Jacobian
  of the *base* model's transition mean (``jax.vjp``): the discrete form of
  ``dã/dt = −(∇_x b_base)ᵀ ã``. When the trajectory is the base model's, ``−ã_k`` is the pathwise
  gradient ``∇_{X_k} f(X₁)`` with the noise held fixed.
* :func:`adjoint_matching_loss` is ``E Σ_k ‖(2/σ(t_k))·(v_θ − v_base)(X_k, t_k) + σ(t_k)·ã_k‖²``
  over the interior grid times; its minimiser is the control ``u* = −σ·E[ã | X_t]`` of the tilt.
* :func:`train_adjoint_matching`: each step simulates a batch with the current model (no gradient),
  computes the lean adjoint with the base and takes an optimizer step on the loss.

**Log-likelihood**: :func:`flow_log_likelihood` integrates ``dx/dt = v``,
``d log p/dt = −∇·v`` (exact divergence, one forward-mode pass per coordinate: for small ``D``)
with midpoint steps; :func:`flow_kl` estimates ``KL(p_θ‖p_ref) = E_{p_θ}[log p_θ − log p_ref]`` of
two flows from samples of the first.

Reference: Domingo-Enrich, Drozdzal, Karrer, Chen, "Adjoint Matching: Fine-tuning Flow and
Diffusion Generative Models with Memoryless Stochastic Optimal Control", ICLR 2025.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax

__all__ = [
    "adjoint_matching_loss",
    "flow_kl",
    "flow_log_likelihood",
    "lean_adjoint",
    "memoryless_sigma",
    "simulate_memoryless",
    "train_adjoint_matching",
]


def memoryless_sigma(t: jax.Array) -> jax.Array:
    r"""``σ(t) = sqrt(2(1 − t)/t)``: the memoryless noise schedule of the linear path
    (infinite at ``t = 0``, zero at ``t = 1``)."""
    return jnp.sqrt(2.0 * (1.0 - t) / t)


def _transition(apply_fn, params, x, t, s):
    """Mean and std of ``X_s | X_t`` (``s > t``) on the memoryless SDE: the Gaussian-path
    posterior of ``x_s`` given ``x_t`` and ``x̂₁ = x_t + (1 − t)·v(x_t, t)``."""
    x1_hat = x + (1.0 - t) * apply_fn(params, x, t)
    ratio = t / s  # signal ratio a_t / a_s of the path x_t = t·x1 + (1 − t)·x0
    var_ts = (1.0 - t) ** 2 - ratio**2 * (1.0 - s) ** 2  # Var(x_t | x_s)
    mean = (var_ts * s * x1_hat + ratio * (1.0 - s) ** 2 * x) / (1.0 - t) ** 2
    std = jnp.sqrt(jnp.maximum((1.0 - s) ** 2 * var_ts / (1.0 - t) ** 2, 0.0))
    return mean, std


def _check_steps(num_steps: int) -> None:
    if num_steps < 2:
        raise ValueError(f"num_steps={num_steps} is invalid: must be >= 2")


def simulate_memoryless(
    apply_fn: Callable[..., jax.Array],
    params,
    key: jax.Array,
    *,
    num: int,
    dim: int,
    num_steps: int = 20,
) -> tuple[jax.Array, jax.Array]:
    r"""Trajectories of the memoryless SDE on ``t_k = k/S``, ``k = 0..S`` (``S = num_steps``).

    Returns:
      ``(xs, noise)``: states ``(S + 1, num, dim)`` (``xs[0] ~ N(0, I)``, ``xs[-1]`` the samples)
      and the standard-normal draws ``(S, num, dim)`` of the steps, so a trajectory can be replayed
      as a deterministic function of ``xs[0]`` (see :func:`lean_adjoint`).
    """
    _check_steps(num_steps)
    k0, kn = jax.random.split(key)
    x0 = jax.random.normal(k0, (num, dim))
    noise = jax.random.normal(kn, (num_steps, num, dim))
    times = jnp.linspace(0.0, 1.0, num_steps + 1)

    def step(x, inputs):
        t, s, eps = inputs
        mean, std = _transition(apply_fn, params, x, t, s)
        x = mean + std * eps
        return x, x

    _, xs = jax.lax.scan(step, x0, (times[:-1], times[1:], noise))
    return jnp.concatenate([x0[None], xs]), noise


def lean_adjoint(
    apply_fn: Callable[..., jax.Array], base_params, xs: jax.Array, terminal_grad: jax.Array
) -> jax.Array:
    r"""The lean adjoint ``ã_k``, ``k = 0..S``, along trajectories ``xs (S + 1, b, D)``.

    ``ã_S = terminal_grad`` (``−∇f(X₁)`` for the tilt ``exp(f)``) and ``ã_k = J_kᵀ ã_{k+1}`` with
    ``J_k = ∂ mean_base(X_k)/∂X_k`` (``jax.vjp`` of the base transition mean). Returns
    ``(S + 1, b, D)``.
    """
    num_steps = xs.shape[0] - 1
    _check_steps(num_steps)
    times = jnp.linspace(0.0, 1.0, num_steps + 1)

    def step(adj, inputs):
        x, t, s = inputs
        _, vjp = jax.vjp(lambda y: _transition(apply_fn, base_params, y, t, s)[0], x)
        adj = vjp(adj)[0]
        return adj, adj

    _, adjs = jax.lax.scan(step, terminal_grad, (xs[:-1], times[:-1], times[1:]), reverse=True)
    return jnp.concatenate([adjs, terminal_grad[None]])


def adjoint_matching_loss(
    params, base_params, apply_fn: Callable[..., jax.Array], xs: jax.Array, adjs: jax.Array
) -> jax.Array:
    r"""``mean_{k, batch} ‖(2/σ(t_k))·(v_θ − v_base)(X_k, t_k) + σ(t_k)·ã_k‖²`` over the interior
    grid times ``t_k = k/S``, ``0 < k < S`` (``σ`` is infinite at 0 and zero at 1)."""
    num_steps = xs.shape[0] - 1
    _check_steps(num_steps)
    times = jnp.linspace(0.0, 1.0, num_steps + 1)[1:-1]

    def one(x, adj, t):
        sigma = memoryless_sigma(t)
        diff = apply_fn(params, x, t) - apply_fn(base_params, x, t)
        return jnp.mean(jnp.sum((2.0 / sigma * diff + sigma * adj) ** 2, -1))

    return jnp.mean(jax.vmap(one)(xs[1:-1], adjs[1:-1], times))


@functools.partial(
    jax.jit,
    static_argnames=("apply_fn", "log_tilt", "tx", "dim", "num_steps", "batch_size", "time_steps"),
)
def train_adjoint_matching(
    params,
    base_params,
    tilt_args,
    key: jax.Array,
    *,
    apply_fn: Callable[..., jax.Array],
    log_tilt: Callable[..., jax.Array],
    tx: optax.GradientTransformation,
    dim: int,
    num_steps: int,
    batch_size: int,
    time_steps: int = 20,
):
    r"""``num_steps`` optimizer steps of adjoint matching towards ``p* ∝ p_base·exp(f)``.

    Each step simulates ``batch_size`` memoryless trajectories (``time_steps`` steps) with the
    current parameters (stopped gradient), sets ``ã(1) = −∇f(X₁)`` with
    ``f = log_tilt(·, tilt_args)`` summed over the batch (``jax.grad``), runs the lean adjoint of
    the base and steps on :func:`adjoint_matching_loss`. One ``lax.scan``.

    Args:
      params: the initial parameters (usually ``base_params``).
      base_params: the frozen base model.
      tilt_args: a pytree of arrays passed to ``log_tilt`` (e.g. the threshold ``η*`` and ``α``).
      key: PRNG key.
      apply_fn: ``(params, x, t) -> v`` (hashable).
      log_tilt: ``(x (b, D), tilt_args) -> (b,)``, the log-tilt ``f = r̃/α`` (hashable).
      tx: the optimizer (hashable).
      dim: the data dimension ``D``.
      num_steps, batch_size, time_steps: static sizes.

    Returns:
      ``(params, losses)`` with the ``(num_steps,)`` losses.
    """
    grad_f = jax.grad(lambda x: jnp.sum(log_tilt(x, tilt_args)))

    def body(carry, k):
        p, s = carry
        xs, _ = simulate_memoryless(
            apply_fn, jax.lax.stop_gradient(p), k, num=batch_size, dim=dim, num_steps=time_steps
        )
        adjs = lean_adjoint(apply_fn, base_params, xs, -grad_f(xs[-1]))
        loss, g = jax.value_and_grad(adjoint_matching_loss)(p, base_params, apply_fn, xs, adjs)
        u, s = tx.update(g, s, p)
        return (optax.apply_updates(p, u), s), loss

    (params, _), losses = jax.lax.scan(
        body, (params, tx.init(params)), jax.random.split(key, num_steps)
    )
    return params, losses


def _divergence(apply_fn, params, x, t):
    """``(v, ∇·v)`` per row, exact: one ``jax.jvp`` per coordinate (rows are independent)."""
    dim = x.shape[-1]

    def column(e):
        return jax.jvp(lambda y: apply_fn(params, y, t), (x,), (jnp.broadcast_to(e, x.shape),))

    v, cols = jax.vmap(column)(jnp.eye(dim, dtype=x.dtype))
    return v[0], jnp.einsum("ibi->b", cols)


def _ode(apply_fn, params, x, num_steps, forward):
    """Midpoint integration of ``(x, ∫∇·v dt)`` from ``t = 0`` to 1 (``forward``) or 1 to 0."""
    h = (1.0 if forward else -1.0) / num_steps
    start = 0.0 if forward else 1.0

    def step(carry, i):
        x, div_int = carry
        t = start + i * h
        v, div = _divergence(apply_fn, params, x, t)
        vm, divm = _divergence(apply_fn, params, x + 0.5 * h * v, t + 0.5 * h)
        del div
        return (x + h * vm, div_int + h * divm), None

    (x, div_int), _ = jax.lax.scan(
        step, (x, jnp.zeros(x.shape[:1], x.dtype)), jnp.arange(num_steps, dtype=x.dtype)
    )
    return x, div_int


def _log_normal(x):
    return -0.5 * jnp.sum(x**2, -1) - 0.5 * x.shape[-1] * jnp.log(2 * jnp.pi)


@functools.partial(jax.jit, static_argnames=("apply_fn", "num_steps"))
def flow_log_likelihood(
    apply_fn: Callable[..., jax.Array], params, x: jax.Array, *, num_steps: int = 100
) -> jax.Array:
    r"""``log p_θ(x)`` of the flow's probability-flow ODE: integrate back to ``x₀`` and use
    ``log p₁(x) = log N(x₀; 0, I) − ∫₀¹ ∇·v(x_t, t) dt`` (midpoint steps, exact divergence).
    ``x (b, D)`` -> ``(b,)``."""
    x0, div_int = _ode(apply_fn, params, x, num_steps, forward=False)
    return _log_normal(x0) + div_int  # the backward integral carries the minus sign


@functools.partial(jax.jit, static_argnames=("apply_fn", "num", "dim", "num_steps"))
def flow_kl(
    apply_fn: Callable[..., jax.Array],
    params,
    ref_params,
    key: jax.Array,
    *,
    num: int,
    dim: int,
    num_steps: int = 100,
) -> tuple[jax.Array, jax.Array]:
    r"""Monte-Carlo ``KL(p_θ‖p_ref)`` of two flows on one ``apply_fn``: ``num`` samples of
    ``p_θ`` by the midpoint ODE, with their ``log p_θ`` from the same integration, and
    ``log p_ref`` by :func:`flow_log_likelihood`. Returns ``(kl, standard error)``."""
    x0 = jax.random.normal(key, (num, dim))
    x1, div_int = _ode(apply_fn, params, x0, num_steps, forward=True)
    log_ratio = (
        _log_normal(x0)
        - div_int
        - flow_log_likelihood(apply_fn, ref_params, x1, num_steps=num_steps)
    )
    return jnp.mean(log_ratio), jnp.std(log_ratio) / jnp.sqrt(num)
