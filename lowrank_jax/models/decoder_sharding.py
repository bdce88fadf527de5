"""FSDP and tensor-parallel partition rules for `DecoderLM` (and its adapters).

A mesh with an FSDP axis (`"fsdp"`: parameters split, gathered per use; the batch is split over
it too) and a tensor-parallel axis (`"tp"`: Megatron-style column/row-parallel projections)::

    embed_tokens/embedding              (V, d)      P(tp, fsdp)       vocab-parallel
    layers/self_attn/{q,k,v}_proj/kernel (L, d, m)  P(None, fsdp, tp) column-parallel
    layers/mlp/{gate,up}_proj/kernel    (L, d, f)   P(None, fsdp, tp)
    layers/self_attn/o_proj/kernel      (L, m, d)   P(None, tp, fsdp) row-parallel
    layers/mlp/down_proj/kernel         (L, f, d)   P(None, tp, fsdp)
    layers/.../{q,k,v,gate,up}_proj/bias (L, m)     P(None, tp)
    lm_head/kernel                      (d, V)      P(fsdp, tp)
    norms, o/down biases                            replicated

Use a mesh of `AxisType.Auto` axes (XLA's SPMD partitioner places the collectives; the
model is not written for explicit-sharding mode). The stacked layer axis is never split (`nn.scan` slices it). With `mesh` given, an axis whose
size does not divide the dimension (e.g. 2 key/value heads of size k over 4 tensor-parallel
devices) is dropped from that dimension, which is then replicated over it.

LoRA factors follow their kernel with `lowrank_jax.adapters.partition_specs(lora, specs)`: for a
column-parallel kernel `A: P(None, fsdp, None)`, `B: P(None, None, tp)`; for a row-parallel one
`A: P(None, tp, None)`, `B: P(None, None, fsdp)`, so `x·A` is split like `x·W`'s contraction and
`(x·A)·B` like its output: no more communication than the frozen projection needs (the cure of
EasyDeL #234, factors partitioned unlike their kernel).

Example::

    mesh = jax.make_mesh((2, 4), ("fsdp", "tp"), axis_types=(AxisType.Auto,) * 2)
    specs = decoder_partition_specs(variables, mesh=mesh)
    variables = jax.device_put(variables, jax.tree.map(lambda s: NamedSharding(mesh, s), specs))
    lora_specs = adapters.partition_specs(lora, specs)

References:
  Shoeybi et al. 2019 (Megatron-LM tensor parallelism); Rajbhandari et al. 2020 (ZeRO/FSDP);
  the layouts of MaxText's and Levanter's Llama partition rules (reconstructed, not copied).
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import Any

import jax
from jax.sharding import PartitionSpec as P

from lowrank_jax.adapters import paths

__all__ = ["decoder_partition_rules", "decoder_partition_specs"]


def decoder_partition_rules(
    *, fsdp: str | None = "fsdp", tp: str | None = "tp"
) -> tuple[tuple[str, P], ...]:
    """`(regex, PartitionSpec)` rules over '/'-joined `DecoderLM` parameter paths (first match).

    Args:
      fsdp: the mesh axis that shards parameters FSDP-style (None: not used).
      tp: the tensor-parallel mesh axis (None: not used).

    Returns:
      Rules in order; the last one (`.*`) replicates everything else (norms, o/down biases).
    """
    column = r".*/layers/(self_attn/(q|k|v)_proj|mlp/(gate|up)_proj)"
    row = r".*/layers/(self_attn/o_proj|mlp/down_proj)"
    return (
        (r".*embed_tokens/embedding", P(tp, fsdp)),
        (column + "/kernel", P(None, fsdp, tp)),
        (row + "/kernel", P(None, tp, fsdp)),
        (column + "/bias", P(None, tp)),
        (r".*lm_head/kernel", P(fsdp, tp)),
        (r".*", P()),
    )


def _axis_size(entry: str | tuple[str, ...], sizes: dict[str, int]) -> int:
    names = entry if isinstance(entry, tuple) else (entry,)
    return math.prod(sizes[n] for n in names)


def _fit(spec: P, shape: Sequence[int], sizes: dict[str, int] | None) -> P:
    """`spec` padded to `len(shape)`, with axes that do not divide their dimension dropped."""
    entries = list(spec) + [None] * (len(shape) - len(spec))
    if len(entries) > len(shape):
        raise ValueError(f"partition spec {spec} has more entries than the shape {shape}.")
    if sizes is not None:
        entries = [
            None if e is not None and dim % _axis_size(e, sizes) else e
            for e, dim in zip(entries, shape, strict=True)
        ]
    while entries and entries[-1] is None:
        entries.pop()
    return P(*entries)


def decoder_partition_specs(
    variables: Any,
    *,
    mesh: jax.sharding.Mesh | None = None,
    fsdp: str | None = "fsdp",
    tp: str | None = "tp",
    rules: Sequence[tuple[str, P]] | None = None,
) -> Any:
    """A `PartitionSpec` per leaf of `DecoderLM` variables (see the module docstring).

    Args:
      variables: the model's variables `{"params": ...}` (arrays or `jax.ShapeDtypeStruct`s,
        e.g. from `jax.eval_shape(model.init, ...)`).
      mesh: if given, a mesh axis that does not divide a dimension is dropped from it (that
        dimension is replicated over the axis); its axis names must include `fsdp` and `tp`.
      fsdp, tp: mesh axis names (None: that kind of parallelism is off).
      rules: `(regex, PartitionSpec)` rules to use instead of `decoder_partition_rules(...)`.

    Returns:
      A pytree like `variables` of `PartitionSpec`s; feed it to `adapters.partition_specs` for
      the LoRA factors and wrap it in `NamedSharding(mesh, spec)` for `jax.device_put`, `jit`'s
      shardings or `load_hf_decoder(..., shardings=...)`.

    Raises:
      ValueError: a mesh without the named axes, or a leaf no rule matches.
    """
    sizes = None
    if mesh is not None:
        sizes = dict(mesh.shape)
        missing = [a for a in (fsdp, tp) if a is not None and a not in sizes]
        if missing:
            raise ValueError(
                f"the mesh has axes {tuple(sizes)}, not {missing}: name them with fsdp=..., "
                "tp=... (or None to switch one off)."
            )
    compiled = [
        (re.compile(p), s)
        for p, s in (rules if rules is not None else decoder_partition_rules(fsdp=fsdp, tp=tp))
    ]

    def spec(keypath, leaf):
        name = paths.path_to_str(keypath)
        for pattern, s in compiled:
            if pattern.fullmatch(name):
                return _fit(s, leaf.shape, sizes)
        raise ValueError(f"no partition rule matches {name!r}; add one (e.g. (r'.*', P())).")

    return jax.tree_util.tree_map_with_path(spec, variables)
