"""The configuration of the decoder family: `DecoderConfig`, `RopeConfig`, RoPE frequencies.

`DecoderConfig` holds the per-family switches of `lowrank_jax.models.DecoderLM` (Llama-3, Qwen2,
Gemma-2, Gemma-3); `lowrank_jax.models.hf_decoder_config.config_from_hf` builds one from a Hugging
Face `config.json`. See `lowrank_jax.models.decoder` for the function they describe.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax.numpy as jnp
import numpy as np

__all__ = ["DecoderConfig", "RopeConfig", "rope_frequencies"]

FAMILIES = ("llama", "qwen2", "gemma2", "gemma3")
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
LAYER_TYPES = ("full_attention", "sliding_attention")
ROPE_TYPES = ("default", "linear", "llama3")
REMAT_POLICIES = (
    "everything_saveable",
    "nothing_saveable",
    "dots_saveable",
    "dots_with_no_batch_dims_saveable",
)


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    """Rotary position embedding frequencies (HF `rope_parameters` of one layer type).

    Attributes:
      theta: the base (HF `rope_theta`).
      rope_type: `"default"`, `"linear"` (frequencies divided by `factor`) or `"llama3"`
        (Llama-3.1's band-wise rescaling with `low_freq_factor`, `high_freq_factor` and
        `original_max_position_embeddings`).
      factor, low_freq_factor, high_freq_factor, original_max_position_embeddings: the scaling
        parameters of the non-default types.
    """

    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self) -> None:
        if self.rope_type not in ROPE_TYPES:
            raise ValueError(
                f"rope_type={self.rope_type!r} is not supported; use one of {ROPE_TYPES}."
            )
        if self.theta <= 0 or self.factor <= 0:
            raise ValueError(f"rope theta and factor must be positive; got {self}.")
        if self.rope_type == "llama3" and self.high_freq_factor <= self.low_freq_factor:
            raise ValueError("llama3 rope scaling needs high_freq_factor > low_freq_factor.")


@dataclasses.dataclass(frozen=True)
class DecoderConfig:
    """Architecture and numerics of a decoder LM; defaults are Llama's switches.

    `lowrank_jax.models.hf_decoder_config.config_from_hf` builds one from a Hugging Face
    `config.json`.

    Attributes:
      family: `"llama"`, `"qwen2"`, `"gemma2"` or `"gemma3"`: the HF architecture written back
        by `save_hf_decoder` (the switches below decide the function).
      vocab_size, hidden_size, intermediate_size, num_hidden_layers: V, d, MLP width f, L.
      num_attention_heads, num_key_value_heads: h and g (g divides h).
      head_dim: k (default d / h).
      hidden_act: `"silu"` (SwiGLU) or `"gelu_pytorch_tanh"` (GeGLU).
      rms_norm_eps: RMSNorm epsilon.
      norm_offset: 0 (`x/rms · w`, Llama/Qwen) or 1 (`x/rms · (1 + w)`, Gemma).
      rope: RoPE of full-attention layers (HF `rope_theta`, `rope_scaling`).
      local_rope: RoPE of sliding-window layers if different (Gemma-3's `rope_local_base_freq`).
      max_position_embeddings: recorded for export; positions are not limited by it.
      qkv_bias, o_bias, mlp_bias: biases of the q/k/v, o and MLP projections.
      qk_norm: RMSNorm over each query and key head before RoPE (Gemma-3).
      sandwich_norms: Gemma's post-attention, pre- and post-feed-forward norms.
      embed_scale: multiply embeddings by sqrt(d) (in the compute dtype, as HF does).
      query_pre_attn_scalar: the attention scale is its ^-1/2 (default k).
      attn_logit_softcapping, final_logit_softcapping: `cap·tanh(z/cap)` (None: off).
      sliding_window: window W of sliding layers: a query attends to keys less than W back.
      layer_types: per layer, `"full_attention"` or `"sliding_attention"` (default all full).
      tie_word_embeddings: logits use the embedding matrix (no `lm_head`).
      bos_token_id, eos_token_id, pad_token_id: recorded for export and sampling.
      dtype: compute dtype (default bfloat16); `param_dtype`: parameter dtype (float32).
      remat_policy: None (no rematerialisation) or a `jax.checkpoint_policies` name applied to
        each scanned layer (`"nothing_saveable"` keeps only the layer inputs).
      scan_layers: True (default): the layers run under `nn.scan`, parameters stacked
        `layers/... (L, ...)`. False: L separate modules `layers_0 ... layers_{L-1}` with 2-D
        kernels, run one after the other (the same function; for debugging and for checking a
        method on the stack against its per-layer form). The checkpoint loaders, PEFT module
        names and partition rules read the stacked layout only.
    """

    family: str = "llama"
    vocab_size: int = 32000
    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    hidden_act: str = "silu"
    rms_norm_eps: float = 1e-6
    norm_offset: float = 0.0
    rope: RopeConfig = RopeConfig()
    local_rope: RopeConfig | None = None
    max_position_embeddings: int = 8192
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    sandwich_norms: bool = False
    embed_scale: bool = False
    query_pre_attn_scalar: float | None = None
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    sliding_window: int | None = None
    layer_types: tuple[str, ...] | None = None
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    pad_token_id: int | None = None
    dtype: str = "bfloat16"
    param_dtype: str = "float32"
    remat_policy: str | None = None
    scan_layers: bool = True

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ValueError(f"family={self.family!r} is not supported; use one of {FAMILIES}.")
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(
                f"hidden_act={self.hidden_act!r} is not supported; use one of {ACTIVATIONS}."
            )
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive; got {getattr(self, name)}.")
        h, g = self.num_attention_heads, self.kv_heads
        if h < 1 or g < 1 or h % g:
            raise ValueError(f"num_key_value_heads={g} must divide num_attention_heads={h}.")
        if self.head_dim is None and self.hidden_size % h:
            raise ValueError(
                f"num_attention_heads={h} must divide hidden_size={self.hidden_size}, or set "
                "head_dim explicitly."
            )
        if self.dims_per_head % 2:
            raise ValueError(f"RoPE needs an even head_dim; got {self.dims_per_head}.")
        types = self.types
        if len(types) != self.num_hidden_layers or any(t not in LAYER_TYPES for t in types):
            raise ValueError(
                f"layer_types must list one of {LAYER_TYPES} per layer "
                f"({self.num_hidden_layers}); got {self.layer_types}."
            )
        if "sliding_attention" in types and not (self.sliding_window and self.sliding_window > 0):
            raise ValueError("sliding_attention layers need a positive sliding_window.")
        if self.remat_policy is not None and self.remat_policy not in REMAT_POLICIES:
            raise ValueError(
                f"remat_policy={self.remat_policy!r} is not supported; use None or one of "
                f"{REMAT_POLICIES}."
            )
        for name in ("dtype", "param_dtype"):
            if not jnp.issubdtype(jnp.dtype(getattr(self, name)), jnp.floating):
                raise ValueError(f"{name} must be a floating dtype; got {getattr(self, name)!r}.")

    @property
    def kv_heads(self) -> int:
        """g, the number of key/value heads."""
        return self.num_key_value_heads or self.num_attention_heads

    @property
    def dims_per_head(self) -> int:
        """k, the size of one head."""
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @property
    def types(self) -> tuple[str, ...]:
        """The attention type of each layer."""
        return self.layer_types or ("full_attention",) * self.num_hidden_layers

    def replace(self, **changes: Any) -> DecoderConfig:
        """A copy with some fields changed (e.g. `dtype="float32"` for parity tests)."""
        return dataclasses.replace(self, **changes)


def rope_frequencies(rope: RopeConfig, head_dim: int) -> np.ndarray:
    """Inverse frequencies `1 / theta^(2j/k)`, j < k/2, rescaled per `rope.rope_type`.

    Computed in float32 as `transformers.modeling_rope_utils` does (`"llama3"`: wavelengths
    longer than `original_max_position_embeddings / low_freq_factor` are divided by `factor`,
    shorter than `... / high_freq_factor` kept, and interpolated in between).

    Args:
      rope: the RoPE configuration.
      head_dim: k (even).

    Returns:
      (k/2,) float32 inverse frequencies.
    """
    exponent = np.arange(0, head_dim, 2, dtype=np.float32) / np.float32(head_dim)
    inv = (np.float32(1.0) / np.float32(rope.theta) ** exponent).astype(np.float32)
    if rope.rope_type == "linear":
        inv = inv / np.float32(rope.factor)
    elif rope.rope_type == "llama3":
        old = rope.original_max_position_embeddings
        low_wavelen, high_wavelen = old / rope.low_freq_factor, old / rope.high_freq_factor
        wavelen = np.float32(2 * math.pi) / inv
        scaled = np.where(wavelen > low_wavelen, inv / np.float32(rope.factor), inv)
        smooth = (old / wavelen - rope.low_freq_factor) / (
            rope.high_freq_factor - rope.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / np.float32(rope.factor) + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv = np.where(medium, smoothed, scaled)
    return np.asarray(inv, np.float32)
