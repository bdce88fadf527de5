"""Hugging Face ViT checkpoints (`ViTModel`, `ViTForImageClassification`) into `models.ViT`.

`load_hf_vit` reads a `save_pretrained` directory (`config.json` + `model.safetensors`, or a
sharded index) into a `ViT` with its layers stacked for `nn.scan`. Our parameter paths and the
Hugging Face keys they come from (i = 0..L-1 is the leading axis of a stacked leaf; a HF `Linear`
weight (m, n) is our kernel (n, m); `ViTForImageClassification` prefixes every key but the
classifier's with `vit.`)::

    params/patch_embed/kernel (p_h*p_w*c, d)   embeddings.patch_embeddings.projection.weight
                                               (d, c, p_h, p_w), reordered to (row, col, channel)
    params/patch_embed/bias                    embeddings.patch_embeddings.projection.bias
    params/cls_token (1, 1, d)                 embeddings.cls_token
    params/pos_embed (1, n + 1, d)             embeddings.position_embeddings
    params/encoder/layers/ln_attention         encoder.layer.{i}.layernorm_before
    params/encoder/layers/attention/query      encoder.layer.{i}.attention.attention.query
    params/encoder/layers/attention/key        encoder.layer.{i}.attention.attention.key
    params/encoder/layers/attention/value      encoder.layer.{i}.attention.attention.value
    params/encoder/layers/attention/out        encoder.layer.{i}.attention.output.dense
    params/encoder/layers/ln_mlp               encoder.layer.{i}.layernorm_after
    params/encoder/layers/mlp/fc1              encoder.layer.{i}.intermediate.dense
    params/encoder/layers/mlp/fc2              encoder.layer.{i}.output.dense
    params/ln_final                            layernorm
    params/pooler                              pooler.dense           (ViTModel with its pooler)
    params/head                                classifier             (ViTForImageClassification)

(LayerNorm `weight` is our `scale`.) These are the names `save_pretrained` writes (transformers
4 and 5 alike) and the Hub's checkpoints carry, e.g. `google/vit-base-patch16-224-in21k`.

`preprocessing` reads the checkpoint's `preprocessor_config.json`: the image size and the
normalisation (mean, std) its images must be given in.

References:
  Dosovitskiy et al., "An Image is Worth 16x16 Words", ICLR 2021; Hugging Face `transformers`
  `modeling_vit.py` / `configuration_vit.py` / `image_processing_vit.py`, against which
  `tests/models/test_hf_vit.py` checks logits and features on random tiny models.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
from collections.abc import Mapping
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from lowrank_jax.checkpoint_files import open_safetensors, tensor_files
from lowrank_jax.models.layers import unstack_layers
from lowrank_jax.models.vit import ViT

__all__ = ["ImagePreprocessing", "load_hf_vit", "preprocessing", "vit_from_hf_config"]

# Hugging Face ACT2FN names of the activations we implement.
_ACTIVATIONS = {
    "gelu": functools.partial(nn.gelu, approximate=False),  # HF "gelu" is the exact erf GELU
    "gelu_new": functools.partial(nn.gelu, approximate=True),
    "gelu_pytorch_tanh": functools.partial(nn.gelu, approximate=True),
    "relu": nn.relu,
    "silu": nn.silu,
    "swish": nn.silu,
    "tanh": jnp.tanh,
}
# ViTConfig's defaults (transformers `configuration_vit.py`) for keys a config.json may omit.
_DEFAULTS = dict(
    hidden_act="gelu",
    layer_norm_eps=1e-12,
    image_size=224,
    patch_size=16,
    num_channels=3,
    qkv_bias=True,
    pooler_act="tanh",
    hidden_dropout_prob=0.0,
)
_REQUIRED = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")
# Our path (below `params`, stacked layers under encoder/layers) -> HF module (below the prefix).
_LAYER = {
    "ln_attention": "layernorm_before",
    "attention/query": "attention.attention.query",
    "attention/key": "attention.attention.key",
    "attention/value": "attention.attention.value",
    "attention/out": "attention.output.dense",
    "ln_mlp": "layernorm_after",
    "mlp/fc1": "intermediate.dense",
    "mlp/fc2": "output.dense",
}
_TOP = {"ln_final": "layernorm", "pooler": "pooler.dense"}


def _pair(value: Any, name: str) -> tuple[int, int]:
    if isinstance(value, int) and not isinstance(value, bool):
        return value, value
    if (
        isinstance(value, list | tuple)
        and len(value) == 2
        and all(isinstance(v, int) for v in value)
    ):
        return int(value[0]), int(value[1])
    raise ValueError(f"config.json {name}={value!r}: expected an int or two ints.")


def _read_json(file: str) -> dict[str, Any]:
    if not os.path.isfile(file):
        raise FileNotFoundError(f"{file} does not exist; pass a save_pretrained directory.")
    try:
        with open(file) as f:
            out = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(
            f"{file} is not valid JSON ({e.msg} at line {e.lineno}): it is truncated or corrupt; "
            "download or save it again."
        ) from e
    if not isinstance(out, dict):
        raise ValueError(f"{file} holds a {type(out).__name__}, not a JSON object.")
    return out


def vit_from_hf_config(
    hf: Mapping[str, Any],
    *,
    num_classes: int = 0,
    pooler: bool = False,
    scan_layers: bool = True,
    dtype: Any = None,
) -> tuple[ViT, tuple[int, int, int]]:
    """The `ViT` of a Hugging Face ViT `config.json` (parsed), and its input shape.

    Args:
      hf: the parsed `config.json` (`model_type` "vit").
      num_classes: width of the head (0: no head, the model returns its features).
      pooler: whether the model has HF's pooler (`pooler_output_size`, `pooler_act`).
      scan_layers: stack the layers under `nn.scan` (as the loader gives them).
      dtype: computation dtype (None: that of the inputs and parameters).

    Returns:
      `(model, (H, W, C))`: the module and the image shape of the checkpoint (its
      `image_size` and `num_channels`; the position embeddings fix it).

    Raises:
      ValueError: not a ViT config (`model_type`), a missing size key, an unsupported
        activation, or sizes that do not fit (the message names the key).
    """
    if hf.get("model_type") != "vit":
        raise ValueError(
            f"config.json has model_type={hf.get('model_type')!r}, not 'vit': this is not a "
            "Hugging Face ViT checkpoint (ViTModel / ViTForImageClassification)."
        )
    missing = [k for k in _REQUIRED if k not in hf]
    if missing:
        raise ValueError(f"config.json lacks {missing}; it is not a complete ViT config.")
    c = {**_DEFAULTS, **{k: v for k, v in hf.items() if v is not None}}
    for key in ("hidden_act", "pooler_act"):
        if c[key] not in _ACTIVATIONS:
            raise ValueError(
                f"config.json {key}={c[key]!r} is not supported; use one of {sorted(_ACTIVATIONS)}."
            )
    d, heads = c["hidden_size"], c["num_attention_heads"]
    if d % heads:
        raise ValueError(
            f"config.json num_attention_heads={heads} does not divide hidden_size={d}."
        )
    (h, w), (ph, pw) = _pair(c["image_size"], "image_size"), _pair(c["patch_size"], "patch_size")
    if h % ph or w % pw:
        raise ValueError(
            f"config.json patch_size={c['patch_size']} does not divide image_size {h}x{w}."
        )
    model = ViT(
        patch=(ph, pw),
        dim=d,
        depth=c["num_hidden_layers"],
        heads=heads,
        mlp_dim=c["intermediate_size"],
        num_classes=num_classes,
        dropout_rate=float(c["hidden_dropout_prob"]),
        scan_layers=scan_layers,
        layer_norm_eps=float(c["layer_norm_eps"]),
        activation=_ACTIVATIONS[c["hidden_act"]],
        qkv_bias=bool(c["qkv_bias"]),
        pooler_dim=int(c.get("pooler_output_size") or d) if pooler else 0,
        pooler_activation=_ACTIVATIONS[c["pooler_act"]],
        dtype=dtype,
    )
    return model, (h, w, int(c["num_channels"]))


def _hf_name(path: tuple[str, ...], prefix: str) -> tuple[str, bool]:
    """HF key of our parameter `path` (below `params`; `{i}` for the layer), and whether the
    stored layout differs (a kernel: transposed, or the patch convolution)."""
    *mods, leaf = path
    suffix = {"kernel": "weight", "scale": "weight"}.get(leaf, leaf)
    body = "/".join(mods)
    if body == "patch_embed":
        return f"{prefix}embeddings.patch_embeddings.projection.{suffix}", leaf == "kernel"
    if leaf in ("cls_token", "pos_embed"):
        name = "cls_token" if leaf == "cls_token" else "position_embeddings"
        return f"{prefix}embeddings.{name}", False
    if body == "head":
        return f"classifier.{suffix}", leaf == "kernel"
    if mods[:2] == ["encoder", "layers"]:
        return (
            f"{prefix}encoder.layer.{{i}}.{_LAYER['/'.join(mods[2:])]}.{suffix}",
            leaf == "kernel",
        )
    return f"{prefix}{_TOP[body]}.{suffix}", leaf == "kernel"


def _to_ours(value: np.ndarray, key: str, relayout: bool) -> np.ndarray:
    if not relayout:
        return value
    if value.ndim == 4:  # the patch convolution (d, c, p_h, p_w) -> (p_h * p_w * c, d)
        return value.transpose(2, 3, 1, 0).reshape(-1, value.shape[0])
    if value.ndim != 2:
        raise ValueError(f"{key} has shape {value.shape}; a Linear weight is 2-D.")
    return value.T


def load_hf_vit(
    directory: str | os.PathLike,
    *,
    num_classes: int | None = None,
    key: jax.Array | None = None,
    scan_layers: bool = True,
    dtype: Any = jnp.float32,
) -> tuple[ViT, dict[str, Any]]:
    """Reads a Hugging Face ViT checkpoint into a `ViT` and its variables.

    With `num_classes=None` the model is the checkpoint's: a `ViTForImageClassification` gives
    logits (its `classifier` becomes our `head`), a `ViTModel` gives its features, HF's
    `pooler_output` when it was saved with its pooler and the class token of the last hidden
    state (after the final LayerNorm) otherwise. With `num_classes=k` the backbone gets a fresh
    head `(d, k)` on the class token (the features of the class-incremental literature; a saved
    pooler or classifier is not used), initialised from `key` as `ViT.init` would.

    Images are `(b, H, W, C)` channels-last, normalised as the checkpoint expects (see
    `preprocessing`); `(H, W)` must be the config's `image_size` (the position embeddings
    are not interpolated).

    Args:
      directory: a `save_pretrained` directory: `config.json` and `model.safetensors` (or
        `model.safetensors.index.json` with its shards).
      num_classes: None (the checkpoint's head or features) or the width of a fresh head.
      key: PRNG key of the fresh head (needed with `num_classes`).
      scan_layers: layers stacked for `nn.scan` (`params/encoder/layers/...`, kernels
        (L, n, m)); False gives the unrolled `layer_i` layout of the same function.
      dtype: dtype of the parameters (the computation follows them).

    Returns:
      `(model, {"params": ...})`.

    Raises:
      FileNotFoundError: no `config.json` or no weights in `directory`.
      ValueError: not a ViT config, a truncated or corrupt file (named, with what to do),
        missing tensors, tensors no parameter takes, shapes that do not fit the config, or
        `num_classes` without `key`.

    Example:
      >>> model, variables = load_hf_vit("vit-base-patch16-224-in21k")  # doctest: +SKIP
      >>> features = model.apply(variables, images)  # (b, 768)  # doctest: +SKIP
      >>> lora = adapters.lora(10, in_ndim=1, out_ndim=1)  # the kernels are (L, n, m)
      >>> rules = [(r".*attention/(query|value)/kernel", lora)]  # doctest: +SKIP
    """
    directory = os.fspath(directory)
    if num_classes is not None and (
        isinstance(num_classes, bool) or not isinstance(num_classes, int) or num_classes < 1
    ):
        raise ValueError(f"num_classes must be a positive int or None; got {num_classes!r}.")
    if num_classes is not None and key is None:
        raise ValueError("load_hf_vit(num_classes=...) needs key= to initialise the new head.")
    if not os.path.isdir(directory):
        raise FileNotFoundError(
            f"{directory} is not a directory; pass a save_pretrained directory."
        )
    hf = _read_json(os.path.join(directory, "config.json"))
    vit_from_hf_config(hf)  # refuses a config that is not a ViT's before the weights are read
    files = tensor_files(directory)
    prefix = "vit." if any(k.startswith("vit.") for k in files) else ""
    has_classifier = "classifier.weight" in files
    has_pooler = f"{prefix}pooler.dense.weight" in files
    if num_classes is None:
        width, pooler = 0, has_pooler
        if has_classifier:  # ViTForImageClassification: the head reads the class token
            with open_safetensors(files["classifier.weight"]) as f:
                width, pooler = int(f.get_slice("classifier.weight").get_shape()[0]), False
    else:
        width, pooler = num_classes, False
    model, shape = vit_from_hf_config(hf, num_classes=width, pooler=pooler, dtype=None)
    images = jnp.zeros((1, *shape), dtype)
    expected = jax.eval_shape(model.init, jax.random.key(0), images)["params"]
    depth = model.depth
    params: dict[str, Any] = {}
    used: set[str] = set()
    with contextlib.ExitStack() as stack:
        handles = {f: stack.enter_context(open_safetensors(f)) for f in sorted(set(files.values()))}

        def read(name: str, relayout: bool) -> np.ndarray:
            if name not in files:
                raise ValueError(f"{directory}: the checkpoint has no tensor {name!r}.")
            used.add(name)
            return _to_ours(np.asarray(handles[files[name]].get_tensor(name)), name, relayout)

        for keypath, leaf in jax.tree_util.tree_flatten_with_path(expected)[0]:
            path = tuple(str(k.key) for k in keypath)
            if path[0] == "head" and num_classes is not None:
                continue
            name, relayout = _hf_name(path, prefix)
            if "{i}" in name:
                value = np.stack([read(name.format(i=i), relayout) for i in range(depth)])
            else:
                value = read(name, relayout)
            if value.shape != leaf.shape:
                raise ValueError(
                    f"{name} gives {'/'.join(path)} the shape {value.shape}; the config needs "
                    f"{leaf.shape}. Check config.json against the weights."
                )
            node = params
            for part in path[:-1]:
                node = node.setdefault(part, {})
            node[path[-1]] = jnp.asarray(value, dtype)
    ignored = {"classifier.weight", "classifier.bias"} if num_classes is not None else set()
    if num_classes is not None:
        ignored |= {f"{prefix}pooler.dense.weight", f"{prefix}pooler.dense.bias"}
    unused = sorted(set(files) - used - ignored)
    if unused:
        raise ValueError(
            f"{directory}: unused tensors (no ViT parameter takes them): {unused[:8]}"
            f"{' ...' if len(unused) > 8 else ''}; this is not a ViTModel or "
            "ViTForImageClassification checkpoint."
        )
    if num_classes is not None:
        d = model.pooler_dim or model.dim
        head = nn.Dense(num_classes, param_dtype=dtype).init(key, jnp.zeros((1, d), dtype))
        params["head"] = head["params"]
    variables = {"params": params}
    if not scan_layers:
        model = model.clone(scan_layers=False)
        variables = unstack_layers(variables)
    return model, variables


class ImagePreprocessing(NamedTuple):
    """How a checkpoint's images are prepared: resized to `size`, scaled to [0, 1], then
    `(x - mean) / std` per channel.

    Attributes:
      size: `(H, W)`.
      mean, std: per-channel tuples.
    """

    size: tuple[int, int]
    mean: tuple[float, ...]
    std: tuple[float, ...]


def preprocessing(directory: str | os.PathLike) -> ImagePreprocessing:
    """The image size and normalisation of a Hugging Face ViT checkpoint.

    Reads `preprocessor_config.json` (`size` as `{"height", "width"}`, `{"shortest_edge"}` or
    an int; `image_mean`, `image_std`; `do_normalize`) when the directory has one; otherwise
    the config's `image_size` and mean = std = 0.5 per channel (`ViTImageProcessor`'s
    defaults, those of `google/vit-base-patch16-224-in21k`).

    Args:
      directory: the checkpoint's directory.

    Returns:
      An `ImagePreprocessing`.

    Raises:
      FileNotFoundError: no `config.json`.
      ValueError: a file that is not valid JSON, or a `size` / mean / std of the wrong form.
    """
    directory = os.fspath(directory)
    hf = _read_json(os.path.join(directory, "config.json"))
    channels = int(hf.get("num_channels", 3))
    size = _pair(hf.get("image_size", _DEFAULTS["image_size"]), "image_size")
    mean, std = (0.5,) * channels, (0.5,) * channels
    file = os.path.join(directory, "preprocessor_config.json")
    if os.path.isfile(file):
        pre = _read_json(file)
        s = pre.get("size")
        if isinstance(s, dict) and "height" in s and "width" in s:
            size = (int(s["height"]), int(s["width"]))
        elif isinstance(s, dict) and "shortest_edge" in s:
            size = (int(s["shortest_edge"]),) * 2
        elif s is not None:
            size = _pair(s, "preprocessor_config.json size")
        if pre.get("do_normalize", True):
            mean = tuple(float(v) for v in np.broadcast_to(pre.get("image_mean", mean), channels))
            std = tuple(float(v) for v in np.broadcast_to(pre.get("image_std", std), channels))
        else:
            mean, std = (0.0,) * channels, (1.0,) * channels
    return ImagePreprocessing(size, mean, std)
