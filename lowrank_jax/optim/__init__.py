"""lowrank_jax.optim."""

from lowrank_jax.optim.projection import (
    OrthogonalProjectionState,
    SubspaceMemory,
    captured_energy,
    extend_subspace_memory,
    init_subspace_memory,
    project_off,
    project_onto,
    scale_by_orthogonal_projection,
)
from lowrank_jax.optim.recycling import (
    GradientRecyclingState,
    scale_by_gradient_recycling,
    split_update,
)

__all__ = [
    "GradientRecyclingState",
    "OrthogonalProjectionState",
    "SubspaceMemory",
    "captured_energy",
    "extend_subspace_memory",
    "init_subspace_memory",
    "project_off",
    "project_onto",
    "scale_by_gradient_recycling",
    "scale_by_orthogonal_projection",
    "split_update",
]
