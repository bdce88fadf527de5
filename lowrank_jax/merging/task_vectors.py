"""Task vectors: the updates that :mod:`~lowrank_jax.merging.task_merges` combines.

A *task vector* is a flat ``{path: update}`` dict over kernel paths (see
:mod:`lowrank_jax.adapters.paths`) whose values are either :class:`~lowrank_jax.adapters.Adapter`
records (an adapter set from :func:`lowrank_jax.adapters.init`, e.g. a trained LoRA, of any kind)
or dense updates in the kernel's shape (``W_finetuned - W_base``, see :func:`task_vector`). The
merges read every task vector through :func:`task_vector_matrices`: the stacked ``(K, L, n, m)``
matrix views of the *products* ``ΔW`` (an adapter's materialised update; a DoRA adapter's, which
depends on the frozen kernel, from the base parameters), never the factors apart. A merged update
is written back as a LoRA by :func:`to_lora`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from lowrank_jax.adapters import paths as paths_lib
from lowrank_jax.adapters.core import Adapter, delta
from lowrank_jax.adapters.kinds import LoRA
from lowrank_jax.adapters.quant import dequantize
from lowrank_jax.merging import trees

__all__ = [
    "TaskVector",
    "task_vector",
    "task_vector_matrices",
    "to_lora",
]

TaskVector = Mapping[str, Any]  # {path: Adapter | dense update in the kernel's shape}


def _check_same_paths(trees_: Sequence[Mapping[str, Any]], what: str) -> None:
    """:func:`~lowrank_jax.merging.trees.check_same_tree` (``compare="paths"``) over a list."""
    signature = None
    for i, t in enumerate(trees_):
        signature = trees.check_same_tree(
            trees_[0],
            t,
            what=f"{what}[{i}]",
            reference_what=f"{what}[0]",
            signature=signature,
            compare="paths",
        )


def _matrix_view(
    value: Any, layout: tuple[int, int] | None, path: str, kernels: Mapping[str, Any] | None
) -> jax.Array:
    """``(L, n, m)`` float32 matrix views of one update (``L`` stacked layers, 1 if none)."""
    if isinstance(value, Adapter):
        if value.matrix is None:
            raise ValueError(f"the Adapter at {path!r} does not record its (n, m) shape.")
        n, m = value.matrix
        if value.kind.needs_kernel:
            if kernels is None:
                raise ValueError(
                    f"the {type(value.kind).__name__} adapter at {path!r} has an update that "
                    "depends on the frozen kernel: pass base=, the parameters it was trained on."
                )
            if path not in kernels:
                raise ValueError(f"base has no kernel at {path!r}, which an adapter adapts.")
            kernel = jnp.asarray(dequantize(kernels[path]))
            dw = delta(value, kernel.shape, kernel)
            return dw.astype(jnp.float32).reshape(-1, n, m)
        stack = value.stack_ndim()
        flat = jax.tree.map(lambda f: jnp.reshape(f, (-1, *f.shape[stack:])), value.factors)
        return jax.vmap(value.kind.materialize)(flat).astype(jnp.float32).reshape(-1, n, m)
    x = jnp.asarray(value)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"the update at {path!r} has dtype {x.dtype}; pass a floating array.")
    if layout is None:
        if x.ndim != 2:
            raise ValueError(
                f"the dense update at {path!r} has shape {x.shape}: only 2-D kernels are read "
                "without an Adapter at the same path to give the layout; pass one, or reshape."
            )
        layout = (1, 1)
    i, o = layout
    stack = x.ndim - i - o
    if stack < 0:
        raise ValueError(f"the dense update at {path!r} of shape {x.shape} has too few axes.")
    n = int(jnp.prod(jnp.asarray(x.shape[stack : stack + i])))
    m = int(jnp.prod(jnp.asarray(x.shape[stack + i :])))
    return x.astype(jnp.float32).reshape(-1, n, m)


def _layout(values: Sequence[Any]) -> tuple[int, int, tuple[int, ...]] | None:
    """``(in_ndim, out_ndim, stack_shape)`` of the first Adapter among ``values`` (else None)."""
    for v in values:
        if isinstance(v, Adapter):
            stack = jax.tree.leaves(v.factors)[0].shape[: v.stack_ndim()]
            return v.in_ndim, v.out_ndim, tuple(stack)
    return None


def task_vector_matrices(
    task_vectors: Sequence[TaskVector], *, base: Any = None
) -> dict[str, tuple[jax.Array, tuple[int, int, tuple[int, ...]]]]:
    """``{path: ((K, L, n, m) stacked matrix views, (in_ndim, out_ndim, stack_shape))}``.

    An Adapter's matrix view is its materialised update ``ΔW`` (``(L, n, m)``, ``L`` the product
    of its stacked-layer axes, 1 if none); a dense update takes the layout of an Adapter at the
    same path, or must be 2-D. A kind whose update depends on the frozen kernel (DoRA,
    ``needs_kernel``) is materialised with the kernel at its path in ``base``
    (:func:`lowrank_jax.adapters.delta`).

    Args:
      task_vectors: ``K`` ``{path: Adapter | dense update}`` dicts with the same paths.
      base: the parameter pytree the adapters were trained on; needed only for DoRA adapters.

    Raises:
      ValueError: the task vectors have different paths, or the matrix views at a path differ in
        shape (the message names the first such path); a DoRA adapter without ``base``.
    """
    if isinstance(task_vectors, Mapping) or not len(task_vectors):
        raise TypeError("pass a non-empty sequence of task vectors ({path: update} dicts).")
    _check_same_paths(task_vectors, "task vectors")
    kernels = None if base is None else paths_lib.named_leaves(base)
    out = {}
    for path in task_vectors[0]:
        values = [tv[path] for tv in task_vectors]
        layout = _layout(values)
        views = [
            _matrix_view(v, None if layout is None else layout[:2], path, kernels) for v in values
        ]
        shapes = [tuple(v.shape) for v in views]
        if len(set(shapes)) != 1:
            raise ValueError(
                f"the task vectors differ at path {path!r}: matrix views of shapes {shapes}. "
                "Merge updates of the same kernels."
            )
        out[path] = (jnp.stack(views), layout if layout is not None else (1, 1, ()))
    return out


def task_vector(finetuned: Any, base: Any, *, targets: Sequence[str] | None = None) -> dict:
    """``{path: finetuned - base}`` over the kernels of two parameter pytrees of one model.

    Args:
      finetuned, base: parameter pytrees of the same structure (linen variables, dicts, ...).
      targets: full-match regexes over '/'-joined paths selecting the kernels (default: every
        floating leaf with at least 2 axes).

    Returns:
      ``{path: (kernel shape) difference}``, a dense task vector for the merges of
      :mod:`~lowrank_jax.merging.task_merges`.

    Raises:
      ValueError: the trees have different paths or shapes (the message names the first
        differing path), or ``targets`` selects nothing.
    """
    fine, start = paths_lib.named_leaves(finetuned), paths_lib.named_leaves(base)
    trees.check_same_tree(start, fine, what="finetuned", reference_what="base", compare="paths")
    compiled = [re.compile(t) for t in targets] if targets is not None else None
    out = {}
    for path, x in start.items():
        y = fine[path]
        if jnp.shape(x) != jnp.shape(y):
            raise ValueError(
                f"the parameter trees differ at path {path!r}: shapes {jnp.shape(y)} (finetuned) "
                f"and {jnp.shape(x)} (base)."
            )
        floating = jnp.issubdtype(jnp.asarray(x).dtype, jnp.floating)
        wanted = (
            any(c.fullmatch(path) for c in compiled) if compiled else floating and jnp.ndim(x) >= 2
        )
        if wanted:
            out[path] = jnp.asarray(y, jnp.float32) - jnp.asarray(x, jnp.float32)
    if not out:
        raise ValueError(f"targets {targets!r} select no parameter; paths: {sorted(start)[:20]}")
    return out


def to_lora(
    factors: tuple[jax.Array, jax.Array], layout: tuple[int, int, tuple[int, ...]], n: int, m: int
) -> Adapter:
    """An :class:`Adapter` of kind ``LoRA(rank=r, alpha=r)`` (scale 1) from ``(L, n, r), (L, r, m)``
    factors, with the stacked-layer axes and kernel layout of ``layout``."""
    a, b = factors
    in_ndim, out_ndim, stack = layout
    r = a.shape[-1]
    kind = LoRA(rank=r, alpha=float(r), in_ndim=in_ndim, out_ndim=out_ndim)
    return Adapter(
        factors={"a": a.reshape(*stack, n, r), "b": b.reshape(*stack, r, m)},
        kind=kind,
        in_ndim=in_ndim,
        out_ndim=out_ndim,
        matrix=(n, m),
    )
