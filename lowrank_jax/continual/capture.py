"""``layer_inputs``: the inputs of chosen linen ``Dense`` kernels, for subspace memories."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

__all__ = ["layer_inputs"]


def layer_inputs(
    apply_fn: Callable[..., Any],
    kernel_paths: Sequence[str],
    params: Any,
    *args: Any,
    **kwargs: Any,
) -> tuple[Any, dict[str, jax.Array]]:
    """Runs ``apply_fn(params, *args, **kwargs)`` and records the inputs of chosen kernels.

    Every call of a linen ``nn.Dense`` / ``nn.DenseGeneral`` whose kernel path
    (``"params/<module path>/kernel"``, the adapter-rule names) is in ``kernel_paths`` has its
    input ``x: (..., n)`` recorded as ``(b, n)`` with all leading axes flattened (tokens and
    examples alike). Pure and jittable (the records are returned, never stored).

    Args:
      apply_fn: a linen ``model.apply`` (or a function that calls linen modules).
      kernel_paths: kernel paths to record, e.g. ``("params/dense_0/kernel",)``.
      params: the variables passed to ``apply_fn`` (merge adapters in first if they should act).
      *args: positional inputs of ``apply_fn``.
      **kwargs: keyword inputs of ``apply_fn``.

    Returns:
      ``(output, {path: (b, n)})``; a kernel called several times gets its inputs concatenated.

    Raises:
      ValueError: a path in ``kernel_paths`` was never called.
    """
    wanted = set(kernel_paths)
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
    missing = sorted(wanted - set(found))
    if missing:
        raise ValueError(
            f"kernels {missing} were never called by a linen Dense layer; check the paths "
            "(they look like 'params/<module>/kernel')."
        )
    return out, {k: jnp.concatenate(v, axis=0) for k, v in found.items()}
