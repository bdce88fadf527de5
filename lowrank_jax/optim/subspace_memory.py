r"""Orthogonal projection of adapter updates off a subspace memory (GPM / InfLoRA style).

A *subspace memory* of a kernel ``W: (n, m)`` (inputs ``x @ W``) is an orthonormal basis
``M: (n, k)`` of the layer inputs of earlier tasks. An update ``U: (n, r)`` of an input-side
adapter factor (LoRA's ``A`` in ``x @ A @ B``) is projected off it,

.. math::  U \leftarrow (I - M M^\top)\, U ,

so that ``x_old @ ΔA ≈ 0`` for every input ``x_old`` that the memory spans: training the new
task's adapter does not change the outputs of old tasks (up to the energy left outside the
memory). The memory is extended between tasks from layer-input activations by the GPM energy
criterion (Saha et al. 2021): with ``R = Xᵀ`` (``n × b``) and ``R̂ = (I − MMᵀ)R = Û Σ̂ V̂ᵀ``, add the
first ``k`` columns of ``Û``, ``k`` the smallest number with

.. math::  \|M^\top R\|_F^2 + \sum_{i<k} \hat\sigma_i^2 \;\ge\; \tau\, \|R\|_F^2 .

Memories have a fixed capacity (static shapes under ``jit``): the basis is zero-padded to
``capacity`` columns and ``size`` counts the columns in use; zero columns leave ``MMᵀ`` unchanged,
so padded and unpadded memories project identically.

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
from lowrank_jax.spectral.svd import left_singular

__all__ = [
    "OrthogonalProjectionState",
    "SubspaceMemory",
    "captured_energy",
    "check_projection_order",
    "extend_subspace_memory",
    "fill_memories",
    "init_subspace_memory",
    "project_off",
    "project_onto",
    "scale_by_orthogonal_projection",
]


class SubspaceMemory(NamedTuple):
    """An orthonormal basis of old-task layer inputs, zero-padded to a fixed capacity.

    Attributes:
      basis: ``(*stack, n, k)``; the first ``size`` columns are orthonormal, the rest zero.
      size: ``(*stack,)`` int32, the number of columns in use.
    """

    basis: jax.Array
    size: jax.Array


def init_subspace_memory(
    n: int, *, capacity: int | None = None, stack: Sequence[int] = (), dtype: Any = jnp.float32
) -> SubspaceMemory:
    """An empty memory for inputs of dimension ``n``.

    Args:
      n: input dimension of the kernel (rows of ``W: (n, m)``).
      capacity: maximum number of basis columns ``k`` (default ``n``: the whole input space).
      stack: leading axes of stacked layers (``nn.scan``), if any.
      dtype: floating dtype of the basis.

    Returns:
      ``SubspaceMemory(basis=zeros(*stack, n, k), size=zeros(*stack))``.

    Raises:
      ValueError: ``n`` or ``capacity`` not positive, or ``capacity > n``.
    """
    capacity = n if capacity is None else capacity
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be a positive int (the kernel's input dimension), got {n!r}.")
    if not isinstance(capacity, int) or not 1 <= capacity <= n:
        raise ValueError(f"capacity must be an int in [1, n={n}], got {capacity!r}.")
    stack = tuple(stack)
    return SubspaceMemory(
        basis=jnp.zeros((*stack, n, capacity), dtype), size=jnp.zeros(stack, jnp.int32)
    )


def _check_memory(memory: Any, what: str) -> None:
    if not isinstance(memory, SubspaceMemory):
        raise TypeError(
            f"{what} must be a SubspaceMemory (from init_subspace_memory), got "
            f"{type(memory).__name__}."
        )


def project_off(memory: SubspaceMemory, g: jax.typing.ArrayLike) -> jax.Array:
    r"""``(I − MMᵀ) g``: the part of ``g`` orthogonal to the memory.

    Args:
      memory: basis ``M: (*stack, n, k)``.
      g: ``(*stack, n, r)`` (an update of an input-side factor ``A``) or ``(*stack, n)``.

    Returns:
      Same shape as ``g``; ``Mᵀ·out = 0`` and ``project_off(M, out) == out``.

    Raises:
      ValueError: ``g``'s input dimension differs from the memory's ``n``.
    """
    _check_memory(memory, "memory")
    return jnp.asarray(g) - project_onto(memory, g)


def project_onto(memory: SubspaceMemory, g: jax.typing.ArrayLike) -> jax.Array:
    r"""``MMᵀ g``: the part of ``g`` inside the memory (what :func:`project_off` discards).

    Args:
      memory: basis ``M: (*stack, n, k)``.
      g: ``(*stack, n, r)`` or ``(*stack, n)``.

    Returns:
      Same shape as ``g``.

    Raises:
      ValueError: ``g``'s input dimension differs from the memory's ``n``.
    """
    _check_memory(memory, "memory")
    g = jnp.asarray(g)
    basis = memory.basis
    vector = g.ndim == basis.ndim - 1
    if vector:
        g = g[..., None]
    if g.shape[-2] != basis.shape[-2] or g.ndim != basis.ndim:
        raise ValueError(
            f"update of shape {g.shape} does not fit a memory of shape {basis.shape}: expected "
            f"(*stack, n={basis.shape[-2]}, r) with the memory's stack axes {basis.shape[:-2]}."
        )
    basis = basis.astype(g.dtype)
    coeff = jnp.einsum("...nk,...nr->...kr", basis, g)
    out = jnp.einsum("...nk,...kr->...nr", basis, coeff)
    return out[..., 0] if vector else out


def captured_energy(memory: SubspaceMemory, x: jax.typing.ArrayLike) -> jax.Array:
    r"""``‖X M‖²_F / ‖X‖²_F``: the fraction of the inputs' energy inside the memory.

    Args:
      memory: basis ``M: (*stack, n, k)``.
      x: activations ``(*stack, b, n)``.

    Returns:
      ``(*stack,)`` values in ``[0, 1]`` (1: the memory spans the inputs; new updates projected
      off it cannot change the layer's outputs on them).
    """
    _check_memory(memory, "memory")
    x = jnp.asarray(x)
    total = jnp.sum(jnp.square(x), axis=(-2, -1))
    inside = jnp.sum(jnp.square(x @ memory.basis.astype(x.dtype)), axis=(-2, -1))
    return inside / jnp.maximum(total, jnp.finfo(x.dtype).tiny)


def _extend_one(
    basis: jax.Array, size: jax.Array, x: jax.Array, threshold: float
) -> tuple[jax.Array, jax.Array]:
    n, capacity = basis.shape
    r = x.T.astype(jnp.float32)  # (n, b)
    m = basis.astype(jnp.float32)
    total = jnp.sum(jnp.square(r))
    inside = jnp.sum(jnp.square(m.T @ r))
    residual = r - m @ (m.T @ r)
    u, s = left_singular(residual)  # u: (n, p), p = min(n, b)
    cumulative = inside + jnp.cumsum(jnp.square(s))
    # smallest k with cumulative[k-1] >= threshold * total (k = 0 if inside already suffices)
    k_new = jnp.where(inside >= threshold * total, 0, jnp.sum(cumulative < threshold * total) + 1)
    k_new = jnp.minimum(k_new, capacity - size)
    p = u.shape[1]
    slots = jnp.arange(capacity)[:, None]
    cols = jnp.arange(p)[None, :]
    place = ((slots == size + cols) & (cols < k_new)).astype(jnp.float32)  # (capacity, p)
    new = m + u @ place.T
    return new.astype(basis.dtype), (size + k_new).astype(jnp.int32)


def extend_subspace_memory(
    memory: SubspaceMemory, x: jax.typing.ArrayLike, *, threshold: float
) -> SubspaceMemory:
    r"""Adds the directions of ``x`` that the memory misses, up to energy ``threshold`` (GPM).

    With ``R = Xᵀ`` and ``R̂ = (I − MMᵀ)R = Û Σ̂ V̂ᵀ`` the first ``k`` columns of ``Û`` are appended,
    ``k`` the smallest count with ``‖MᵀR‖² + Σ_{i<k} σ̂_i² ≥ τ‖R‖²`` (``k = 0`` when the memory
    already holds a fraction ``τ`` of the energy). Columns beyond the capacity are dropped (the
    most energetic ones are kept). Jittable.

    Args:
      memory: the current memory, basis ``(*stack, n, k)``.
      x: layer-input activations of the task just learned, ``(*stack, b, n)`` (tokens or
        examples along ``b``; any count); record them with
        :func:`lowrank_jax.continual.layer_inputs` (linen, nnx or plain functions).
      threshold: ``τ`` in ``(0, 1]`` (GPM uses 0.95–0.99; higher keeps more directions).

    Returns:
      The extended memory (columns stay orthonormal; earlier columns unchanged).

    Raises:
      ValueError: ``threshold`` outside ``(0, 1]`` or ``x`` of the wrong shape.
    """
    _check_memory(memory, "memory")
    if not 0.0 < float(threshold) <= 1.0:
        raise ValueError(f"threshold must lie in (0, 1], got {threshold!r}.")
    x = jnp.asarray(x)
    basis, size = memory.basis, memory.size
    if x.ndim != basis.ndim or x.shape[-1] != basis.shape[-2] or x.shape[:-2] != basis.shape[:-2]:
        raise ValueError(
            f"activations of shape {x.shape} do not fit a memory of shape {basis.shape}: "
            f"expected (*stack={basis.shape[:-2]}, b, n={basis.shape[-2]})."
        )
    fn = lambda b, s, a: _extend_one(b, s, a, float(threshold))  # noqa: E731
    for _ in range(basis.ndim - 2):
        fn = jax.vmap(fn)
    new_basis, new_size = fn(basis, size, x)
    return SubspaceMemory(basis=new_basis, size=new_size)


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
