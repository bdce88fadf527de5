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

The optax transformation that projects with these memories, and the checks of its place in a
chain, are in :mod:`lowrank_jax.optim.orthogonal_projection`.

References:
  Saha, Garg, Roy 2021, "Gradient Projection Memory for Continual Learning" (GPM);
  Liang, Li 2024, "InfLoRA: Interference-Free Low-Rank Adaptation for Continual Learning"
  (arXiv 2404.00228). Used by P1 SABER and P2 GR-LoRA (both reconstructions, see
  ``papers/specs.md`` §1, §2).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from lowrank_jax.spectral.svd import left_singular

__all__ = [
    "SubspaceMemory",
    "captured_energy",
    "extend_subspace_memory",
    "init_subspace_memory",
    "project_off",
    "project_onto",
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
