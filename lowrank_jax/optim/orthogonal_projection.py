r"""The optax transformation that projects adapter updates off subspace memories (GPM / InfLoRA).

The memories and their linear algebra are in :mod:`lowrank_jax.optim.subspace_memory`.

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
    "check_projection_order",
    "fill_memories",
    "init_memories",
    "scale_by_orthogonal_projection",
]


class OrthogonalProjectionState(NamedTuple):
    """State of :func:`scale_by_orthogonal_projection`.

    Attributes:
      count: number of updates so far (int32).
      memory: ``{path: SubspaceMemory}`` for each projected leaf ('/'-joined paths of the
        params pytree, e.g. ``"params/dense_0/kernel/factors/a"`` for an adapter set).
    """

    count: jax.Array
    memory: dict[str, SubspaceMemory]


def _targets(params: Any, targets: str | Sequence[str]) -> dict[str, Any]:
    patterns = [targets] if isinstance(targets, str) else list(targets)
    compiled = [re.compile(p) for p in patterns]
    leaves = paths.named_leaves(params)
    return {k: v for k, v in leaves.items() if any(c.fullmatch(k) for c in compiled)}


def init_memories(
    params: Any,
    memory: Mapping[str, SubspaceMemory] | None,
    targets: str | Sequence[str],
    capacity: int | None,
) -> dict[str, SubspaceMemory]:
    """``{path: SubspaceMemory}`` of a transform: ``memory`` checked against ``params``, or
    empty memories (``capacity`` columns) for the leaves matching ``targets``."""
    leaves = paths.named_leaves(params)
    if memory is not None:
        unknown = sorted(set(memory) - set(leaves))
        if unknown:
            raise ValueError(
                f"memory refers to {unknown}, which are not parameters; the paths are:\n  "
                + "\n  ".join(leaves)
            )
        out = {}
        for path, mem in memory.items():
            _check_memory(mem, f"memory[{path!r}]")
            if tuple(leaves[path].shape[:-1]) != tuple(mem.basis.shape[:-1]):
                raise ValueError(
                    f"memory[{path!r}] has basis {mem.basis.shape}, which does not fit the "
                    f"parameter of shape {leaves[path].shape}: expected (*stack, n, k) with "
                    f"(*stack, n) = {leaves[path].shape[:-1]}."
                )
            out[path] = mem
        return out
    chosen = _targets(params, targets)
    if not chosen:
        raise ValueError(
            f"targets={targets!r} match no parameter; the paths are:\n  " + "\n  ".join(leaves)
        )
    out = {}
    for path, leaf in chosen.items():
        if leaf.ndim < 2:
            raise ValueError(f"{path!r} has shape {leaf.shape}: only (*stack, n, r) factors.")
        n = leaf.shape[-2]
        out[path] = init_subspace_memory(
            n, capacity=None if capacity is None else min(capacity, n), stack=leaf.shape[:-2]
        )
    return out


def _map_memory(fn, updates: Any, memory: Mapping[str, SubspaceMemory]) -> Any:
    def leaf(keypath, u):
        path = paths.path_to_str(keypath)
        return fn(memory[path], u) if path in memory else u

    return jax.tree_util.tree_map_with_path(leaf, updates)


def scale_by_orthogonal_projection(
    memory: Mapping[str, SubspaceMemory] | None = None,
    *,
    targets: str | Sequence[str] = r".*/a",
    capacity: int | None = None,
) -> optax.GradientTransformation:
    r"""Projects the updates of input-side adapter factors off per-kernel subspace memories.

    For each targeted leaf ``u: (*stack, n, r)``: ``u ← (I − M Mᵀ) u`` with ``M`` the leaf's
    memory; other leaves pass unchanged. The output is idempotent under the transform and
    orthogonal to ``M``, so a factor ``A`` initialised off ``M`` stays off it (GPM on LoRA).

    Args:
      memory: ``{path: SubspaceMemory}`` keyed by '/'-joined parameter paths (the memories of
        earlier tasks, an explicit argument); stored in the state by ``init``. ``None``: ``init``
        creates empty memories for the leaves matching ``targets``, to be filled between tasks
        with :func:`fill_memories` from the layer inputs of the adapted kernels.
      targets: full-match regexes over parameter paths used when ``memory`` is None (default: the
        ``a`` factor of every LoRA adapter, ``.../factors/a``).
      capacity: basis columns per empty memory (default: ``n``).

    Returns:
      An ``optax.GradientTransformation`` with state :class:`OrthogonalProjectionState`.

    Raises:
      ValueError: in ``init``, ``memory`` names a path that is not a parameter or has the wrong
        shape, or ``targets`` match nothing.

    References:
      Saha et al. 2021 (GPM); Liang & Li 2024 (InfLoRA). Used by P1 SABER and P2 GR-LoRA
      (reconstructions, specs §1–2).

    Example:
      >>> tx = optax.chain(optax.scale_by_adam(), scale_by_orthogonal_projection(mem),
      ...                  optax.scale(-1e-3))
    """

    def init_fn(params):
        return OrthogonalProjectionState(
            count=jnp.zeros([], jnp.int32),
            memory=init_memories(params, memory, targets, capacity),
        )

    def update_fn(updates, state, params=None):
        del params
        updates = _map_memory(project_off, updates, state.memory)
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
    """The longest of ``kernels`` that ``path`` (a factor's path) lies under, e.g. ``k`` for
    ``k + "/factors/a"`` or ``"shared/" + k + "/factors/a"``."""
    under = [k for k in kernels if path.startswith(k + "/") or f"/{k}/" in path]
    return max(under, key=len) if under else None


def fill_memories(
    opt_state: Any, inputs: Mapping[str, jax.typing.ArrayLike], *, threshold: float
) -> Any:
    r"""Extends every subspace memory in an optimizer state with the layer inputs of its kernel.

    The memories of :func:`scale_by_orthogonal_projection` and
    :func:`~lowrank_jax.optim.scale_by_gradient_recycling` are keyed by the path of the adapter
    factor they protect (``"params/dense_0/kernel/factors/a"``, ``"shared/params/.../factors/a"``);
    :func:`lowrank_jax.continual.layer_inputs` returns inputs keyed by kernel path
    (``"params/dense_0/kernel"``). This matches the two (a memory belongs to the kernel whose
    path its own path contains), applies :func:`extend_subspace_memory` to each, and puts the
    result back wherever the state sits in a chain (``optax.chain``, ``masked``,
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
    kernels = list(inputs)

    def fill(state):
        memory = {}
        for path, mem in state.memory.items():
            kernel = _kernel_of(path, kernels)
            if kernel is None:
                raise ValueError(
                    f"the memory of {path!r} has no layer inputs: inputs holds {kernels}; record "
                    "the kernel that this factor adapts (continual.layer_inputs)."
                )
            memory[path] = extend_subspace_memory(mem, inputs[kernel], threshold=threshold)
        return state._replace(memory=memory)

    found = _memory_states(opt_state)
    if not found:
        raise ValueError(
            "opt_state holds no subspace memory: chain scale_by_orthogonal_projection or "
            "scale_by_gradient_recycling into the optimizer."
        )
    for path, state in found:
        opt_state = optax.tree_utils.tree_set(
            opt_state, lambda p, _, path=path: p == path, **{type(state).__name__: fill(state)}
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
