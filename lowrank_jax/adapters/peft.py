r"""PEFT interop: LoRA adapters as ``adapter_model.safetensors`` + ``adapter_config.json``.

PyTorch PEFT stores, for each adapted ``nn.Linear`` named ``<module>``, the tensors
``base_model.model.<module>.lora_A.weight`` of shape ``(r, in)`` and ``...lora_B.weight`` of shape
``(out, r)``, with ``ΔW_torch = (lora_alpha / r) · B_peft A_peft`` of shape ``(out, in)``. Our kernels
are ``(in, out)`` and our factors ``a: (n, r)``, ``b: (r, m)``, so ``A_peft = aᵀ`` and ``B_peft = bᵀ``.
Module names come from a user-supplied map (for the MiniLM BERT of :mod:`lowrank_jax.models`, its
``bert_module_name`` / ``bert_path_from_module``). A kernel stacked on a layer axis (``nn.scan``,
``(L, n, m)``) is L PyTorch modules: the map then takes the layer index too
(``module_name(path, layer)``, and ``module_path(name) -> (path, layer)``), as
``models.decoder_module_name`` / ``models.decoder_path_from_module`` do for the decoder family, and the
per-layer factors are stacked back on the layer axis. No pickle is read or written.

Besides ``nn.Linear`` LoRA, the format covers (both ways):

* **DoRA** (``use_dora=True``): ``<module>.lora_magnitude_vector`` ``(out,)`` is the factor ``m`` of
  :class:`lowrank_jax.adapters.DoRA`;
* **embedding LoRA**: ``<module>.lora_embedding_A`` ``(r, vocab)`` and ``lora_embedding_B``
  ``(dim, r)`` are ``aᵀ``, ``bᵀ`` of a LoRA on the ``(vocab, dim)`` table (our path ends in
  ``/embedding``); ``ΔE = s·a b``;
* **convolution LoRA** (Conv1d/2d; Conv3d takes the same path): ``lora_A.weight`` ``(r, in, *window)`` is ``a`` reshaped from
  flax's kernel layout ``(*window, in, r)``, ``lora_B.weight`` ``(out, r, 1, ...)`` is ``bᵀ``;
* **trained biases and modules** (``bias="lora_only"``/``"all"``, ``modules_to_save``): a *trained*
  tree, see :mod:`lowrank_jax.adapters.peft_trained` (``load_peft(..., with_trained=True)``,
  ``save_peft(..., trained=...)``).

Loading is strict: every tensor of the file and every setting of ``adapter_config.json`` that would
change the adapted model is either used or refused with an error naming it (``lora_bias``,
``trainable_token_indices``, DoRA on an embedding or convolution, ...), never silently dropped. ``rank_pattern``/``alpha_pattern`` keys match a
module name as PEFT matches them: the key is a regular expression for the name's dotted suffix,
``(.*\.)?key$``, and the first matching key wins.
"""

from __future__ import annotations

import inspect
import json
import os
import re
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from safetensors.numpy import save_file

from lowrank_jax.adapters import paths, peft_layout, peft_trained
from lowrank_jax.adapters.core import Adapter, AdapterSet, resolve_layout, split_shape
from lowrank_jax.adapters.dora import DoRA
from lowrank_jax.adapters.kinds import LoRA
from lowrank_jax.checkpoint_files import load_safetensors

__all__ = [
    "CONFIG_NAME",
    "WEIGHTS_NAME",
    "load_peft",
    "save_peft",
]

WEIGHTS_NAME = "adapter_model.safetensors"
CONFIG_NAME = "adapter_config.json"
_PREFIX = peft_layout.PREFIX
# a kind's peft_layout -> its factors written as lora_A, lora_B (and lora_magnitude_vector)
_PEFT_FACTORS = {"lora": ("a", "b"), "dora": ("a", "b", "m")}

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
    {"r", "lora_alpha", "lora_dropout", "use_rslora", "rank_pattern", "alpha_pattern", "use_dora",
     "bias", "modules_to_save"}
)  # fmt: skip
# Keys that change the model and are not supported: allowed only at their neutral value.
_WHY_UNSUPPORTED = {
    "lora_bias": "LoRA bias terms (lora_B with a bias) are not supported",
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
    if config.get("bias", "none") not in ("none", "lora_only", "all"):
        raise ValueError(
            f"{file}: bias={config['bias']!r}; PEFT's values are none, lora_only, all."
        )
    saved = config.get("modules_to_save") or []
    if not isinstance(saved, list) or not all(isinstance(m, str) for m in saved):
        raise ValueError(f"{file}: modules_to_save must be a list of module names, not {saved!r}.")
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


def _check_targets(config: dict[str, Any], modules: list[str], file: str) -> None:
    """Refuses ``target_modules`` that match none of the adapter's modules, as PEFT refuses
    targets that match no module ("Target modules ... not found in the base model")."""
    targets = config.get("target_modules")
    if targets is None or targets == "all-linear":  # PEFT picks the modules by model type
        return
    if isinstance(targets, str):
        matches = lambda name: re.fullmatch(targets, name) is not None  # noqa: E731
    else:
        matches = lambda name: any(name == t or name.endswith("." + t) for t in targets)  # noqa: E731
    if not any(matches(name) for name in modules):
        shown = ", ".join(repr(m) for m in modules[:6]) + (" ..." if len(modules) > 6 else "")
        raise ValueError(
            f"{file}: target_modules={targets!r} match none of the adapter's modules ({shown}); "
            "PEFT refuses such an adapter: set target_modules to names (or dotted suffixes) of "
            "these modules."
        )


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
    params: Any = None,
    trained: Any = None,
    conv_paths: str | Sequence[str] | None = None,
) -> list[str]:
    """Writes LoRA/DoRA adapters in PEFT's format so ``PeftModel.from_pretrained`` can load them.

    Args:
      directory: created if missing; ``adapter_model.safetensors`` and ``adapter_config.json`` go
        there. For named sets, one sub-directory per name (``directory/<name>/``), as PEFT's
        ``save_pretrained`` writes extra adapters; load each with ``PeftModel.from_pretrained(
        model, directory/<name>, adapter_name=<name>)``.
      adapters: one adapter set from :func:`lowrank_jax.adapters.init` (all :class:`LoRA` or all
        :class:`DoRA`; factors with at most one stacked layer axis), or named sets
        ``{name: set}`` as :func:`lowrank_jax.adapters.adapt` takes them. A LoRA on a path that
        ends in ``/embedding`` is written as PEFT's embedding LoRA.
      module_name: maps our kernel path to the PyTorch module name, e.g. ``params/encoder/layer_0/
        attention/query/kernel`` -> ``encoder.layer.0.attention.self.query``. For adapters
        stacked on a layer axis it is called as ``module_name(path, layer)`` for each layer
        index, e.g. ``models.decoder_module_name`` (``model.layers.<layer>.self_attn.q_proj``).
      base_model: ``base_model_name_or_path`` recorded in the config (for MiniLM:
        ``models.MINILM_NAME``).
      task_type: PEFT task type (``None``, ``"SEQ_CLS"``, ...).
      params: the parameter pytree; needed with ``trained`` and for convolutions: with it, an
        unstacked kernel of 3 to 5 axes whose adapter reads all but the last as inputs (flax's
        ``nn.Conv`` layout ``(*window, in, out)``) is written as a PyTorch convolution's LoRA.
      trained: trained biases and modules, a tree shaped like ``params`` with ``None`` elsewhere
        (from :func:`lowrank_jax.adapters.split_trainable` or ``load_peft(..., with_trained=True)``);
        written as ``bias="lora_only"``/``"all"`` tensors and ``modules_to_save``.
      conv_paths: regexes (``re.fullmatch``) of the kernels that are convolutions; ``None`` (the
        default) takes every kernel of the shape above as one. A ``DenseGeneral`` kernel of the
        same shape, such as flax attention's out-projection ``(heads, head_dim, features)``,
        cannot be told from a convolution by its shape: pass ``conv_paths=()`` (or the conv
        layers' paths) to write it as the ``nn.Linear`` LoRA that PyTorch's attention has.

    Returns:
      The directories written (one, or one per named set).

    Raises:
      OSError: ``directory`` cannot be created or written (one line naming it).
      TypeError: an adapter is neither LoRA nor DoRA.
      ValueError: ``conv_paths`` without ``params``, or with a pattern that matches no adapted
        kernel; a set that mixes LoRA and DoRA (PEFT has one ``use_dora``), stacked adapters
        with a ``module_name`` that takes no layer index or with more than one stacked axis,
        dropout rates that differ (PEFT has one ``lora_dropout``), ``trained`` without
        ``params``, a trained leaf no module owns, or an empty set.
    """
    if trained is not None and params is None:
        raise ValueError("save_peft(..., trained=...) needs params= to name the trained leaves.")
    named = bool(adapters) and all(isinstance(v, dict) for v in adapters.values())
    sets = adapters if named else {"": adapters}
    conv = [conv_paths] if isinstance(conv_paths, str) else conv_paths
    if conv is not None:
        if params is None:
            raise ValueError("save_peft(..., conv_paths=...) needs params= to see kernel shapes.")
        adapted = {path for s in sets.values() for path in s}
        for pattern in conv:
            if not any(re.fullmatch(pattern, path) for path in adapted):
                raise ValueError(
                    f"save_peft: conv_paths pattern {pattern!r} matches no adapted kernel; "
                    f"the adapted paths are {sorted(adapted)}."
                )

    def write(d, s):
        return _save_one(d, s, module_name, base_model, task_type, params, trained, conv)

    if named:
        return [write(os.path.join(directory, str(name)), s) for name, s in sets.items()]
    return [write(directory, adapters)]


def _save_one(
    directory: str | os.PathLike,
    adapters: AdapterSet,
    module_name: Callable[..., str],
    base_model: str,
    task_type: str | None,
    params: Any,
    trained: Any,
    conv_paths: Sequence[str] | None,
) -> str:
    if not adapters:
        raise ValueError("save_peft got an empty adapter set; nothing to write.")
    kernels = paths.named_leaves(params) if params is not None else {}
    tensors, ranks, alphas, dropouts, rslora, dora = {}, {}, {}, set(), set(), set()
    for path, adapter in adapters.items():
        written = adapter.kind.peft_layout if isinstance(adapter, Adapter) else None
        if written not in _PEFT_FACTORS:
            kind = type(getattr(adapter, "kind", adapter)).__name__
            raise TypeError(
                f"{path!r} is a {kind}, which has no PEFT layout; PEFT export is LoRA and DoRA only."
            )
        kind = adapter.kind  # a kind with a PEFT layout has LoRA's rank, alpha, rslora, dropout
        dora.add(written == "dora")
        names = _PEFT_FACTORS[written]
        f = {k: _numpy(adapter.factors[k]) for k in names}
        if f["a"].ndim == 2:
            per_module = {module_name(path): f}
        elif f["a"].ndim == 3 and _takes_layer(module_name):
            per_module = {
                module_name(path, i): {k: v[i] for k, v in f.items()}
                for i in range(f["a"].shape[0])
            }
        else:
            raise ValueError(
                f"{path!r} is stacked (nn.scan) with factor shape {f['a'].shape}: PEFT export needs "
                "one stacked layer axis and a module_name(path, layer) that names each layer's "
                "module (e.g. models.decoder_module_name), or unstacked layers."
            )
        layout = None
        if path.endswith("/embedding"):
            layout = "embedding"
        elif (
            f["a"].ndim == 2
            and peft_layout.is_conv(path, adapter, kernels)
            and (conv_paths is None or any(re.fullmatch(p, path) for p in conv_paths))
        ):
            layout = tuple(kernels[path].shape)
        for name, f_i in per_module.items():
            tensors.update(
                {
                    _PREFIX + k: v
                    for k, v in peft_layout.module_tensors(name, f_i["a"], f_i["b"], layout).items()
                }
            )
            if "m" in f_i:
                tensors[f"{_PREFIX}{name}.lora_magnitude_vector"] = f_i["m"].copy()
            ranks[name] = kind.rank
            alphas[name] = float(kind.rank if kind.alpha is None else kind.alpha)
        dropouts.add(kind.dropout)
        rslora.add(kind.rslora)
    if len(dropouts) > 1 or len(rslora) > 1:
        raise ValueError(
            "PEFT has one lora_dropout and one use_rslora per adapter; make them equal."
        )
    if len(dora) > 1:
        raise ValueError("PEFT has one use_dora per adapter; save LoRA and DoRA sets apart.")
    bias, saved = "none", None
    if trained is not None:
        extra, bias, saved = peft_trained.save_trained(trained, params, module_name, set(ranks))
        tensors.update({_PREFIX + k: v for k, v in extra.items()})
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
        "use_dora": dora.pop(),
        "target_modules": sorted(ranks),
        "rank_pattern": {k: v for k, v in ranks.items() if v != r},
        "alpha_pattern": {k: v for k, v in alphas.items() if v != alpha},
        "bias": bias,
        "fan_in_fan_out": False,
        "init_lora_weights": True,
        "modules_to_save": saved or None,
        "inference_mode": True,
    }
    try:
        os.makedirs(directory, exist_ok=True)
        save_file(tensors, os.path.join(directory, WEIGHTS_NAME), metadata={"format": "pt"})
        with open(os.path.join(directory, CONFIG_NAME), "w") as f:
            json.dump(config, f, indent=2, sort_keys=True)
    except OSError as e:
        raise type(e)(
            f"save_peft cannot write to {os.fspath(directory)!r} ({e.strerror or e}): pass a "
            "directory you can write to."
        ) from e
    return str(directory)


def _adapter_from_peft(
    path: str,
    layers: dict[int | None, dict[str, Any]],
    kernel: Any,
    spec: Any,
    config: dict[str, Any],
    dtype: Any,
) -> Adapter:
    """One ``Adapter`` from the PEFT modules of one kernel: a single module (``layers`` keyed by
    ``None``) or one per layer of a stacked kernel (keyed by layer index; absent layers get zero
    factors, i.e. no update, as PEFT's ``layers_to_transform`` leaves them; a DoRA magnitude of an
    absent layer is its column norm, which is no update either)."""
    stacked = None not in layers
    if not stacked and len(layers) > 1:
        raise ValueError(f"{path!r} gets both a whole-kernel module and per-layer modules.")
    settings = {(v["rank"], v["alpha"]) for v in layers.values()}
    if len(settings) > 1:
        raise ValueError(
            f"the layers of {path!r} have different (rank, alpha) {sorted(settings)} in the PEFT "
            "config; a stacked adapter has one rank and alpha for all its layers."
        )
    rank, alpha = settings.pop()
    in_ndim, out_ndim = getattr(spec, "in_ndim", None), getattr(spec, "out_ndim", None)
    conv = {v["in_ndim"] for v in layers.values()} - {None}
    if conv:
        in_ndim, out_ndim = conv.pop(), 1
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
    use_dora = bool(config.get("use_dora", False))
    shape = tuple(kernel.shape)
    i, o = resolve_layout(kind, shape, path)
    stack, n, m = split_shape(shape, i, o)
    if len(stack) != (1 if stacked else 0):
        raise ValueError(
            f"{path!r} has shape {shape} ({len(stack)} stacked axes) but the PEFT modules map to "
            f"it {'per layer' if stacked else 'as one matrix'}; module_path must return "
            "(path, layer) exactly for the layers of a kernel with one stacked axis."
        )
    for v in layers.values():
        if v["a"].shape[1] != rank or v["b"].shape[0] != rank:
            raise ValueError(
                f"PEFT tensors for {v['name']!r} have rank {v['a'].shape[1]} (lora_A "
                f"{v['a'].shape[::-1]}) but the config's {v['rank_from']} says rank {rank}: fix "
                f"{CONFIG_NAME} (r, rank_pattern) to match the tensors."
            )
        if v["a"].shape != (n, rank) or v["b"].shape != (rank, m):
            raise ValueError(
                f"PEFT tensors for {v['name']!r} have shapes A{v['a'].shape[::-1]}, "
                f"B{v['b'].shape[::-1]} (as a matrix); the kernel {path!r} {shape} needs "
                f"A({rank}, {n}) and B({m}, {rank})."
            )
        if use_dora and v["m"].shape != (m,):
            raise ValueError(f"{v['name']!r}: lora_magnitude_vector {v['m'].shape}, need ({m},).")
    names = ("a", "b", "m") if use_dora else ("a", "b")
    if not stacked:
        factors = {f: layers[None][f] for f in names}
    else:
        bad = sorted(k for k in layers if not 0 <= k < stack[0])
        if bad:
            raise ValueError(f"layers {bad} of {path!r} do not exist (it has {stack[0]}).")
        first = next(iter(layers.values()))
        factors = {f: np.zeros((stack[0], *first[f].shape), first[f].dtype) for f in names}
        if use_dora:  # absent layers: magnitude = column norm of W, i.e. no update
            matrices = np.asarray(kernel, np.float32).reshape(stack[0], n, m)
            factors["m"][:] = np.linalg.norm(matrices, axis=1)
        for k, v in layers.items():
            for f in names:
                factors[f][k] = v[f]
    factors = {f: jnp.asarray(x, dtype) for f, x in factors.items()}
    return Adapter(
        factors=factors,
        kind=DoRA(lora=kind) if use_dora else kind,
        in_ndim=i,
        out_ndim=o,
        matrix=(n, m),
    )


def load_peft(
    directory: str | os.PathLike,
    params: Any,
    *,
    module_path: Callable[[str], str | tuple[str, int | None]],
    dtype: Any = None,
    rules: paths.Rules | None = None,
    with_trained: bool = False,
) -> AdapterSet | tuple[AdapterSet, Any]:
    """Reads a PEFT LoRA adapter into an adapter set for ``params``; the mirror of `save_peft`.

    Args:
      directory: holds ``adapter_model.safetensors`` and ``adapter_config.json``.
      params: the parameter pytree to adapt (kernel shapes are checked against the tensors).
      module_path: maps a PyTorch module name to our path of the module's kernel (an embedding's
        ``embedding``, a LayerNorm's ``scale``): the inverse of ``save_peft``'s ``module_name``
        (for MiniLM: ``models.bert_path_from_module``). It may return ``(path, layer)`` for one
        layer of a kernel stacked on a layer axis (``(path, None)``: a whole kernel), e.g.
        ``models.decoder_path_from_module``; the layers' factors are stacked on that axis, and layers
        PEFT did not adapt get zero factors.
      dtype: dtype of the factors (default: as stored).
      rules: only needed for kernels that are not 2-D and not convolutions, to give their
        ``in_ndim``/``out_ndim``.
      with_trained: also return the trained biases and modules (``bias="lora_only"``/``"all"``,
        ``modules_to_save``) as a tree shaped like ``params`` with ``None`` elsewhere; required
        when the file holds any (see :mod:`lowrank_jax.adapters.peft_trained`).

    Returns:
      ``{path: Adapter}`` equal to what was saved (:class:`LoRA`, or :class:`DoRA` for
      ``use_dora=True``); with ``with_trained``, ``(adapters, trained)``: the adapted model is
      ``adapt(apply)(combine(trained, params), adapters, ...)``.

    Raises:
      FileNotFoundError: a file is missing.
      ValueError: not a LoRA adapter; a truncated or corrupt tensor file; a config that is not
        valid JSON, lacks ``r`` or ``lora_alpha``, has ``target_modules`` that match none of the
        adapter's modules (PEFT refuses these), gives a rank other than the tensors' (the message
        names ``r`` or ``rank_pattern``), or sets something this loader cannot honour
        (``lora_bias``, trainable tokens, ...: the message names the key); a tensor that the
        config does not explain, or trained tensors without ``with_trained``; DoRA on an
        embedding or convolution; a module that maps to no kernel; shapes that disagree; or
        layers of one stacked kernel with different ranks or alphas.

    Example:
      >>> lora = load_peft("out/", variables, module_path=models.bert_path_from_module)  # doctest: +SKIP
    """
    config = _read_config(directory)
    file = os.path.join(directory, WEIGHTS_NAME)
    if not os.path.isfile(file):
        raise FileNotFoundError(f"{file} does not exist: not a PEFT adapter directory.")
    modules, others = peft_layout.parse_tensors(load_safetensors(file), file)
    _check_targets(config, sorted(modules), os.path.join(directory, CONFIG_NAME))
    if others and not with_trained:
        raise ValueError(
            f"{file} holds trained parameters besides LoRA factors ({sorted(others)[0]!r}, ...: "
            "bias or modules_to_save); pass with_trained=True to get them as (adapters, trained)."
        )
    use_dora = bool(config.get("use_dora", False))
    kernels = paths.named_leaves(params)
    layouts = (
        {p: spec for p, (_, spec) in paths.match_rules(params, rules).items()} if rules else {}
    )
    found: dict[str, dict[int | None, dict[str, Any]]] = {}
    for name, entry in modules.items():
        target = module_path(name)
        path, layer = target if isinstance(target, tuple) else (target, None)
        if path not in kernels:
            raise ValueError(f"PEFT module {name!r} maps to {path!r}, which is not in params.")
        if layer in found.get(path, {}):
            raise ValueError(f"PEFT modules {found[path][layer]['name']!r} and {name!r} both map "
                             f"to {path!r}{'' if layer is None else f' layer {layer}'}.")  # fmt: skip
        pattern = _pattern_value(config.get("rank_pattern") or {}, name, None)
        rank = config["r"] if pattern is None else pattern
        rank_from = f"r={config['r']}" if pattern is None else f"rank_pattern ({pattern} for it)"
        alpha = _pattern_value(config.get("alpha_pattern") or {}, name, config["lora_alpha"])
        found.setdefault(path, {})[layer] = {
            "name": name,
            "rank": int(rank),
            "rank_from": rank_from,
            "alpha": float(alpha),
            **peft_layout.factors_from_peft(entry, name, use_dora, file),
        }
    out: AdapterSet = {}
    for path, layers in found.items():
        spec = layouts.get(path)
        out[path] = _adapter_from_peft(path, layers, kernels[path], spec, config, dtype)
    if not with_trained:
        return out
    trained = peft_trained.load_trained(others, params, module_path, config, set(modules), file)
    return out, trained
