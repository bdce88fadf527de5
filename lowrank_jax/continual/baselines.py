r"""Per-matrix pieces of the LoRA continual-learning baselines: O-LoRA, InfLoRA, SD-LoRA.

* **O-LoRA** (Wang et al. 2023): new LoRA ``A_t`` kept orthogonal to earlier ones by the penalty
  ``λ Σ_{i<t} ‖A_iᵀ A_t‖²_F`` (:func:`o_lora_penalty`).
* **InfLoRA** (Liang & Li 2024): the down-projection ``A_t`` is fixed to the top-``r`` left
  singular vectors of the new task's layer inputs projected off the old-task input memory ``M``
  (:func:`inflora_down_projection`); only ``B_t`` is trained, so ``x_old A_t ≈ 0``. The DualGPM
  memory of the paper is replaced by the GPM memory of :mod:`lowrank_jax.optim`.
* **SD-LoRA** (Wu et al. 2025): ``W = W₀ + Σ_i α_i ΔW_i/‖ΔW_i‖_F``; old directions frozen, the
  magnitudes ``α_i`` stay learnable (:func:`sd_lora_kernel`).

References:
  Wang et al. 2023, "Orthogonal Subspace Learning for Language Model Continual Learning"
  (O-LoRA); Liang & Li 2024, arXiv 2404.00228 (InfLoRA); Wu et al. 2025, "SD-LoRA: Scalable
  Decoupled Low-Rank Adaptation for Class Incremental Learning". Named as baselines by
  specs.md §1 (5) and §2 (5).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from lowrank_jax.optim.subspace_memory import SubspaceMemory, project_off
from lowrank_jax.spectral.svd import left_singular

__all__ = ["inflora_down_projection", "o_lora_penalty", "sd_lora_kernel", "unit_direction"]


def o_lora_penalty(a: jax.typing.ArrayLike, old: jax.typing.ArrayLike) -> jax.Array:
    r"""``Σ_i ‖A_iᵀ A‖²_F`` for the new factor ``A: (n, r)`` and old factors ``(T_old, n, r')``.

    Returns 0 when ``old`` is empty (``T_old = 0``).
    """
    a = jnp.asarray(a)
    old = jnp.asarray(old, a.dtype)
    if old.ndim != 3 or old.shape[1] != a.shape[0]:
        raise ValueError(f"old factors {old.shape} must be (T_old, n={a.shape[0]}, r').")
    return jnp.sum(jnp.square(jnp.einsum("tnq,nr->tqr", old, a)))


def inflora_down_projection(
    x: jax.typing.ArrayLike, memory: SubspaceMemory, *, rank: int
) -> jax.Array:
    r"""``A_t = `` top-``rank`` left singular vectors of ``(I − MMᵀ) Xᵀ``, shape ``(n, rank)``.

    Args:
      x: the new task's layer inputs ``(b, n)`` (under the current model, before training).
      memory: old-task input memory ``M: (n, k)``.
      rank: ``r ≤ min(n, b)``.

    Returns:
      ``(n, r)`` with orthonormal columns orthogonal to ``M`` (columns whose singular value is
      zero, when the memory already spans the inputs, are zero vectors scaled by it).

    Raises:
      ValueError: ``rank`` larger than ``min(n, b)``.
    """
    x = jnp.asarray(x, jnp.float32)
    b, n = x.shape
    if not 1 <= rank <= min(n, b):
        raise ValueError(f"rank must lie in [1, min(n, b) = {min(n, b)}], got {rank}.")
    residual = project_off(memory, x.T)
    u, s = left_singular(residual)
    # columns of (numerically) zero singular value carry no new direction: zero them
    keep = s[:rank] > 1e-6 * jnp.maximum(s[0], 1e-30)
    return project_off(memory, u[:, :rank] * keep)


def unit_direction(delta: jax.typing.ArrayLike) -> tuple[jax.Array, jax.Array]:
    """``(ΔW/‖ΔW‖_F, ‖ΔW‖_F)`` (a zero update gives a zero direction and norm 0)."""
    delta = jnp.asarray(delta)
    norm = jnp.sqrt(jnp.sum(jnp.square(delta)))
    return delta / jnp.maximum(norm, 1e-30), norm


def sd_lora_kernel(
    w0: jax.typing.ArrayLike, directions: jax.typing.ArrayLike, alphas: jax.typing.ArrayLike
) -> jax.Array:
    r"""``W₀ + Σ_i α_i D_i`` with ``directions: (T, n, m)`` and ``alphas: (T,)``."""
    directions = jnp.asarray(directions)
    return jnp.asarray(w0) + jnp.einsum("t,tnm->nm", jnp.asarray(alphas), directions).astype(
        directions.dtype
    )
