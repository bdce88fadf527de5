r"""Conditional flow matching with an MLP velocity field (the pre-trained model of P16, TFFT).

Linear (rectified-flow) paths from ``x₀ ~ N(0, I)`` to data ``x₁``: ``x_t = (1 − t)·x₀ + t·x₁``
with conditional velocity ``x₁ − x₀``; the loss :func:`flow_matching_loss` is
``E_{t ~ U(0,1), x₀, x₁} ‖v_θ(x_t, t) − (x₁ − x₀)‖²`` (Lipman et al. 2023; Liu et al. 2023), whose
minimiser is the marginal velocity ``E[x₁ − x₀ | x_t]`` that transports ``N(0, I)`` to the data
law. :func:`sample_flow` integrates ``dx/dt = v_θ(x, t)`` from ``t = 0`` to ``1`` with Euler
steps, in one ``lax.scan``.

Fine-tuning towards a tilted law ``p* ∝ p_pre·exp(r̃/α)`` (:mod:`lowrank_jax.generative.tail`)
is flow matching from the pre-trained parameters on samples resampled with the tilt's weights
(specs.md §16, stage 2 variant (B): exact target, no reward gradients).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

__all__ = ["VelocityMLP", "flow_matching_loss", "sample_flow", "train_flow"]


class VelocityMLP(nn.Module):
    """``v_θ(x, t)``: an MLP on ``[x, sin(2πkt), cos(2πkt)]_{k=1..F}`` with SiLU activations.

    Attributes:
      features: hidden widths (specs.md §16: three layers of 128 for the 2-D ring).
      num_frequencies: ``F``, the Fourier features of ``t``.
    """

    features: Sequence[int] = (128, 128, 128)
    num_frequencies: int = 8

    @nn.compact
    def __call__(self, x: jax.Array, t: jax.Array) -> jax.Array:
        """``x (b, D)``, ``t`` scalar or ``(b,)`` in [0, 1] -> velocity ``(b, D)``."""
        t = jnp.broadcast_to(jnp.asarray(t, x.dtype), x.shape[:1])[:, None]
        k = jnp.arange(1, self.num_frequencies + 1, dtype=x.dtype)
        h = jnp.concatenate([x, t, jnp.sin(2 * jnp.pi * k * t), jnp.cos(2 * jnp.pi * k * t)], -1)
        for i, w in enumerate(self.features):
            h = nn.silu(nn.Dense(w, name=f"dense_{i}")(h))
        return nn.Dense(x.shape[-1], name="head")(h)


def flow_matching_loss(
    params, apply_fn: Callable[..., jax.Array], key: jax.Array, x1: jax.Array
) -> jax.Array:
    r"""``E ‖v_θ((1−t)x₀ + t·x₁, t) − (x₁ − x₀)‖²`` (mean over batch and coordinates).

    Args:
      params: the velocity network's parameters.
      apply_fn: ``(params, x, t) -> v``.
      key: PRNG key (draws ``t ~ U(0, 1)`` and ``x₀ ~ N(0, I)``).
      x1: ``(b, D)`` data.
    """
    if x1.ndim != 2:
        raise ValueError(f"x1 must be (batch, dim), got shape {x1.shape}")
    kt, k0 = jax.random.split(key)
    t = jax.random.uniform(kt, x1.shape[:1], x1.dtype)
    x0 = jax.random.normal(k0, x1.shape, x1.dtype)
    xt = (1 - t)[:, None] * x0 + t[:, None] * x1
    return jnp.mean((apply_fn(params, xt, t) - (x1 - x0)) ** 2)


def sample_flow(
    apply_fn: Callable[..., jax.Array],
    params,
    key: jax.Array,
    *,
    num: int,
    dim: int,
    num_steps: int = 50,
) -> jax.Array:
    r"""``num`` samples: Euler integration of ``dx/dt = v_θ(x, t)`` on ``t = 0, 1/S, …, 1`` from
    ``x₀ ~ N(0, I_dim)``, ``S = num_steps``. Jit-compatible (``num``, ``dim``, ``num_steps``
    static)."""
    if num_steps < 1:
        raise ValueError(f"num_steps={num_steps} is invalid: must be >= 1")
    x = jax.random.normal(key, (num, dim))
    h = 1.0 / num_steps

    def step(x, i):
        return x + h * apply_fn(params, x, i * h), None

    x, _ = jax.lax.scan(step, x, jnp.arange(num_steps, dtype=x.dtype))
    return x


@functools.partial(jax.jit, static_argnames=("apply_fn", "tx", "num_steps", "batch_size"))
def train_flow(
    params,
    data: jax.Array,
    log_weights: jax.Array,
    key: jax.Array,
    *,
    apply_fn: Callable[..., jax.Array],
    tx: optax.GradientTransformation,
    num_steps: int,
    batch_size: int,
):
    r"""``num_steps`` Adam-style steps of flow matching on the weighted empirical law of ``data``.

    Each step draws ``batch_size`` indices with probabilities ``softmax(log_weights)`` (with
    replacement: self-normalised importance resampling) and takes a gradient step of
    :func:`flow_matching_loss`. With uniform ``log_weights`` this is ordinary training on
    ``data``; with the log-weights ``r̃/α`` of pre-trained samples it fine-tunes towards the
    tilted law ``p* ∝ p_pre·exp(r̃/α)`` (specs.md §16, stage 2 (B)). One ``lax.scan``, no host
    round-trips.

    Args:
      params: initial parameters (pre-trained, for fine-tuning).
      data: ``(M, D)`` samples.
      log_weights: ``(M,)`` unnormalised log-probabilities of the samples.
      key: PRNG key.
      apply_fn: ``(params, x, t) -> v`` (hashable: a module's ``apply`` or a cached closure).
      tx: the optimizer (hashable).
      num_steps, batch_size: static sizes.

    Returns:
      ``(params, losses)`` with the ``(num_steps,)`` minibatch losses.
    """

    def body(carry, k):
        p, s = carry
        k_idx, k_loss = jax.random.split(k)
        idx = jax.random.categorical(k_idx, log_weights, shape=(batch_size,))
        loss, g = jax.value_and_grad(flow_matching_loss)(p, apply_fn, k_loss, data[idx])
        u, s = tx.update(g, s, p)
        return (optax.apply_updates(p, u), s), loss

    (params, _), losses = jax.lax.scan(
        body, (params, tx.init(params)), jax.random.split(key, num_steps)
    )
    return params, losses
