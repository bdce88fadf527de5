"""lowrank_jax.merging: combining weights without gradient steps.

* Trajectory merges of late checkpoints, streamed (:mod:`~lowrank_jax.merging.trajectory`):
  ``lawa``, ``ema``, ``expo`` and Extra-Merge (P5: ``extra_merge``, ``extra_merge_line``,
  ``sketch_trajectory``, ``trajectory_pca``, ``line_search``).
* Task-vector merges on adapter products (:mod:`~lowrank_jax.merging.task_vectors`):
  ``merge_task_arithmetic``, ``merge_ties``, ``merge_dare``; CASA, LoRA transfer to a fine-tuned or
  distilled target (P18, :mod:`~lowrank_jax.merging.casa`).
* Tree checks shared by every merge (:mod:`~lowrank_jax.merging.trees`): ``check_same_tree``.
"""

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
from lowrank_jax.merging.trajectory import (
    ExtraMerge,
    ExtraMergeLine,
    LineSearch,
    TrajectoryPCA,
    TrajectorySketch,
    default_alpha,
    ema,
    expo,
    extra_merge,
    extra_merge_line,
    extrapolation_weights,
    lawa,
    line_search,
    sketch_trajectory,
    theil_sen_slope,
    trajectory_pca,
    weighted_sum,
    weighted_sums,
    window_matrix,
    window_merges,
)
from lowrank_jax.merging.trees import check_same_tree, leaf_signature

__all__ = [
    "Arbitration",
    "ExtraMerge",
    "ExtraMergeLine",
    "LineSearch",
    "SpectralBasis",
    "TaskVector",
    "TrajectoryPCA",
    "TrajectorySketch",
    "casa",
    "casa_arbitration",
    "casa_diagnostics",
    "casa_matrix",
    "check_same_tree",
    "dare_delta",
    "dare_masks",
    "default_alpha",
    "ema",
    "expo",
    "extra_merge",
    "extra_merge_line",
    "extrapolation_weights",
    "lawa",
    "leaf_signature",
    "line_search",
    "lowrank_factors",
    "merge_dare",
    "merge_task_arithmetic",
    "merge_ties",
    "sketch_trajectory",
    "source_basis",
    "spectral_diagnostics",
    "task_vector",
    "task_vector_matrices",
    "theil_sen_slope",
    "ties_delta",
    "to_lora",
    "trajectory_pca",
    "weighted_sum",
    "weighted_sums",
    "window_matrix",
    "window_merges",
]
