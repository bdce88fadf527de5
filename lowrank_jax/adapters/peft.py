r"""PEFT interop: LoRA adapters as ``adapter_model.safetensors`` + ``adapter_config.json``.

PyTorch PEFT stores, for each adapted ``nn.Linear`` named ``<module>``, the tensors
``base_model.model.<module>.lora_A.weight`` of shape ``(r, in)`` and ``...lora_B.weight`` of shape
``(out, r)``, with ``ΔW_torch = (lora_alpha / r) · B_peft A_peft`` of shape ``(out, in)``. Our kernels
are ``(in, out)`` and our factors ``a: (n, r)``, ``b: (r, m)``, so ``A_peft = aᵀ`` and ``B_peft = bᵀ``.
Module names come from a user-supplied map (for the MiniLM BERT of :mod:`lowrank_jax.models`, its
``peft_module_name`` / ``flax_path_from_peft``). A kernel stacked on a layer axis (``nn.scan``,
``(L, n, m)``) is L PyTorch modules: the map then takes the layer index too
(``module_name(path, layer)``, and ``module_path(name) -> (path, layer)``), as
``models.hf_module_name`` / ``models.path_from_hf_module`` do for the decoder family, and the
per-layer factors are stacked back on the layer axis. No pickle is read or written.

Loading is strict: every tensor of the file and every setting of ``adapter_config.json`` that would
change the adapted model is either used or refused with an error naming it (DoRA's
``lora_magnitude_vector``, embedding LoRA's ``lora_embedding_A/B``, ``bias="lora_only"`` tensors,
``modules_to_save``, ...), never silently dropped. ``rank_pattern``/``alpha_pattern`` keys match a
module name as PEFT matches them: the key is a regular expression for the name's dotted suffix,
``(.*\.)?key$``, and the first matching key wins.
"""

from __future__ import annotations

import inspect
import json
import os
import re
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from safetensors.numpy import load_file, save_file

from lowrank_jax.adapters import paths
from lowrank_jax.adapters.core import Adapter, AdapterSet, resolve_layout, split_shape
from lowrank_jax.adapters.kinds import LoRA

WEIGHTS_NAME = "adapter_model.safetensors"
CONFIG_NAME = "adapter_config.json"
_PREFIX = "base_model.model."

# adapter_config.json keys that do not change the adapted function (metadata, initialisation,
# target selection already reflected by the saved tensors).
_METADATA_KEYS = frozenset(
    {
        "task_type", "peft_type", "auto_mapping", "peft_version", "base_model_name_or_path",
        "revision", "inference_mode", "target_modules", "exclude_modules", "init_lora_weights",
        "layers_to_transform", "layers_pattern", "megatron_core", "loftq_config", "eva_config",
        "corda_config", "lora_ga_config", "runtime_config", "qalora_group_size",
        "ensure_weight_tying", "fan_in_fan_out",
    }
)  # fmt: skip
# Keys this loader reads.
_USED_KEYS = frozenset(
    {"r", "lora_alpha", "lora_dropout", "use_rslora", "rank_pattern", "alpha_pattern"}
)
# Keys that change the model and are not supported: allowed only at their neutral value.
_WHY_UNSUPPORTED = {
    "use_dora": "DoRA (magnitude vectors) is not supported; merge the DoRA adapter in PEFT first",
    "bias": 'bias training is not supported; only bias="none" loads',
    "lora_bias": "LoRA bias terms are not supported",
    "modules_to_save": "fully trained modules (modules_to_save) are not supported",
    "trainable_token_indices": "trainable tokens are not supported",
    "use_qalora": "QA-LoRA is not supported",
    "alora_invocation_tokens": "activated LoRA (aLoRA) is not supported",
    "layer_replication": "layer replication is not supported",
    "target_parameters": "LoRA on nn.Parameter targets is not supported",
    "megatron_config": "Megatron parallel layers are not supported",
    "monteclora_config": "MonteCLoRA is not supported",
    "velora_config": "VeLoRA is not supported",
    "use_bdlora": "BD-LoRA is not supported",
    "arrow_config": "Arrow routing is not supported",
    "kasa_config": "KaSA is not supported",
}
_NEUTRAL = (None, False, "none", {}, [], "")


def _read_config(directory: str | os.PathLike) -> dict[str, Any]:
    """Reads and validates ``adapter_config.json``; errors name the file and the key."""
    file = os.path.join(directory, CONFIG_NAME)
    try:
        with open(file) as f:
            config = json.load(f)
    except FileNotFoundError as e:
        raise FileNotFoundError(f"{file} does not exist: not a PEFT adapter directory.") from e
    except json.JSONDecodeError as e:
        raise ValueError(f"{file} is not valid JSON ({e.msg} at line {e.lineno}).") from e
    if not isinstance(config, dict):
        raise ValueError(f"{file} must hold a JSON object, not {type(config).__name__}.")
    if config.get("peft_type") != "LORA":
        raise ValueError(f"{file}: peft_type is {config.get('peft_type')!r}; only LORA loads.")
    for key in ("r", "lora_alpha"):
        if key not in config:
            raise ValueError(f"{file} has no {key!r}; a PEFT LoRA config needs it.")
        if isinstance(config[key], bool) or not isinstance(config[key], int | float):
            raise ValueError(f"{file}: {key!r} must be a number, not {config[key]!r}.")
    for key in ("rank_pattern", "alpha_pattern"):
        if not isinstance(config.get(key) or {}, dict):
            raise ValueError(f"{file}: {key!r} must be an object of module-name patterns.")
    for key, value in config.items():
        if key in _METADATA_KEYS or key in _USED_KEYS or value in _NEUTRAL:
            continue
        why = _WHY_UNSUPPORTED.get(key, "this loader does not know the setting")
        raise ValueError(f"{file}: {key}={value!r} cannot be loaded: {why}.")
    return config


def _pattern_value(patterns: dict[str, Any], name: str, default: Any) -> Any:
    r"""PEFT's ``get_pattern_key``: the first key that matches ``(.*\.)?key$`` of ``name``."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", name):
            return value
    return default


def _check_tensor_keys(tensors: dict[str, np.ndarray], file: str) -> list[str]:
    """Returns the module names with LoRA A/B pairs; any other tensor is an error naming it."""
    names = []
    for key in sorted(tensors):
        body = key.removeprefix(_PREFIX)
        if body.endswith(".lora_A.weight"):
            name = body[: -len(".lora_A.weight")]
            if f"{_PREFIX}{name}.lora_B.weight" not in tensors:
                raise ValueError(f"{file}: {key!r} has no matching lora_B.weight.")
            names.append(name)
        elif body.endswith(".lora_B.weight"):
            if f"{_PREFIX}{body[: -len('.lora_B.weight')]}.lora_A.weight" not in tensors:
                raise ValueError(f"{file}: {key!r} has no matching lora_A.weight.")
        elif "lora_magnitude_vector" in body:
            raise ValueError(f"{file}: {key!r} is a DoRA magnitude vector; DoRA is not supported.")
        elif "lora_embedding_" in body:
            raise ValueError(
                f"{file}: {key!r} is an embedding LoRA factor; embedding LoRA is not supported."
            )
        else:
            raise ValueError(
                f"{file}: tensor {key!r} is not a LoRA factor (a bias, a module to save, ...); "
                "only lora_A/lora_B weights load."
            )
    if not names:
        raise ValueError(f"{file} holds no lora_A/lora_B tensors.")
    return names


def _takes_layer(module_name: Callable[..., str]) -> bool:
    """Whether ``module_name(path, layer)`` is a valid call (a name map for stacked layers)."""
    try:
        inspect.signature(module_name).bind("path", 0)
    except TypeError:
        return False
    except ValueError:  # no signature (a builtin): try it
        return True
    return True


def _numpy(x: jax.Array) -> np.ndarray:
    x = np.asarray(x)
    return x.astype(np.float32) if x.dtype not in (np.float16, np.float32, np.float64) else x


def save_peft(
    directory: str | os.PathLike,
    adapters: AdapterSet | dict[str, AdapterSet],
    *,
    module_name: Callable[..., str],
    base_model: str = "",
    task_type: str | None = None,
) -> list[str]:
    """Writes LoRA adapters in PEFT's format so ``PeftModel.from_pretrained`` can load them.

    Args:
      directory: created if missing; ``adapter_model.safetensors`` and ``adapter_config.json`` go
        there. For named sets, one sub-directory per name (``directory/<name>/``), as PEFT's
        ``save_pretrained`` writes extra adapters; load each with ``PeftModel.from_pretrained(
        model, directory/<name>, adapter_name=<name>)``.
      adapters: one adapter set from :func:`lowrank_jax.adapters.init` (LoRA kind; factors with
        at most one stacked layer axis), or named sets ``{name: set}`` as
        :func:`lowrank_jax.adapters.adapt` takes them.
      module_name: maps our kernel path to the PyTorch module name, e.g. ``params/encoder/layer_0/
        attention/query/kernel`` -> ``encoder.layer.0.attention.self.query``. For adapters
        stacked on a layer axis it is called as ``module_name(path, layer)`` for each layer
        index, e.g. ``models.hf_module_name`` (``model.layers.<layer>.self_attn.q_proj``).
      base_model: ``base_model_name_or_path`` recorded in the config (for MiniLM:
        ``models.MINILM_NAME``).
      task_type: PEFT task type (``None``, ``"SEQ_CLS"``, ...).

    Returns:
      The directories written (one, or one per named set).

    Raises:
      TypeError: an adapter is not LoRA.
      ValueError: stacked adapters with a ``module_name`` that takes no layer index or with more
        than one stacked axis, dropout rates that differ (PEFT has one ``lora_dropout``), or an
        empty set.
    """
    if adapters and all(isinstance(v, dict) for v in adapters.values()):
        return [
            _save_one(os.path.join(directory, str(name)), s, module_name, base_model, task_type)
            for name, s in adapters.items()
        ]
    return [_save_one(directory, adapters, module_name, base_model, task_type)]


def _save_one(
    directory: str | os.PathLike,
    adapters: AdapterSet,
    module_name: Callable[..., str],
    base_model: str,
    task_type: str | None,
) -> str:
    if not adapters:
        raise ValueError("save_peft got an empty adapter set; nothing to write.")
    tensors, ranks, alphas, dropouts, rslora = {}, {}, {}, set(), set()
    for path, adapter in adapters.items():
        if not isinstance(adapter, Adapter) or not isinstance(adapter.kind, LoRA):
            kind = type(getattr(adapter, "kind", adapter)).__name__
            raise TypeError(f"{path!r} is a {kind}; PEFT export is LoRA only.")
        a, b = _numpy(adapter.factors["a"]), _numpy(adapter.factors["b"])
        if a.ndim == 2:
            per_module = {module_name(path): (a, b)}
        elif a.ndim == 3 and _takes_layer(module_name):
            per_module = {module_name(path, i): (a[i], b[i]) for i in range(a.shape[0])}
        else:
            raise ValueError(
                f"{path!r} is stacked (nn.scan) with factor shape {a.shape}: PEFT export needs "
                "one stacked layer axis and a module_name(path, layer) that names each layer's "
                "module (e.g. models.hf_module_name), or unstacked layers."
            )
        kind = adapter.kind
        for name, (a_i, b_i) in per_module.items():
            tensors[f"{_PREFIX}{name}.lora_A.weight"] = a_i.T.copy()
            tensors[f"{_PREFIX}{name}.lora_B.weight"] = b_i.T.copy()
            ranks[name] = kind.rank
            alphas[name] = float(kind.rank if kind.alpha is None else kind.alpha)
        dropouts.add(kind.dropout)
        rslora.add(kind.rslora)
    if len(dropouts) > 1 or len(rslora) > 1:
        raise ValueError(
            "PEFT has one lora_dropout and one use_rslora per adapter; make them equal."
        )
    r = max(set(ranks.values()), key=list(ranks.values()).count)
    alpha = max(set(alphas.values()), key=list(alphas.values()).count)
    config = {
        "peft_type": "LORA",
        "task_type": task_type,
        "base_model_name_or_path": base_model,
        "r": r,
        "lora_alpha": alpha,
        "lora_dropout": dropouts.pop() if dropouts else 0.0,
        "use_rslora": rslora.pop() if rslora else False,
        "target_modules": sorted(ranks),
        "rank_pattern": {k: v for k, v in ranks.items() if v != r},
        "alpha_pattern": {k: v for k, v in alphas.items() if v != alpha},
        "bias": "none",
        "fan_in_fan_out": False,
        "init_lora_weights": True,
        "modules_to_save": None,
        "inference_mode": True,
    }
    os.makedirs(directory, exist_ok=True)
    save_file(tensors, os.path.join(directory, WEIGHTS_NAME), metadata={"format": "pt"})
    with open(os.path.join(directory, CONFIG_NAME), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
    return str(directory)


def _adapter_from_peft(
    path: str,
    layers: dict[int | None, tuple],
    kernel: Any,
    spec: Any,
    config: dict[str, Any],
    dtype: Any,
) -> Adapter:
    """One ``Adapter`` from the PEFT modules of one kernel: a single module (``layers`` keyed by
    ``None``) or one per layer of a stacked kernel (keyed by layer index; absent layers get zero
    factors, i.e. no update, as PEFT's ``layers_to_transform`` leaves them)."""
    stacked = None not in layers
    if not stacked and len(layers) > 1:
        raise ValueError(f"{path!r} gets both a whole-kernel module and per-layer modules.")
    settings = {(v[3], v[4]) for v in layers.values()}
    if len(settings) > 1:
        raise ValueError(
            f"the layers of {path!r} have different (rank, alpha) {sorted(settings)} in the PEFT "
            "config; a stacked adapter has one rank and alpha for all its layers."
        )
    rank, alpha = settings.pop()
    in_ndim, out_ndim = getattr(spec, "in_ndim", None), getattr(spec, "out_ndim", None)
    if stacked and in_ndim is None and out_ndim is None:
        in_ndim = out_ndim = 1  # (L, n, m): one matrix per layer
    kind = LoRA(
        rank=rank,
        alpha=alpha,
        rslora=bool(config.get("use_rslora", False)),
        dropout=float(config.get("lora_dropout", 0.0)),
        in_ndim=in_ndim,
        out_ndim=out_ndim,
    )
    shape = tuple(kernel.shape)
    i, o = resolve_layout(kind, shape, path)
    stack, n, m = split_shape(shape, i, o)
    if len(stack) != (1 if stacked else 0):
        raise ValueError(
            f"{path!r} has shape {shape} ({len(stack)} stacked axes) but the PEFT modules map to "
            f"it {'per layer' if stacked else 'as one matrix'}; module_path must return "
            "(path, layer) exactly for the layers of a kernel with one stacked axis."
        )
    for name, a, b, *_ in layers.values():
        if a.shape != (n, rank) or b.shape != (rank, m):
            raise ValueError(
                f"PEFT tensors for {name!r} have shapes A{a.shape[::-1]}, B{b.shape[::-1]}; the "
                f"kernel {path!r} {shape} needs A({rank}, {n}) and B({m}, {rank})."
            )
    if not stacked:
        _, a, b, *_ = layers[None]
    else:
        bad = sorted(k for k in layers if not 0 <= k < stack[0])
        if bad:
            raise ValueError(f"layers {bad} of {path!r} do not exist (it has {stack[0]}).")
        first = next(iter(layers.values()))
        a = np.zeros((stack[0], n, rank), first[1].dtype)
        b = np.zeros((stack[0], rank, m), first[2].dtype)
        for k, (_, a_k, b_k, *_) in layers.items():
            a[k], b[k] = a_k, b_k
    factors = {"a": jnp.asarray(a, dtype), "b": jnp.asarray(b, dtype)}
    return Adapter(factors=factors, kind=kind, in_ndim=i, out_ndim=o, matrix=(n, m))


def load_peft(
    directory: str | os.PathLike,
    params: Any,
    *,
    module_path: Callable[[str], str | tuple[str, int | None]],
    dtype: Any = None,
    rules: paths.Rules | None = None,
) -> AdapterSet:
    """Reads a PEFT LoRA adapter into an adapter set for ``params``; the mirror of `save_peft`.

    Args:
      directory: holds ``adapter_model.safetensors`` and ``adapter_config.json``.
      params: the parameter pytree to adapt (kernel shapes are checked against the tensors).
      module_path: maps a PyTorch module name to our kernel path: the inverse of ``save_peft``'s
        ``module_name`` (for MiniLM: ``models.flax_path_from_peft``). It may return ``(path,
        layer)`` for one layer of a kernel stacked on a layer axis (``(path, None)``: a whole
        kernel), e.g. ``models.path_from_hf_module``; the layers' factors are stacked on that
        axis, and layers PEFT did not adapt get zero factors.
      dtype: dtype of the factors (default: as stored).
      rules: only needed for kernels that are not 2-D, to give their ``in_ndim``/``out_ndim``.

    Returns:
      ``{path: Adapter}`` equal to what was saved.

    Raises:
      FileNotFoundError: a file is missing.
      ValueError: not a LoRA adapter; a config that is not valid JSON, lacks ``r`` or
        ``lora_alpha``, or sets something this loader cannot honour (DoRA, bias training,
        modules to save, ...: the message names the key); a tensor that is not a LoRA factor
        (DoRA magnitudes, embedding LoRA, biases); a module that maps to no kernel; shapes
        that disagree; or layers of one stacked kernel with different ranks or alphas.

    Example:
      >>> lora = load_peft("out/", variables, module_path=models.flax_path_from_peft)  # doctest: +SKIP
    """
    config = _read_config(directory)
    file = os.path.join(directory, WEIGHTS_NAME)
    if not os.path.isfile(file):
        raise FileNotFoundError(f"{file} does not exist: not a PEFT adapter directory.")
    tensors = load_file(file)
    names = _check_tensor_keys(tensors, file)
    kernels = paths.named_leaves(params)
    layouts = (
        {p: spec for p, (_, spec) in paths.match_rules(params, rules).items()} if rules else {}
    )
    found: dict[str, dict[int | None, tuple]] = {}
    for name in names:
        target = module_path(name)
        path, layer = target if isinstance(target, tuple) else (target, None)
        if path not in kernels:
            raise ValueError(f"PEFT module {name!r} maps to {path!r}, which is not in params.")
        if layer in found.get(path, {}):
            raise ValueError(f"PEFT modules {found[path][layer][0]!r} and {name!r} both map to "
                             f"{path!r}{'' if layer is None else f' layer {layer}'}.")  # fmt: skip
        rank = _pattern_value(config.get("rank_pattern") or {}, name, config["r"])
        alpha = _pattern_value(config.get("alpha_pattern") or {}, name, config["lora_alpha"])
        a = tensors[f"{_PREFIX}{name}.lora_A.weight"].T
        b = tensors[f"{_PREFIX}{name}.lora_B.weight"].T
        found.setdefault(path, {})[layer] = (name, a, b, int(rank), float(alpha))
    out: AdapterSet = {}
    for path, layers in found.items():
        spec = layouts.get(path)
        out[path] = _adapter_from_peft(path, layers, kernels[path], spec, config, dtype)
    return out
