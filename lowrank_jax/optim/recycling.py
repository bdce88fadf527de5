r"""Gradient recycling (P2 GR-LoRA, reconstruction): keep the orthogonal part, recycle the rest.

Orthogonal-projection continual learning (GPM, InfLoRA) throws away the component of each update
that lies in the subspace memory ``M`` of old-task inputs. Over a long task stream ``M`` fills the
input space and the kept part shrinks to nothing: the shared adapter loses its plasticity.
GR-LoRA *recycles* the discarded part into a task-specific lightweight module. For a shared
input-side factor update ``u: (n, r)``,

.. math::

    u_\perp = (I - M M^\top)\, u \;\; \text{(applied to the shared adapter)}, \qquad
    u_\parallel = M M^\top u \;\; \text{(applied to the current task's module)},

and ``u_⊥ + u_∥ = u`` exactly. When the module's factor ``Ã_t`` sits beside the shared ``A_t``
in the forward pass (``x (A_t + Ã_t) B_t``), the pair receives the full, unprojected update while
the shared adapter stays interference-free for old tasks; the module is active only when task
``t`` is selected (entropy-based selection in :mod:`lowrank_jax.continual`).

Chain it after the moment estimator, as the projection (see
:func:`~lowrank_jax.optim.orthogonal_projection.check_projection_order`); the forward wiring of the module
beside the shared adapter is :func:`lowrank_jax.continual.gr_lora_adapters`, the layer inputs that
fill the memory come from :func:`lowrank_jax.continual.layer_inputs`.

The updates pytree is a dict with two entries: ``shared`` (the shared adapter, whose targeted
leaves are projected) and ``module`` (the task module, whose leaf at the same sub-path receives
the recycled part in place of its own update). Other entries and leaves pass unchanged. The
memories are a pytree shaped like the params, with a memory at each projected leaf of ``shared``
and ``None`` elsewhere; ``tree_map`` pairs them with the updates::

    params = {"shared": adapter_set, "module": module_set, "head": head}
    memory = init_memories(params, r"shared/.*/a")        # or the memories of earlier tasks
    tx = optax.chain(optax.scale_by_adam(), scale_by_gradient_recycling(memory),
                     optax.scale(-1e-3))

References:
  P2 GR-LoRA (abstract only; the split above is the reconstruction of specs.md §2, step 2–3).
  Saha et al. 2021 (GPM) for the memory.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from lowrank_jax.adapters import paths
from lowrank_jax.optim.orthogonal_projection import check_memories, init_memories, is_memory
from lowrank_jax.optim.subspace_memory import SubspaceMemory, project_off, project_onto

__all__ = ["GradientRecyclingState", "scale_by_gradient_recycling", "split_update"]


def split_update(memory: SubspaceMemory, u: jax.typing.ArrayLike) -> tuple[jax.Array, jax.Array]:
    r"""``(u_⊥, u_∥) = ((I − MMᵀ)u, MMᵀu)``; ``u_⊥ + u_∥ = u``.

    Args:
      memory: basis ``M: (*stack, n, k)``.
      u: ``(*stack, n, r)``.

    Returns:
      ``(kept, recycled)``, each of the shape of ``u``.
    """
    recycled = project_onto(memory, u)
    return jnp.asarray(u) - recycled, recycled


class GradientRecyclingState(NamedTuple):
    """State of :func:`scale_by_gradient_recycling`.

    Attributes:
      count: number of updates so far (int32).
      memory: a pytree shaped like the params: a :class:`SubspaceMemory` at each projected leaf
        under ``shared`` (e.g. ``["shared"]["params/dense_0/kernel"].factors["a"]``), ``None``
        elsewhere.
      recycled_fraction: ``Σ‖u_∥‖² / Σ‖u‖²`` of the last update over all shared targeted leaves
        (0: nothing recycled, 1: the projection would have discarded everything).
    """

    count: jax.Array
    memory: Any
    recycled_fraction: jax.Array


def scale_by_gradient_recycling(
    memory: Any = None,
    *,
    shared: str = "shared",
    module: str = "module",
    targets: str | Sequence[str] | None = None,
    capacity: int | None = None,
    recycle_scale: float = 1.0,
) -> optax.GradientTransformation:
    r"""Splits shared-adapter updates into the kept orthogonal part and the recycled part.

    For every leaf ``u`` under ``updates[shared]`` with a memory ``M``, at sub-path ``p``:
    ``updates[shared][p] ← (I − MMᵀ) u`` and ``updates[module][p] ← recycle_scale · MMᵀ u``
    (the module's own update at ``p`` is replaced). ``recycle_scale = 0`` is pure projection
    (GPM/InfLoRA-style); ``1`` gives the pair ``(shared + module)`` the unprojected update.

    Args:
      memory: a pytree shaped like the params with a :class:`SubspaceMemory` at each projected
        leaf under ``shared`` and ``None`` elsewhere (a ``None`` may stand for a whole subtree,
        e.g. ``{"shared": ..., "module": None, "head": None}``), an explicit argument stored in
        the state; ``None`` creates empty memories for the targeted leaves
        (:func:`~lowrank_jax.optim.init_memories`; fill them between tasks with
        :func:`~lowrank_jax.optim.fill_memories`).
      shared: top-level key of the shared adapter in the params/updates dict.
      module: top-level key of the current task's module; its subtree must have the structure of
        the shared one, with a leaf of the same shape at the sub-path of every projected leaf.
      targets: regexes for ``memory=None`` (default ``"<shared>/.*/a"``: every LoRA ``a`` factor).
      capacity: basis columns per empty memory (default: ``n``).
      recycle_scale: multiplier of the recycled part (keep knob for the paper's exact form).

    Returns:
      An ``optax.GradientTransformation`` with state :class:`GradientRecyclingState`.

    Raises:
      ValueError: in ``init``, params are not a dict with ``shared`` and ``module`` entries, a
        memory is not under ``shared`` or does not fit, or a projected shared leaf has no
        module counterpart of the same shape.

    References:
      P2 GR-LoRA (reconstruction, specs §2); Saha et al. 2021 (GPM).

    Example:
      >>> mem = init_memories(params, r"shared/.*/a")           # or last task's memories
      >>> tx = optax.chain(optax.scale_by_adam(), scale_by_gradient_recycling(mem),
      ...                  optax.scale(-1e-3))
    """
    if not recycle_scale >= 0.0:
        raise ValueError(f"recycle_scale must be >= 0, got {recycle_scale!r}.")
    targets = f"{shared}/.*/a" if targets is None else targets

    def check_module(keypath, mem, kept, counterpart):  # a leaf of shared, its module twin
        if mem is None:
            return
        where = paths.path_to_str(keypath)
        if counterpart.shape != kept.shape:
            raise ValueError(
                f"{shared}/{where} has no module counterpart {module}/{where} of shape "
                f"{kept.shape}: give the task module the same factor layout."
            )

    def init_fn(params):
        if not isinstance(params, Mapping) or shared not in params or module not in params:
            raise ValueError(
                f"gradient recycling needs params as a dict with entries {shared!r} (the shared "
                f"adapter) and {module!r} (the task module); got "
                f"{list(params) if isinstance(params, Mapping) else type(params).__name__}."
            )
        if memory is None:
            memories = init_memories(params, targets, capacity=capacity)
        else:
            check_memories(params, memory)
            memories = memory
        outside = [
            p
            for p, m in paths.named_leaves({**memories, shared: None}, is_leaf=is_memory).items()
            if m is not None
        ]
        if outside:
            raise ValueError(f"memories {outside} are not under the shared entry {shared!r}.")
        if jax.tree.structure(params[module]) != jax.tree.structure(params[shared]):
            raise ValueError(
                f"params[{module!r}] (the task module) has no counterpart of every leaf of "
                f"params[{shared!r}]: give it the shared adapter's factor layout."
            )
        jax.tree_util.tree_map_with_path(
            check_module, memories[shared], params[shared], params[module], is_leaf=is_memory
        )
        return GradientRecyclingState(
            count=jnp.zeros([], jnp.int32),
            memory=memories,
            recycled_fraction=jnp.zeros([], jnp.float32),
        )

    def update_fn(updates, state, params=None):
        del params
        kept_sq, recycled_sq = jnp.zeros([]), jnp.zeros([])

        def split(mem, u):
            nonlocal kept_sq, recycled_sq
            if mem is None:
                return u, None
            k, r = project_off(mem, u), project_onto(mem, u)
            kept_sq = kept_sq + jnp.sum(jnp.square(k))
            recycled_sq = recycled_sq + jnp.sum(jnp.square(r))
            return k, r

        memory = state.memory[shared]
        pairs = jax.tree.map(split, memory, updates[shared], is_leaf=is_memory)
        new_shared = jax.tree.map(lambda m, p: p[0], memory, pairs, is_leaf=is_memory)
        new_module = jax.tree.map(
            lambda m, p, u: u if m is None else (recycle_scale * p[1]).astype(u.dtype),
            memory,
            pairs,
            updates[module],
            is_leaf=is_memory,
        )
        out = {**updates, shared: new_shared, module: new_module}
        fraction = recycled_sq / jnp.maximum(kept_sq + recycled_sq, 1e-30)
        return out, GradientRecyclingState(
            count=optax.safe_increment(state.count),
            memory=state.memory,
            recycled_fraction=fraction.astype(jnp.float32),
        )

    return optax.GradientTransformation(init_fn, update_fn)
