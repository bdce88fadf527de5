"""Hugging Face `config.json` <-> `DecoderConfig` for Llama, Qwen2, Gemma-2 and Gemma-3 (text).

Reads the v5 `rope_parameters` and the v4 `rope_theta`/`rope_scaling`/`rope_local_base_freq`
keys and writes both. Reading is strict: a key that changes the model at a value we do not
implement (dropout, bidirectional attention, quantisation), an unsupported RoPE type, or a key this
reader does not know raises a `ValueError` that names it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

from lowrank_jax.models.decoder_config import DecoderConfig, RopeConfig

__all__ = ["config_from_hf", "config_to_hf"]

_MODEL_TYPES = {"llama": "llama", "qwen2": "qwen2", "gemma2": "gemma2", "gemma3_text": "gemma3"}
_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
}
# Keys of config.json that do not change the function of the model.
_IGNORED = frozenset(
    {
        "architectures", "model_type", "transformers_version", "dtype", "torch_dtype",
        "initializer_range", "use_cache", "_name_or_path", "pretraining_tp", "output_attentions",
        "output_hidden_states", "return_dict", "cache_implementation", "attn_implementation",
        "_attn_implementation_autoset", "tokenizer_class", "id2label", "label2id",
        "problem_type", "is_encoder_decoder", "torchscript", "chunk_size_feed_forward",
        "max_window_layers", "use_sliding_window", "sliding_window_pattern",
        "_sliding_window_pattern",
    }
)  # fmt: skip
_READ = frozenset(
    {
        "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
        "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_act",
        "hidden_activation", "rms_norm_eps", "rope_parameters", "rope_theta", "rope_scaling",
        "rope_local_base_freq", "max_position_embeddings", "attention_bias", "mlp_bias",
        "tie_word_embeddings", "query_pre_attn_scalar", "sliding_window", "layer_types",
        "bos_token_id", "eos_token_id", "pad_token_id", "final_logit_softcapping",
        "attn_logit_softcapping",
    }
)  # fmt: skip
# Keys that change the model; allowed only at the value shown (a neutral one).
_NEUTRAL = {
    "attention_dropout": (0, 0.0, None),
    "use_bidirectional_attention": (False, None),
    "quantization_config": (None,),
}


def _rope(params: Mapping[str, Any], default_theta: float, max_pos: int) -> RopeConfig:
    params = dict(params)
    rope_type = params.pop("rope_type", params.pop("type", "default"))
    if params.pop("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError("partial_rotary_factor != 1 (partial RoPE) is not supported.")
    if params.pop("attention_factor", None) not in (None, 1.0):
        raise ValueError("a RoPE attention_factor other than 1 is not supported.")
    known = {"rope_theta", "factor", "low_freq_factor", "high_freq_factor"}
    known.add("original_max_position_embeddings")
    extra = sorted(set(params) - known)
    if extra:
        raise ValueError(f"RoPE parameters {extra} are not supported (rope_type={rope_type!r}).")
    if rope_type not in ("default", "linear", "llama3"):
        raise ValueError(
            f"rope_type={rope_type!r} is not supported; default, linear and llama3 are."
        )
    return RopeConfig(
        theta=float(params.get("rope_theta", default_theta)),
        rope_type=rope_type,
        factor=float(params.get("factor", 1.0)),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(
            params.get("original_max_position_embeddings", max_pos)
        ),
    )


def _read_json(path: str | os.PathLike) -> dict[str, Any]:
    try:
        with open(path) as f:
            out = json.load(f)
    except FileNotFoundError as e:
        raise FileNotFoundError(
            f"{path} does not exist: not a Hugging Face model directory."
        ) from e
    if not isinstance(out, dict):
        raise ValueError(f"{path} must hold a JSON object.")
    return out


def config_from_hf(
    hf: Mapping[str, Any] | str | os.PathLike,
    *,
    dtype: str = "bfloat16",
    param_dtype: str = "float32",
    remat_policy: str | None = None,
    ignore_keys: tuple[str, ...] = (),
) -> DecoderConfig:
    """A `DecoderConfig` from a Hugging Face `config.json` (a dict, the file or its directory).

    Reads `model_type` `llama`, `qwen2`, `gemma2` and `gemma3_text` (the text-only
    `Gemma3ForCausalLM`), with the v5 `rope_parameters` or the v4 `rope_theta`/`rope_scaling`
    (`rope_local_base_freq` for Gemma-3) and the families' defaults for missing keys.

    Args:
      hf: the parsed `config.json`, its path, or the directory that holds it.
      dtype, param_dtype, remat_policy: our numerics (see `DecoderConfig`).
      ignore_keys: further keys to accept without reading them (only for keys you know do not
        change the model).

    Returns:
      The configuration.

    Raises:
      ValueError: an unsupported `model_type`, activation or RoPE type; a key that changes the
        model at a value we do not implement (dropout, bidirectional attention, quantisation);
        or a key this reader does not know (named in the message).
    """
    if not isinstance(hf, Mapping):
        path = os.fspath(hf)
        hf = _read_json(os.path.join(path, "config.json") if os.path.isdir(path) else path)
    c = dict(hf)
    model_type = c.get("model_type")
    if model_type not in _MODEL_TYPES:
        hint = " (use its text_config for Gemma3ForCausalLM)" if model_type == "gemma3" else ""
        raise ValueError(
            f"model_type={model_type!r} is not supported{hint}; supported: {sorted(_MODEL_TYPES)}."
        )
    family = _MODEL_TYPES[model_type]
    for key, neutral in _NEUTRAL.items():
        if key in c and c[key] not in neutral:
            raise ValueError(f"config.json sets {key}={c[key]!r}; only {neutral} is supported.")
    unknown = sorted(set(c) - _IGNORED - _READ - set(_NEUTRAL) - set(ignore_keys))
    if unknown:
        raise ValueError(
            f"config.json has keys this reader does not know: {unknown}. If they do not change "
            "the model, pass config_from_hf(..., ignore_keys=(...)) to accept them."
        )
    gemma = family in ("gemma2", "gemma3")
    if not gemma:
        gemma_only = ("attn_logit_softcapping", "final_logit_softcapping", "query_pre_attn_scalar")
        set_keys = [k for k in gemma_only if c.get(k) is not None]
        if set_keys:
            raise ValueError(f"{model_type} has no {set_keys}; this config.json sets them.")
    d, heads, layers = c["hidden_size"], c["num_attention_heads"], c["num_hidden_layers"]
    head_dim = c.get("head_dim") or (256 if gemma else d // heads)
    act = (
        c.get("hidden_activation")
        or c.get("hidden_act")
        or ("gelu_pytorch_tanh" if gemma else "silu")
    )
    max_pos = int(c.get("max_position_embeddings", 8192))
    local_rope = None
    if family == "gemma3":
        rp = c.get("rope_parameters")
        if not (isinstance(rp, Mapping) and "full_attention" in rp):
            full = {**(c.get("rope_scaling") or {}), "rope_theta": c.get("rope_theta", 1e6)}
            rp = {
                "full_attention": full,
                "sliding_attention": {"rope_theta": c.get("rope_local_base_freq", 1e4)},
            }
        rope = _rope(rp["full_attention"], 1e6, max_pos)
        local_rope = _rope(rp.get("sliding_attention") or {}, 1e4, max_pos)
    else:
        rp = c.get("rope_parameters") or {
            **(c.get("rope_scaling") or {}),
            "rope_theta": c.get("rope_theta", 10000.0),
        }
        rope = _rope(rp, 10000.0, max_pos)
    layer_types = c.get("layer_types")
    window = c.get("sliding_window")
    if layer_types is None:
        if family == "gemma2":
            layer_types = [
                "sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(layers)
            ]
        elif family == "gemma3":
            pattern = c.get("sliding_window_pattern", c.get("_sliding_window_pattern", 6))
            layer_types = [
                "sliding_attention" if (i + 1) % pattern else "full_attention"
                for i in range(layers)
            ]
        elif family == "qwen2" and c.get("use_sliding_window") and window:
            first = c.get("max_window_layers", layers)
            layer_types = [
                "sliding_attention" if i >= first else "full_attention" for i in range(layers)
            ]
    if gemma and window is None and layer_types and "sliding_attention" in layer_types:
        window = 4096
    bias = bool(c.get("attention_bias", False))
    eos = c.get("eos_token_id")
    return DecoderConfig(
        family=family,
        vocab_size=c["vocab_size"],
        hidden_size=d,
        intermediate_size=c["intermediate_size"],
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=c.get("num_key_value_heads") or heads,
        head_dim=head_dim,
        hidden_act=act,
        rms_norm_eps=float(c.get("rms_norm_eps", 1e-6)),
        norm_offset=1.0 if gemma else 0.0,
        rope=rope,
        local_rope=local_rope,
        max_position_embeddings=max_pos,
        qkv_bias=True if family == "qwen2" else bias,
        o_bias=False if family == "qwen2" else bias,
        mlp_bias=bool(c.get("mlp_bias", False)),
        qk_norm=family == "gemma3",
        sandwich_norms=gemma,
        embed_scale=gemma,
        query_pre_attn_scalar=c.get("query_pre_attn_scalar", 256) if gemma else None,
        attn_logit_softcapping=c.get(
            "attn_logit_softcapping", 50.0 if family == "gemma2" else None
        ),
        final_logit_softcapping=c.get(
            "final_logit_softcapping", 30.0 if family == "gemma2" else None
        ),
        sliding_window=window if layer_types and "sliding_attention" in layer_types else None,
        layer_types=tuple(layer_types) if layer_types else None,
        tie_word_embeddings=bool(c.get("tie_word_embeddings", gemma)),
        bos_token_id=c.get("bos_token_id"),
        eos_token_id=tuple(eos) if isinstance(eos, list) else eos,
        pad_token_id=c.get("pad_token_id"),
        dtype=dtype,
        param_dtype=param_dtype,
        remat_policy=remat_policy,
    )


def _rope_dict(rope: RopeConfig) -> dict[str, Any]:
    out: dict[str, Any] = {"rope_type": rope.rope_type, "rope_theta": rope.theta}
    if rope.rope_type in ("linear", "llama3"):
        out["factor"] = rope.factor
    if rope.rope_type == "llama3":
        out["low_freq_factor"] = rope.low_freq_factor
        out["high_freq_factor"] = rope.high_freq_factor
        out["original_max_position_embeddings"] = rope.original_max_position_embeddings
    return out


def config_to_hf(config: DecoderConfig, *, dtype: str | None = None) -> dict[str, Any]:
    """The Hugging Face `config.json` of `config` (v5 `rope_parameters` and the v4 keys).

    Args:
      config: the configuration.
      dtype: the stored weights' dtype recorded as `dtype`/`torch_dtype` (default param_dtype).

    Returns:
      A JSON-serialisable dict that `AutoConfig`/`from_pretrained` read back to the same model.

    Raises:
      ValueError: switches that the family's HF class cannot express (e.g. q/k norms on Llama).
    """
    fam = config.family
    gemma = fam in ("gemma2", "gemma3")
    expected = {
        "norm_offset": 1.0 if gemma else 0.0,
        "sandwich_norms": gemma,
        "embed_scale": gemma,
        "qk_norm": fam == "gemma3",
    }
    if fam == "qwen2":
        expected.update(qkv_bias=True, o_bias=False, mlp_bias=False)
    elif fam != "llama":
        expected.update(o_bias=config.qkv_bias, mlp_bias=False)
    if fam == "llama":
        expected.update(o_bias=config.qkv_bias, attn_logit_softcapping=None)
        expected.update(final_logit_softcapping=None, local_rope=None)
    wrong = {k: getattr(config, k) for k, v in expected.items() if getattr(config, k) != v}
    if wrong:
        raise ValueError(f"{_ARCHITECTURES[fam]} cannot express {wrong}; change the family.")
    dtype = dtype or config.param_dtype
    out: dict[str, Any] = {
        "architectures": [_ARCHITECTURES[fam]],
        "model_type": "gemma3_text" if fam == "gemma3" else fam,
        "dtype": dtype,
        "torch_dtype": dtype,
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_hidden_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.kv_heads,
        "head_dim": config.dims_per_head,
        "rms_norm_eps": config.rms_norm_eps,
        "max_position_embeddings": config.max_position_embeddings,
        "tie_word_embeddings": config.tie_word_embeddings,
        "bos_token_id": config.bos_token_id,
        "eos_token_id": list(config.eos_token_id)
        if isinstance(config.eos_token_id, tuple)
        else config.eos_token_id,
        "pad_token_id": config.pad_token_id,
        "attention_dropout": 0.0,
        "layer_types": list(config.types),
        "sliding_window": config.sliding_window,
    }
    if gemma:
        out["hidden_activation"] = out["hidden_act"] = config.hidden_act
        out["query_pre_attn_scalar"] = config.query_pre_attn_scalar or config.dims_per_head
        out["attn_logit_softcapping"] = config.attn_logit_softcapping
        out["final_logit_softcapping"] = config.final_logit_softcapping
        out["attention_bias"] = config.qkv_bias
    else:
        out["hidden_act"] = config.hidden_act
    if fam == "llama":
        out["attention_bias"] = config.qkv_bias
        out["mlp_bias"] = config.mlp_bias
    if fam == "qwen2":
        sliding = [t == "sliding_attention" for t in config.types]
        out["use_sliding_window"] = any(sliding)
        out["max_window_layers"] = sliding.index(True) if any(sliding) else len(sliding)
    if fam == "gemma3":
        local = config.local_rope or config.rope
        out["rope_parameters"] = {
            "full_attention": _rope_dict(config.rope),
            "sliding_attention": _rope_dict(local),
        }
        out["rope_local_base_freq"] = local.theta
    else:
        out["rope_parameters"] = _rope_dict(config.rope)
    out["rope_theta"] = config.rope.theta
    scaling = {k: v for k, v in _rope_dict(config.rope).items() if k != "rope_theta"}
    out["rope_scaling"] = scaling if config.rope.rope_type != "default" else None
    return out
