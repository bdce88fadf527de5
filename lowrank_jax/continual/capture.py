"""``layer_inputs``: the inputs of chosen kernels, for subspace memories (linen, nnx, plain JAX).

The GPM memories of :mod:`lowrank_jax.optim` (``extend_subspace_memory``) are built from the
activations that enter a kernel ``W: (n, m)`` (``x @ W``). :func:`layer_inputs` records them for
any model:

* linen: every ``nn.Dense`` / ``nn.DenseGeneral`` call is intercepted (``nn.intercept_methods``);
* anything else — an nnx model (``lambda state, x: nnx.merge(graphdef, state)(x)``), a plain
  function of a parameter pytree, or linen layers that are not ``Dense`` — through the adapter
  machinery: each chosen kernel is wrapped (:func:`lowrank_jax.adapters.adapt`, ``quax``
  backend) with a recording adapter that adds zero and keeps the input of every matmul over the
  kernel's input axes.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Sequence
from typing import Any, Literal

import flax.linen as nn
import jax
import jax.numpy as jnp

__all__ = ["layer_inputs"]


def _linen_inputs(apply_fn, wanted, params, args, kwargs):
    found: dict[str, list[jax.Array]] = {}

    def interceptor(next_fun, call_args, call_kwargs, context):
        module = context.module
        if context.method_name == "__call__" and isinstance(module, nn.Dense | nn.DenseGeneral):
            path = "/".join(("params", *module.path, "kernel"))
            if path in wanted:
                x = jnp.asarray(call_args[0])
                n = module.variables["params"]["kernel"].shape[0]
                found.setdefault(path, []).append(jnp.reshape(x, (-1, n)))
        return next_fun(*call_args, **call_kwargs)

    with nn.intercept_methods(interceptor):
        out = apply_fn(params, *args, **kwargs)
    return out, found


@dataclasses.dataclass(frozen=True, eq=False)
class _Recorder:
    """An adapter kind that contributes zero and appends its (flattened) input to ``sink``."""

    path: str
    sink: dict = dataclasses.field(repr=False)
    in_ndim: int | None = None
    out_ndim: int | None = None

    def check_shape(self, n: int, m: int, path: str) -> None:
        del n, m, path

    def init_factors(self, key: jax.Array, kernel: jax.Array) -> dict[str, jax.Array]:
        del key, kernel
        return {}

    def apply_delta(self, factors, x, *, shape, key=None):
        del factors, key
        self.sink.setdefault(self.path, []).append(x)
        return jnp.zeros((x.shape[0], shape[1]), x.dtype)

    def apply_delta_transposed(self, factors, y, *, shape):
        raise NotImplementedError(
            f"{self.path!r} is used transposed (x @ W.T, a tied embedding): its 'inputs' are not "
            "inputs of x @ W; leave it out of kernel_paths."
        )

    def materialize(self, factors, *, shape):
        raise NotImplementedError(
            f"{self.path!r} reached an operation other than a matmul; layer_inputs records "
            "matmul inputs only."
        )

    def factor_specs(self, in_spec, out_spec):
        return {}


def _adapter_inputs(apply_fn, wanted, params, args, kwargs):
    from lowrank_jax import adapters  # (adapters imports nothing from continual)

    sink: dict[str, list[jax.Array]] = {}
    present = sorted(wanted & set(adapters.named_leaves(params)))  # the rest: reported missing
    if not present:
        return apply_fn(params, *args, **kwargs), sink
    rules = [(re.escape(p), _Recorder(p, sink)) for p in present]
    recorders = adapters.init(jax.random.key(0), params, rules)
    out = adapters.adapt(apply_fn)(params, recorders, *args, **kwargs)
    return out, sink


def layer_inputs(
    apply_fn: Callable[..., Any],
    kernel_paths: Sequence[str],
    params: Any,
    *args: Any,
    capture: Literal["auto", "linen", "adapters"] = "auto",
    **kwargs: Any,
) -> tuple[Any, dict[str, jax.Array]]:
    """Runs ``apply_fn(params, *args, **kwargs)`` and records the inputs of chosen kernels.

    Every matmul of a kernel whose path (the adapter-rule names: ``"params/dense_0/kernel"`` for
    linen variables, the '/'-joined pytree path for an nnx ``State`` or a plain dict) is in
    ``kernel_paths`` has its input ``x: (..., n)`` recorded as ``(b, n)`` with all leading axes
    flattened (tokens and examples alike). Pure and jittable (the records are returned, never
    stored); the recording must happen in the traced function itself, not inside a
    ``lax.scan``/``nn.scan`` body (stacked layers are not supported).

    Args:
      apply_fn: a linen ``model.apply``, ``lambda state, x: nnx.merge(graphdef, state)(x)``, or
        any function of a parameter pytree first.
      kernel_paths: kernel paths to record, e.g. ``("params/dense_0/kernel",)``.
      params: the parameters passed to ``apply_fn`` (merge adapters in first if they should act).
      *args: positional inputs of ``apply_fn``.
      capture: ``"linen"`` (intercept linen ``Dense``/``DenseGeneral`` calls), ``"adapters"``
        (recording adapters: any function), or ``"auto"`` (linen when it finds every path, else
        adapters).
      **kwargs: keyword inputs of ``apply_fn``.

    Returns:
      ``(output, {path: (b, n)})``; a kernel used several times gets its inputs concatenated.

    Raises:
      ValueError: a path in ``kernel_paths`` was never used in a matmul, or an unknown
        ``capture``.

    Example:
      >>> _, inputs = layer_inputs(model.apply, ["params/dense_0/kernel"], variables, x)
      >>> memory = optim.extend_subspace_memory(memory, inputs["params/dense_0/kernel"],
      ...                                       threshold=0.97)
    """
    if capture not in ("auto", "linen", "adapters"):
        raise ValueError(f"capture must be 'auto', 'linen' or 'adapters', got {capture!r}.")
    wanted = set(kernel_paths)
    found: dict[str, list[jax.Array]] = {}
    out = None
    if capture in ("auto", "linen"):
        out, found = _linen_inputs(apply_fn, wanted, params, args, kwargs)
    if capture == "adapters" or (capture == "auto" and wanted - set(found)):
        out, found = _adapter_inputs(apply_fn, wanted, params, args, kwargs)
    missing = sorted(wanted - set(found))
    if missing:
        raise ValueError(
            f"kernels {missing} were never used in a matmul by apply_fn; check the paths (linen: "
            "'params/<module>/kernel'; see lowrank_jax.adapters.named_leaves(params))."
        )
    return out, {k: jnp.concatenate(v, axis=0) for k, v in found.items()}
