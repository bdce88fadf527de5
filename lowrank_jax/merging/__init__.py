"""lowrank_jax.merging: combining weights without gradient steps.

* Trajectory merges of late checkpoints, streamed (one checkpoint in memory at a time):
  ``lawa``, ``ema``, ``expo``, ``window_merges`` (:mod:`~lowrank_jax.merging.averaging`) and
  Extra-Merge (P5: ``extra_merge``, ``extra_merge_line``, ``trajectory_pca``, ``line_search`` in
  :mod:`~lowrank_jax.merging.extrapolation`; its pass 1 ``sketch_trajectory`` in
  :mod:`~lowrank_jax.merging.sketch`), all built on the one-pass ``weighted_sums`` of
  :mod:`~lowrank_jax.merging.streaming` (which also reads and checks the checkpoints).
* Task-vector merges on adapter products (:mod:`~lowrank_jax.merging.task_merges`):
  ``merge_task_arithmetic``, ``merge_ties``, ``merge_dare``, ``merge_dare_ties``,
  ``merge_magnitude_prune``, all run by the one driver ``merge_per_kernel``
  (:mod:`~lowrank_jax.merging.per_kernel`), which also runs any rule, over task vectors
  (:mod:`~lowrank_jax.merging.task_vectors`: adapter sets of any kind, DoRA with ``base=``, or
  dense updates, ``task_vector``); PEFT's eleven
  ``add_weighted_adapter`` combination types on products
  (:mod:`~lowrank_jax.merging.peft_combinations`); mergekit's SLERP, Model Stock, Breadcrumbs and
  DELLA (:mod:`~lowrank_jax.merging.mergekit`); CASA, LoRA transfer to a fine-tuned or
  distilled target (P18, :mod:`~lowrank_jax.merging.casa`).
* Tree checks shared by every merge (:mod:`~lowrank_jax.merging.trees`): ``check_same_tree``
  (parameter pytrees leaf by leaf, or task vectors ``{path: update}`` by path).
"""

from lowrank_jax.merging.averaging import ema, lawa, window_merges
from lowrank_jax.merging.casa import (
    casa,
    casa_arbitration,
    casa_matrix,
    source_basis,
    spectral_diagnostics,
)
from lowrank_jax.merging.extrapolation import (
    default_alpha,
    extra_merge,
    extra_merge_line,
    line_search,
    trajectory_pca,
)
from lowrank_jax.merging.mergekit import (
    merge_breadcrumbs,
    merge_della,
    merge_model_stock,
    merge_slerp,
)
from lowrank_jax.merging.peft_combinations import COMBINATION_TYPES, add_weighted_adapter
from lowrank_jax.merging.sketch import sketch_trajectory
from lowrank_jax.merging.task_merges import merge_dare, merge_task_arithmetic, merge_ties
from lowrank_jax.merging.task_vectors import task_vector

__all__ = [
    "COMBINATION_TYPES",
    "add_weighted_adapter",
    "casa",
    "casa_arbitration",
    "casa_matrix",
    "default_alpha",
    "ema",
    "extra_merge",
    "extra_merge_line",
    "lawa",
    "line_search",
    "merge_breadcrumbs",
    "merge_dare",
    "merge_della",
    "merge_model_stock",
    "merge_slerp",
    "merge_task_arithmetic",
    "merge_ties",
    "sketch_trajectory",
    "source_basis",
    "spectral_diagnostics",
    "task_vector",
    "trajectory_pca",
    "window_merges",
]
