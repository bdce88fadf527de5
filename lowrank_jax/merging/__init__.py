"""lowrank_jax.merging: combining weights without gradient steps.

* Trajectory merges of late checkpoints, streamed (:mod:`~lowrank_jax.merging.trajectory`):
  ``lawa``, ``ema``, ``expo`` and Extra-Merge (P5: ``extra_merge``, ``extra_merge_line``,
  ``sketch_trajectory``, ``trajectory_pca``, ``line_search``).
* Tree checks shared by every merge (:mod:`~lowrank_jax.merging.trees`): ``check_same_tree``.
"""

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
    "ExtraMerge",
    "ExtraMergeLine",
    "LineSearch",
    "TrajectoryPCA",
    "TrajectorySketch",
    "check_same_tree",
    "default_alpha",
    "ema",
    "expo",
    "extra_merge",
    "extra_merge_line",
    "extrapolation_weights",
    "lawa",
    "leaf_signature",
    "line_search",
    "sketch_trajectory",
    "theil_sen_slope",
    "trajectory_pca",
    "weighted_sum",
    "weighted_sums",
    "window_matrix",
    "window_merges",
]
