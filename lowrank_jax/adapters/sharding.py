"""Sharding adapters like the kernels they adapt.

A kernel partitioned as ``P(*stack, *in_axes, *out_axes)`` gets factors partitioned along the same
mesh axes: for LoRA ``A: P(*stack, in, None)`` and ``B: P(*stack, None, out)``, so ``x @ A`` and
``(x @ A) @ B`` need no more communication than ``x @ W`` does.
"""

from __future__ import annotations

from typing import Any

import jax
from jax.sharding import NamedSharding, PartitionSpec

from lowrank_jax.adapters import paths
from lowrank_jax.adapters.core import AdapterSet

__all__ = [
    "partition_specs",
    "shardings",
]


def _merge_axes(entries: tuple[Any, ...]) -> Any:
    """Mesh axes of a flattened group of dimensions (``None`` if none is partitioned)."""
    names: list[str] = []
    for e in entries:
        if e is None:
            continue
        names.extend(e if isinstance(e, tuple) else (e,))
    if not names:
        return None
    return names[0] if len(names) == 1 else tuple(names)


def partition_specs(adapters: AdapterSet, param_specs: Any) -> AdapterSet:
    """``PartitionSpec``s for the factors of ``adapters``, derived from the kernels' specs.

    Args:
      adapters: from :func:`lowrank_jax.adapters.init`.
      param_specs: a pytree like the params with a ``PartitionSpec`` (or ``None``) per leaf, e.g.
        ``flax.linen.get_partition_spec(variables)``.

    Returns:
      The adapter set's structure with a ``PartitionSpec`` in place of each factor.
    """
    specs = paths.named_leaves(
        param_specs, is_leaf=lambda s: s is None or isinstance(s, PartitionSpec)
    )
    out = {}
    for path, adapter in adapters.items():
        spec = specs.get(path)
        if spec is None and path not in specs:
            raise ValueError(f"param_specs has no entry for the adapted kernel {path!r}.")
        stack = adapter.stack_ndim()
        ndim = stack + adapter.in_ndim + adapter.out_ndim
        entries = tuple(spec or ()) + (None,) * (ndim - len(tuple(spec or ())))
        in_spec = _merge_axes(entries[stack : stack + adapter.in_ndim])
        out_spec = _merge_axes(entries[stack + adapter.in_ndim :])
        per_factor = adapter.kind.factor_specs(in_spec, out_spec)
        out[path] = adapter.replace(
            factors={k: PartitionSpec(*entries[:stack], *v) for k, v in per_factor.items()}
        )
    return out


def shardings(adapters: AdapterSet, param_specs: Any, mesh: jax.sharding.Mesh) -> AdapterSet:
    """``NamedSharding``s for ``adapters`` on ``mesh`` (see :func:`partition_specs`)."""
    return jax.tree.map(
        lambda s: NamedSharding(mesh, s),
        partition_specs(adapters, param_specs),
        is_leaf=lambda s: isinstance(s, PartitionSpec),
    )
