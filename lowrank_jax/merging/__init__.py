"""lowrank_jax.merging: combining weights without gradient steps.

* Trajectory merges of late checkpoints, streamed (one checkpoint in memory at a time):
  ``lawa``, ``ema``, ``expo``, ``window_merges`` (:mod:`~lowrank_jax.merging.averaging`) and
  Extra-Merge (P5: ``extra_merge``, ``extra_merge_line``, ``trajectory_pca``, ``line_search`` in
  :mod:`~lowrank_jax.merging.extrapolation`; its pass 1 ``sketch_trajectory`` in
  :mod:`~lowrank_jax.merging.sketch`), all built on the one-pass ``weighted_sums`` of
  :mod:`~lowrank_jax.merging.streaming` (which also reads and checks the checkpoints).
* Task-vector merges on adapter products (:mod:`~lowrank_jax.merging.task_vectors`):
  ``merge_task_arithmetic``, ``merge_ties``, ``merge_dare``, ``merge_dare_ties``,
  ``merge_magnitude_prune``, any rule via ``merge_per_kernel``; PEFT's eleven
  ``add_weighted_adapter`` combination types on products
  (:mod:`~lowrank_jax.merging.peft_combinations`); mergekit's SLERP, Model Stock, Breadcrumbs and
  DELLA (:mod:`~lowrank_jax.merging.mergekit`); CASA, LoRA transfer to a fine-tuned or
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
from lowrank_jax.merging.mergekit import (
    breadcrumbs_delta,
    della_delta,
    della_keep_probabilities,
    merge_breadcrumbs,
    merge_della,
    merge_model_stock,
    merge_slerp,
    model_stock_delta,
    slerp_delta,
)
from lowrank_jax.merging.peft_combinations import COMBINATION_TYPES, add_weighted_adapter
from lowrank_jax.merging.sketch import TrajectorySketch, sketch_trajectory
from lowrank_jax.merging.sparsify import (
    dare_delta,
    dare_masks,
    dare_ties_delta,
    lowrank_factors,
    magnitude_prune_delta,
    ties_delta,
)
from lowrank_jax.merging.streaming import weighted_sum, weighted_sums
from lowrank_jax.merging.task_vectors import (
    TaskVector,
    merge_dare,
    merge_dare_ties,
    merge_magnitude_prune,
    merge_per_kernel,
    merge_task_arithmetic,
    merge_ties,
    task_vector,
    task_vector_matrices,
    to_lora,
    trim_task_vectors,
)
from lowrank_jax.merging.trees import check_same_tree, leaf_signature

__all__ = [
    "Arbitration",
    "COMBINATION_TYPES",
    "ExtraMerge",
    "ExtraMergeLine",
    "LineSearch",
    "SpectralBasis",
    "TaskVector",
    "TrajectoryPCA",
    "TrajectorySketch",
    "add_weighted_adapter",
    "breadcrumbs_delta",
    "casa",
    "casa_arbitration",
    "casa_diagnostics",
    "casa_matrix",
    "check_same_tree",
    "dare_delta",
    "dare_masks",
    "dare_ties_delta",
    "default_alpha",
    "della_delta",
    "della_keep_probabilities",
    "ema",
    "expo",
    "extra_merge",
    "extra_merge_line",
    "extrapolation_weights",
    "lawa",
    "leaf_signature",
    "line_search",
    "lowrank_factors",
    "magnitude_prune_delta",
    "merge_breadcrumbs",
    "merge_dare",
    "merge_dare_ties",
    "merge_della",
    "merge_magnitude_prune",
    "merge_model_stock",
    "merge_per_kernel",
    "merge_slerp",
    "merge_task_arithmetic",
    "merge_ties",
    "model_stock_delta",
    "sketch_trajectory",
    "slerp_delta",
    "source_basis",
    "spectral_diagnostics",
    "task_vector",
    "task_vector_matrices",
    "theil_sen_slope",
    "ties_delta",
    "to_lora",
    "trajectory_pca",
    "trim_task_vectors",
    "weighted_sum",
    "weighted_sums",
    "window_matrix",
    "window_merges",
]
