"""The fused LoRA projection: ``y = x·(W + Σ sᵢ·Aᵢ·Bᵢ)`` with a hand-written backward (custom_vjp).

Why. The factorised forward ``x·W + s·(x·A)·B`` is two token-sized products that are added; XLA
(CPU) fuses the add into the consumers (GELU, residual add) instead of materialising the sum, so
*both* ``x·W`` and ``(x·A)·B`` stay alive until the backward, and the backward's input gradient
``g·Wᵀ + s·(g·Bᵀ)·Aᵀ`` is likewise two token-sized buffers. At the benchmark shape (one pre-LN
block, d=1024, 8192 tokens) that is +234 MB of XLA temp over full fine-tuning (``docs/notes/adapter_step_bench.md``).

What. One matmul per projection, as in the frozen model:

* forward: ``W' = W + Σ sᵢ·Aᵢ·Bᵢ`` (an ``(n, m)`` temporary, ``n·m·r`` flops) and ``y = x·W'``;
  residuals are ``x`` (already alive: it is the layer's input), the frozen ``W`` and the
  ``(tokens, r)`` products ``uᵢ = sᵢ·x·Aᵢ``;
* backward, for the output cotangent ``g``: ``gᵢ = sᵢ·g·Bᵢᵀ`` (tokens × r),
  ``∂Aᵢ = xᵀ·gᵢ``, ``∂Bᵢ = uᵢᵀ·g``, and ``∂x = g·W'ᵀ`` with ``W'`` recomputed. No gradient of
  ``W`` is formed (``None`` cotangent) and no weight-shaped product contracts over tokens: the only
  weight-shaped dot is ``Aᵢ·Bᵢ``, which contracts over the rank.

The recomputed ``W'`` uses ``Aᵢ + 0·∂Aᵢ`` and ``Bᵢ + 0·∂Bᵢ`` (exactly ``Aᵢ``, ``Bᵢ`` for finite
gradients): the data dependence makes XLA compute the rank-r weight gradients before ``∂x``, so
the layer input ``x`` can be freed before the next layer's backward instead of being held across
it (measured: −117 MB of temp at the benchmark shape; XLA does not fold ``0·v`` for floats).

Exactly the factorised maths up to float rounding (``x·(W + sAB)`` vs ``x·W + s(xA)B``); tests check
values and gradients against the factorised reference. Dropout on the adapter input cannot be
folded into ``W'``, so :func:`lowrank_jax.adapters.adapt` uses this path only for LoRA adapters
without active dropout and falls back to the factorised one otherwise.

A quantised kernel (``qwix.QArray``) is dequantised inside the forward and again inside the
backward, so only the int8 kernel is kept between them.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from lowrank_jax.adapters import quant

__all__ = [
    "apply_fused",
    "fusable",
    "lora_matmul",
]


def _merged(w: Any, factors: Sequence[tuple[jax.Array, jax.Array]], scales, shape, dtype):
    w = jnp.reshape(quant.dequantize(w).astype(dtype), shape)
    for (a, b), s in zip(factors, scales, strict=True):
        w = w + ((a.astype(dtype) * jnp.asarray(s, dtype)) @ b.astype(dtype))
    return w


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def lora_matmul(
    x: jax.Array,
    w: Any,
    factors: tuple[tuple[jax.Array, jax.Array], ...],
    scales: tuple[float, ...],
    shape: tuple[int, int],
) -> jax.Array:
    """``x·(W + Σ sᵢ·Aᵢ·Bᵢ)`` for ``x: (tokens, n)``, ``W`` of ``n·m`` entries, ``Aᵢ: (n, r)``,
    ``Bᵢ: (r, m)``; returns ``(tokens, m)`` in ``x``'s dtype promoted with the factors'.

    Args:
      x: the 2-D input.
      w: the frozen kernel (float array or ``qwix.QArray``), any shape with ``n·m`` entries.
      factors: ``((A₁, B₁), ...)``.
      scales: ``(s₁, ...)`` Python floats (static).
      shape: ``(n, m)``, the kernel's matrix view (static).
    """
    dtype = jnp.result_type(x.dtype, *(f.dtype for ab in factors for f in ab))
    return x.astype(dtype) @ _merged(w, factors, scales, shape, dtype)


def _fwd(x, w, factors, scales, shape):
    dtype = jnp.result_type(x.dtype, *(f.dtype for ab in factors for f in ab))
    xd = x.astype(dtype)
    us = tuple(
        (xd @ a.astype(dtype)) * jnp.asarray(s, dtype)
        for (a, _), s in zip(factors, scales, strict=True)
    )
    y = xd @ _merged(w, factors, scales, shape, dtype)
    return y, (x, w, factors, us)


def _bwd(scales, shape, res, g):
    x, w, factors, us = res
    dtype = g.dtype
    xd = x.astype(dtype)
    grads, ordered = [], []
    for (a, b), s, u in zip(factors, scales, us, strict=True):
        gb = (g @ b.astype(dtype).T) * jnp.asarray(s, dtype)
        da, db = xd.T @ gb, u.T @ g
        grads.append((da.astype(a.dtype), db.astype(b.dtype)))
        ordered.append((a + 0 * grads[-1][0], b + 0 * grads[-1][1]))  # see the module docstring
    dx = g @ _merged(w, tuple(ordered), scales, shape, dtype).T
    return dx.astype(x.dtype), None, tuple(grads)


lora_matmul.defvjp(_fwd, _bwd)


def fusable(adapters: Sequence[Any], keys: Sequence[Any]) -> bool:
    """Whether a kernel's adapters can take the fused path: all in product form (``LoRA``), no
    active dropout."""
    return all(
        a.kind.lowrank_factors(a.factors) is not None and (k is None or a.kind.dropout == 0.0)
        for a, k in zip(adapters, keys, strict=True)
    )


def apply_fused(x2: jax.Array, w: Any, adapters: Sequence[Any], n: int, m: int) -> jax.Array:
    """:func:`lora_matmul` for a kernel's adapters in product form (``Adapter`` records)."""
    forms = [a.kind.lowrank_factors(a.factors) for a in adapters]
    factors = tuple((a, b) for a, b, _ in forms)
    scales = tuple(float(s) for _, _, s in forms)
    return lora_matmul(x2, w, factors, scales, (n, m))
