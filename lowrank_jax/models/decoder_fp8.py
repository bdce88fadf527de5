"""P14's geometry-aware FP8 scales for the grouped-query attention of `DecoderLM` (under RoPE).

`DecoderLM(config).apply(variables, tokens, fp8_scales=s, mutable=["intermediates"])` with scales
`s` (L, H) casts every layer's attention logits `S = c·q kᵀ` (before soft-capping) to simulated
FP8 E4M3 per query head, `cast(S·s)/s` (`lowrank_jax.fp8.fp8_quantize_dequantize`, saturating),
and sows per layer and head the number of attended logits with `|S·s| > R`
(`lowrank_jax.fp8.emulation.fp8_overflow_count`) and their max `|S|` into `intermediates`;
:func:`overflow_counts` and :func:`logit_amax` read them as (L, H). Without `fp8_scales` the
model is unchanged (its logits are bit-identical).

**RoPE.** Query i and key j are rotated by their positions, so the logit of head h (key head
`g(h)`) is `S_ij = c (W_q,hᵀ x_i + b_q,h)ᵀ R(θ_j − θ_i) (W_k,gᵀ x_j + b_k,g)` with an orthogonal
`R` that depends on the pair. `σ_max(W_q,h R W_k,gᵀ)` changes with `R` (it is not rotation
invariant in general: the rotation mixes the directions `W_q,h` and `W_k,g` align), so P14's
`σ_max(W_q,h W_k,gᵀ)` does not bound these logits. What holds for every rotation is
`σ̄ = ‖W_q,h‖₂ ‖W_k,g‖₂ ≥ σ_max(W_q,h R W_k,gᵀ)`, and, with `‖x‖ ≤ g√d` after the input RMSNorm
(`g = max|offset + w|`, :func:`lowrank_jax.fp8.bounds.norm_gain_bound`), the deterministic bound::

    |S_ij| ≤ B_h = c · Q_h · K_g,   Q_h = ‖W_q,h‖₂ g√d + ‖b_q,h‖   (QK-norm: Q_h = √d_h max|w_q|)

(:func:`decoder_logit_bound`; the same for K). For a Llama layer (no bias, no QK-norm,
`c = d_h^-1/2`) `B_h = σ̄ d g²/√d_h`: P14's `B_wc` with `σ̄` for `σ_max`. The rank-aware scale
multiplies it by P14's `α(δ)` (`ScaleRule.alpha`): its Chernoff bound holds for every matrix of
rank ≤ d_h with `σ_max ≤ σ̄`, so the union bound over pairs stays valid when the matrix changes
with the pair, within P14's isotropic-token model. Real tokens are not isotropic, and biases and
QK-norm are outside that model: `rule=None` (α = 1) is the unconditional scale, with no overflow
by construction.

References: P14, arXiv 2602.18851 (reconstruction, see `lowrank_jax.fp8`); Su et al. 2021 (RoPE).
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from lowrank_jax.fp8.bounds import norm_gain_bound
from lowrank_jax.fp8.emulation import fp8_max, fp8_overflow_count, fp8_quantize_dequantize
from lowrank_jax.fp8.scale_rule import ScaleRule
from lowrank_jax.models.decoder_config import DecoderConfig

__all__ = [
    "FP8_FORMAT",
    "decoder_attention_scales",
    "decoder_logit_bound",
    "fp8_logits",
    "logit_amax",
    "overflow_counts",
]

FP8_FORMAT = "e4m3"  # the format of the decoder's FP8 attention logits
_RTOL = 1e-5  # a logit scaled exactly onto R (s = R/amax) is not an overflow


def fp8_logits(module: Any, scores: jax.Array, scales: jax.Array, allowed: jax.Array) -> jax.Array:
    """`cast(S·s)/s` of one layer's logits `scores` (b, g, r, t, S), sowing its statistics.

    Args:
      module: the attention module (sows `fp8_overflow` and `fp8_amax`, (H,), into
        `intermediates`).
      scores: float32 logits, query head `h = g·r + i` at `[:, g, i]`.
      scales: (H,) per-head scales.
      allowed: boolean mask broadcastable to `scores`: the pairs that are attended.
    """
    _, g, r = scores.shape[:3]
    sc = lax.stop_gradient(scales).astype(jnp.float32).reshape(g, r)[:, :, None, None]
    attended = lax.stop_gradient(jnp.where(allowed, scores, 0.0))
    over = fp8_overflow_count(attended, sc, fmt=FP8_FORMAT, rtol=_RTOL, axis=(0, 3, 4))
    module.sow("intermediates", "fp8_overflow", over.reshape(g * r))
    module.sow("intermediates", "fp8_amax", jnp.max(jnp.abs(attended), axis=(0, 3, 4)).reshape(-1))
    return fp8_quantize_dequantize(scores, sc, fmt=FP8_FORMAT)


def _sown(state: Any, name: str) -> jax.Array:
    """(L, H) of a sown statistic, from the stacked layers or `layers_0 ... layers_{L-1}`."""
    model = state.get("intermediates", state).get("model", {})
    if "layers" in model:
        return model["layers"]["self_attn"][name][0]
    layers = sorted((k for k in model if k.startswith("layers_")), key=lambda k: int(k[7:]))
    if not layers:
        raise ValueError(
            "no FP8 statistics in this state: apply the model with fp8_scales and "
            "mutable=['intermediates']."
        )
    return jnp.stack([model[k]["self_attn"][name][0] for k in layers])


def overflow_counts(state: Any) -> jax.Array:
    """(L, H) int32 attended logits with `|S·s| > R` (the `intermediates` of an FP8 apply)."""
    return _sown(state, "fp8_overflow")


def logit_amax(state: Any) -> jax.Array:
    """(L, H) max `|S|` over the attended logits (the `intermediates` of an FP8 apply)."""
    return _sown(state, "fp8_amax")


def _layer_params(config: DecoderConfig, variables: Any) -> list[dict[str, Any]] | dict[str, Any]:
    params = variables.get("params", variables)["model"]
    if "layers" in params:
        return params["layers"]
    layers = [params[f"layers_{i}"] for i in range(config.num_hidden_layers)]
    return jax.tree.map(lambda *a: jnp.stack(a), *layers)


def _side_bound(config, attn, proj, norm, heads, x_norm, d) -> jax.Array:
    """(L, heads) bound on ‖q_h‖ (or ‖k_g‖) over every token after the input norm."""
    dh = config.dims_per_head
    if config.qk_norm:  # RMSNorm over the head: ‖y‖ ≤ √d_h · max|offset + w|
        gain = norm_gain_bound(config.norm_offset + attn[norm]["scale"].astype(jnp.float32))
        return jnp.broadcast_to(gain[:, None] * math.sqrt(dh), (gain.shape[0], heads))
    w = jnp.asarray(attn[proj]["kernel"], jnp.float32)
    w = jnp.moveaxis(w.reshape(*w.shape[:-1], heads, dh), -2, -3)  # (L, heads, d, d_h)
    bound = jnp.linalg.svd(w, compute_uv=False)[..., 0] * (x_norm[:, None] * math.sqrt(d))
    if "bias" in attn[proj]:
        bias = jnp.asarray(attn[proj]["bias"], jnp.float32)
        bound = bound + jnp.linalg.norm(bias.reshape(*bias.shape[:-1], heads, dh), axis=-1)
    return bound


def decoder_logit_bound(config: DecoderConfig, variables: Any) -> jax.Array:
    """Per layer and query head, `B_h ≥ |S_ij|` for every token pair, position and RoPE rotation.

    Args:
      config: the model's architecture.
      variables: its variables (`{"params": ...}`) or params, float kernels (fold adapters and
        dequantise a low-precision base first, e.g. `adapters.fold`).

    Returns:
      (L, H) float32 bounds `c Q_h K_g(h)` (module docstring).
    """
    layers = _layer_params(config, variables)
    attn = layers["self_attn"]
    d, h, g = config.hidden_size, config.num_attention_heads, config.kv_heads
    w_in = config.norm_offset + jnp.asarray(layers["input_layernorm"]["scale"], jnp.float32)
    x_norm = norm_gain_bound(w_in)  # (L,): ‖x‖ ≤ g √d
    q = _side_bound(config, attn, "q_proj", "q_norm", h, x_norm, d)
    k = _side_bound(config, attn, "k_proj", "k_norm", g, x_norm, d)
    c = (config.query_pre_attn_scalar or config.dims_per_head) ** -0.5
    return c * q * jnp.repeat(k, h // g, axis=-1)


def decoder_attention_scales(
    config: DecoderConfig, variables: Any, rule: ScaleRule | None = None
) -> jax.Array:
    """Per layer and query head FP8 E4M3 scales `c_rule R / (α B_h)` of the decoder's logits.

    Args:
      config: the model's architecture.
      variables: as for :func:`decoder_logit_bound`.
      rule: P14's knobs (`ScaleRule`: `seq_len`, `delta`, `gamma`, `rank_aware`, `calibration`;
        `fmt` must be "e4m3"): `α = rule.alpha(d, d_h)`. None: `α = 1`, `R / B_h`, no overflow
        by construction.

    Returns:
      (L, H) float32 scales for `DecoderLM(...)(..., fp8_scales=...)`.

    Raises:
      ValueError: a rule of another FP8 format.
    """
    bound = decoder_logit_bound(config, variables)
    if rule is None:
        return fp8_max(FP8_FORMAT) / bound
    if rule.fmt != FP8_FORMAT:
        raise ValueError(f"the decoder's FP8 logits are {FP8_FORMAT}; got a rule for {rule.fmt!r}.")
    alpha = rule.alpha(d=config.hidden_size, head_dim=config.dims_per_head)
    return rule.calibration * fp8_max(FP8_FORMAT) / (alpha * bound)
