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
weight` (m, n). `decoder_module_name` / `decoder_path_from_module` translate projection paths to PEFT's
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
from safetensors.numpy import save_file

from lowrank_jax.checkpoint_files import open_safetensors, tensor_files
from lowrank_jax.models.decoder import DecoderLM
from lowrank_jax.models.decoder_config import DecoderConfig
from lowrank_jax.models.hf_decoder_config import config_from_hf, config_to_hf

__all__ = ["decoder_module_name", "decoder_path_from_module", "load_hf_decoder", "save_hf_decoder"]

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


def decoder_module_name(path: str, layer: int | None = None) -> str:
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


def decoder_path_from_module(name: str) -> tuple[str, int | None]:
    """Inverse of `decoder_module_name`: `(our kernel path, layer index or None)`.

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


def _check_stacked(config: DecoderConfig) -> None:
    if not config.scan_layers:
        raise ValueError(
            "Hugging Face checkpoints map to the stacked layout (layers/...): use "
            "DecoderConfig(scan_layers=True)."
        )


def load_hf_decoder(
    directory: str | os.PathLike,
    *,
    config: DecoderConfig | None = None,
    shardings: Any = None,
) -> tuple[DecoderConfig, dict[str, Any]]:
    """Reads a Hugging Face checkpoint into `DecoderLM` variables; by default computes in bfloat16.

    The default config, `config_from_hf(directory)`, keeps float32 parameters and computes in
    bfloat16 (on the tests' random tiny models, logits 4e-3 to 8e-3 from float32 `transformers`;
    4e-7 in float32); for float32 compute, as the parity tests use, pass
    `config=config_from_hf(directory, dtype="float32")`.

    Each parameter becomes one `jax.Array` of `config.param_dtype` built by
    `jax.make_array_from_callback` in its sharding; the callback reads, for each device, only
    that device's slice of the per-layer tensors from the memory-mapped safetensors files
    (transposing `Linear` weights, stacking layers), so no full copy of the model, nor of a
    sharded tensor, is formed on the host.

    Args:
      directory: a `save_pretrained` directory: `config.json` and `model.safetensors` or
        `model.safetensors.index.json` with its shards.
      config: the architecture and numerics (default: `config_from_hf(directory)`: bfloat16
        compute, float32 parameters).
      shardings: where to put each parameter: None (the first device), one
        `jax.sharding.Sharding` for all, a pytree like the variables with a `Sharding` per leaf,
        or a callable `path -> Sharding` over '/'-joined paths (`params/model/layers/...`).

    Returns:
      `(config, {"params": ...})`.

    Raises:
      FileNotFoundError: missing files.
      ValueError: a truncated or corrupt file (named, with what to do), missing tensors, tensors
        no parameter takes (named), wrong shapes, or a config with `scan_layers=False`.

    Example:
      >>> config, variables = load_hf_decoder("llama-dir")  # doctest: +SKIP
      >>> logits = DecoderLM(config).apply(variables, tokens, mask)  # doctest: +SKIP
    """
    directory = os.fspath(directory)
    config = config or config_from_hf(directory)
    _check_stacked(config)
    files = tensor_files(directory)
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
        handles = {f: stack.enter_context(open_safetensors(f)) for f in sorted(set(files.values()))}

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
      ValueError: variables whose structure differs from `DecoderLM(config)`'s, a config the
        family's HF class cannot express, or one with `scan_layers=False`.
    """
    _check_stacked(config)
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
