"""lowrank_jax.optim."""

from lowrank_jax.optim.adalora import (
    AdaLoRAState,
    adalora_budget,
    adalora_orthogonality,
    adalora_ranks,
    scale_by_adalora,
)
from lowrank_jax.optim.projection import (
    OrthogonalProjectionState,
    SubspaceMemory,
    captured_energy,
    check_projection_order,
    extend_subspace_memory,
    init_subspace_memory,
    left_singular,
    project_off,
    project_onto,
    scale_by_orthogonal_projection,
)
from lowrank_jax.optim.recycling import (
    GradientRecyclingState,
    scale_by_gradient_recycling,
    split_update,
)
from lowrank_jax.optim.sbvi import (
    SBVIState,
    bures_wasserstein_step,
    is_spectral_triple,
    qr_retraction,
    sbvi_mean,
    sbvi_posterior,
    sbvi_preconditioner,
    sbvi_ranks,
    scale_by_sbvi,
    stiefel_project,
)

__all__ = [
    "AdaLoRAState",
    "GradientRecyclingState",
    "OrthogonalProjectionState",
    "SBVIState",
    "SubspaceMemory",
    "adalora_budget",
    "adalora_orthogonality",
    "adalora_ranks",
    "bures_wasserstein_step",
    "captured_energy",
    "check_projection_order",
    "extend_subspace_memory",
    "init_subspace_memory",
    "left_singular",
    "is_spectral_triple",
    "project_off",
    "project_onto",
    "qr_retraction",
    "sbvi_mean",
    "sbvi_posterior",
    "sbvi_preconditioner",
    "sbvi_ranks",
    "scale_by_adalora",
    "scale_by_gradient_recycling",
    "scale_by_orthogonal_projection",
    "scale_by_sbvi",
    "split_update",
    "stiefel_project",
]
