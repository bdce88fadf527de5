"""Merging weights without gradient steps: task arithmetic, TIES, DARE (on adapter products) and
CASA (LoRA transfer to a fine-tuned or distilled target, P18)."""

from lowrank_jax.merging.casa import (
    Arbitration,
    SpectralBasis,
    casa,
    casa_arbitration,
    casa_diagnostics,
    casa_matrix,
    source_basis,
    spectral_diagnostics,
)
from lowrank_jax.merging.task_vectors import (
    TaskVector,
    check_same_paths,
    dare_delta,
    dare_masks,
    lowrank_factors,
    merge_dare,
    merge_task_arithmetic,
    merge_ties,
    task_vector,
    task_vector_matrices,
    ties_delta,
    to_lora,
)

__all__ = [
    "Arbitration",
    "SpectralBasis",
    "TaskVector",
    "casa",
    "casa_arbitration",
    "casa_diagnostics",
    "casa_matrix",
    "check_same_paths",
    "dare_delta",
    "dare_masks",
    "lowrank_factors",
    "merge_dare",
    "merge_task_arithmetic",
    "merge_ties",
    "source_basis",
    "spectral_diagnostics",
    "task_vector",
    "task_vector_matrices",
    "ties_delta",
    "to_lora",
]
