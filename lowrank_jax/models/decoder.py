"""One decoder-only LLM family (Llama-3, Qwen2/2.5, Gemma-2, Gemma-3) with layers under `scan`.

A `DecoderConfig` holds the per-family switches; `DecoderLM(config)` is a Flax linen module whose
parameter paths mirror Hugging Face's state-dict keys (L layers stacked on a leading axis; a HF
`Linear.weight` (m, n) is our `kernel` (n, m), a norm's `weight` our `scale`)::

    params/model/embed_tokens/embedding                     (V, d)     model.embed_tokens.weight
    params/model/layers/input_layernorm/scale               (L, d)     model.layers.{i}.input_layernorm
    params/model/layers/self_attn/{q,k,v,o}_proj/kernel     (L, n, m)  model.layers.{i}.self_attn.*
    params/model/layers/self_attn/{q,k,v}_proj/bias         (L, m)     (qkv_bias: Qwen2)
    params/model/layers/self_attn/{q,k}_norm/scale          (L, k)     (qk_norm: Gemma-3)
    params/model/layers/post_attention_layernorm/scale      (L, d)
    params/model/layers/{pre,post}_feedforward_layernorm/scale (L, d)  (sandwich_norms: Gemma)
    params/model/layers/mlp/{gate,up,down}_proj/kernel      (L, n, m)  model.layers.{i}.mlp.*
    params/model/norm/scale                                 (d,)       model.norm.weight
    params/lm_head/kernel                                   (d, V)     lm_head.weight (untied only)

so adapter rules read `.*q_proj/kernel` and one rule covers all L layers (the kernel is (L, n, m)).
With x (b, t, d), h query heads, g key/value heads (GQA, h = g·r) of size k, one layer computes::

    a = attn(norm_in(x)),   x = x + (norm_post_attn(a) if sandwich_norms else a)
    f = mlp(norm_ff(x)),    x = x + (norm_post_ff(f) if sandwich_norms else f)
    mlp(y) = down(act(gate(y)) * up(y))           (SwiGLU: act = silu; GeGLU: tanh-GELU)
    attn: q, k = rope(norm_q(y W_q)), rope(norm_k(y W_k));  s = cap_a(q kᵀ · c);  softmax over
          keys that are not padding, not in the future and (sliding layers) within the window

with RMSNorm `y = x / rms(x) · (offset + w)` (offset 1 for Gemma), `c = query_pre_attn_scalar^-1/2`
(default k^-1/2) and `cap(z) = cap·tanh(z / cap)` soft-capping (Gemma-2). Embeddings are scaled by
sqrt(d) for Gemma; logits are `x_L Eᵀ` with tied embeddings, soft-capped by `final_logit_softcapping`.

The stack runs under `nn.scan` (one compiled layer; `remat_policy` wraps it in `nn.remat`);
`DecoderConfig(scan_layers=False)` unrolls it into modules `layers_0 ... layers_{L-1}` with 2-D
kernels (the same function, for debugging and per-layer checks; loaders need the stack). Layers
that differ (sliding vs full attention, Gemma-3's local vs global RoPE base) receive their window
and RoPE choice as per-layer scan inputs, so the stack stays one program. A `KVCache` is explicit
state: `DecoderLM.__call__(tokens, mask, cache=cache)` returns `(logits, new_cache)`.
`fp8_scales=` (L, H) casts the attention logits to simulated FP8 and sows overflow counts
(P14; `lowrank_jax.models.decoder_fp8`).

LoRA on the stack: rules take the stacked kernels with `lora(r, in_ndim=1, out_ndim=1)` (the
leading axis is the layer), so the factors are stacked too (`a` (L, n, r), `b` (L, r, m)), and
`adapters.adapt(model.apply)` (quax backend) runs under the same `nn.scan`, which slices the frozen
kernel and the factors per layer: the base is never copied or folded (`tests/models/
test_decoder_lora.py` checks the compiled step's memory). `adapters.save_peft(dir, lora,
module_name=decoder_module_name)` writes one PEFT module per layer (`model.layers.{i}.self_attn.q_proj`)::

    rules = [(r".*_proj/kernel", adapters.lora(8, alpha=16.0, in_ndim=1, out_ndim=1))]
    lora = adapters.init(key, variables, rules)
    logits = adapters.adapt(DecoderLM(config).apply)(variables, lora, tokens, mask)

References:
  Touvron et al. 2023 and Grattafiori et al. 2024 (Llama, Llama-3 RoPE scaling); Qwen Team 2024
  (Qwen2); Gemma Team 2024 and 2025 (Gemma-2, Gemma-3); Su et al. 2021 (RoPE); Ainslie et al.
  2023 (GQA); Shazeer 2020 (GLU variants). Reconstructed from Hugging Face `transformers`
  (`modeling_llama/qwen2/gemma2/gemma3.py`), against which `tests/models/test_decoder_hf.py`
  checks logits and greedy tokens.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax import lax

from lowrank_jax.models.decoder_config import DecoderConfig, rope_frequencies
from lowrank_jax.models.decoder_fp8 import fp8_logits

__all__ = ["DecoderLM", "DecoderModel", "KVCache", "RMSNorm", "init_cache"]

_FULL_WINDOW = 2**30  # the window of a full-attention layer: larger than any sequence


def _rope_tables(positions: jax.Array, inv_freq: np.ndarray, dtype: Any) -> tuple:
    """cos, sin tables (b, t, k) for integer positions (b, t), HF's `cat(freqs, freqs)` layout."""
    freqs = positions[..., None].astype(jnp.float32) * jnp.asarray(inv_freq)
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb).astype(dtype), jnp.sin(emb).astype(dtype)


def _apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotates (b, t, heads, k) by (b, t, k) tables: `x cos + rotate_half(x) sin`."""
    x1, x2 = jnp.split(x, 2, axis=-1)
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    return x * cos[:, :, None, :] + rotated * sin[:, :, None, :]


def _softcap(z: jax.Array, cap: float | None) -> jax.Array:
    return z if cap is None else jnp.tanh(z / cap) * cap


@struct.dataclass
class KVCache:
    """Keys and values of every layer for `slots` token slots, explicit state of the sampler.

    Attributes:
      k, v: (L, b, S, g, k) keys (after RoPE) and values.
      mask: (b, S) True for slots that hold a (non-padding) token.
      index: () int32, the next slot to write.
    """

    k: jax.Array
    v: jax.Array
    mask: jax.Array
    index: jax.Array


def init_cache(config: DecoderConfig, batch: int, slots: int, *, dtype: Any = None) -> KVCache:
    """An empty `KVCache` for `batch` sequences of at most `slots` tokens (prompt + new).

    Args:
      config: the model's configuration.
      batch: b.
      slots: S, the total length the cache can hold.
      dtype: key/value dtype (default: the compute dtype).

    Returns:
      A cache with zero keys/values, no valid slot and index 0.
    """
    shape = (config.num_hidden_layers, batch, slots, config.kv_heads, config.dims_per_head)
    dtype = dtype or config.dtype
    return KVCache(
        k=jnp.zeros(shape, dtype),
        v=jnp.zeros(shape, dtype),
        mask=jnp.zeros((batch, slots), jnp.bool_),
        index=jnp.zeros((), jnp.int32),
    )


class _PerLayer(NamedTuple):
    window: jax.Array  # () int32: sliding window of this layer (huge for full attention)
    local: jax.Array  # () bool: use the local RoPE tables
    cache_k: jax.Array | None  # (b, S, g, k)
    cache_v: jax.Array | None
    fp8_scales: jax.Array | None = None  # (H,) FP8 logit scales (`decoder_fp8`)


class _Shared(NamedTuple):
    rope: tuple  # (cos, sin) (b, t, k) of full layers
    local_rope: tuple | None  # the same for sliding layers, if their RoPE differs
    query_slots: jax.Array  # (t,) int32
    key_slots: jax.Array  # (S,) int32
    key_valid: jax.Array  # (b, S) bool
    index: jax.Array | None  # () int32 cache write position
    same_segment: jax.Array | None = None  # (b, t, t) bool: query and key in one packed segment


class RMSNorm(nn.Module):
    """`x / sqrt(mean(x²) + eps) · (offset + w)` over the last axis, computed in float32."""

    eps: float
    offset: float = 0.0
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        init = nn.initializers.zeros if self.offset else nn.initializers.ones
        w = self.param("scale", init, (x.shape[-1],), self.param_dtype)
        x32 = x.astype(jnp.float32)
        y = x32 * lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (y * (self.offset + w.astype(jnp.float32))).astype(self.dtype)


def _dense(cfg: DecoderConfig, features: int, bias: bool, name: str) -> nn.Dense:
    return nn.Dense(
        features,
        use_bias=bias,
        dtype=cfg.dtype,
        param_dtype=cfg.param_dtype,
        kernel_init=nn.initializers.normal(0.02),
        name=name,
    )


def _norm(cfg: DecoderConfig, name: str) -> RMSNorm:
    return RMSNorm(
        cfg.rms_norm_eps, cfg.norm_offset, dtype=cfg.dtype, param_dtype=cfg.param_dtype, name=name
    )


class _Attention(nn.Module):
    config: DecoderConfig

    @nn.compact
    def __call__(self, x: jax.Array, layer: _PerLayer, shared: _Shared) -> tuple:
        cfg = self.config
        b, t, _ = x.shape
        h, g, k = cfg.num_attention_heads, cfg.kv_heads, cfg.dims_per_head
        q = _dense(cfg, h * k, cfg.qkv_bias, "q_proj")(x).reshape(b, t, h, k)
        key = _dense(cfg, g * k, cfg.qkv_bias, "k_proj")(x).reshape(b, t, g, k)
        value = _dense(cfg, g * k, cfg.qkv_bias, "v_proj")(x).reshape(b, t, g, k)
        if cfg.qk_norm:
            q, key = _norm(cfg, "q_norm")(q), _norm(cfg, "k_norm")(key)
        cos, sin = shared.rope
        if shared.local_rope is not None:
            cos = jnp.where(layer.local, shared.local_rope[0], cos)
            sin = jnp.where(layer.local, shared.local_rope[1], sin)
        q, key = _apply_rope(q, cos, sin), _apply_rope(key, cos, sin)
        new_kv = None
        if layer.cache_k is not None:
            start = (0, shared.index, 0, 0)
            key = lax.dynamic_update_slice(layer.cache_k, key.astype(layer.cache_k.dtype), start)
            value = lax.dynamic_update_slice(
                layer.cache_v, value.astype(layer.cache_v.dtype), start
            )
            new_kv = (key, value)
        scale = (cfg.query_pre_attn_scalar or k) ** -0.5
        qg = q.reshape(b, t, g, h // g, k)
        scores = jnp.einsum("btgrk,bsgk->bgrts", qg, key.astype(q.dtype)).astype(jnp.float32)
        qs, ks = shared.query_slots[:, None], shared.key_slots[None, :]
        allowed = (ks <= qs) & (qs - ks < layer.window)  # (t, S)
        allowed = allowed[None, None, None] & shared.key_valid[:, None, None, None, :]
        if shared.same_segment is not None:  # packed sequences: no attention across segments
            allowed = allowed & shared.same_segment[:, None, None]
        scores = scores * scale
        if layer.fp8_scales is not None:  # simulated FP8 logits, overflow counts sown
            scores = fp8_logits(self, scores, layer.fp8_scales, allowed)
        scores = _softcap(scores, cfg.attn_logit_softcapping)
        scores = jnp.where(allowed, scores, jnp.finfo(jnp.float32).min)
        probs = jax.nn.softmax(scores, axis=-1).astype(cfg.dtype)
        out = jnp.einsum("bgrts,bsgk->btgrk", probs, value.astype(cfg.dtype))
        out = _dense(cfg, cfg.hidden_size, cfg.o_bias, "o_proj")(out.reshape(b, t, h * k))
        return out, new_kv


class _MLP(nn.Module):
    config: DecoderConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        cfg = self.config
        gate = _dense(cfg, cfg.intermediate_size, cfg.mlp_bias, "gate_proj")(x)
        up = _dense(cfg, cfg.intermediate_size, cfg.mlp_bias, "up_proj")(x)
        silu = cfg.hidden_act == "silu"
        act = jax.nn.silu(gate) if silu else jax.nn.gelu(gate, approximate=True)
        return _dense(cfg, cfg.hidden_size, cfg.mlp_bias, "down_proj")(act * up)


class _Layer(nn.Module):
    """One decoder layer with the `(carry, xs) -> (carry, ys)` signature of `nn.scan`."""

    config: DecoderConfig

    @nn.compact
    def __call__(self, x: jax.Array, layer: _PerLayer, shared: _Shared) -> tuple:
        cfg = self.config
        a, new_kv = _Attention(cfg, name="self_attn")(
            _norm(cfg, "input_layernorm")(x), layer, shared
        )
        if cfg.sandwich_norms:
            a = _norm(cfg, "post_attention_layernorm")(a)
        x = x + a
        pre_ff = "pre_feedforward_layernorm" if cfg.sandwich_norms else "post_attention_layernorm"
        f = _MLP(cfg, name="mlp")(_norm(cfg, pre_ff)(x))
        if cfg.sandwich_norms:
            f = _norm(cfg, "post_feedforward_layernorm")(f)
        return x + f, new_kv


def _layer_inputs(cfg: DecoderConfig) -> tuple[np.ndarray, np.ndarray]:
    """Per-layer window (L,) int32 and local-RoPE flag (L,) bool."""
    sliding = np.array([t == "sliding_attention" for t in cfg.types])
    window = np.where(sliding, cfg.sliding_window or _FULL_WINDOW, _FULL_WINDOW)
    return window.astype(np.int32), sliding


class DecoderModel(nn.Module):
    """Embedding, the scanned stack of layers and the final norm (HF's `model.` prefix).

    Attributes:
      config: the architecture.
    """

    config: DecoderConfig

    def setup(self) -> None:
        cfg = self.config
        self.embed_tokens = nn.Embed(
            cfg.vocab_size,
            cfg.hidden_size,
            dtype=cfg.dtype,
            param_dtype=cfg.param_dtype,
            embedding_init=nn.initializers.normal(0.02),
        )
        layer = _Layer
        if cfg.remat_policy is not None:
            policy = getattr(jax.checkpoint_policies, cfg.remat_policy)
            layer = nn.remat(layer, policy=policy, prevent_cse=False)
        if cfg.scan_layers:
            self.layers = nn.scan(
                layer,
                variable_axes={"params": 0, "intermediates": 0},
                split_rngs={"params": True},
                in_axes=(0, nn.broadcast),
                length=cfg.num_hidden_layers,
            )(cfg)
        else:  # named layers_0 ... layers_{L-1} by linen
            self.layers = [layer(cfg) for _ in range(cfg.num_hidden_layers)]
        self.norm = _norm(cfg, None)

    def __call__(
        self,
        tokens: jax.Array,
        attention_mask: jax.Array,
        positions: jax.Array,
        cache: KVCache | None,
        segment_ids: jax.Array | None = None,
        fp8_scales: jax.Array | None = None,
    ) -> tuple[jax.Array, KVCache | None]:
        """Final hidden states (b, t, d) and the updated cache (see `DecoderLM`)."""
        cfg = self.config
        b, t = tokens.shape
        x = self.embed_tokens(tokens)
        if cfg.embed_scale:
            x = x * jnp.asarray(math.sqrt(cfg.hidden_size), x.dtype)
        rope = _rope_tables(positions, rope_frequencies(cfg.rope, cfg.dims_per_head), cfg.dtype)
        local_rope = None
        if cfg.local_rope is not None and cfg.local_rope != cfg.rope:
            inv = rope_frequencies(cfg.local_rope, cfg.dims_per_head)
            local_rope = _rope_tables(positions, inv, cfg.dtype)
        window, local = _layer_inputs(cfg)
        if cache is None:
            slots = jnp.arange(t, dtype=jnp.int32)
            same = None
            if segment_ids is not None:
                same = segment_ids[:, :, None] == segment_ids[:, None, :]
            shared = _Shared(rope, local_rope, slots, slots, attention_mask, None, same)
            per_layer = _PerLayer(jnp.asarray(window), jnp.asarray(local), None, None, fp8_scales)
        else:
            valid = lax.dynamic_update_slice(cache.mask, attention_mask, (0, cache.index))
            shared = _Shared(
                rope,
                local_rope,
                cache.index + jnp.arange(t, dtype=jnp.int32),
                jnp.arange(cache.mask.shape[1], dtype=jnp.int32),
                valid,
                cache.index,
            )
            per_layer = _PerLayer(
                jnp.asarray(window), jnp.asarray(local), cache.k, cache.v, fp8_scales
            )
        if cfg.scan_layers:
            x, new_kv = self.layers(x, per_layer, shared)
        else:
            new_kv = []
            for i, layer in enumerate(self.layers):
                x, kv = layer(x, jax.tree.map(lambda a, i=i: a[i], per_layer), shared)
                new_kv.append(kv)
            new_kv = jax.tree.map(lambda *a: jnp.stack(a), *new_kv)  # None without a cache
        x = self.norm(x)
        if cache is None:
            return x, None
        return x, KVCache(k=new_kv[0], v=new_kv[1], mask=shared.key_valid, index=cache.index + t)

    def attend(self, x: jax.Array) -> jax.Array:
        """`x Eᵀ` with the embedding matrix E (tied output head)."""
        return self.embed_tokens.attend(x)


def _positions(attention_mask: jax.Array, cache: KVCache | None) -> jax.Array:
    """RoPE positions: the count of earlier non-padding tokens (HF `generate`'s position_ids)."""
    before = 0
    if cache is not None:
        slots = jnp.arange(cache.mask.shape[1])
        before = jnp.sum(cache.mask & (slots < cache.index)[None], axis=1, keepdims=True)
    pos = before + jnp.cumsum(attention_mask.astype(jnp.int32), axis=1) - 1
    return jnp.maximum(pos, 0).astype(jnp.int32)


def _segment_positions(segment_ids: jax.Array) -> jax.Array:
    """RoPE positions of packed sequences: each contiguous segment counts from 0."""
    t = segment_ids.shape[1]
    starts = jnp.concatenate(
        [jnp.ones_like(segment_ids[:, :1], jnp.bool_), segment_ids[:, 1:] != segment_ids[:, :-1]],
        axis=1,
    )
    index = jnp.arange(t, dtype=jnp.int32)[None]
    return index - lax.cummax(jnp.where(starts, index, 0), axis=1)


class DecoderLM(nn.Module):
    """Causal LM over token ids: next-token logits, optionally with a `KVCache`.

    Attributes:
      config: the architecture and dtypes (see `DecoderConfig`).

    Example:
      >>> cfg = DecoderConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
      ...                     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
      >>> model = DecoderLM(cfg)
      >>> variables = model.init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))
      >>> logits = model.apply(variables, tokens, attention_mask)  # doctest: +SKIP
    """

    config: DecoderConfig

    def setup(self) -> None:
        self.model = DecoderModel(self.config)
        if not self.config.tie_word_embeddings:
            self.lm_head = _dense(self.config, self.config.vocab_size, False, None)

    def __call__(
        self,
        tokens: jax.Array,
        attention_mask: jax.Array | None = None,
        *,
        positions: jax.Array | None = None,
        cache: KVCache | None = None,
        segment_ids: jax.Array | None = None,
        fp8_scales: jax.Array | None = None,
    ) -> jax.Array | tuple[jax.Array, KVCache]:
        """Logits for the next token at every position.

        Padding may be on either side: a padded key is never attended to, and the RoPE position
        of a token counts the non-padding tokens before it (as HF `generate` does). Logits at
        padded positions are meaningless. Several sequences packed into one row
        (`lowrank_jax.data.text.pack`) are kept apart by `segment_ids`: a token attends only to
        earlier tokens of its own segment, so each segment's logits equal those of the segment
        alone.

        Args:
          tokens: (b, t) integer ids.
          attention_mask: (b, t), 1/True for tokens, 0/False for padding (default: all tokens).
          positions: (b, t) RoPE positions (default: from `attention_mask` and the cache).
          cache: a `KVCache`; the t tokens are written at slots `cache.index ...` and attend to
            every earlier valid slot. Keep `cache.index + t <= S`: under `jit` an overflow cannot
            be detected, and XLA's `dynamic_update_slice` would clamp the write position.
          fp8_scales: (L, H) per-layer, per-head scales: every layer's attention logits go
            through simulated FP8 E4M3 and their overflow counts are sown into `intermediates`
            (`lowrank_jax.models.decoder_fp8`; apply with `mutable=["intermediates"]`).

        Returns:
          (b, t, V) float32 logits; with a cache, `(logits, updated_cache)`.

        Raises:
          ValueError: tokens that are not 2-D integers, a mask or segment ids of another shape,
            or segment ids with a cache, FP8 scales not (L, H).
        """
        if tokens.ndim != 2 or not jnp.issubdtype(tokens.dtype, jnp.integer):
            raise ValueError(
                f"DecoderLM expects integer token ids (b, t); got {tokens.dtype} {tokens.shape}."
            )
        if segment_ids is not None:
            if cache is not None:
                raise ValueError("segment_ids (packed sequences) cannot be used with a cache.")
            if segment_ids.shape != tokens.shape:
                raise ValueError(
                    f"segment_ids {segment_ids.shape} must have the tokens' shape {tokens.shape}."
                )
            if attention_mask is None:
                attention_mask = segment_ids != 0
            if positions is None:
                positions = _segment_positions(segment_ids)
        if attention_mask is None:
            attention_mask = jnp.ones(tokens.shape, jnp.bool_)
        if attention_mask.shape != tokens.shape:
            raise ValueError(
                f"attention_mask {attention_mask.shape} must have the tokens' shape {tokens.shape}."
            )
        attention_mask = attention_mask.astype(jnp.bool_)
        heads = (self.config.num_hidden_layers, self.config.num_attention_heads)
        if fp8_scales is not None and jnp.shape(fp8_scales) != heads:
            raise ValueError(
                f"fp8_scales must be (layers, heads) = {heads}; got {jnp.shape(fp8_scales)}."
            )
        if positions is None:
            positions = _positions(attention_mask, cache)
        x, new_cache = self.model(tokens, attention_mask, positions, cache, segment_ids, fp8_scales)
        logits = self.model.attend(x) if self.config.tie_word_embeddings else self.lm_head(x)
        logits = _softcap(logits.astype(jnp.float32), self.config.final_logit_softcapping)
        return logits if cache is None else (logits, new_cache)
