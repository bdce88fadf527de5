"""A small pre-LN causal transformer whose attention logits go through simulated FP8 (P14).

Each attention layer computes the logits ``S = QKᵀ/√d_h`` in float32, multiplies them by a
per-head scale ``s``, casts to FP8 (saturating, :func:`lowrank_jax.fp8.fp8_quantize_dequantize`),
dequantises and applies the softmax; the float32 softmax is computed alongside as the reference.
The scales are an input of the forward pass (from any :class:`lowrank_jax.fp8.ScalingPolicy`), or
None for current (just-in-time) scaling; the per-head statistics a policy needs (``amax``) and
those an experiment reports come back with the logits.

References:
    P14, arXiv 2602.18851; specs.md §14 (4) for the experiment design.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from lowrank_jax import fp8
from lowrank_jax.fp8.bounds import norm_gain_bound
from lowrank_jax.fp8.delayed import current_scale
from lowrank_jax.fp8.emulation import fp8_overflow_count

__all__ = ["Fp8SelfAttention", "Fp8Transformer", "fp8_attention_geometry"]


class Fp8SelfAttention(nn.Module):
    """Causal self-attention with FP8-simulated logits and per-head scales.

    Kernels ``query``/``key``/``value`` are ``(d, H, d_h)`` (no bias), ``out`` is ``(H, d_h, d)``.
    ``__call__(x (b, n, d), scales (H,) or None) -> (y (b, n, d), stats)`` with ``stats`` entries
    ``(H,)``: ``amax`` (max ``|S|`` over the causal positions), ``overflow`` (saturated logits),
    ``utilisation`` (``amax·s/R``), ``softmax_error`` (``‖P_fp8 − P_fp32‖_F/‖P_fp32‖_F``),
    ``scale``.

    Attributes:
        num_heads: ``H``.
        fmt: FP8 format of the logits.
        quantize: False gives exact float32 attention (the statistics are still computed).
    """

    num_heads: int
    fmt: str = "e4m3"
    quantize: bool = True

    @nn.compact
    def __call__(
        self, x: jax.Array, scales: jax.Array | None
    ) -> tuple[jax.Array, dict[str, jax.Array]]:
        _, n, d = x.shape
        h = self.num_heads
        if d % h:
            raise ValueError(f"the width d={d} must be a multiple of num_heads={h}.")
        dh = d // h
        dense = lambda name: nn.DenseGeneral((h, dh), use_bias=False, name=name)
        q, k, v = dense("query")(x), dense("key")(x), dense("value")(x)
        s = jnp.einsum("bihk,bjhk->bhij", q, k) / math.sqrt(dh)
        mask = jnp.tril(jnp.ones((n, n), bool))
        abs_s = jnp.where(mask, jnp.abs(s), 0.0)
        amax = jax.lax.stop_gradient(jnp.max(abs_s, axis=(0, 2, 3)))  # (H,)
        if scales is None:
            scales = current_scale(amax, fmt=self.fmt)
        scales = jax.lax.stop_gradient(scales).astype(jnp.float32)
        sc = scales[None, :, None, None]
        r = fp8.fp8_max(self.fmt)
        sq = fp8.fp8_quantize_dequantize(s, sc, fmt=self.fmt) if self.quantize else s
        neg = jnp.finfo(s.dtype).min
        p = jax.nn.softmax(jnp.where(mask, sq, neg), axis=-1)
        p_ref = jax.lax.stop_gradient(jax.nn.softmax(jnp.where(mask, s, neg), axis=-1))
        diff = jnp.sum((jax.lax.stop_gradient(p) - p_ref) ** 2, axis=(0, 2, 3))
        stats = {
            "amax": amax,
            "overflow": fp8_overflow_count(abs_s, sc, fmt=self.fmt, rtol=1e-5, axis=(0, 2, 3)),
            "utilisation": amax * scales / r,
            "softmax_error": jnp.sqrt(diff / jnp.sum(p_ref**2, axis=(0, 2, 3))),
            "scale": scales,
        }
        o = jnp.einsum("bhij,bjhk->bihk", p, v)
        out = nn.DenseGeneral(d, axis=(-2, -1), use_bias=False, name="out")(o)
        return out, stats


class Fp8Transformer(nn.Module):
    """Pre-LN causal transformer (token + learned position embeddings) with FP8 attention logits.

    ``__call__(tokens (b, n) int, scales (L, H) or None) -> (logits (b, n, vocab), stats)`` with
    every ``stats`` entry ``(L, H)`` (see :class:`Fp8SelfAttention`). Parameters of layer ``i``:
    ``block_{i}_ln_attention``, ``block_{i}_attention/{query,key,value,out}``,
    ``block_{i}_ln_mlp``, ``block_{i}_fc1``, ``block_{i}_fc2``; :func:`fp8_attention_geometry`
    reads what a scaling policy needs from them.

    Attributes:
        vocab_size, num_layers, d_model, num_heads, mlp_dim, max_len: the architecture.
        fmt: FP8 format of the logits.
        quantize: False gives exact float32 attention.
    """

    vocab_size: int
    num_layers: int
    d_model: int
    num_heads: int
    mlp_dim: int
    max_len: int
    fmt: str = "e4m3"
    quantize: bool = True

    @nn.compact
    def __call__(self, tokens: jax.Array, scales: jax.Array | None):
        n = tokens.shape[1]
        x = nn.Embed(self.vocab_size, self.d_model, name="embed")(tokens)
        pos = self.param("pos", nn.initializers.normal(0.02), (self.max_len, self.d_model))
        x = x + pos[:n]
        all_stats = []
        for i in range(self.num_layers):
            ln = nn.LayerNorm(name=f"block_{i}_ln_attention")(x)
            attn = Fp8SelfAttention(
                self.num_heads, fmt=self.fmt, quantize=self.quantize, name=f"block_{i}_attention"
            )
            y, stats = attn(ln, None if scales is None else scales[i])
            x = x + y
            y = nn.LayerNorm(name=f"block_{i}_ln_mlp")(x)
            y = nn.Dense(self.mlp_dim, name=f"block_{i}_fc1")(y)
            x = x + nn.Dense(self.d_model, name=f"block_{i}_fc2")(nn.gelu(y))
            all_stats.append(stats)
        x = nn.LayerNorm(name="ln_final")(x)
        logits = nn.Dense(self.vocab_size, name="head")(x)
        return logits, jax.tree.map(lambda *a: jnp.stack(a), *all_stats)


def fp8_attention_geometry(
    params: Mapping[str, Any], *, num_layers: int
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """What a scaling policy reads from an :class:`Fp8Transformer`'s parameters.

    Args:
        params: the model's ``params`` collection.
        num_layers: ``L``.

    Returns:
        ``(w_q, w_k, gains)``: stacked query and key kernels ``(L, d, H, d_h)`` and the effective
        gains ``(L,)`` of the LayerNorms feeding the attention
        (:func:`lowrank_jax.fp8.bounds.norm_gain_bound`).

    Raises:
        KeyError: if ``params`` lacks a layer's attention or LayerNorm parameters.
    """
    blocks = range(num_layers)
    wq = jnp.stack([params[f"block_{i}_attention"]["query"]["kernel"] for i in blocks])
    wk = jnp.stack([params[f"block_{i}_attention"]["key"]["kernel"] for i in blocks])
    gains = jnp.stack(
        [
            norm_gain_bound(
                params[f"block_{i}_ln_attention"]["scale"],
                params[f"block_{i}_ln_attention"]["bias"],
            )
            for i in blocks
        ]
    )
    return wq, wk, gains
