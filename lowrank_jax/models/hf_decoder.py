"""Hugging Face decoder checkpoints both ways: `config.json` + (sharded) safetensors <-> `DecoderLM`.

`load_hf_decoder` reads a `save_pretrained` directory of a `LlamaForCausalLM`,
`Qwen2ForCausalLM`, `Gemma2ForCausalLM` or (text-only) `Gemma3ForCausalLM` into the variables of
`DecoderLM` (layers stacked on a leading axis) tensor by tensor: each parameter is assembled
straight into its target sharding with `jax.make_array_from_callback`, each device's piece read
from the memory-mapped files with safetensors' `safe_open(...).get_slice` (only the rows a device
holds), so the host never holds two copies of the model, nor one of a whole sharded tensor.
`save_hf_decoder` writes them back (`config.json`, `model.safetensors` or `model-0000i-of-0000n.
safetensors` + `model.safetensors.index.json` over `max_shard_size`) for `from_pretrained`.

Names: our path `params/<a>/<b>/.../<leaf>` is the HF key `<a>.<b>. ... .weight` (`kernel`,
transposed; `embedding`; `scale`) or `.bias`, with the layer index after `model.layers`:
`params/model/layers/self_attn/q_proj/kernel[i]` (n, m) is `model.layers.{i}.self_attn.q_proj.
weight` (m, n). `hf_module_name` / `path_from_hf_module` translate projection paths to PEFT's
module names and back.

References:
  Hugging Face `transformers` `PreTrainedModel.save_pretrained` (file layout, index format) and the
  `config.json` of each family (v5 `rope_parameters`; v4 `rope_theta`/`rope_scaling` also read).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from lowrank_jax.models.decoder import DecoderConfig, DecoderLM, RopeConfig

__all__ = [
    "config_from_hf",
    "config_to_hf",
    "hf_module_name",
    "load_hf_decoder",
    "path_from_hf_module",
    "save_hf_decoder",
]

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
        "_sliding_window_pattern", "final_logit_softcapping", "attn_logit_softcapping",
    }
)  # fmt: skip
_READ = frozenset(
    {
        "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
        "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_act",
        "hidden_activation", "rms_norm_eps", "rope_parameters", "rope_theta", "rope_scaling",
        "rope_local_base_freq", "max_position_embeddings", "attention_bias", "mlp_bias",
        "tie_word_embeddings", "query_pre_attn_scalar", "sliding_window", "layer_types",
        "bos_token_id", "eos_token_id", "pad_token_id",
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


# ----------------------------------------------------------------------------------------------
# Names.


def _hf_key(path: tuple[str, ...], layer: int | None) -> tuple[str, bool]:
    """HF key of our parameter `path` (without `params`) in layer `layer`; and transposed?"""
    *mods, leaf = path
    suffix = "bias" if leaf == "bias" else "weight"
    if layer is not None:
        mods = [*mods[:2], str(layer), *mods[2:]]
    return ".".join([*mods, suffix]), leaf == "kernel"


def _is_stacked(path: tuple[str, ...]) -> bool:
    return path[:2] == ("model", "layers")


_PATH_RE = re.compile(r"^(?:params/)?(?P<body>[A-Za-z0-9_/]+)/kernel$")
_NAME_RE = re.compile(r"^(?:base_model\.model\.)?(?P<body>[A-Za-z0-9_.]+)$")


def hf_module_name(path: str, layer: int | None = None) -> str:
    """The HF/PEFT module name of one of our kernels (in layer `layer` of a stacked kernel).

        params/model/layers/self_attn/q_proj/kernel, 3  ->  model.layers.3.self_attn.q_proj
        params/lm_head/kernel                            ->  lm_head

    Args:
      path: '/'-joined path of a kernel (an optional leading `params/` is accepted).
      layer: the layer index for a kernel of the stacked `model/layers` block.

    Returns:
      The dotted module name; its HF weight is `<name>.weight` (m, n), our kernel transposed.

    Raises:
      ValueError: not a kernel path, or `layer` given for an unstacked kernel or missing for a
        stacked one.
    """
    m = _PATH_RE.match(path)
    if m is None:
        raise ValueError(f"{path!r} is not a DecoderLM kernel path ('[params/]<...>/kernel').")
    parts = tuple(m["body"].split("/"))
    if _is_stacked(parts) != (layer is not None):
        raise ValueError(
            f"{path!r} {'is' if _is_stacked(parts) else 'is not'} a stacked layer kernel; "
            f"{'pass' if _is_stacked(parts) else 'do not pass'} its layer index."
        )
    return _hf_key((*parts, "kernel"), layer)[0].removesuffix(".weight")


def path_from_hf_module(name: str) -> tuple[str, int | None]:
    """Inverse of `hf_module_name`: `(our kernel path, layer index or None)`.

    A leading `base_model.model.` (PEFT's wrapper) is dropped.

    Raises:
      ValueError: a name that is not a dotted module name.
    """
    m = _NAME_RE.match(name)
    if m is None:
        raise ValueError(f"{name!r} is not a dotted module name such as 'model.layers.0.mlp'.")
    parts = m["body"].split(".")
    layer = None
    if parts[:2] == ["model", "layers"] and len(parts) > 2 and parts[2].isdigit():
        layer = int(parts.pop(2))
    return "params/" + "/".join(parts) + "/kernel", layer


# ----------------------------------------------------------------------------------------------
# Loading.


def _checkpoint_files(directory: str) -> dict[str, str]:
    """HF key -> safetensors file, from the index or the single file."""
    index = os.path.join(directory, "model.safetensors.index.json")
    if os.path.isfile(index):
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index} has no weight_map object.")
        return {k: os.path.join(directory, v) for k, v in weight_map.items()}
    single = os.path.join(directory, "model.safetensors")
    if not os.path.isfile(single):
        raise FileNotFoundError(
            f"{directory} has neither model.safetensors nor model.safetensors.index.json "
            "(pytorch_model.bin is not read: convert it with save_pretrained(safe_serialization"
            "=True))."
        )
    with safe_open(single, framework="numpy") as f:
        return dict.fromkeys(f.keys(), single)


def _sharding_for(shardings: Any, path: str, named: dict[str, Any]) -> jax.sharding.Sharding:
    if shardings is None:
        return jax.sharding.SingleDeviceSharding(jax.devices()[0])
    if isinstance(shardings, jax.sharding.Sharding):
        return shardings
    if callable(shardings):
        return shardings(path)
    if path not in named:
        raise ValueError(f"shardings has no entry for {path!r}.")
    return named[path]


def load_hf_decoder(
    directory: str | os.PathLike,
    *,
    config: DecoderConfig | None = None,
    shardings: Any = None,
) -> tuple[DecoderConfig, dict[str, Any]]:
    """Reads a Hugging Face checkpoint into `DecoderLM` variables, tensor by tensor.

    Each parameter becomes one `jax.Array` of `config.param_dtype` built by
    `jax.make_array_from_callback` in its sharding; the callback reads, for each device, only
    that device's slice of the per-layer tensors from the memory-mapped safetensors files
    (transposing `Linear` weights, stacking layers), so no full copy of the model, nor of a
    sharded tensor, is formed on the host.

    Args:
      directory: a `save_pretrained` directory: `config.json` and `model.safetensors` or
        `model.safetensors.index.json` with its shards.
      config: the architecture (default: `config_from_hf(directory)`, bfloat16 compute).
      shardings: where to put each parameter: None (the first device), one
        `jax.sharding.Sharding` for all, a pytree like the variables with a `Sharding` per leaf,
        or a callable `path -> Sharding` over '/'-joined paths (`params/model/layers/...`).

    Returns:
      `(config, {"params": ...})`.

    Raises:
      FileNotFoundError: missing files.
      ValueError: missing tensors, tensors no parameter takes (named), or wrong shapes.

    Example:
      >>> config, variables = load_hf_decoder("llama-dir")  # doctest: +SKIP
      >>> logits = DecoderLM(config).apply(variables, tokens, mask)  # doctest: +SKIP
    """
    directory = os.fspath(directory)
    config = config or config_from_hf(directory)
    files = _checkpoint_files(directory)
    expected = jax.eval_shape(
        DecoderLM(config).init, jax.random.key(0), jnp.zeros((1, 1), jnp.int32)
    )
    flat = jax.tree_util.tree_flatten_with_path(expected)[0]
    named = {}
    is_tree = not (shardings is None or isinstance(shardings, jax.sharding.Sharding))
    if is_tree and not callable(shardings):
        named = {
            "/".join(str(k.key) for k in p): s
            for p, s in jax.tree_util.tree_flatten_with_path(shardings)[0]
        }
    dtype = jnp.dtype(config.param_dtype)
    used: set[str] = set()
    leaves = []
    with contextlib.ExitStack() as stack:
        handles = {
            f: stack.enter_context(safe_open(f, framework="numpy")) for f in set(files.values())
        }

        def read(key: str, index: tuple, transpose: bool, shape: tuple) -> np.ndarray:
            if key not in files:
                raise ValueError(f"the checkpoint has no tensor {key!r}.")
            sl = handles[files[key]].get_slice(key)
            hf_shape = tuple(shape[::-1]) if transpose else tuple(shape)
            if tuple(sl.get_shape()) != hf_shape:
                raise ValueError(
                    f"{key} has shape {tuple(sl.get_shape())}; the config needs {hf_shape}."
                )
            arr = sl[tuple(index[::-1]) if transpose else tuple(index)]
            return np.asarray(arr.T if transpose else arr).astype(dtype)

        for keypath, leaf in flat:
            parts = tuple(str(k.key) for k in keypath)
            path, body = "/".join(parts), parts[1:]
            stacked = _is_stacked(body)
            keys = [
                _hf_key(body, i if stacked else None)
                for i in range(config.num_hidden_layers if stacked else 1)
            ]
            used.update(k for k, _ in keys)
            one_shape = leaf.shape[1:] if stacked else leaf.shape

            def callback(index, keys=keys, stacked=stacked, one_shape=one_shape):
                if not stacked:
                    key, tr = keys[0]
                    return read(key, index, tr, one_shape)
                layers = range(len(keys))[index[0]]
                return np.stack(
                    [read(keys[i][0], index[1:], keys[i][1], one_shape) for i in layers]
                )

            sharding = _sharding_for(shardings, path, named)
            leaves.append(jax.make_array_from_callback(leaf.shape, sharding, callback))
    unused = sorted(
        k
        for k in set(files) - used
        if not k.endswith("rotary_emb.inv_freq")
        and not (config.tie_word_embeddings and k == "lm_head.weight")
    )
    if unused:
        raise ValueError(
            f"unused tensors (no DecoderLM parameter takes them): {unused[:8]}"
            f"{' ...' if len(unused) > 8 else ''}; check the config (biases, norms, tying)."
        )
    treedef = jax.tree.structure(expected)
    return config, jax.tree.unflatten(treedef, leaves)


# ----------------------------------------------------------------------------------------------
# Saving.


def _parse_size(size: int | str) -> int:
    if isinstance(size, int):
        return size
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]i?B)\s*", size, re.IGNORECASE)
    if m is None:
        raise ValueError(f"max_shard_size={size!r}: use bytes or a string like '5GB' or '200MiB'.")
    unit = m[2].upper()
    base = 1024 if "I" in unit else 1000
    return int(float(m[1]) * base ** {"K": 1, "M": 2, "G": 3}[unit[0]])


def save_hf_decoder(
    directory: str | os.PathLike,
    config: DecoderConfig,
    variables: Mapping[str, Any],
    *,
    max_shard_size: int | str = "5GB",
    dtype: str | None = None,
) -> list[str]:
    """Writes `DecoderLM` variables as a Hugging Face checkpoint (`from_pretrained` reads it).

    Tensors are gathered one layer slice at a time and written shard by shard, so the host holds
    at most one shard. Over `max_shard_size` the files are `model-0000i-of-0000n.safetensors` with
    `model.safetensors.index.json`, as `save_pretrained` names them; else one `model.safetensors`.

    Args:
      directory: created if missing.
      config: the architecture (its HF class is `config.family`'s).
      variables: `{"params": ...}` of `DecoderLM(config)`.
      max_shard_size: bytes per file, an int or a string (`"5GB"`, `"200MiB"`).
      dtype: the stored dtype (default: `config.param_dtype`).

    Returns:
      The files written.

    Raises:
      ValueError: variables whose structure differs from `DecoderLM(config)`'s, or a config the
        family's HF class cannot express.
    """
    directory = os.fspath(directory)
    limit = _parse_size(max_shard_size)
    dtype = dtype or config.param_dtype
    np_dtype = jnp.dtype(dtype)
    hf_config = config_to_hf(config, dtype=dtype)
    expected = jax.eval_shape(
        DecoderLM(config).init, jax.random.key(0), jnp.zeros((1, 1), jnp.int32)
    )
    if jax.tree.structure(expected) != jax.tree.structure(dict(variables)):
        raise ValueError("variables do not have the structure of DecoderLM(config)'s parameters.")
    entries = []  # (key, leaf, layer, transpose, nbytes)
    for keypath, leaf in jax.tree_util.tree_flatten_with_path(dict(variables))[0]:
        body = tuple(str(k.key) for k in keypath)[1:]
        stacked = _is_stacked(body)
        for i in range(config.num_hidden_layers) if stacked else [None]:
            key, tr = _hf_key(body, i)
            n = int(np.prod(leaf.shape[1:] if stacked else leaf.shape)) * np_dtype.itemsize
            entries.append((key, leaf, i, tr, n))
    entries.sort(key=lambda e: [int(s) if s.isdigit() else s for s in e[0].split(".")])
    shards: list[list] = [[]]
    size = 0
    for e in entries:
        if shards[-1] and size + e[4] > limit:
            shards.append([])
            size = 0
        shards[-1].append(e)
        size += e[4]
    os.makedirs(directory, exist_ok=True)
    names = (
        ["model.safetensors"]
        if len(shards) == 1
        else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    )
    written = []
    for name, shard in zip(names, shards, strict=True):
        tensors = {}
        for key, leaf, i, tr, _ in shard:
            x = np.asarray(leaf[i] if i is not None else leaf)
            tensors[key] = np.ascontiguousarray(x.T if tr else x).astype(np_dtype)
        save_file(tensors, os.path.join(directory, name), metadata={"format": "pt"})
        written.append(os.path.join(directory, name))
        del tensors
    if len(shards) > 1:
        index = {
            "metadata": {"total_size": sum(e[4] for e in entries)},
            "weight_map": {e[0]: name for name, s in zip(names, shards, strict=True) for e in s},
        }
        with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
            json.dump(index, f, indent=2, sort_keys=True)
        written.append(os.path.join(directory, "model.safetensors.index.json"))
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(hf_config, f, indent=2, sort_keys=True)
    written.append(os.path.join(directory, "config.json"))
    return written
