"""Checking the logit bounds against real activations of a (possibly biased) attention layer.

For a layer with query/key biases (BERT, GPT-2) the logits are ``(x W^Q + b_Q)(x W^K + b_K)ᵀ/√d_h``:
a bilinear form of the augmented tokens ``x̃ = [x; 1]`` with ``W̃ = [W; b]`` (``d → d + 1``,
``‖x̃‖² ≤ g² d + 1``, so the effective gain becomes ``g̃ = √((g² d + 1)/(d + 1))``). The bounds of
:mod:`lowrank_jax.fp8.bounds` then apply unchanged; :func:`attention_logit_report` computes them
next to the empirical ``max |S|`` of a batch, per head.

References:
    P14, arXiv 2602.18851; bias folding is ours (the paper's setting has no biases).
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from lowrank_jax.fp8.bounds import worst_case_logit_bound
from lowrank_jax.fp8.scale_rule import ScaleRule
from lowrank_jax.spectral.power_iteration import (
    attention_power_iteration,
    init_attention_power_iteration,
)

__all__ = ["AttentionLogitReport", "attention_logit_report", "fold_attention_bias"]


class AttentionLogitReport(NamedTuple):
    """Per-head ``(H,)`` arrays of :func:`attention_logit_report`.

    Attributes:
        sigma: ``σ_max(W̃^Q_h W̃^{K⊤}_h)`` of the (bias-folded) weights.
        max_logit: empirical ``max_ij |S_ij|`` over the batch's valid pairs.
        rank_aware_bound: ``α(δ) B_wc`` with the rank-aware ``α``.
        rank_agnostic_bound: the same with the rank-agnostic ``α``.
        worst_case_bound: the deterministic ``B_wc``.
        scale: the rule's geometry-aware FP8 scale (``max_logit · scale > R`` is an overflow).
    """

    sigma: jax.Array
    max_logit: jax.Array
    rank_aware_bound: jax.Array
    rank_agnostic_bound: jax.Array
    worst_case_bound: jax.Array
    scale: jax.Array


def fold_attention_bias(w: jax.typing.ArrayLike, b: jax.typing.ArrayLike) -> jax.Array:
    """``W̃ = [W; b]``: a ``(d, H, d_h)`` kernel and ``(H, d_h)`` bias as one ``(d + 1, H, d_h)``.

    Raises:
        ValueError: if the shapes do not match.
    """
    w, b = jnp.asarray(w), jnp.asarray(b)
    if w.ndim != 3 or b.shape != w.shape[1:]:
        raise ValueError(f"need w (d, H, d_h) and b (H, d_h); got {w.shape} and {b.shape}.")
    return jnp.concatenate([w, b[None]], 0)


def attention_logit_report(
    x: jax.typing.ArrayLike,
    w_q: jax.typing.ArrayLike,
    w_k: jax.typing.ArrayLike,
    rule: ScaleRule,
    *,
    key: jax.Array,
    norm_gain: jax.typing.ArrayLike,
    b_q: jax.typing.ArrayLike | None = None,
    b_k: jax.typing.ArrayLike | None = None,
    mask: jax.typing.ArrayLike | None = None,
    num_iters: int = 100,
) -> AttentionLogitReport:
    """Bounds and scales of one attention layer next to its empirical max logit on ``x``.

    Args:
        x: ``(b, n, d)`` inputs of the layer (outputs of the norm with gain ``norm_gain``).
        w_q: ``(d, H, d_h)`` query kernel.
        w_k: ``(d, H, d_h)`` key kernel.
        rule: the scale rule (:class:`~lowrank_jax.fp8.scale_rule.ScaleRule`; its ``seq_len``
            is ``n`` of the bound, e.g. the longest unpadded sequence). Both bounds are reported
            whatever its ``rank_aware``; ``scale`` is the rule's.
        key: PRNG key of the power iteration's start.
        norm_gain: effective gain ``g`` of the norm feeding the layer (``norm_gain_bound``).
        b_q: optional ``(H, d_h)`` query bias (folded into the weights).
        b_k: optional ``(H, d_h)`` key bias.
        mask: optional ``(b, n)`` bool, the valid (unpadded) tokens.
        num_iters: power steps from the cold start.

    Returns:
        An :class:`AttentionLogitReport`.

    Raises:
        ValueError: on inconsistent shapes.
    """
    x, w_q, w_k = jnp.asarray(x), jnp.asarray(w_q), jnp.asarray(w_k)
    d, h, dh = w_q.shape
    if x.ndim != 3 or x.shape[-1] != d or w_k.shape != w_q.shape:
        raise ValueError(f"need x (b, n, {d}) and w_k {w_q.shape}; got {x.shape}, {w_k.shape}.")
    b_q = jnp.zeros((h, dh), w_q.dtype) if b_q is None else jnp.asarray(b_q)
    b_k = jnp.zeros((h, dh), w_k.dtype) if b_k is None else jnp.asarray(b_k)
    wq_aug, wk_aug = fold_attention_bias(w_q, b_q), fold_attention_bias(w_k, b_k)
    st = init_attention_power_iteration(key, wq_aug)
    sigma, _ = attention_power_iteration(wq_aug, wk_aug, st, num_iters=num_iters)
    g = jnp.asarray(norm_gain, jnp.float32)
    g_aug = jnp.sqrt((g**2 * d + 1.0) / (d + 1))
    kw = dict(d=d + 1, head_dim=dh, norm_gain=g_aug)
    q = (x @ w_q.reshape(d, h * dh) + b_q.reshape(-1)).reshape(*x.shape[:2], h, dh)
    k = (x @ w_k.reshape(d, h * dh) + b_k.reshape(-1)).reshape(*x.shape[:2], h, dh)
    s = jnp.einsum("bihk,bjhk->bhij", q, k) / math.sqrt(dh)
    valid = jnp.ones(x.shape[:2], bool) if mask is None else jnp.asarray(mask, bool)
    pair = valid[:, None, :, None] & valid[:, None, None, :]
    return AttentionLogitReport(
        sigma=sigma,
        max_logit=jnp.max(jnp.where(pair, jnp.abs(s), 0.0), axis=(0, 2, 3)),
        rank_aware_bound=dataclasses.replace(rule, rank_aware=True).bound(sigma, **kw),
        rank_agnostic_bound=dataclasses.replace(rule, rank_aware=False).bound(sigma, **kw),
        worst_case_bound=worst_case_logit_bound(sigma, d=d + 1, head_dim=dh, norm_gain=g_aug),
        scale=rule.scales(sigma, **kw),
    )
