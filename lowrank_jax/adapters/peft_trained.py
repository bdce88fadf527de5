r"""PEFT's trained base parameters: ``bias="lora_only"``/``"all"`` and ``modules_to_save``.

Besides the LoRA factors, a PEFT adapter file may hold full parameters trained next to them:

* ``bias="lora_only"``: the biases of the LoRA-wrapped modules, ``<module>.base_layer.bias``;
* ``bias="all"``: also every other bias, ``<module>.bias``;
* ``modules_to_save``: trainable copies of whole modules, ``<module>.weight`` / ``<module>.bias``
  (with ``bias="all"`` PEFT also writes ``<module>.modules_to_save.bias``, the same copy, and
  ``<module>.original_module.bias``, the frozen original, which the adapted model does not use).
  A module to save may be a parent of the tensors' modules (``["pooler"]`` saves
  ``pooler.dense.weight``), as in PEFT; we save the modules that hold the trained leaves
  (``["pooler.dense"]``), which PEFT loads to the same model.

Here they are one *trained* pytree with the structure of ``params`` and ``None`` wherever the base
parameter is kept, the format of :func:`lowrank_jax.adapters.split_trainable`:
``combine(trained, params)`` is the adapted model's base, and ``jax.grad`` with respect to
``(adapters, trained)`` trains both, as PEFT's trainable copies are trained. Names map through the
user's module map (``module_path(name)`` is the path of the module's main parameter: a kernel,
a LayerNorm ``scale`` or an ``embedding``; its ``bias`` is the sibling ``bias``). A PyTorch
``weight`` is converted by our name: a 2-D ``kernel`` is transposed, a convolution kernel
``(out, in, *window)`` becomes flax's ``(*window, in, out)``, anything else is copied.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from lowrank_jax.adapters import paths

__all__ = [
    "load_trained",
    "save_trained",
    "split_key",
]

_ROLES = ("base_layer", "modules_to_save", "original_module")


def split_key(body: str) -> tuple[str, str, str]:
    """``"<module>[.<role>].<leaf>"`` -> ``(module, role, leaf)``, role ``""`` when absent.

    A module to save that is a parent of the tensor's module (``modules_to_save=["pooler"]``
    for ``pooler.dense.bias``) puts the role in the middle: ``pooler.original_module.dense.bias``
    and ``pooler.modules_to_save.<adapter>.dense.bias`` (PEFT removes the adapter name only when
    it comes just before the leaf) are ``("pooler.dense", role, "bias")``.
    """
    module, leaf = body.rsplit(".", 1) if "." in body else ("", body)
    parts = module.split(".")
    for i, part in enumerate(parts[1:], start=1):
        if part in _ROLES:
            rest = parts[i + 1 :]
            if part == "modules_to_save" and rest:
                rest = rest[1:]  # the adapter name
            return ".".join(parts[:i] + rest), part, leaf
    return module, "", leaf


def _to_ours(value: np.ndarray, name: str) -> np.ndarray:
    if name != "kernel" or value.ndim < 2:
        return value
    return np.transpose(value, (*range(2, value.ndim), 1, 0))  # (out, in, *w) -> (*w, in, out)


def _to_torch(value: np.ndarray, name: str) -> np.ndarray:
    if name != "kernel" or value.ndim < 2:
        return value
    nd = value.ndim
    return np.ascontiguousarray(np.transpose(value, (nd - 1, nd - 2, *range(nd - 2))))


def _in_list(module: str, targets: Any) -> bool:
    """PEFT's module match for ``modules_to_save``: the name or a dotted suffix of it, of the
    module or of one of its parents (PEFT saves a whole parent module, e.g. ``pooler`` for the
    tensors of ``pooler.dense``)."""
    parts = module.split(".")
    names = [".".join(parts[:i]) for i in range(len(parts), 0, -1)]
    return any(n == t or n.endswith("." + t) for n in names for t in targets or ())


def _leaf_path(module: str, leaf: str, module_path: Callable, leaves: dict, file: str) -> str:
    target = module_path(module)
    main, layer = target if isinstance(target, tuple) else (target, None)
    if layer is not None:
        raise ValueError(
            f"{file}: {module!r} is one layer of a stacked kernel; trained biases and modules to "
            "save load for unstacked parameters only."
        )
    if leaf == "weight":
        path = main
    elif leaf == "bias":
        path = main.rsplit("/", 1)[0] + "/bias"
    else:
        raise ValueError(f"{file}: {module}.{leaf} is not a weight or a bias.")
    if path not in leaves:
        raise ValueError(f"{file}: PEFT tensor {module}.{leaf} maps to {path!r}, not in params.")
    return path


def load_trained(
    tensors: dict[str, np.ndarray],
    params: Any,
    module_path: Callable,
    config: dict[str, Any],
    adapted: set[str],
    file: str,
) -> Any:
    """The trained tree from the non-LoRA tensors of a PEFT file (keys without the prefix).

    Raises:
      ValueError: a tensor that the config's ``bias``/``modules_to_save`` does not explain, one
        that maps to no parameter or to one of another shape, or two copies that differ.
    """
    bias, saved = config.get("bias") or "none", config.get("modules_to_save") or []
    leaves = paths.named_leaves(params)
    values: dict[str, np.ndarray] = {}
    for body in sorted(tensors):
        module, role, leaf = split_key(body)
        if role == "original_module":
            continue  # the frozen original next to a trainable copy: not used by the model
        is_saved = _in_list(module, saved)
        if role == "base_layer":
            ok = leaf == "bias" and bias in ("lora_only", "all") and module in adapted
        elif role == "modules_to_save":
            ok = is_saved
        else:
            ok = is_saved or (leaf == "bias" and bias == "all" and module not in adapted)
        if not ok:
            raise ValueError(
                f"{file}: tensor {body!r} is not a LoRA factor, and the config (bias={bias!r}, "
                f"modules_to_save={saved!r}) does not say it is a trained bias or module."
            )
        path = _leaf_path(module, leaf, module_path, leaves, file)
        value = _to_ours(np.asarray(tensors[body]), path.rsplit("/", 1)[-1])
        if tuple(value.shape) != tuple(leaves[path].shape):
            raise ValueError(
                f"{file}: {body!r} has shape {value.shape} as {path!r}, which has shape "
                f"{tuple(leaves[path].shape)}."
            )
        if path in values and not np.array_equal(values[path], value):
            raise ValueError(f"{file}: two different copies of {path!r} ({body!r}).")
        values[path] = value

    def pick(keypath, leaf):
        value = values.get(paths.path_to_str(keypath))
        return None if value is None else jax.numpy.asarray(value, leaf.dtype)

    return jax.tree_util.tree_map_with_path(pick, params, is_leaf=paths.is_param_leaf)


def save_trained(
    trained: Any, params: Any, module_name: Callable, adapted: set[str]
) -> tuple[dict[str, np.ndarray], str, list[str]]:
    """PEFT tensors (keys without the prefix), ``bias`` mode and ``modules_to_save`` of a trained tree.

    A module whose main parameter (kernel, scale, embedding) is trained is a module to save (all
    its trained leaves are written); a trained bias of a LoRA module is ``bias="lora_only"``; a
    trained bias of any other module makes it ``bias="all"``.

    Raises:
      ValueError: a trained leaf that is not in ``params``, not a module's main parameter or bias,
        or the main parameter of a module that also carries LoRA.
    """
    leaves = paths.named_leaves(params)
    chosen = paths.named_leaves(trained)
    mains: dict[str, str] = {}  # our module prefix -> path of its main parameter
    for path in leaves:
        prefix, name = path.rsplit("/", 1) if "/" in path else ("", path)
        if name != "bias":
            try:
                module_name(path)
            except (ValueError, KeyError):
                continue
            mains.setdefault(prefix, path)
    tensors: dict[str, np.ndarray] = {}
    saved: list[str] = []
    bias_mode = "none"
    for path, value in chosen.items():
        if path not in leaves:
            raise ValueError(f"the trained parameter {path!r} is not in params.")
        prefix, name = path.rsplit("/", 1) if "/" in path else ("", path)
        if prefix not in mains:
            raise ValueError(
                f"the trained parameter {path!r} belongs to no module that module_name names."
            )
        module = module_name(mains[prefix])
        whole = mains[prefix] in chosen
        if whole and module in adapted:
            raise ValueError(f"{module!r} carries LoRA and cannot also be a module to save.")
        value = _to_torch(np.asarray(value, np.float32), name)
        if whole:
            saved += [] if module in saved else [module]
            tensors[f"{module}.{'bias' if name == 'bias' else 'weight'}"] = value
        elif name == "bias" and module in adapted:
            tensors[f"{module}.base_layer.bias"] = value
            bias_mode = "all" if bias_mode == "all" else "lora_only"
        elif name == "bias":
            tensors[f"{module}.bias"] = value
            bias_mode = "all"
        else:
            raise ValueError(f"{path!r} is not a module's main parameter or its bias.")
    return tensors, bias_mode, sorted(saved)
