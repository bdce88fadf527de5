"""lowrank_jax.optim."""

from lowrank_jax.optim.adalora import AdaLoRAState, adalora_ranks, scale_by_adalora
from lowrank_jax.optim.orthogonal_projection import (
    OrthogonalProjectionState,
    fill_memories,
    init_memories,
    scale_by_orthogonal_projection,
)
from lowrank_jax.optim.recycling import GradientRecyclingState, scale_by_gradient_recycling
from lowrank_jax.optim.sbvi import SBVIState, sbvi_posterior, sbvi_ranks, scale_by_sbvi
from lowrank_jax.optim.subspace_memory import (
    SubspaceMemory,
    captured_energy,
    extend_subspace_memory,
    init_subspace_memory,
    project_onto,
)

__all__ = [
    "AdaLoRAState",
    "GradientRecyclingState",
    "OrthogonalProjectionState",
    "SBVIState",
    "SubspaceMemory",
    "adalora_ranks",
    "captured_energy",
    "extend_subspace_memory",
    "fill_memories",
    "init_memories",
    "init_subspace_memory",
    "project_onto",
    "sbvi_posterior",
    "sbvi_ranks",
    "scale_by_adalora",
    "scale_by_gradient_recycling",
    "scale_by_orthogonal_projection",
    "scale_by_sbvi",
]
