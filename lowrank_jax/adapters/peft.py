"""PEFT interop: LoRA adapters as ``adapter_model.safetensors`` + ``adapter_config.json``.

PyTorch PEFT stores, for each adapted ``nn.Linear`` named ``<module>``, the tensors
``base_model.model.<module>.lora_A.weight`` of shape ``(r, in)`` and ``...lora_B.weight`` of shape
``(out, r)``, with ``ΔW_torch = (lora_alpha / r) · B_peft A_peft`` of shape ``(out, in)``. Our kernels
are ``(in, out)`` and our factors ``a: (n, r)``, ``b: (r, m)``, so ``A_peft = aᵀ`` and ``B_peft = bᵀ``.
Module names come from a user-supplied map (for the MiniLM BERT of :mod:`lowrank_jax.models`, its
``peft_module_name`` / ``flax_path_from_peft``). No pickle is read or written.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from safetensors.numpy import load_file, save_file

from lowrank_jax.adapters import paths
from lowrank_jax.adapters.core import Adapter, AdapterSet, resolve_layout
from lowrank_jax.adapters.kinds import LoRA

WEIGHTS_NAME = "adapter_model.safetensors"
CONFIG_NAME = "adapter_config.json"
_PREFIX = "base_model.model."


def _numpy(x: jax.Array) -> np.ndarray:
    x = np.asarray(x)
    return x.astype(np.float32) if x.dtype not in (np.float16, np.float32, np.float64) else x


def save_peft(
    directory: str | os.PathLike,
    adapters: AdapterSet,
    *,
    module_name: Callable[[str], str],
    base_model: str = "",
    task_type: str | None = None,
) -> None:
    """Writes LoRA adapters in PEFT's format so ``PeftModel.from_pretrained`` can load them.

    Args:
      directory: created if missing; ``adapter_model.safetensors`` and ``adapter_config.json`` go
        there.
      adapters: one adapter set from :func:`lowrank_jax.adapters.init` (LoRA kind, no stacked
        layers: unstack ``nn.scan`` kernels first).
      module_name: maps our kernel path to the PyTorch module name, e.g. ``params/encoder/layer_0/
        attention/query/kernel`` -> ``encoder.layer.0.attention.self.query``.
      base_model: ``base_model_name_or_path`` recorded in the config.
      task_type: PEFT task type (``None``, ``"SEQ_CLS"``, ...).

    Raises:
      TypeError: an adapter is not LoRA.
      ValueError: stacked adapters, or dropout rates that differ (PEFT has one ``lora_dropout``).
    """
    tensors, ranks, alphas, dropouts, rslora = {}, {}, {}, set(), set()
    for path, adapter in adapters.items():
        if not isinstance(adapter.kind, LoRA):
            raise TypeError(
                f"{path!r} is a {type(adapter.kind).__name__}; PEFT export is LoRA only."
            )
        if adapter.factors["a"].ndim != 2:
            raise ValueError(
                f"{path!r} is stacked (nn.scan); unstack the layers to export to PEFT."
            )
        name = module_name(path)
        tensors[f"{_PREFIX}{name}.lora_A.weight"] = _numpy(adapter.factors["a"]).T.copy()
        tensors[f"{_PREFIX}{name}.lora_B.weight"] = _numpy(adapter.factors["b"]).T.copy()
        kind = adapter.kind
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


def load_peft(
    directory: str | os.PathLike,
    params: Any,
    *,
    path_for_module: Callable[[str], str],
    dtype: Any = None,
    rules: paths.Rules | None = None,
) -> AdapterSet:
    """Reads a PEFT LoRA adapter into an adapter set for ``params``.

    Args:
      directory: holds ``adapter_model.safetensors`` and ``adapter_config.json``.
      params: the parameter pytree to adapt (kernel shapes are checked against the tensors).
      path_for_module: the inverse of ``save_peft``'s ``module_name``.
      dtype: dtype of the factors (default: as stored).
      rules: only needed for kernels that are not 2-D, to give their ``in_ndim``/``out_ndim``.

    Returns:
      ``{path: Adapter}`` equal to what was saved.

    Raises:
      ValueError: not a LoRA adapter, a module that maps to no kernel, or shapes that disagree.
    """
    with open(os.path.join(directory, CONFIG_NAME)) as f:
        config = json.load(f)
    if config.get("peft_type") != "LORA":
        raise ValueError(f"{directory} holds a {config.get('peft_type')} adapter; only LORA loads.")
    tensors = load_file(os.path.join(directory, WEIGHTS_NAME))
    kernels = paths.named_leaves(params)
    layouts = (
        {p: spec for p, (_, spec) in paths.match_rules(params, rules).items()} if rules else {}
    )
    out: AdapterSet = {}
    for key in sorted(tensors):
        if not key.endswith(".lora_A.weight"):
            continue
        name = key[len(_PREFIX) : -len(".lora_A.weight")]
        path = path_for_module(name)
        if path not in kernels:
            raise ValueError(f"PEFT module {name!r} maps to {path!r}, which is not in params.")
        a = tensors[key].T
        b = tensors[f"{_PREFIX}{name}.lora_B.weight"].T
        rank = config.get("rank_pattern", {}).get(name, config["r"])
        alpha = config.get("alpha_pattern", {}).get(name, config["lora_alpha"])
        spec = layouts.get(path)
        kind = LoRA(
            rank=int(rank),
            alpha=float(alpha),
            rslora=bool(config.get("use_rslora", False)),
            dropout=float(config.get("lora_dropout", 0.0)),
            in_ndim=getattr(spec, "in_ndim", None),
            out_ndim=getattr(spec, "out_ndim", None),
        )
        shape = tuple(kernels[path].shape)
        i, o = resolve_layout(kind, shape, path)
        n, m = int(np.prod(shape[:i])), int(np.prod(shape[i:]))
        if a.shape != (n, kind.rank) or b.shape != (kind.rank, m):
            raise ValueError(
                f"PEFT tensors for {name!r} have shapes A{a.shape[::-1]}, B{b.shape[::-1]}; the "
                f"kernel {path!r} {shape} needs A({kind.rank}, {n}) and B({m}, {kind.rank})."
            )
        factors = {"a": jnp.asarray(a, dtype), "b": jnp.asarray(b, dtype)}
        out[path] = Adapter(factors=factors, kind=kind, in_ndim=i, out_ndim=o, matrix=(n, m))
    if not out:
        raise ValueError(f"{directory}/{WEIGHTS_NAME} holds no lora_A/lora_B tensors.")
    return out
