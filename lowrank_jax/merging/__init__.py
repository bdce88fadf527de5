"""lowrank_jax.merging: combining weights without gradient steps.

* Trajectory merges of late checkpoints, streamed (one checkpoint in memory at a time):
  ``lawa``, ``ema``, ``expo``, ``window_merges`` (:mod:`~lowrank_jax.merging.averaging`) and
  Extra-Merge (P5: ``extra_merge``, ``extra_merge_line``, ``trajectory_pca``, ``line_search`` in
  :mod:`~lowrank_jax.merging.extrapolation`; its pass 1 ``sketch_trajectory`` in
  :mod:`~lowrank_jax.merging.sketch`), all built on the one-pass ``weighted_sums`` of
  :mod:`~lowrank_jax.merging.streaming` (which also reads and checks the checkpoints).
* Task-vector merges on adapter products (:mod:`~lowrank_jax.merging.task_vectors`):
  ``merge_task_arithmetic``, ``merge_ties``, ``merge_dare``; CASA, LoRA transfer to a fine-tuned or
  distilled target (P18, :mod:`~lowrank_jax.merging.casa`).
* Tree checks shared by every merge (:mod:`~lowrank_jax.merging.trees`): ``check_same_tree``
  (parameter pytrees leaf by leaf, or task vectors ``{path: update}`` by path).
"""

from lowrank_jax.merging.averaging import ema, expo, lawa, window_matrix, window_merges
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
from lowrank_jax.merging.extrapolation import (
    ExtraMerge,
    ExtraMergeLine,
    LineSearch,
    TrajectoryPCA,
    default_alpha,
    extra_merge,
    extra_merge_line,
    extrapolation_weights,
    line_search,
    theil_sen_slope,
    trajectory_pca,
)
from lowrank_jax.merging.sketch import TrajectorySketch, sketch_trajectory
from lowrank_jax.merging.streaming import weighted_sum, weighted_sums
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
    trim_task_vectors,
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
    "trim_task_vectors",
    "trajectory_pca",
    "weighted_sum",
    "weighted_sums",
    "window_matrix",
    "window_merges",
]
