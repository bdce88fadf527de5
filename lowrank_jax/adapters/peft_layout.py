"""PEFT's tensor layouts: which keys are LoRA factors, and our factors from and to them.

One module's LoRA is ``lora_A.weight`` ``(r, n)`` + ``lora_B.weight`` ``(m, r)`` (a linear layer),
the same with ``(r, in, *window)`` and ``(out, r, 1, ...)`` (a convolution),
``lora_embedding_A`` ``(r, vocab)`` + ``lora_embedding_B`` ``(dim, r)`` (an embedding), plus
``lora_magnitude_vector`` ``(m,)`` for DoRA. Ours are ``a: (n, r)``, ``b: (r, m)`` (and ``m``) on
the matrix view of the kernel; a flax convolution kernel ``(*window, in, out)`` has
``n = window·in`` in the kernel's axis order. See :mod:`lowrank_jax.adapters.peft`.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from lowrank_jax.adapters.core import Adapter

__all__ = [
    "FACTOR_KEYS",
    "PREFIX",
    "factors_from_peft",
    "is_conv",
    "module_tensors",
    "parse_tensors",
]

PREFIX = "base_model.model."


FACTOR_KEYS = {
    ".lora_A.weight": "a",
    ".lora_B.weight": "b",
    ".lora_embedding_A": "a",
    ".lora_embedding_B": "b",
    ".lora_magnitude_vector": "m",
}


def parse_tensors(
    tensors: dict[str, np.ndarray], file: str
) -> tuple[dict[str, dict[str, Any]], dict[str, np.ndarray]]:
    """Splits the file's tensors into ``{module: {"a", "b", "m"?, "embedding"}}`` (as stored) and
    the other tensors (trained biases and modules, keyed without the prefix)."""
    modules: dict[str, dict[str, Any]] = {}
    others: dict[str, np.ndarray] = {}
    for key in sorted(tensors):
        body = key.removeprefix(PREFIX)
        suffix = next((x for x in FACTOR_KEYS if body.endswith(x)), None)
        if suffix is None:
            others[body] = tensors[key]
            continue
        entry = modules.setdefault(body[: -len(suffix)], {})
        entry[FACTOR_KEYS[suffix]] = tensors[key]
        if "embedding" in suffix:
            entry["embedding"] = True
    for name, entry in modules.items():
        for factor, what in (("a", "lora_A"), ("b", "lora_B")):
            if factor not in entry:
                raise ValueError(f"{file}: module {name!r} has no {what} tensor.")
    if not modules:
        raise ValueError(f"{file} holds no lora_A/lora_B tensors.")
    return modules, others


def factors_from_peft(entry: dict[str, Any], name: str, use_dora: bool, file: str) -> dict:
    """Our ``a: (n, r)``, ``b: (r, m)`` (and DoRA's ``m``) from one module's PEFT tensors, and the
    kernel's input axes for a convolution (``lora_A`` ``(r, in, *window)``)."""
    a, b = np.asarray(entry["a"]), np.asarray(entry["b"])
    r = a.shape[0]
    if a.ndim > 2:  # a convolution: (r, in, *window) -> (*window, in, r) -> (n, r)
        out = {"in_ndim": a.ndim - 1, "b": b.reshape(b.shape[0], r).T}
        out["a"] = np.transpose(a, (*range(2, a.ndim), 1, 0)).reshape(-1, r)
    else:
        out = {"in_ndim": None, "a": a.T, "b": b.T}
    if use_dora != ("m" in entry):
        raise ValueError(
            f"{file}: module {name!r} {'lacks' if use_dora else 'has'} a lora_magnitude_vector "
            f"but the config says use_dora={use_dora}."
        )
    if use_dora and (entry.get("embedding") or out["in_ndim"]):
        raise ValueError(
            f"{file}: module {name!r} is DoRA on an embedding or a convolution; DoRA loads for "
            "linear layers only."
        )
    if use_dora:
        out["m"] = np.asarray(entry["m"]).reshape(-1)
    return out


def is_conv(path: str, adapter: Adapter, kernels: dict[str, Any]) -> bool:
    """Whether ``path`` is written as a convolution: an unstacked kernel of 3 to 5 axes whose
    adapter reads all but the last as inputs (flax's ``nn.Conv`` layout)."""
    shape = getattr(kernels.get(path), "shape", ())
    return 3 <= len(shape) <= 5 and adapter.in_ndim == len(shape) - 1 and adapter.out_ndim == 1


def module_tensors(name: str, a: np.ndarray, b: np.ndarray, layout: Any) -> dict[str, np.ndarray]:
    """PEFT's tensors of one module from ``a: (n, r)``, ``b: (r, m)``; ``layout`` is
    ``"embedding"``, a conv kernel shape ``(*window, in, out)`` or ``None`` (linear)."""
    if layout == "embedding":
        return {f"{name}.lora_embedding_A": a.T.copy(), f"{name}.lora_embedding_B": b.T.copy()}
    if layout is None:
        return {f"{name}.lora_A.weight": a.T.copy(), f"{name}.lora_B.weight": b.T.copy()}
    r, nd = a.shape[1], len(layout)
    a_conv = np.reshape(a, (*layout[:-1], r)).transpose((nd - 1, nd - 2, *range(nd - 2)))
    b_conv = np.reshape(b.T, (b.shape[1], r) + (1,) * (nd - 2))
    return {f"{name}.lora_A.weight": a_conv.copy(), f"{name}.lora_B.weight": b_conv}
