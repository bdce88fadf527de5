"""The adapter pytree: ``init``, ``fold``, ``unfold`` and friends.

An *adapter set* is a flat ``dict`` from a kernel's path (see :mod:`lowrank_jax.adapters.paths`) to
an :class:`Adapter` record that holds that kernel's trainable factors and, as static metadata, its
kind and axis layout. It never contains the frozen kernel itself, so ``jax.grad`` with respect to it
gives adapter gradients only and optax transforms see only the factors. Several named sets can be
stacked on one model by passing ``{"name": set, ...}`` (or a list of sets) wherever a set is taken.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from lowrank_jax.adapters import paths
from lowrank_jax.adapters.kinds import AdapterKind
from lowrank_jax.adapters.quant import dequantize

__all__ = [
    "Adapter",
    "AdapterSet",
    "as_sets",
    "combine",
    "count_params",
    "delta",
    "fold",
    "group_by_path",
    "init",
    "map_adapted",
    "needs_kernel",
    "resolve_layout",
    "split_shape",
    "split_trainable",
    "unfold",
]

AdapterSet = dict[str, "Adapter"]


@struct.dataclass
class Adapter:
    """One kernel's adapter: trainable ``factors`` plus its static kind and axis layout.

    The kernel has shape ``(*stack, *in_shape, *out_shape)`` with ``len(in_shape) = in_ndim`` and
    ``len(out_shape) = out_ndim``; the factors describe the ``(n, m)`` matrix view (``matrix``) per
    stacked layer and carry the ``stack`` axes in front.
    """

    factors: dict[str, jax.Array]
    kind: AdapterKind = struct.field(pytree_node=False)
    in_ndim: int = struct.field(pytree_node=False)
    out_ndim: int = struct.field(pytree_node=False)
    matrix: tuple[int, int] | None = struct.field(pytree_node=False, default=None)

    def stack_ndim(self) -> int:
        """How many stacked-layer axes lead the factors (needs ``matrix``, the ``(n, m)`` view)."""
        if self.matrix is None:
            raise ValueError("this Adapter does not record its (n, m) matrix shape; rebuild it.")
        one = jax.eval_shape(
            self.kind.init_factors,
            jax.random.key(0),
            jax.ShapeDtypeStruct(self.matrix, jnp.float32),
        )
        leaf, ref = jax.tree.leaves(self.factors)[0], jax.tree.leaves(one)[0]
        return leaf.ndim - ref.ndim

    def matrix_shape(self, kernel_shape: Sequence[int]) -> tuple[tuple[int, ...], int, int]:
        """``(stack_shape, n, m)`` of the matrix view of a kernel of this layout."""
        return split_shape(kernel_shape, self.in_ndim, self.out_ndim)


def split_shape(
    shape: Sequence[int], in_ndim: int, out_ndim: int
) -> tuple[tuple[int, ...], int, int]:
    """Splits a kernel shape into ``(stack_shape, n, m)`` for its matrix view."""
    stack = len(shape) - in_ndim - out_ndim
    return (
        tuple(shape[:stack]),
        math.prod(shape[stack : stack + in_ndim]),
        math.prod(shape[stack + in_ndim :]),
    )


def resolve_layout(kind: AdapterKind, shape: tuple[int, ...], path: str) -> tuple[int, int]:
    ndim = len(shape)
    i, o = kind.in_ndim, kind.out_ndim
    hint = (
        "say which kernel axes are inputs and outputs, e.g. lora(rank, in_ndim=1, out_ndim=2) for a "
        "DenseGeneral kernel (d, heads, head_dim); axes in front of them are stacked layers."
    )
    if ndim < 2:
        raise ValueError(f"{path!r} has shape {shape} and is not a matrix: adapt kernels only.")
    if i is None and o is None:
        if ndim != 2:
            raise ValueError(
                f"{path!r} has shape {shape}, an unsupported layout by default: {hint}"
            )
        i, o = 1, 1
    elif i is None:
        i = ndim - o
    elif o is None:
        o = ndim - i
    if i < 1 or o < 1 or i + o > ndim:
        raise ValueError(f"in_ndim={i}, out_ndim={o} do not fit {path!r} of shape {shape}: {hint}")
    return i, o


def _init_one(key: jax.Array, kernel: jax.Array, kind: AdapterKind, path: str) -> Adapter:
    if not jnp.issubdtype(kernel.dtype, jnp.floating):
        raise TypeError(f"{path!r} has dtype {kernel.dtype}; only floating kernels can be adapted.")
    i, o = resolve_layout(kind, tuple(kernel.shape), path)
    stack, n, m = split_shape(kernel.shape, i, o)
    kind.check_shape(n, m, path)
    matrices = jnp.reshape(kernel, (-1, n, m))
    keys = jax.random.split(key, matrices.shape[0])
    factors = jax.vmap(kind.init_factors)(keys, matrices)
    factors = jax.tree.map(lambda f: jnp.reshape(f, stack + f.shape[1:]), factors)
    return Adapter(factors=factors, kind=kind, in_ndim=i, out_ndim=o, matrix=(n, m))


def init(key: jax.Array, params: Any, rules: paths.Rules) -> AdapterSet:
    """Creates the adapters that ``rules`` ask for.

    Args:
      key: PRNG key; each targeted kernel gets ``fold_in(key, index)`` (and one split per stacked
        layer), so adding a rule does not reshuffle the others' initialisations.
      params: any parameter pytree (linen variables ``{"params": ...}``, nnx ``State``, a dict).
      rules: ordered ``(regex, spec)`` pairs over '/'-joined paths; full match, first rule wins,
        ``None`` freezes. E.g. ``[(r".*attention/(query|value)/kernel", lora(rank=8)), (r".*", None)]``.

    Returns:
      ``{path: Adapter}`` for each targeted kernel: the trainable factors only, never the kernel.

    Raises:
      ValueError: no rule matches (the message lists the paths), a rank exceeds ``min(n, m)``, or a
        kernel's layout is ambiguous.
      TypeError: a targeted leaf is not a floating-point array.

    Example:
      >>> adapters = init(jax.random.key(0), variables, [(r".*kernel", lora(rank=4))])
    """
    targets = paths.match_rules(params, rules)
    return {
        path: _init_one(jax.random.fold_in(key, index), jnp.asarray(dequantize(kernel)), spec, path)
        for index, (path, (kernel, spec)) in enumerate(targets.items())
    }


def as_sets(adapters: Any) -> list[AdapterSet]:
    """Normalises one set, a list of sets, or ``{name: set}`` to a list of sets."""
    if isinstance(adapters, Mapping):
        values = list(adapters.values())
        if all(isinstance(v, Adapter) for v in values):
            return [dict(adapters)]
        if all(isinstance(v, Mapping) for v in values):
            return [s for v in values for s in as_sets(v)]
    if isinstance(adapters, list | tuple):
        return [s for v in adapters for s in as_sets(v)]
    raise TypeError(
        "adapters must be the dict returned by adapters.init, a list of such dicts, or a dict "
        f"{{name: adapters}}; got {type(adapters).__name__}."
    )


def needs_kernel(adapter: Adapter) -> bool:
    """Whether the adapter's update depends on the frozen kernel (DoRA), not only its factors."""
    return bool(getattr(adapter.kind, "needs_kernel", False))


def delta(adapter: Adapter, kernel_shape: Sequence[int], kernel: Any = None) -> jax.Array:
    """The full update ``ΔW`` in the kernel's shape (for folding and export, never in training).

    Args:
      adapter: one kernel's adapter.
      kernel_shape: the kernel's shape ``(*stack, *in_shape, *out_shape)``.
      kernel: the frozen kernel itself; needed by kinds whose update depends on it (DoRA's
        ``W·diag(c) − W``), ignored by the others.

    Returns:
      ``ΔW`` of shape ``kernel_shape``.

    Raises:
      ValueError: the kind needs the kernel and none was given.
    """
    stack, n, m = adapter.matrix_shape(kernel_shape)
    flat = jax.tree.map(lambda f: jnp.reshape(f, (-1, *f.shape[len(stack) :])), adapter.factors)
    fn = functools.partial(adapter.kind.materialize, shape=(n, m))
    if needs_kernel(adapter):
        if kernel is None:
            raise ValueError(
                f"{type(adapter.kind).__name__}'s update depends on the frozen kernel: pass "
                "delta(adapter, kernel.shape, kernel)."
            )
        w = jnp.reshape(dequantize(kernel), (-1, n, m))
        dw = jax.vmap(lambda f, w: fn(f, kernel=w))(flat, w)
    else:
        dw = jax.vmap(fn)(flat)
    return jnp.reshape(dw, tuple(kernel_shape))


def group_by_path(adapters: Any) -> dict[str, list[Adapter]]:
    """``{path: [adapter, ...]}`` over all sets of ``adapters`` (see :func:`as_sets`)."""
    by_path: dict[str, list[Adapter]] = {}
    for s in as_sets(adapters):
        for path, adapter in s.items():
            by_path.setdefault(path, []).append(adapter)
    return by_path


def map_adapted(params: Any, adapters: Any, fn: Callable[[str, Any, list[Adapter]], Any]) -> Any:
    """Replaces each adapted leaf of ``params`` by ``fn(path, leaf, its_adapters)``.

    Raises:
      ValueError: some adapters refer to paths that ``params`` does not have.
    """
    by_path = group_by_path(adapters)
    found = set()

    def update(keypath, leaf):
        path = paths.path_to_str(keypath)
        if path not in by_path:
            return leaf
        found.add(path)
        return fn(path, leaf, by_path[path])

    out = jax.tree_util.tree_map_with_path(update, params, is_leaf=paths.is_param_leaf)
    missing = sorted(set(by_path) - found)
    if missing:
        raise ValueError(
            f"adapters for {missing} are not in params; were they made for these params?"
        )
    return out


def _apply_to_kernels(params: Any, adapters: Any, sign: float) -> Any:
    def update(path, leaf, ads):
        leaf = dequantize(leaf)  # an int8 base folds into float32 kernels
        if sign < 0 and any(needs_kernel(a) for a in ads):
            raise ValueError(
                f"{path!r} carries a DoRA adapter, whose fold cannot be undone from the folded "
                "kernel alone; use adapters.unfold_dora(params, adapters, norms) with norms = "
                "adapters.dora_norms(params_before_fold, adapters)."
            )
        total = sum(delta(a, leaf.shape, leaf) for a in ads)
        dtype = jnp.result_type(leaf.dtype, total.dtype)  # bf16 base + f32 factors: float32
        return (leaf.astype(dtype) + sign * total.astype(dtype)).astype(dtype)

    return map_adapted(params, adapters, update)


def fold(params: Any, adapters: Any) -> Any:
    """Folds the adapters into the kernels: ``W ← W + ΔW`` (for inference and export).

    Args:
      params: the parameter pytree the adapters were made for.
      adapters: one adapter set, a list of sets, or ``{name: set}`` (all are summed).

    Returns:
      ``params`` with every adapted kernel replaced by ``W + ΔW``, in the kernel's dtype promoted
      with the factors' (a bfloat16 base with float32 factors gives float32); an int8 kernel
      (:mod:`lowrank_jax.adapters.quant`) is dequantised first. Every ``ΔW`` is taken from the
      unfolded kernel; a DoRA adapter's is ``(W + s·A B)·diag(c) − W``.
    """
    return _apply_to_kernels(params, adapters, 1.0)


def unfold(params: Any, adapters: Any) -> Any:
    """The inverse of :func:`fold`, ``W ← W − ΔW`` (exact up to float rounding).

    Also turns a data-aware initialisation (PiSSA, ...) into a residual base: after
    ``params = unfold(params, adapters)`` the adapted model starts at the original function.

    Raises:
      ValueError: a kernel carries a DoRA adapter (use :func:`lowrank_jax.adapters.unfold_dora`).
    """
    return _apply_to_kernels(params, adapters, -1.0)


def count_params(tree: Any) -> int:
    """Number of scalars in a pytree (e.g. the trainable parameters of an adapter set)."""
    return sum(int(x.size) for x in jax.tree.leaves(tree))


def split_trainable(params: Any, patterns: Sequence[str]) -> tuple[Any, Any]:
    """Splits ``params`` into ``(trainable, frozen)`` by full-match regexes over paths.

    Each output has the structure of ``params`` with ``None`` where the other one holds the leaf;
    :func:`combine` puts them back together. Use it to train, say, a classifier head next to the
    adapters.

    Raises:
      ValueError: a pattern matches no path (the message lists the paths).
    """
    compiled = [re.compile(p) for p in patterns]
    names = paths.named_leaves(params)
    for p, c in zip(patterns, compiled, strict=True):
        if not any(c.fullmatch(n) for n in names):
            raise ValueError(
                f"pattern {p!r} matches no parameter; the paths are:\n  " + "\n  ".join(names)
            )

    def pick(want: bool) -> Callable[[Any, Any], Any]:
        def f(keypath, leaf):
            hit = any(c.fullmatch(paths.path_to_str(keypath)) for c in compiled)
            return leaf if hit == want else None

        return f

    return (
        jax.tree_util.tree_map_with_path(pick(True), params, is_leaf=paths.is_param_leaf),
        jax.tree_util.tree_map_with_path(pick(False), params, is_leaf=paths.is_param_leaf),
    )


def combine(trainable: Any, frozen: Any) -> Any:
    """Inverse of :func:`split_trainable`."""
    return jax.tree.map(
        lambda a, b: b if a is None else a, trainable, frozen, is_leaf=lambda x: x is None
    )
