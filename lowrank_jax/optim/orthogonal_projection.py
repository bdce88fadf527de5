r"""The optax transformation that projects adapter updates off subspace memories (GPM / InfLoRA).

The memories and their linear algebra are in :mod:`lowrank_jax.optim.subspace_memory`. A
transform holds them as a pytree shaped like the parameters: a :class:`SubspaceMemory` at each
projected leaf (the ``a`` factor of an adapter), ``None`` at every other one
(:func:`init_memories`; path regexes ``targets`` choose the leaves), so the projection is one
``jax.tree.map`` over (memories, updates) with ``is_leaf=is_memory``.

:func:`scale_by_orthogonal_projection` is the optax transform; it composes with any inner
optimizer through ``optax.chain``. Put it *after* the moment estimator so the applied update, not
the raw gradient, is orthogonal: Adam's element-wise division by ``√ν`` does not commute with
``I − MMᵀ``, so a projection chained *before* it is undone (the applied update leaves the span
again). :func:`check_projection_order` detects that order in an optimizer state::

    tx = optax.chain(optax.scale_by_adam(), scale_by_orthogonal_projection(memory),
                     optax.scale(-1e-3))                  # right
    check_projection_order(tx.init(params))              # raises for the swapped order

The activations ``X`` that build a memory come from the model's forward pass:
:func:`lowrank_jax.continual.layer_inputs` records the inputs of chosen kernels for a linen model,
an nnx model or a plain function of a parameter pytree.

References:
  Saha, Garg, Roy 2021, "Gradient Projection Memory for Continual Learning" (GPM);
  Liang, Li 2024, "InfLoRA: Interference-Free Low-Rank Adaptation for Continual Learning"
  (arXiv 2404.00228). Used by P1 SABER and P2 GR-LoRA (both reconstructions, see
  ``papers/specs.md`` §1, §2).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from lowrank_jax.adapters import paths
from lowrank_jax.optim.subspace_memory import (
    SubspaceMemory,
    _check_memory,
    extend_subspace_memory,
    init_subspace_memory,
    project_off,
)

__all__ = [
    "OrthogonalProjectionState",
    "check_memories",
    "check_projection_order",
    "extend_memories",
    "fill_memories",
    "init_memories",
    "is_memory",
    "project_memories",
    "scale_by_orthogonal_projection",
]


class OrthogonalProjectionState(NamedTuple):
    """State of :func:`scale_by_orthogonal_projection`.

    Attributes:
      count: number of updates so far (int32).
      memory: a pytree shaped like the params: a :class:`SubspaceMemory` at each projected leaf
        (e.g. the ``a`` factor of every adapter of an adapter set), ``None`` at every other leaf
        (:func:`init_memories`).
    """

    count: jax.Array
    memory: Any


def is_memory(x: Any) -> bool:
    """``is_leaf`` of a memory tree: a :class:`SubspaceMemory` or the ``None`` of an unprojected
    leaf, e.g. ``jax.tree.map(fn, memory, updates, is_leaf=is_memory)``."""
    return x is None or isinstance(x, SubspaceMemory)


def init_memories(
    params: Any, targets: str | Sequence[str] = r".*/a", *, capacity: int | None = None
) -> Any:
    """Empty memories shaped like ``params``: one at each leaf whose '/'-joined path fully
    matches one of ``targets``, ``None`` elsewhere.

    A leaf ``(*stack, n, r)`` gets a memory of basis ``(*stack, n, min(capacity, n))``
    (``capacity=None``: ``n``).

    Raises:
      ValueError: ``targets`` match no leaf (the message lists the paths), or a matched leaf has
        fewer than two axes.
    """
    patterns = [targets] if isinstance(targets, str) else list(targets)
    compiled = [re.compile(p) for p in patterns]

    def leaf(keypath, x):
        path = paths.path_to_str(keypath)
        if not any(c.fullmatch(path) for c in compiled):
            return None
        if x.ndim < 2:
            raise ValueError(f"{path!r} has shape {x.shape}: only (*stack, n, r) factors.")
        n = x.shape[-2]
        cap = None if capacity is None else min(capacity, n)
        return init_subspace_memory(n, capacity=cap, stack=x.shape[:-2])

    out = jax.tree_util.tree_map_with_path(leaf, params, is_leaf=paths.is_param_leaf)
    if not jax.tree.leaves(out, is_leaf=lambda x: isinstance(x, SubspaceMemory)):
        raise ValueError(
            f"targets={targets!r} match no parameter; the paths are:\n  "
            + "\n  ".join(paths.named_leaves(params))
        )
    return out


def check_memories(params: Any, memory: Any) -> None:
    """Raises unless ``memory`` is shaped like ``params``: a fitting :class:`SubspaceMemory`
    (basis ``(*stack, n, k)`` for a leaf ``(*stack, n, r)``) or ``None`` at each leaf, where a
    ``None`` may also stand for a whole subtree of unprojected leaves."""
    leaves = paths.named_leaves(params)
    memories = paths.named_leaves(memory, is_leaf=is_memory)
    for path, mem in memories.items():
        if mem is None:
            continue
        _check_memory(mem, f"the memory at {path!r}")
        if path not in leaves:
            raise ValueError(
                f"the memory at {path!r} is not at a parameter; the paths are:\n  "
                + "\n  ".join(leaves)
            )
        shape = leaves[path].shape
        if tuple(shape[:-1]) != tuple(mem.basis.shape[:-1]):
            raise ValueError(
                f"the memory at {path!r} has basis {mem.basis.shape}, which does not fit the "
                f"parameter of shape {shape}: expected (*stack, n, k) with (*stack, n) = "
                f"{shape[:-1]}."
            )
    unprojected = tuple(q + "/" for q, m in memories.items() if m is None)
    uncovered = [p for p in leaves if p not in memories and not p.startswith(unprojected)]
    if uncovered:
        raise ValueError(
            "memory must be a pytree shaped like the params, a SubspaceMemory at each projected "
            f"leaf and None elsewhere (init_memories builds one); it has no entry for {uncovered[:3]}"
            f"{' and more' if len(uncovered) > 3 else ''}."
        )


def project_memories(memory: Any, updates: Any) -> Any:
    """``updates`` with each leaf that has a memory projected off it (:func:`project_off`); the
    leaves under a ``None`` of ``memory`` pass unchanged."""
    return jax.tree.map(
        lambda m, u: u if m is None else project_off(m, u), memory, updates, is_leaf=is_memory
    )


def scale_by_orthogonal_projection(
    memory: Any = None,
    *,
    targets: str | Sequence[str] = r".*/a",
    capacity: int | None = None,
) -> optax.GradientTransformation:
    r"""Projects the updates of input-side adapter factors off per-kernel subspace memories.

    For each leaf ``u: (*stack, n, r)`` with a memory ``M``: ``u ← (I − M Mᵀ) u``; other leaves
    pass unchanged. The output is idempotent under the transform and orthogonal to ``M``, so a
    factor ``A`` initialised off ``M`` stays off it (GPM on LoRA).

    Args:
      memory: a pytree shaped like the params, a :class:`SubspaceMemory` at each projected leaf
        and ``None`` at the others (the memories of earlier tasks, an explicit argument; a
        ``None`` may stand for a whole unprojected subtree); stored in the state by ``init``.
        ``None``: ``init`` creates empty memories for the leaves matching ``targets``
        (:func:`init_memories`), to be filled between tasks with :func:`fill_memories` from the
        layer inputs of the adapted kernels.
      targets: full-match regexes over '/'-joined parameter paths used when ``memory`` is None
        (default: the ``a`` factor of every LoRA adapter, ``.../factors/a``).
      capacity: basis columns per empty memory (default: ``n``).

    Returns:
      An ``optax.GradientTransformation`` with state :class:`OrthogonalProjectionState`.

    Raises:
      ValueError: in ``init``, ``memory`` is not shaped like the params or a memory does not fit
        its leaf, or ``targets`` match nothing.

    References:
      Saha et al. 2021 (GPM); Liang & Li 2024 (InfLoRA). Used by P1 SABER and P2 GR-LoRA
      (reconstructions, specs §1–2).

    Example:
      >>> mem = init_memories(params, r".*/factors/a")          # or last task's memories
      >>> tx = optax.chain(optax.scale_by_adam(), scale_by_orthogonal_projection(mem),
      ...                  optax.scale(-1e-3))
    """

    def init_fn(params):
        if memory is None:
            mem = init_memories(params, targets, capacity=capacity)
        else:
            check_memories(params, memory)
            mem = memory
        return OrthogonalProjectionState(count=jnp.zeros([], jnp.int32), memory=mem)

    def update_fn(updates, state, params=None):
        del params
        updates = project_memories(state.memory, updates)
        return updates, state._replace(count=optax.safe_increment(state.count))

    return optax.GradientTransformation(init_fn, update_fn)


_MEMORY_STATES = ("OrthogonalProjectionState", "GradientRecyclingState")


def _memory_states(opt_state: Any) -> list[tuple[tuple, Any]]:
    """``(path, state)`` of every memory-holding transform state (``optax.tree_utils`` paths)."""
    found = []
    for name in _MEMORY_STATES:
        found += optax.tree_utils.tree_get_all_with_path(opt_state, name)
    return found


def _position(tree: Any, path: tuple) -> tuple[int, ...]:
    """The chain order of the node at an ``optax.tree_utils`` ``path`` (flattening order)."""
    out, node = [], tree
    for key in path:
        if isinstance(key, optax.tree_utils.NamedTupleKey):
            out.append(node._fields.index(key.name))
            node = getattr(node, key.name)
        elif isinstance(key, jax.tree_util.DictKey):
            out.append(sorted(node).index(key.key))
            node = node[key.key]
        else:  # SequenceKey
            out.append(key.idx)
            node = node[key.idx]
    return tuple(out)


def _kernel_of(path: str, kernels: Sequence[str]) -> str | None:
    """The longest of ``kernels`` that ``path`` (a factor's path) is or lies under, e.g. ``k`` for
    ``k``, ``k + "/factors/a"`` or ``"shared/" + k + "/factors/a"``."""
    under = [k for k in kernels if path == k or path.startswith(k + "/") or f"/{k}/" in path]
    return max(under, key=len) if under else None


def extend_memories(
    memory: Any, inputs: Mapping[str, jax.typing.ArrayLike], *, threshold: float
) -> Any:
    r"""Every :class:`SubspaceMemory` of a memory tree extended with the layer inputs of its kernel.

    A memory belongs to the kernel whose path its own path is or contains (the memory of
    ``"shared/params/dense_0/kernel/factors/a"`` or of ``"params/dense_0/kernel"`` to the kernel
    ``"params/dense_0/kernel"``); :func:`extend_subspace_memory` adds that kernel's inputs.

    Args:
      memory: a memory tree (:func:`init_memories`); ``None`` entries pass unchanged.
      inputs: ``{kernel path: (*stack, b, n)}`` layer inputs of the task just learned
        (:func:`lowrank_jax.continual.layer_inputs`).
      threshold: GPM energy ``τ`` in ``(0, 1]``.

    Raises:
      ValueError: a memory has no inputs for its kernel (the message lists both).
    """
    kernels = list(inputs)

    def leaf(keypath, mem):
        if mem is None:
            return None
        path = paths.path_to_str(keypath)
        kernel = _kernel_of(path, kernels)
        if kernel is None:
            raise ValueError(
                f"the memory of {path!r} has no layer inputs: inputs holds {kernels}; record "
                "the kernel that this factor adapts (continual.layer_inputs)."
            )
        return extend_subspace_memory(mem, inputs[kernel], threshold=threshold)

    return jax.tree_util.tree_map_with_path(leaf, memory, is_leaf=is_memory)


def fill_memories(
    opt_state: Any, inputs: Mapping[str, jax.typing.ArrayLike], *, threshold: float
) -> Any:
    r"""Extends every subspace memory in an optimizer state with the layer inputs of its kernel.

    The memories of :func:`scale_by_orthogonal_projection` and
    :func:`~lowrank_jax.optim.scale_by_gradient_recycling` sit at the adapter factors they
    protect (``"params/dense_0/kernel/factors/a"``, ``"shared/params/.../factors/a"``);
    :func:`lowrank_jax.continual.layer_inputs` returns inputs keyed by kernel path
    (``"params/dense_0/kernel"``). This applies :func:`extend_memories` to each memory state
    and puts the result back wherever the state sits in a chain (``optax.chain``, ``masked``,
    ``multi_transform``), so a loop between tasks reads::

        _, inputs = continual.layer_inputs(model.apply, kernels, variables, task_x)
        opt_state = optim.fill_memories(opt_state, inputs, threshold=0.97)

    Args:
      opt_state: an optimizer state holding one or more memory states.
      inputs: ``{kernel path: (b, n)}`` layer inputs of the task just learned.
      threshold: GPM energy ``τ`` in ``(0, 1]``.

    Returns:
      ``opt_state`` with every memory extended (other entries unchanged).

    Raises:
      ValueError: the state holds no memory, or a memory has no inputs for its kernel (the
        message lists both key sets).
    """
    found = _memory_states(opt_state)
    if not found:
        raise ValueError(
            "opt_state holds no subspace memory: chain scale_by_orthogonal_projection or "
            "scale_by_gradient_recycling into the optimizer."
        )
    for path, state in found:
        filled = state._replace(memory=extend_memories(state.memory, inputs, threshold=threshold))
        opt_state = optax.tree_utils.tree_set(
            opt_state, lambda p, _, path=path: p == path, **{type(state).__name__: filled}
        )
    return opt_state


def check_projection_order(opt_state: Any) -> None:
    r"""Raises if a projection is chained before an adaptive moment estimator.

    Walks an optimizer state (``tx.init(params)``; chains, ``masked`` and ``multi_transform``
    states included) in chain order. A :class:`OrthogonalProjectionState` or
    :class:`~lowrank_jax.optim.GradientRecyclingState` that comes before a state with a second
    moment ``nu`` (Adam, AdamW, RMSProp, AdaBelief, ...) means the projected gradient is then
    divided element-wise by ``√ν``, which moves it off ``(I − MMᵀ)`` again: the applied update
    is not orthogonal to the memory and old tasks are no longer protected.

    Args:
      opt_state: the state returned by the chain's ``init``.

    Raises:
      ValueError: the wrong order, naming both states and the right chain.

    Example:
      >>> tx = optax.chain(scale_by_orthogonal_projection(mem), optax.scale_by_adam())
      >>> check_projection_order(tx.init(params))  # ValueError: chain the projection after
    """
    states = [(p, "projection", type(st).__name__) for p, st in _memory_states(opt_state)]
    for p, _ in optax.tree_utils.tree_get_all_with_path(opt_state, "nu"):
        if p and isinstance(p[-1], optax.tree_utils.NamedTupleKey):
            states.append((p[:-1], "moments", p[-1].tuple_name))
    states.sort(key=lambda s: _position(opt_state, s[0]))
    seen = [(kind, name) for _, kind, name in states]
    for i, (kind, name) in enumerate(seen):
        if kind != "projection":
            continue
        later = [n for k, n in seen[i + 1 :] if k == "moments"]
        if later:
            raise ValueError(
                f"{name} is chained before {later[0]}: the moment estimator rescales the projected "
                "update element-wise and undoes the projection. Chain the projection after it, "
                "e.g. optax.chain(optax.scale_by_adam(), scale_by_orthogonal_projection(memory), "
                "optax.scale(-learning_rate))."
            )
